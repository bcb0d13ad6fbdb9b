"""What constrained decoding costs per step: bitmask fill and masking, at 1 and 32 rows.

Runs `switchyard_engine.grammar.GrammarSupport.apply` (fill each constrained
row's bitmask from its matcher, then mask the logits in place) on random
float32 logits. Each row follows a JSON document of its own that the schema
accepts (its tokens fed to its matcher, as sampling would), and the rows start
at staggered positions, so every step mixes grammar states as 32 concurrent
streams do: keys and punctuation (a few allowed tokens), numbers (~2k), the
inside of a string (most of the vocabulary). A row that finishes its document
starts it again. Reports the mean and p50/p90 of one step's grammar work (not
the forward pass), and the share of it spent filling bitmasks. A measurement,
not a test.

Two schemas: `free` (strings without length bounds, as most tool and
response schemas are) and `bounded` (a `maxLength` string, which xgrammar
unrolls into one grammar state per character: a cost of the schema).

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
from typing import Any

import torch
from switchyard_engine.grammar import GrammarSupport
from switchyard_engine.sampling import RowSampler
from switchyard_spec import (
    Constraint,
    ConstraintKind,
    EngineRequest,
    SamplingParams,
    StoppingParams,
)

TAGS = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}
SCHEMAS: dict[str, dict[str, Any]] = {
    "free": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "tags": TAGS,
        "ok": {"type": "boolean"}}, "required": ["name", "age", "tags", "ok"],
        "additionalProperties": False},
    "bounded": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}, "tags": TAGS,
        "ok": {"type": "boolean"}}, "required": ["name", "age", "tags", "ok"],
        "additionalProperties": False},
}
NAMES = ["Ada Lovelace", "Grace Hopper", "Alan Turing", "Edsger", "B. Liskov",
         "Ken Thompson", "F. Allen", "J. McCarthy"]
"""Within the bounded schema's 12 characters."""


def document(i: int) -> str:
    """Row ``i``'s JSON text, in the schema's property order (sorted keys), compact."""
    return json.dumps({"age": 17 + 37 * i, "name": NAMES[i % len(NAMES)], "ok": i % 2 == 0,
                       "tags": ["a", "b", "c"][: i % 4]}, sort_keys=True, separators=(",", ":"))


def run(folder: str, schema: dict[str, Any], rows: int, steps: int,
        warmup: int, mask: str = "torch") -> dict[str, float]:
    """Time ``steps`` steps of ``rows`` constrained rows after ``warmup`` unmeasured ones;
    ``mask`` "torch" (``grammar.mask_logits``) or "native" (the xeon engine's kernel)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    t0 = time.perf_counter()
    support = GrammarSupport(tok, vocab, mask=native_mask() if mask == "native" else None)
    constraint = Constraint(kind=ConstraintKind.JSON_SCHEMA,
                            spec=json.dumps(schema, sort_keys=True, separators=(",", ":")))
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    request = EngineRequest(request_id="b", prompt_token_ids=(1,), sampling=SamplingParams(),
                            stopping=StoppingParams(max_new_tokens=warmup + steps,
                                                    eos_token_ids=(eos,)),
                            constraint=constraint)
    samplers, docs, cursor = [], [], []
    for i in range(rows):
        s = RowSampler(SamplingParams(), (1,), vocab)
        s.grammar = support.start(request)
        samplers.append(s)
        docs.append(tok.encode(document(i), add_special_tokens=False) + [eos])
        cursor.append(0)
    samplers[0].grammar.ready(timeout=60)
    setup = time.perf_counter() - t0
    for i, row in enumerate(samplers):  # stagger: row i starts i tokens into its document
        for token in docs[i][: i % (len(docs[i]) - 1)]:
            row.record(token)
            cursor[i] += 1
    gen = torch.Generator().manual_seed(0)
    times, fills = [], []
    bitmask = support._bitmask_rows(rows)
    for step in range(warmup + steps):
        logits = torch.randn(rows, vocab, generator=gen)
        begin = time.perf_counter()
        errors = support.apply(logits, samplers)
        took = time.perf_counter() - begin
        assert not any(errors), errors
        # The fill alone, again (it does not change the matchers): its share of the step.
        begin = time.perf_counter()
        for i, row in enumerate(samplers):
            row.grammar.matcher.fill_next_token_bitmask(bitmask, i)
        fill = time.perf_counter() - begin
        if step >= warmup:  # xgrammar builds some states' masks on their first visit
            times.append(took)
            fills.append(fill)
        for i, row in enumerate(samplers):
            token = docs[i][cursor[i]]
            assert torch.isfinite(logits[i, token]), "the document's token was masked"
            row.record(token)
            cursor[i] += 1
            if row.grammar.terminated:  # the document again: measure steady state
                row.grammar.matcher.reset()
                cursor[i] = 0
    times.sort()
    return {"rows": rows, "vocab": vocab, "setup_ms": setup * 1e3,
            "mean_ms": statistics.fmean(times) * 1e3, "p50_ms": times[len(times) // 2] * 1e3,
            "p90_ms": times[int(len(times) * 0.9)] * 1e3,
            "fill_mean_ms": statistics.fmean(fills) * 1e3}


def native_mask() -> Any:
    """The xeon engine's native grammar mask (built on first use); exits if it did not load."""
    from switchyard_xeon.kernels import load_kernels

    status = load_kernels()
    if status.token_mask is None:
        raise SystemExit(f"no native token mask here: {status.reason}")
    return status.token_mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the tiny default)")
    ap.add_argument("--steps", type=int, default=200, help="measured steps")
    ap.add_argument("--warmup", type=int, default=100,
                    help="steps run first and not measured (first visits to grammar states)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--schema", choices=[*SCHEMAS, "all"], default="all")
    ap.add_argument("--mask", choices=["torch", "native", "both"], default="both",
                    help="how masks reach the logits: grammar.mask_logits, the xeon engine's "
                         "native kernel, or both in turn (default)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.model
    if folder is None:
        from switchyard.models.random_model import ensure_random_model

        folder = str(ensure_random_model(Path.home() / ".cache" / "switchyard"))
    names = list(SCHEMAS) if args.schema == "all" else [args.schema]
    masks = ["torch", "native"] if args.mask == "both" else [args.mask]
    for name in names:
        for rows, mask in ((r, m) for r in (1, 32) for m in masks):
            r = run(folder, SCHEMAS[name], rows, args.steps, args.warmup, mask)
            print(f"{name:>7} schema, {mask:>6} mask, rows {r['rows']:>2}, vocab {r['vocab']}: "
                  "grammar work "
                  f"per step mean {r['mean_ms']:.3f} ms, p50 {r['p50_ms']:.3f}, "
                  f"p90 {r['p90_ms']:.3f} (filling bitmasks {r['fill_mean_ms']:.3f}; "
                  f"wrap + first compile {r['setup_ms']:.0f} ms)", flush=True)


if __name__ == "__main__":
    main()
