"""One decode step's worth of matmuls: ``F.linear`` against oneDNN-packed weights, by row count.

Sweeps every linear of the SmolLM2-135M shape (q|k|v and gate|up fused, as
the engine runs them, plus the tied LM head) for M rows, the way a decode step
of M sequences does, and prints ms per sweep and GFLOP/s for each way of
running it. Rounds interleave the variants, and the table keeps each one's
best round, so a machine that gets busier mid-run skews all of them alike.

    .venv/bin/python benchmarks/cpu_path/linear_sweep.py --dtype float32 --rows 1 8 32 64

``packed:HINT`` reorders the weights once for a batch-size hint of HINT rows
(``none``: oneDNN's default); it is what ``switchyard_xeon.linears`` does at load.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common import SMALL

Matmul = Callable[[torch.Tensor], torch.Tensor]


def step_shapes(cfg: dict = SMALL) -> list[tuple[int, int]]:
    """(out, in) of each matmul of one decode step, fused as the engine fuses them."""
    h, i, d = cfg["hidden"], cfg["inter"], cfg["head_dim"]
    layer = [((cfg["heads"] + 2 * cfg["kv_heads"]) * d, h), (h, cfg["heads"] * d), (2 * i, h), (h, i)]
    return layer * cfg["layers"] + [(cfg["vocab"], h)]


def variant(name: str, weight: torch.Tensor) -> Matmul:
    """A callable x -> x @ weight.T for the variant ``name``."""
    if name == "F.linear":
        return lambda x: F.linear(x, weight)
    hint_text = name.removeprefix("packed:")
    hint = None if hint_text == "none" else int(hint_text)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--variants", nargs="+", default=["F.linear", "packed:none", "packed:1",
                                                          "packed:64"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weights = [torch.randn(o, i).mul_(0.02).to(dtype) for o, i in step_shapes()]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"{os.cpu_count()} CPUs, {torch.get_num_threads()} threads, {args.dtype}, "
          f"{flops_per_row // 2 / 1e6:.1f} M weights, load {os.getloadavg()[0]:.1f}")
    calls = {name: [variant(name, w) for w in weights] for name in args.variants}
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k).to(dtype) for k in {w.shape[1] for w in weights}}
            for _ in range(args.rounds):
                for name, fns in calls.items():
                    start = time.perf_counter()
                    for fn, w in zip(fns, weights, strict=True):
                        fn(inputs[w.shape[1]])
                    took = time.perf_counter() - start
                    key = (name, rows)
                    best[key] = min(best.get(key, took), took)
    print("\n| variant | rows | ms/sweep | GFLOP/s |\n|---|---:|---:|---:|")
    for (name, rows), took in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"| {name} | {rows} | {took * 1e3:.1f} | {flops_per_row * rows / took / 1e9:.1f} |")
    print(f"\nload {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
