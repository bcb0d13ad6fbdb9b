"""FP8 E4M3 per-tensor linears in float64, written from the format's definition in the contract
(``FP8_E4M3_PER_TENSOR``), not from the engine's code: PyTorch's own ``float8_e4m3fn`` cast
for the rounding, float64 matmuls over the values the FP8 numbers stand for.
"""

from __future__ import annotations

import copy

import torch

from tests.support.bf16_reference import register_bf16_kv_sdpa
from tests.support.calibration import input_absmax

E4M3_MAX = 448.0


def qdq(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 of what ``x`` becomes as E4M3 with ``scale``: the format's rounding, by PyTorch's cast."""
    e4m3 = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return e4m3.double() * scale


class Fp8Reference(torch.nn.Module):
    """A linear in FP8 E4M3 math, float64: per-tensor weight scale, static input scale."""

    def __init__(self, linear: torch.nn.Linear, input_absmax: float) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        self.w = qdq(weight, float(weight.abs().max()) / E4M3_MAX)
        self.a = input_absmax / E4M3_MAX
        self.bias = None if linear.bias is None else linear.bias.detach().double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = qdq(x, self.a) @ self.w.T
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def fp8_twin(model: torch.nn.Module, prompts: list[list[int]],
             attention: str = "sdpa") -> torch.nn.Module:
    """``model`` with every linear an :class:`Fp8Reference` scaled by statistics recorded over
    ``prompts`` (:func:`~tests.support.calibration.input_absmax`); ``attention`` other than
    ``sdpa`` names attention over keys and values rounded to bf16 (a bf16 KV cache)."""
    stats = input_absmax(model, prompts)
    twin = copy.deepcopy(model)
    for prefix, parent in list(twin.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                absmax = float(stats[f"{prefix}.{name}" if prefix else name].max())
                setattr(parent, name, Fp8Reference(child, absmax))
    if attention != "sdpa":
        register_bf16_kv_sdpa(attention)
    twin.set_attn_implementation(attention)
    return twin
