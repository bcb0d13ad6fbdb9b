"""Decode-step benchmark of the forward-path variants on a built model (default: small = 135M shape).

  nice -n 5 .venv/bin/python benchmarks/cpu_path/decode.py --batch 1 8 32 \
      --variant loop:stock batched:stock batched:mkldnn batched:int8 [--fuse] [--compile]

A variant is ATTN:LINEAR[:fuse][:compile]; ATTN in loop, batched, batched_mm;
LINEAR in stock, mkldnn, int8, int4. Prints median ms per decode step and
tokens/s, and for every variant the greedy tokens' agreement with the first one.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from common import MODELS, header, setup_threads
import harness


def build(path, spec, dtype):
    parts = spec.split(":")
    attn, linear = parts[0], parts[1]
    flags = set(parts[2:])
    model = harness.load_model(path, dtype)
    if "fuse" in flags:
        harness.fuse_projections(model)
    harness.replace_linears(model, linear)
    if "compile" in flags or "compile-ma" in flags:
        import torch._inductor.config as ic
        ic.freezing = "freeze" in flags
        mode = "max-autotune-no-cudagraphs" if "compile-ma" in flags else None
        for layer in model.model.layers:
            layer.mlp.compile(mode=mode, dynamic=True)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(MODELS / "small"))
    ap.add_argument("--variant", nargs="+", default=["loop:stock", "batched:stock"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sample", default="argmax", choices=["argmax", "engine"])
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json")
    args = ap.parse_args()
    setup_threads(args.threads)
    header(f"decode step, {args.model}, prompt {args.prompt}, {args.dtype}")
    dtype = getattr(torch, args.dtype)
    rows, ref_tokens = [], {}
    for spec in args.variant:
        model = build(args.model, spec, dtype)
        runner = harness.Runner(model, attn_mode=spec.split(":")[0], sample=args.sample)
        for b in args.batch:
            times, cpu, seqs = harness.decode_bench(runner, b, args.prompt, args.steps)
            med = statistics.median(times)
            toks = [s.tokens[args.prompt:] for s in seqs]
            if b not in ref_tokens:
                ref_tokens[b] = toks
            ref = ref_tokens[b]
            same = sum(x == y for a, r in zip(toks, ref) for x, y in zip(a, r))
            total = sum(len(a) for a in toks)
            first_div = min((next((i for i, (x, y) in enumerate(zip(a, r)) if x != y), len(a))
                             for a, r in zip(toks, ref)))
            cmed = statistics.median(cpu)
            row = dict(variant=spec, batch=b, ms=med * 1e3, ms_min=min(times) * 1e3,
                       cpu_ms=cmed * 1e3, tok_s=b / med, agree=same / total, first_divergence=first_div)
            rows.append(row)
            print(f"{spec:28s} B={b:<3d} {med*1e3:8.2f} ms/step (min {min(times)*1e3:7.2f}, "
                  f"cpu {cmed*1e3:7.2f})  {b/med:7.1f} tok/s  greedy agreement {same}/{total} "
                  f"(first diff at step {first_div})", flush=True)
        del model, runner
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
