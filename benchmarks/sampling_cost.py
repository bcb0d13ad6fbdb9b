"""Median cost of one ``sample_step`` (engine/switchyard_engine/sampling.py) for 32 rows.

  .venv/bin/python benchmarks/sampling_cost.py

Vocabulary 49152, float32 logits from ``randn * 3``, two threads, median of 30 calls.
Each case runs with log-probabilities requested, as the OpenAI and TGI routes often do.
"""

from __future__ import annotations

import statistics
import time

import torch

from switchyard_engine.sampling import RowSampler, sample_step
from switchyard_spec import SamplingParams

VOCAB = 49152
ROWS = 32
CALLS = 30

CASES: dict[str, SamplingParams] = {
    "greedy": SamplingParams(),
    "t=0.8 top_p=0.95 top_k=50": SamplingParams(do_sample=True, temperature=0.8, top_p=0.95,
                                                top_k=50),
    "t=0.7 top_p=0.9": SamplingParams(do_sample=True, temperature=0.7, top_p=0.9),
    # No top-k or top-p (OpenAI's defaults): every row draws from its whole softmax.
    "t=1.0 no filter": SamplingParams(do_sample=True),
}


def median_ms(params: SamplingParams, logits: torch.Tensor) -> float:
    """Median wall time of ``sample_step`` over :data:`CALLS` calls, after one warm-up call."""
    rows = [RowSampler(params, [1, 2, 3], VOCAB, seed=i if params.do_sample else None)
            for i in range(ROWS)]
    sample_step(logits, rows)
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        sample_step(logits, rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(2)
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    with torch.inference_mode():
        for name, params in CASES.items():
            print(f"{ROWS} rows {name:28s} {median_ms(params, logits):8.2f} ms/step", flush=True)


if __name__ == "__main__":
    main()
