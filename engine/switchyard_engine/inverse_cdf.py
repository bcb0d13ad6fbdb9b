"""Picking one entry per row from its probabilities and a uniform, by inverse CDF.

:func:`inverse_cdf` is how :mod:`switchyard_engine.sampling` turns each sampled
row's one uniform into its token: deterministic given the row's probabilities
and its uniform, whatever else shares the batch.
"""

from __future__ import annotations

import torch

_BLOCK = 1024
"""Entries per block when :func:`inverse_cdf` searches a whole vocabulary."""


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The position where each row's cumulative ``probs`` ([m, w]) first exceeds ``u`` ([m]) of it.

    Entries of probability 0 (removed, or underflowed) never come out: the cumulative sum
    does not grow on them, and a uniform that rounding pushes to the total mass falls
    back to the last entry that reaches it, which has a positive probability. A wide row
    finds its block of :data:`_BLOCK` entries first, so that no float64 copy of the whole
    row is written (on a CPU that copy alone cost more than the rest of the step).
    """
    m, width = probs.shape
    if width <= 2 * _BLOCK:
        return _search(probs.cumsum(dim=-1, dtype=torch.float64), u)
    full = width // _BLOCK * _BLOCK
    sums = probs[:, :full].view(m, -1, _BLOCK).sum(dim=-1, dtype=torch.float64)
    if full < width:
        sums = torch.cat([sums, probs[:, full:].sum(dim=-1, keepdim=True, dtype=torch.float64)], 1)
    block_cdf = sums.cumsum(dim=-1)
    block = _search(block_cdf, u)
    # Where the uniform points in the row, and so in its block, past the blocks before.
    before = torch.cat([torch.zeros_like(sums[:, :1]), block_cdf], dim=1).gather(1, block[:, None])
    point = u[:, None] * block_cdf[:, -1:]
    cols = block[:, None] * _BLOCK + torch.arange(_BLOCK, device=probs.device)
    inside = probs.gather(1, cols.clamp(max=width - 1)).masked_fill(cols >= width, 0.0)
    inside_cdf = inside.cumsum(dim=-1, dtype=torch.float64)
    # The chosen block has a positive mass. Its running sum and its float64 block sum round
    # apart by about 1e-16; the search clamps a share just past the block's end back in.
    share = (point - before)[:, 0] / inside_cdf[:, -1]
    return block * _BLOCK + _search(inside_cdf, share)


def _search(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first position of each row of nondecreasing ``cdf`` above ``u`` of its total.

    A share that rounding puts at or past the total picks the last position where the
    total is first reached: the last one of positive probability.
    """
    total = cdf[:, -1:].contiguous()
    at = torch.searchsorted(cdf, u[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total)
    return torch.minimum(at, last)[:, 0]
