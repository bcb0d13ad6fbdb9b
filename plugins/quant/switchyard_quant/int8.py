"""Weight-only int8: symmetric, one scale per output feature, round to nearest.

Every weight of a row is ``q * scale`` with ``q`` in -127..127 and
``scale = absmax / 127`` of that row: the error is at most half a step,
``scale / 2``, per weight. The format is ``switchyard_spec.INT8_PER_CHANNEL``.
"""

from __future__ import annotations

import torch

from switchyard_spec import INT8_PER_CHANNEL, QuantizedWeight

INT8_LEVELS = INT8_PER_CHANNEL.levels[1]
"""127: the symmetric range -127..127, so negating a weight never overflows."""


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Round ``weight`` [N, K] to int8 per output feature (all-zero rows get scale 1)."""
    if weight.dim() != 2:
        raise ValueError(f"int8: a weight must be [N, K], not {tuple(weight.shape)}")
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / INT8_LEVELS, torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return QuantizedWeight(format=INT8_PER_CHANNEL, out_features=w.shape[0],
                           in_features=w.shape[1], data=q.contiguous(), scales=scale.contiguous())


def dequantize_int8(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight ``q * scale[:, None]`` an int8 ``QuantizedWeight`` stands for."""
    return weight.data.float() * weight.scales[:, None]
