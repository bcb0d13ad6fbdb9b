#!/usr/bin/env python3
"""The LoRA products alone: decoder layers' four projections, timed per product.

Not a timed test: a measurement. The default model's layer shapes (q|k|v,
o, gate|up, down of SmolLM2-135M), ``--rows`` decode rows spread evenly over
``--adapters`` random adapters of rank ``--rank`` on every projection of
``--layers`` layers, fp32 activations; each product adds its deltas to the
four projections' outputs of every layer in turn, ``--repeats`` times, the
best of ``--rounds`` (ms per layer). With one layer the adapters' matrices
stay in the caches between repeats; with the model's 30 they do not (8
adapters of rank 16 are 156 MB in fp32), as in a decode step:

- ``native fp32`` / ``native bf16``: ``kernels/lora.cpp`` over flat adapters
  in fp32 or bf16 (what ``lora_kernel=native`` runs);
- ``grouped``, ``stacked``, ``looped``: the PyTorch-ops products of
  :mod:`switchyard_engine.lora.grouped` (``looped`` is the plain per-adapter
  path vLLM's CPU backend and TGI's fallback use).

Every product's output is checked against ``looped``'s before it is timed.

Usage: python benchmarks/lora_products.py [--threads 1] [--rows 32] [--adapters 8]
                                          [--layers 1]
"""

from __future__ import annotations

import argparse
import time

import torch
from switchyard_engine.lora.config import AdapterConfig
from switchyard_engine.lora.flat import flatten
from switchyard_engine.lora.folder import LoraAdapter, LoraModule
from switchyard_engine.lora.grouped import StepLora
from switchyard_engine.lora.layouts import PROJECTIONS, llama_family
from switchyard_xeon.kernels import load_kernels
from switchyard_xeon.native_lora import NativeLora
from transformers import LlamaConfig


def shape(layers: int) -> LlamaConfig:
    """``layers`` layers of SmolLM2-135M."""
    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                       num_key_value_heads=3, num_hidden_layers=layers, head_dim=64)


def adapters(count: int, rank: int, layers: int) -> list[LoraAdapter]:
    """``count`` random adapters of ``rank`` on every projection of ``layers`` layers."""
    layouts = llama_family(shape(layers))
    out = []
    for i in range(count):
        gen = torch.Generator().manual_seed(i)
        modules = {module: LoraModule(a=torch.randn(rank, fan_in, generator=gen) * 0.05,
                                      b=torch.randn(fan_out, rank, generator=gen) * 0.05,
                                      scaling=2.0)
                   for module, (fan_in, fan_out) in layouts.shapes.items()}
        out.append(LoraAdapter(name=f"a{i}", path="", modules=modules,
                               config=AdapterConfig(rank=rank, alpha=2 * rank,
                                                    target_modules=())))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()
    status = load_kernels()
    if not status.lora:
        raise SystemExit(f"the native LoRA kernel is not available: {status.reason}")
    torch.set_num_threads(args.threads)
    config = shape(args.layers)
    layouts = llama_family(config).layouts
    held = adapters(args.adapters, args.rank, args.layers)
    groups = [i % args.adapters for i in range(args.rows)]
    hidden, inner = config.hidden_size, config.intermediate_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    q = config.num_attention_heads * config.head_dim
    gen = torch.Generator().manual_seed(99)
    shapes = {"qkv": (hidden, qkv), "o": (q, hidden), "gate_up": (hidden, 2 * inner),
              "down": (inner, hidden)}
    xs = {p: torch.randn(args.rows, fan_in, generator=gen) for p, (fan_in, _) in shapes.items()}

    def torch_step(kernel: str) -> StepLora:
        return StepLora(adapters=tuple(held), groups=torch.tensor(groups).unsqueeze(1),
                        stacks={}, layouts=layouts, kernel=kernel)

    def native_step(dtype: torch.dtype) -> NativeLora:
        flats = [flatten(a, layouts, PROJECTIONS, args.layers, dtype) for a in held]
        rows = [r for g in range(args.adapters) for r in range(args.rows) if groups[r] == g]
        counts = [groups.count(g) for g in range(args.adapters)]
        return NativeLora(rows=torch.tensor(rows),
                          starts=torch.tensor([0, *counts]).cumsum(0),
                          weights=[f.weights for f in flats], tables=[f.table for f in flats])

    products = {"native fp32": native_step(torch.float32),
                "native bf16": native_step(torch.bfloat16), "grouped": torch_step("grouped"),
                "stacked": torch_step("stacked"), "looped": torch_step("looped")}

    def run(step) -> dict[str, torch.Tensor]:
        outs = {p: torch.zeros(args.rows, width) for p, (_, width) in shapes.items()}
        for layer in range(args.layers):
            for p in PROJECTIONS:
                step.add_(layer, p, xs[p], outs[p])
        return outs

    want = run(products["looped"])
    for name, step in products.items():
        got = run(step)
        tol = 2e-2 if name == "native bf16" else 1e-4  # bf16: the matrices rounded
        for p in PROJECTIONS:
            scale = float(want[p].abs().max())
            torch.testing.assert_close(got[p], want[p], atol=tol * scale, rtol=tol,
                                       msg=f"{name} {p}")
    outs = {p: torch.zeros(args.rows, width) for p, (_, width) in shapes.items()}
    print(f"{args.layers} layer(s) of SmolLM2-135M's shapes, {args.rows} rows over "
          f"{args.adapters} adapters "
          f"of rank {args.rank} on every projection, {args.threads} thread(s), "
          f"kernels {status.variant}")
    for name, step in products.items():
        best = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.repeats):
                for layer in range(args.layers):
                    for p in PROJECTIONS:
                        step.add_(layer, p, xs[p], outs[p])
            best = min(best, (time.perf_counter() - start) / args.repeats / args.layers)
        print(f"{name:12s} {best * 1e3:7.3f} ms per layer")


if __name__ == "__main__":
    main()
