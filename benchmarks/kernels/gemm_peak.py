"""The machine's measured bf16 GEMM peak, and the engine's many-row linears as a share of it.

    .venv/bin/python benchmarks/kernels/gemm_peak.py --rows 32 128 512

The peak is the best GFLOP/s of oneDNN's bf16 GEMM (``torch.mm``, AMX tiles
where the CPU has them) on large products (a 2,048-cube and 4,096 x 4,096 x
1,024), best of ``--rounds``. Then one decode step's matmuls of the 135M shape
(q|k|v and gate|up fused, as the engine runs them) at each row count, the way
the engine calls them: fp32 rows into the bf16 dot-product panels, which take
AMX from the crossover up (``bf16_amx_rows``, set to ``--gemm-rows``, default
16). Reported with and without the LM head (a prefill step computes logits
for its last rows only), as GFLOP/s and as a share of the peak.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins" / "xeon"))

from common import SMALL  # noqa: E402
from linear_sweep import step_shapes  # noqa: E402


def best_seconds(fn: Callable[[], object], rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--gemm-rows", type=int, default=16)
    args = parser.parse_args()
    from switchyard_xeon.kernels import load_kernels

    status = load_kernels()
    assert status.bf16_dot, f"needs the bf16 dot-product panels: {status.reason}"
    ops = torch.ops.switchyard_xeon
    amx = status.bf16_amx
    if amx:
        ops.bf16_amx_rows(args.gemm_rows)
    print(f"{os.cpu_count()} CPUs, {torch.get_num_threads()} threads, AMX path: "
          f"{'from ' + str(args.gemm_rows) + ' rows' if amx else 'none'}, "
          f"load {os.getloadavg()[0]:.1f}")
    torch.manual_seed(0)
    peak = 0.0
    for m, n, k in ((2048, 2048, 2048), (4096, 4096, 1024)):
        a, b = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16()
        took = best_seconds(lambda a=a, b=b: torch.mm(a, b), args.rounds)
        gflops = 2 * m * n * k / took / 1e9
        peak = max(peak, gflops)
        print(f"oneDNN bf16 GEMM {m} x {n} x {k}: {gflops:.0f} GFLOP/s")
    print(f"peak: {peak:.0f} GFLOP/s\n")
    shapes = step_shapes(SMALL)
    weights = [torch.randn(o, i) * 0.02 for o, i in shapes]
    packed = [ops.pack_panels_bf16_dot(w) for w in weights]
    print("| rows | linears | ms | GFLOP/s | share of peak |\n|---:|---|---:|---:|---:|")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        for label, count in (("layers", len(weights) - 1), ("layers + LM head", len(weights))):
            def sweep(count: int = count) -> None:
                for w, p in zip(weights[:count], packed[:count], strict=True):
                    ops.panel_linear(inputs[w.shape[1]], p, None, w.shape[0])

            took = best_seconds(sweep, args.rounds)
            flops = 2 * rows * sum(w.numel() for w in weights[:count])
            gflops = flops / took / 1e9
            print(f"| {rows} | {label} | {took * 1e3:.1f} | {gflops:.0f} | "
                  f"{gflops / peak:.0%} |")
    print(f"\nload {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
