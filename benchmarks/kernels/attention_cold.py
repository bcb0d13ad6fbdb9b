"""The paged decode-attention kernel as a decode step meets it: every layer's cache cold.

    .venv/bin/python benchmarks/kernels/attention_cold.py [--order scattered|in-order]

One bf16 pool per layer (30 layers of the 135M shape: 9 query / 3 KV heads
of 64 dims, blocks of 16 tokens), 32 sequences of 192 cached tokens. "cold"
calls the kernel once per layer in turn, as a step does: 30 layers' caches
(~190 MB) do not fit in L3, and the weights a real step streams in between
would evict them anyway. "hot" repeats one layer. With ``--order scattered``
each sequence's blocks are spread over the pool (as 32 sequences growing
together leave them); ``in-order`` gives each sequence consecutive blocks.
Prints ms per layer, best of 5. Compare builds by running it before and after
a kernel change; the machine drifts, so alternate.
"""

from __future__ import annotations

import argparse
import time

import torch

from switchyard_xeon.kernels import load_kernels

BATCH, HEADS, KV_HEADS, DIM, BLOCK, CONTEXT, LAYERS = 32, 9, 3, 64, 16, 192, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--order", choices=["scattered", "in-order"], default="scattered")
    args = parser.parse_args()
    kernel = load_kernels().fn
    assert kernel is not None, load_kernels().reason
    gen = torch.Generator().manual_seed(0)
    width = -(-CONTEXT // BLOCK)
    blocks = BATCH * width + 8
    pools = [tuple(torch.randn(KV_HEADS, blocks, BLOCK, DIM, generator=gen).bfloat16()
                   for _ in range(2)) for _ in range(LAYERS)]
    order = (torch.randperm(blocks, generator=gen)[: BATCH * width]
             if args.order == "scattered" else torch.arange(BATCH * width))
    tables = order.view(BATCH, width).int().contiguous()
    lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32)
    q = torch.randn(BATCH, HEADS, DIM, generator=gen)
    scale = DIM ** -0.5
    cold, hot = [], []
    for _ in range(5):
        start = time.perf_counter()
        for k, v in pools:
            kernel(q, k, v, tables, lens, scale, 0)
        cold.append((time.perf_counter() - start) / LAYERS)
        k, v = pools[0]
        start = time.perf_counter()
        for _ in range(LAYERS):
            kernel(q, k, v, tables, lens, scale, 0)
        hot.append((time.perf_counter() - start) / LAYERS)
    read = 2 * BATCH * CONTEXT * KV_HEADS * DIM * 2  # K and V, bf16
    print(f"{args.order} blocks, {BATCH} sequences x {CONTEXT} tokens, {read / 1e6:.1f} MB a layer")
    for name, times in (("cold", cold), ("hot", hot)):
        best = min(times)
        print(f"{name}: {best * 1e3:.3f} ms a layer ({read / best / 1e9:.1f} GB/s of K/V)")


if __name__ == "__main__":
    main()
