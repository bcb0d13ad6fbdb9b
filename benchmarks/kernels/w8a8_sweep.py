"""W8A8 (``--quantize smoothquant``) against bf16 matmuls: one decode or prefill step's linears.

Sweeps every linear of a model shape (q|k|v and gate|up fused, as the engine
runs them; the LM head with ``--lm-head``, left out by default since a
prefill step computes it for one row per sequence) for M rows, in one run:

- ``bf16-dot``: the engine's bf16 dot-product panels (``kernels/panel_dot_bf16.cpp``);
- ``int8-wo``: the same over weight-only int8 (``--quantize int8``);
- ``w8a8-amx``, ``w8a8-vnni``, ``w8a8-avx2``: ``kernels/panel_w8a8.cpp`` on
  each of its paths (tdpbusd, vpdpbusd, vpmaddubsw), activations quantized
  per token inside the call;
- ``torch-bf16``: ``F.linear`` on bf16 inputs and weights (oneDNN, which
  takes AMX where the CPU has it), the input's conversion included.

Each round times every variant once, in an order that rotates; the table
gives each variant's median over the rounds and its speed against
``bf16-dot`` in the same run, so a machine shared with other work skews them
alike. Paths this build or CPU lacks are left out.

    .venv/bin/python benchmarks/kernels/w8a8_sweep.py --rows 1 8 32 128 1024 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common import SMALL

MEDIUM = dict(hidden=896, inter=4864, layers=24, heads=14, kv_heads=2, head_dim=64, vocab=151936)
PATHS = {"w8a8-amx": 1, "w8a8-vnni": 2, "w8a8-avx2": 3}


def step_shapes(cfg: dict, lm_head: bool) -> list[tuple[int, int]]:
    h, i, d = cfg["hidden"], cfg["inter"], cfg["head_dim"]
    layer = [((cfg["heads"] + 2 * cfg["kv_heads"]) * d, h), (h, cfg["heads"] * d), (2 * i, h),
             (h, i)]
    return layer * cfg["layers"] + ([(cfg["vocab"], h)] if lm_head else [])


def variants(weights: list[torch.Tensor], names: list[str]) -> dict[str, list[Callable]]:
    from switchyard_quant.int8 import quantize_int8
    from switchyard_quant.smoothquant import quantize_smoothquant
    from switchyard_xeon.kernels import load_kernels
    from switchyard_xeon.quantized import pack_quantized

    status = load_kernels()
    ops = torch.ops.switchyard_xeon
    available = ops.w8a8_paths() if status.w8a8 else 0
    out: dict[str, list[Callable]] = {}
    for name in names:
        fns = []
        for w in weights:
            n = w.shape[0]
            if name == "bf16-dot" and status.bf16_dot:
                p = ops.pack_panels_bf16_dot(w)
                fns.append(lambda x, p=p, n=n: ops.panel_linear(x, p, None, n))
            elif name == "int8-wo" and status.bf16_dot:
                p = pack_quantized(quantize_int8(w))
                fns.append(lambda x, p=p, n=n: ops.panel_linear(x, p, None, n))
            elif name in PATHS and available >> PATHS[name] & 1:
                p = pack_quantized(quantize_smoothquant(w))
                fns.append(lambda x, p=p, n=n, k=PATHS[name]: ops.w8a8_linear(x, p, None, n, k,
                                                                              False))
            elif name == "torch-bf16":
                wb = w.bfloat16()
                fns.append(lambda x, wb=wb: F.linear(x.bfloat16(), wb))
        if len(fns) == len(weights):
            out[name] = fns
        else:
            print(f"({name}: not available here)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 1024])
    parser.add_argument("--variants", nargs="+",
                        default=["bf16-dot", "int8-wo", "w8a8-amx", "w8a8-vnni", "torch-bf16"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shape", default="small", choices=["small", "medium"])
    parser.add_argument("--lm-head", action="store_true")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default); 1 is steadier on a shared machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = MEDIUM if args.shape == "medium" else SMALL
    weights = [torch.randn(o, i).mul_(0.02) for o, i in step_shapes(cfg, args.lm_head)]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"{os.cpu_count()} CPUs, {torch.get_num_threads()} threads, shape {args.shape}, "
          f"{flops_per_row // 2 / 1e6:.1f} M weights, load {os.getloadavg()[0]:.1f}")
    calls = variants(weights, args.variants)
    names = list(calls)
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
            for fns in calls.values():  # warm: first-touch of buffers, oneDNN primitives
                for fn, w in zip(fns, weights, strict=True):
                    fn(inputs[w.shape[1]])
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    start = time.perf_counter()
                    for fn, w in zip(calls[name], weights, strict=True):
                        fn(inputs[w.shape[1]])
                    times.setdefault((name, rows), []).append(time.perf_counter() - start)
    print("\n| rows | variant | ms/sweep (median) | min | GFLOP/s | vs bf16-dot |")
    print("|---:|---|---:|---:|---:|---:|")
    for rows in args.rows:
        base = statistics.median(times[("bf16-dot", rows)]) if ("bf16-dot", rows) in times else 0
        for name in names:
            t = times[(name, rows)]
            med = statistics.median(t)
            ratio = f"{base / med:.2f}x" if base else "-"
            print(f"| {rows} | {name} | {med * 1e3:.2f} | {min(t) * 1e3:.2f} | "
                  f"{flops_per_row * rows / med / 1e9:.0f} | {ratio} |")
    print(f"\nload {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
