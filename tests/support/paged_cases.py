"""Random inputs for the paged attention kernels, laid out as the Xeon runner lays them out."""

from __future__ import annotations

import math

import torch


def random_paged_case(dtype: torch.dtype, dim: int, heads: int, kv_heads: int, lens: list[int],
                      block: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A scattered pool and block tables padded with block 0, as the runner builds them:
    ``(q, k_pool, v_pool, tables, lens)``, one query row per sequence."""
    gen = torch.Generator().manual_seed(seed)
    widths = [math.ceil(n / block) for n in lens]
    num_blocks = sum(widths) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for w in widths:
        tables.append(order[used : used + w] + [0] * (max(widths) - w))
        used += w
    k = torch.randn(kv_heads, num_blocks, block, dim, generator=gen).to(dtype)
    v = torch.randn(kv_heads, num_blocks, block, dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    return (q, k, v, torch.tensor(tables, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32))
