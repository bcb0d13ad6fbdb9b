"""Cost of the engine's batched sampling (gateway/switchyard/engine/sampling.py) per decode step.

  nice -n 5 .venv/bin/python benchmarks/cpu_path/sampling_bench.py --batch 1 32
"""

from __future__ import annotations

import argparse

import torch

from common import header, setup_threads, timeit
from switchyard.engine.sampling import RowSampler, sample_step
from switchyard_spec import SamplingParams

VOCAB = 49152


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()
    setup_threads(args.threads)
    header("sampling per step")
    cases = {
        "greedy, logprobs": (SamplingParams(), True),
        "greedy, no logprobs": (SamplingParams(), False),
        "sampled t=0.7 top_p=0.9, logprobs": (SamplingParams(do_sample=True, temperature=0.7,
                                                             top_p=0.9, seed=1), True),
        "sampled t=0.7 top_k=50 rep=1.1": (SamplingParams(do_sample=True, temperature=0.7, top_k=50,
                                                          repetition_penalty=1.1, seed=1), True),
    }
    with torch.inference_mode():
        for b in args.batch:
            logits = torch.randn(b, VOCAB).to(torch.bfloat16)
            for name, (params, lp) in cases.items():
                rows = [RowSampler(params, list(range(100)), VOCAB, seed=params.seed, logprobs=lp)
                        for _ in range(b)]
                t = timeit(lambda: sample_step(logits, rows), repeats=9, inner=5)
                argmax = timeit(lambda: logits.argmax(-1).tolist(), repeats=9, inner=5)
                print(f"B={b:<3d} {name:36s} {t['cpu']*1e3:7.3f} ms cpu/step "
                      f"(argmax+tolist alone {argmax['cpu']*1e3:.3f})", flush=True)


if __name__ == "__main__":
    main()
