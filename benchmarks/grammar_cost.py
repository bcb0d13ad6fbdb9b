"""What constrained decoding costs per step: bitmask fill and masking, at 1 and 32 rows.

Runs `switchyard.engine.grammar.GrammarSupport.apply` (fill each constrained
row's bitmask from its matcher, then mask the logits in place) on random
float32 logits, advancing every row's matcher with a token it allows, over a
whole JSON-schema generation. Reports the mean and p50/p90 of one step's
grammar work (not the forward pass). A measurement, not a test.

    .venv/bin/python benchmarks/grammar_cost.py [--model FOLDER] [--steps 200] [--warmup 100]

FOLDER defaults to the default tiny model (2,048 tokens); pass a folder made by
benchmarks/make_model.py (small: the 135M shape, 49,152 tokens) for the
vocabulary the issue's budget is about.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from switchyard.engine.grammar import GrammarSupport
from switchyard.engine.sampling import RowSampler
from switchyard_spec import (
    Constraint,
    ConstraintKind,
    EngineRequest,
    SamplingParams,
    StoppingParams,
)

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False}


def run(folder: str, rows: int, steps: int, warmup: int) -> dict[str, float]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    t0 = time.perf_counter()
    support = GrammarSupport(tok, vocab)
    constraint = Constraint(kind=ConstraintKind.JSON_SCHEMA,
                            spec=json.dumps(SCHEMA, sort_keys=True, separators=(",", ":")))
    eos = tuple(x for x in [tok.eos_token_id] if x is not None)
    request = EngineRequest(request_id="b", prompt_token_ids=(1,), sampling=SamplingParams(),
                            stopping=StoppingParams(max_new_tokens=warmup + steps,
                                                    eos_token_ids=eos),
                            constraint=constraint)
    samplers = []
    for _ in range(rows):
        s = RowSampler(SamplingParams(), (1,), vocab)
        s.grammar = support.start(request)
        samplers.append(s)
    samplers[0].grammar.ready(timeout=60)
    setup = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    times = []
    for step in range(warmup + steps):
        logits = torch.randn(rows, vocab, generator=gen)
        begin = time.perf_counter()
        errors = support.apply(logits, samplers)
        if step >= warmup:  # xgrammar builds a state's mask cache on its first visit
            times.append(time.perf_counter() - begin)
        assert not any(errors)
        # Advance each row with its best allowed token (greedy over random logits).
        for row, token in zip(samplers, logits.argmax(dim=-1).tolist(), strict=True):
            row.record(token)
            if row.grammar.terminated:  # start the object again: measure steady state
                row.grammar.matcher.reset()
    times.sort()
    return {"rows": rows, "vocab": vocab, "setup_ms": setup * 1e3,
            "mean_ms": statistics.fmean(times) * 1e3, "p50_ms": times[len(times) // 2] * 1e3,
            "p90_ms": times[int(len(times) * 0.9)] * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the tiny default)")
    ap.add_argument("--steps", type=int, default=200, help="measured steps")
    ap.add_argument("--warmup", type=int, default=100,
                    help="steps run first and not measured (first visits to grammar states)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.model
    if folder is None:
        from switchyard.models.default_model import ensure_default_model

        folder = str(ensure_default_model(Path.home() / ".cache" / "switchyard"))
    for rows in (1, 32):
        r = run(folder, rows, args.steps, args.warmup)
        print(f"rows {r['rows']:>2}  vocab {r['vocab']}: grammar work per step mean "
              f"{r['mean_ms']:.3f} ms, p50 {r['p50_ms']:.3f}, p90 {r['p90_ms']:.3f} "
              f"(wrap + first compile {r['setup_ms']:.0f} ms)")


if __name__ == "__main__":
    main()
