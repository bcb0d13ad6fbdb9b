"""Weight-only int8 quantization for the Xeon engine's dot-product panels.

``--quantize int8``: every linear's weight (the LM head included) is stored as
int8 with one fp32 scale per output feature (symmetric, absmax / 127), and
the matmul is ``scale * (bf16(x) @ q.T)`` with fp32 sums
(``kernels/panel_dot_bf16.cpp``). Half the bytes of bf16 weights: batch-1
decoding reads its weights once per token, so that is where it pays.
Activations, norms, rotary, the KV cache and the embeddings are as in the
bf16 mode; the error is the weights' rounding, at most half a step of
``absmax / 127`` per weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8 = "int8"
METHODS = (INT8,)
"""The ``--quantize`` values the Xeon engine implements."""

INT8_LEVELS = 127
"""Symmetric range: -127..127, so negating a weight never overflows."""


@dataclass(frozen=True)
class Int8Weight:
    """A weight quantized per output feature: ``weight ≈ q * scale[:, None]``."""

    q: torch.Tensor
    """int8 [out_features, in_features]."""
    scale: torch.Tensor
    """float32 [out_features]."""

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight these integers stand for (what a reference computes with)."""
        return self.q.float() * self.scale[:, None]


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Round ``weight`` [N, K] to int8 per output feature (all-zero rows get scale 1)."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / INT8_LEVELS, torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return Int8Weight(q=q.contiguous(), scale=scale.contiguous())
