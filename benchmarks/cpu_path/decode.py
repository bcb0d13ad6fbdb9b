"""Decode-step benchmark of forward-path variants on a built model (default: small = 135M shape).

  nice -n 5 .venv/bin/python benchmarks/cpu_path/decode.py --batch 1 32 \
      --variant loop:stock batched:mkldnn batched:int8 batched:mkldnn:fuse batched:stock:compile

A variant is ATTN:LINEAR[:FLAG...]: ATTN in loop (today's per-sequence path),
batched (one gather + one masked SDPA), batched_mm, cpp (the C++ paged kernel
of paged_attn_ext.py); LINEAR
in stock, mkldnn, int8, int4; flags: fuse (q|k|v and gate|up as one matmul),
compile (whole model through torch.compile, attention as an opaque custom op,
see compiled.py), freeze (compile with inductor freezing + weight prepack).

All variants are built first and then stepped in interleaved rounds (one
decode step of each variant per round), so that the load other people put on
this shared machine hits every variant alike; medians over rounds of wall
time and of process CPU time are reported, with the greedy tokens' agreement
with the first variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from common import MODELS, header, load, setup_threads, wait_idle
import harness


def build(path, spec, dtype=torch.bfloat16):
    """(model, runner) for one variant spec."""
    parts = spec.split(":")
    attn, linear, flags = parts[0], parts[1], set(parts[2:])
    if flags & {"compile", "freeze", "compile-ma"}:
        import compiled
        mode = "freeze" if "freeze" in flags else ("compile-ma" if "compile-ma" in flags else "compile")
        model, fn = compiled.build(path, mode, linear, fuse="fuse" in flags)
        runner = compiled.CompiledRunner(model, attn_mode=attn, compiled=fn)
        with torch.inference_mode():  # compile the prefill, decode and T=1 graphs now
            warm = harness.make_prompts(2, 16, model.config.vocab_size, seed=1)
            runner.step(warm)
            runner.step(warm)
            runner.step(warm[:1])
            for s in warm:
                runner.release(s)
        return model, runner
    model = harness.load_model(path, dtype)
    if "fuse" in flags:
        harness.fuse_projections(model)
    harness.replace_linears(model, linear)
    return model, harness.Runner(model, attn_mode=attn)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(MODELS / "small"))
    ap.add_argument("--variant", nargs="+", default=["loop:stock", "batched:stock"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20, help="rounds (decode steps per variant)")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--gate", action="store_true",
                    help="start every timed round only when the machine is idle (common.wait_idle)")
    ap.add_argument("--json")
    args = ap.parse_args()
    setup_threads(args.threads)
    header(f"decode step, {args.model}, prompt {args.prompt}")
    built = {}
    for spec in args.variant:
        t0 = time.perf_counter()
        built[spec] = build(args.model, spec)
        print(f"# built {spec} in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for b in args.batch:
        seqs = {}
        with torch.inference_mode():
            for spec, (model, runner) in built.items():
                seqs[spec] = harness.make_prompts(b, args.prompt, model.config.vocab_size)
                for i in range(0, b, 8):
                    runner.step(seqs[spec][i:i + 8])
                for _ in range(2):
                    runner.step(seqs[spec])
            wall = {s: [] for s in built}
            cpu = {s: [] for s in built}
            for _ in range(args.steps):
                for spec, (_, runner) in built.items():
                    if args.gate:
                        wait_idle()
                    t0, c0 = time.perf_counter(), time.process_time()
                    runner.step(seqs[spec])
                    wall[spec].append(time.perf_counter() - t0)
                    cpu[spec].append(time.process_time() - c0)
        first = args.variant[0]
        for spec in built:
            toks = [s.tokens[args.prompt:] for s in seqs[spec]]
            ref = [s.tokens[args.prompt:] for s in seqs[first]]
            same = sum(x == y for a, r in zip(toks, ref) for x, y in zip(a, r))
            total = sum(len(a) for a in toks)
            med, cmed = statistics.median(wall[spec]), statistics.median(cpu[spec])
            row = dict(variant=spec, batch=b, ms=med * 1e3, ms_min=min(wall[spec]) * 1e3,
                       cpu_ms=cmed * 1e3, tok_s=b / med, tok_s_best=b / min(wall[spec]),
                       agree=same / total, load=load())
            rows.append(row)
            print(f"{spec:28s} B={b:<3d} {med*1e3:8.2f} ms/step (min {min(wall[spec])*1e3:7.2f}, "
                  f"cpu {cmed*1e3:7.2f})  {b/med:7.1f} tok/s (best {b/min(wall[spec]):7.1f})  "
                  f"greedy = {first}: {same}/{total}", flush=True)
            for s in seqs[spec]:
                built[spec][1].release(s)
    print(f"# load after: {load()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
