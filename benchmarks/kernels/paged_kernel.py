"""Time the engine's paged decode-attention kernel on one layer of the 135M shape.

    .venv/bin/python benchmarks/kernels/paged_kernel.py

Rows of 9 query / 3 KV heads of 64 dims, fp32, blocks of 16 tokens scattered
over a 4,096-block pool (as a busy cache leaves them), uniform and ragged
context lengths. Prints ms per call (best of 5 x 30) and the K/V bytes read
per second. Compare builds by running it before and after a kernel change.
"""

from __future__ import annotations

import time

import torch

from switchyard_xeon.kernels import load_kernels

HEADS, KV_HEADS, DIM, BLOCK, POOL = 9, 3, 64, 16, 4096


def case(lens: list[int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Queries, pools and padded block tables with every sequence's blocks scattered."""
    widths = [-(-n // BLOCK) for n in lens]
    order = torch.randperm(POOL, generator=gen)[: sum(widths)].tolist()
    tables, used = [], 0
    for w in widths:
        tables.append(order[used : used + w] + [0] * (max(widths) - w))
        used += w
    k = torch.randn(KV_HEADS, POOL, BLOCK, DIM, generator=gen)
    v = torch.randn(KV_HEADS, POOL, BLOCK, DIM, generator=gen)
    q = torch.randn(len(lens), HEADS, DIM, generator=gen)
    return q, k, v, torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def main() -> None:
    status = load_kernels()
    if status.fn is None:
        raise SystemExit(status.reason)
    gen = torch.Generator().manual_seed(0)
    for lens in ([192] * 32, [150 + 3 * i for i in range(32)], [192] * 64):
        q, k, v, tables, n = case(lens, gen)
        for _ in range(3):
            status.fn(q, k, v, tables, n, DIM**-0.5, 0)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(30):
                status.fn(q, k, v, tables, n, DIM**-0.5, 0)
            best = min(best, (time.perf_counter() - start) / 30)
        kv_bytes = sum(lens) * KV_HEADS * DIM * 4 * 2
        print(f"{len(lens)} sequences, mean context {sum(lens) // len(lens)}: "
              f"{best * 1e3:.3f} ms, {kv_bytes / best / 1e9:.1f} GB/s of K/V")


if __name__ == "__main__":
    main()
