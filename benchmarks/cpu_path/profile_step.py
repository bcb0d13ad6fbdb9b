"""Where a decode step's time goes: torch.profiler over a few steps, ops grouped by name.

  nice -n 5 .venv/bin/python benchmarks/cpu_path/profile_step.py --batch 1 --variant loop:stock

Also counts the aten ops launched per step and the wall time spent outside
any aten op (Python, transformers' module plumbing, the dispatcher).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common import MODELS, header, setup_threads
import decode
import harness


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(MODELS / "small"))
    ap.add_argument("--variant", default="loop:stock")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    setup_threads(args.threads)
    header(f"profile {args.variant} B={args.batch}")
    model, runner = decode.build(args.model, args.variant)
    seqs = harness.make_prompts(args.batch, args.prompt, model.config.vocab_size)
    with torch.inference_mode():
        runner.step(seqs)
        for _ in range(3):
            runner.step(seqs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            c0 = time.process_time()
            for _ in range(args.steps):
                runner.step(seqs)
            wall = (time.perf_counter() - t0) / args.steps
            cpu = (time.process_time() - c0) / args.steps
    ka = prof.key_averages()
    # time outside aten ops: wall minus the self time of top-level ops is a lower bound on
    # Python/transformers overhead (with 2 threads, kernels' time is counted once, on the caller)
    # top-level aten ops only (no double counting): self CPU time by name
    total_self = sum(e.self_cpu_time_total for e in ka) / args.steps / 1e3
    n_ops = sum(e.count for e in ka if e.key.startswith("aten::")) / args.steps
    print(f"step wall {wall*1e3:.2f} ms (cpu {cpu*1e3:.2f}) under the profiler; "
          f"profiled self time {total_self:.2f} ms/step; aten ops/step {n_ops:.0f}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                    max_name_column_width=40))


if __name__ == "__main__":
    main()
