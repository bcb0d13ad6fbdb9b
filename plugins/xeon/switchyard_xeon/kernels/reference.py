"""Portable paged decode attention: the same contract as the native kernel, in PyTorch.

The engine's fallback when no kernel could be built, and the reference the
kernel is checked against. Decode rows of the step are handled in one call:
one gather of every row's blocks (tables padded to the longest), then one
SDPA with a key mask, the query heads of a GQA group folded into the query
axis so each K/V head is shared without a copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Decode attention: ``q`` [B, H, D] over the first ``context_lens[b]`` cached tokens.

    ``k_pool``/``v_pool`` are [kv_heads, num_blocks, block_size, D];
    ``block_tables`` [B, n] lists each row's blocks (padding entries are never
    read past its length). With ``window`` > 0 only the last ``window`` keys
    count. Returns [B, H, D] in ``q``'s dtype.
    """
    batch, heads, dim = q.shape
    kv_heads, _, block_size, _ = k_pool.shape
    tables = block_tables.long()
    width = tables.shape[1]
    length = width * block_size
    flat = tables.reshape(-1)
    # [kv_heads, B * width, block, D] -> [B, kv_heads, width * block, D]
    keys = k_pool.index_select(1, flat).view(kv_heads, batch, length, dim).transpose(0, 1)
    values = v_pool.index_select(1, flat).view(kv_heads, batch, length, dim).transpose(0, 1)
    pos = torch.arange(length, device=q.device)[None, :]
    lens = context_lens.long()[:, None]
    mask = pos < lens
    if window > 0:
        mask &= pos >= lens - window
    group = heads // kv_heads
    out = F.scaled_dot_product_attention(
        q.view(batch, kv_heads, group, dim), keys, values,
        attn_mask=mask[:, None, None, :], scale=scale,
    )
    return out.reshape(batch, heads, dim)
