"""SmoothQuant W8A8 in PyTorch, written from the format's definition: the reference the Xeon
engine's ``--quantize smoothquant`` is checked against.

:func:`quantize_rows` is the format's activation quantization; :class:`W8A8Matmul`
a linear in W8A8 math; :func:`smoothquant_twin` a copy of a model with every
linear W8A8, smoothed with factors computed here from statistics recorded here
(:func:`tests.support.calibration.input_absmax`).
"""

from __future__ import annotations

import copy

import torch

from tests.support.bf16_reference import register_bf16_kv_sdpa
from tests.support.calibration import input_absmax


def quantize_rows(x: torch.Tensor, inv: torch.Tensor, static: float = 0.0):
    """The format's activation quantization: ``t = x * (1 / m)``, a scale per row, round to even."""
    t = x * inv
    if static > 0:
        scale = torch.full((x.shape[0],), static)
        step = torch.full((x.shape[0],), 1.0) / scale
    else:
        amax = t.abs().amax(1)
        scale = amax / 127
        step = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round((t * step[:, None]).clamp(-127, 127)).to(torch.int64), scale


class W8A8Matmul(torch.nn.Module):
    """A linear as W8A8 math: int8 weights of ``W * m`` per row, int8 activations of ``x / m``."""

    def __init__(self, linear: torch.nn.Linear, m: torch.Tensor, static: bool,
                 absmax: torch.Tensor) -> None:
        super().__init__()
        w = linear.weight.detach().float() * m
        self.ws = (w.abs().amax(1) / 127).clamp(min=1e-30)
        self.q = torch.round(w / self.ws[:, None]).clamp(-127, 127).long()
        self.inv = 1.0 / m
        self.static = float((absmax * self.inv).max()) / 127 if static else 0.0
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        xq, scale = quantize_rows(flat, self.inv, self.static)
        y = (xq @ self.q.T).double() * (scale[:, None] * self.ws[None, :]).double()
        if self.bias is not None:
            y = y + self.bias.double()
        return y.float().view(*x.shape[:-1], -1)


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Linears that share their smoothing factors (one input, fused in the engine)."""


def smoothquant_twin(model: torch.nn.Module, prompts: list[list[int]], alpha: float,
                     static: bool, bf16_cache: bool = True) -> torch.nn.Module:
    """``model`` with every linear W8A8 (q|k|v and gate|up share their factors, as fused), and
    attention over keys and values rounded to bf16 where the engine's cache is bf16
    (``--dtype auto`` on a CPU with AVX512_BF16; fp32 elsewhere)."""
    stats = input_absmax(model, prompts)
    register_bf16_kv_sdpa()
    twin = copy.deepcopy(model)
    for prefix, parent in list(twin.named_modules()):
        children = dict(parent.named_children())
        groups = [g for g in GROUPS if all(n in children for n in g)]
        groups += [(n,) for n, c in children.items() if isinstance(c, torch.nn.Linear)
                   and not any(n in g for g in groups)]
        for group in groups:
            absmax = stats[f"{prefix}.{group[0]}" if prefix else group[0]].double()
            wmax = torch.cat([children[n].weight.detach() for n in group]).double().abs().amax(0)
            m = absmax.pow(alpha) / wmax.pow(1 - alpha)
            m = torch.where((absmax > 0) & (wmax > 0), m, torch.ones_like(m)).clamp(1e-5, 1e5)
            for n in group:
                setattr(parent, n, W8A8Matmul(children[n], m.float(), static, absmax.float()))
    if bf16_cache:
        twin.set_attn_implementation("bf16_kv_sdpa")
    return twin
