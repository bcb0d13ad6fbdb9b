"""Weight-only int4: unsigned 4-bit, asymmetric, per group of K, round to nearest.

Each group of ``group_size`` weights along a row's K (the last may be
shorter) gets a float32 scale ``s`` and an integer zero point ``z`` in 0..15
and stands for ``(q - z) * s`` with ``q`` in 0..15. The range is the group's
minimum and maximum widened to include 0, so that 0 is exact and ``z`` is an
integer in range: ``s = (max - min) / 15``, ``z = round(-min / s)``, and every
weight is within half a step, ``s / 2``, of its value (the RTN of gpt-fast's
and ipex's group-wise asymmetric INT4, with an integer zero point as ipex's
low-precision checkpoints store it). The format is
``switchyard_spec.uint4_group_asym(group_size)``; the integers are packed
eight to an int32 along K (``Packing.UINT4_K_INT32``).
"""

from __future__ import annotations

import torch

from switchyard_spec import Packing, QuantizedWeight, uint4_group_asym

UINT4_MAX = 15
NIBBLES_PER_WORD = 8


def pack_uint4_along_k(q: torch.Tensor) -> torch.Tensor:
    """``uint8[N, K]`` values 0..15 -> ``int32[N, ceil(K / 8)]``, least significant nibble first."""
    n, k = q.shape
    words = -(-k // NIBBLES_PER_WORD)
    padded = torch.zeros(n, words * NIBBLES_PER_WORD, dtype=torch.int64)
    padded[:, :k] = q.to(torch.int64)
    shifts = torch.arange(NIBBLES_PER_WORD, dtype=torch.int64) * 4
    packed = (padded.view(n, words, NIBBLES_PER_WORD) << shifts).sum(-1)
    # Words with a top nibble >= 8 exceed int32's range as unsigned values:
    # store their two's-complement bit pattern.
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32).contiguous()


def unpack_uint4_along_k(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of :func:`pack_uint4_along_k`: ``uint8[N, k]``."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(NIBBLES_PER_WORD, dtype=torch.int64) * 4
    nibbles = (words[..., None] >> shifts) & UINT4_MAX
    return nibbles.reshape(packed.shape[0], -1)[:, :k].to(torch.uint8)


def quantize_uint4(weight: torch.Tensor, group_size: int) -> QuantizedWeight:
    """Round ``weight`` [N, K] to uint4 with a scale and zero point per ``group_size`` along K."""
    fmt = uint4_group_asym(group_size)
    if weight.dim() != 2:
        raise ValueError(f"int4: a weight must be [N, K], not {tuple(weight.shape)}")
    w = weight.detach().float()
    n, k = w.shape
    groups = -(-k // group_size)
    # Zeros pad the last group: they change nothing, since its range includes 0 anyway.
    padded = torch.zeros(n, groups * group_size)
    padded[:, :k] = w
    grouped = padded.view(n, groups, group_size)
    low = grouped.amin(-1).clamp(max=0.0)
    high = grouped.amax(-1).clamp(min=0.0)
    scale = (high - low) / UINT4_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
    zero = torch.round(-low / scale).clamp_(0, UINT4_MAX)
    q = torch.round(grouped / scale[..., None] + zero[..., None]).clamp_(0, UINT4_MAX)
    q = q.view(n, groups * group_size)[:, :k].to(torch.uint8)
    return QuantizedWeight(format=fmt, out_features=n, in_features=k,
                           data=pack_uint4_along_k(q), scales=scale.contiguous(),
                           zero_points=zero.to(torch.uint8).contiguous())


def dequantize_uint4(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight a uint4 ``QuantizedWeight`` stands for, per group: ``(q - z) * s``,
    or ``q * s + b`` for a ``uint4_group_min`` format (the product rounded, then the sum)."""
    if weight.format.packing is not Packing.UINT4_K_INT32:
        raise ValueError(f"not a uint4 weight: {weight.format.name}")
    k, group = weight.in_features, weight.format.group_size
    q = unpack_uint4_along_k(weight.data, k).float()
    scale = weight.scales.repeat_interleave(group, dim=1)[:, :k]
    if weight.format.group_min:
        return q * scale + weight.mins.float().repeat_interleave(group, dim=1)[:, :k]
    zero = weight.zero_points.float().repeat_interleave(group, dim=1)[:, :k]
    return (q - zero) * scale
