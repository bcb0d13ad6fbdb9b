"""What act-order GPTQ costs on the xeon engine: the input gather before each uint4 linear.

An act-order layer's columns are stored sorted by group, so the engine runs
``linear(x.index_select(-1, order))`` (``switchyard_xeon.quantized.InputOrdered``)
instead of ``linear(x)``. This times one decoder layer's uint4 linears of a
model shape (q|k|v and gate|up fused, o_proj, down_proj; random weights,
int4 groups of 128) both ways at each row count, and the gathers alone.
Each round times every variant once, in a rotating order; the table keeps
medians.

    .venv/bin/python benchmarks/kernels/act_order_cost.py --rows 1 512 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import SMALL


def _layer_shapes(shape: dict) -> list[tuple[int, int]]:
    """(N, K) of one layer's linears as the engine fuses them."""
    hidden, inter, head_dim = shape["hidden"], shape["inter"], shape["head_dim"]
    qkv = (shape["heads"] + 2 * shape["kv_heads"]) * head_dim
    return [(qkv, hidden), (hidden, shape["heads"] * head_dim), (2 * inter, hidden),
            (hidden, inter)]


def _time(fn, inputs: list[torch.Tensor], repeat: int) -> float:
    """Seconds per sweep of ``fn`` over ``inputs``, the best of nothing: one timed run."""
    start = time.perf_counter()
    for _ in range(repeat):
        for x in inputs:
            fn(x)
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 512])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from switchyard_quant.int4 import quantize_uint4
    from switchyard_xeon.kernels import load_kernels
    from switchyard_xeon.linears import PanelLinear
    from switchyard_xeon.quantized import InputOrdered

    if not load_kernels().uint4_dot:
        raise SystemExit(f"no uint4 panels here: {load_kernels().reason}")
    gen = torch.Generator().manual_seed(0)
    plain, ordered, gathers = [], [], []
    for n, k in _layer_shapes(SMALL):
        weight = torch.randn(n, k, generator=gen) * 0.05
        linear = PanelLinear(None, None, bf16_dot=True,  # type: ignore[arg-type]
                             quantized=quantize_uint4(weight, 128))
        order = torch.randperm(k, generator=gen)
        plain.append(linear)
        ordered.append(InputOrdered(linear, order))
        gathers.append(order)
    print(f"shape: {SMALL['hidden']} hidden, {SMALL['inter']} MLP; threads {args.threads}; "
          f"one layer's 4 uint4 linears (int4, groups of 128)")
    print("| rows | plain ms | act-order ms | gathers alone ms | cost |")
    print("|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for rows in args.rows:
            xs = [torch.randn(rows, m.in_features, generator=gen) for m in plain]
            repeat = max(1, 2000 // rows)
            variants = {
                "plain": lambda _x, xs=xs: [m(x) for m, x in zip(plain, xs, strict=True)],
                "ordered": lambda _x, xs=xs: [m(x) for m, x in zip(ordered, xs, strict=True)],
                "gathers": lambda _x, xs=xs: [x.index_select(-1, o)
                                              for o, x in zip(gathers, xs, strict=True)],
            }
            times: dict[str, list[float]] = {name: [] for name in variants}
            names = list(variants)
            for name in names:  # warm up
                _time(variants[name], [None], 3)
            for r in range(args.rounds):
                for name in names[r % 3:] + names[:r % 3]:
                    times[name].append(_time(variants[name], [None], repeat) * 1e3)
            med = {name: statistics.median(t) for name, t in times.items()}
            print(f"| {rows} | {med['plain']:.3f} | {med['ordered']:.3f} | "
                  f"{med['gathers']:.3f} | {100 * (med['ordered'] / med['plain'] - 1):+.1f}% |")


if __name__ == "__main__":
    main()
