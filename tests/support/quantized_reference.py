"""Reference linears for quantized weights, in PyTorch, in the order the Xeon kernels compute.

Greedy parity runs through bf16 rounding at every linear's input and in the
KV cache, which turns a one-ulp difference in an fp32 sum into a one-ulp bf16
difference now and then; over a few layers that moves logits by ~1e-2 and
splits the rare near tie. So the reference is not just "F.linear over the
dequantized weight" in some order: it computes the same exact products (bf16
inputs times small integers, exact in fp32) and applies scales, zero points
and bias in the kernels' order, which leaves only the order of fp32 sums to
differ, as for bf16 weights. The weight it stands for is the method's
``dequantize`` (the format's formula, checked against it in
``tests/xeon/test_xeon_int4.py``), and ``test_reference_is_the_dequantized_matmul``
checks this module against ``F.linear`` over it in float64.
"""

from __future__ import annotations

import torch

from switchyard_spec import INT8_PER_CHANNEL, QuantizationMethod, QuantizedWeight
from switchyard_xeon.quantized import uint4_integers

OFFSET = 16
"""The uint4 kernel's integers are ``16 + q`` (see ``kernels/panel_dot_uint4.cpp``)."""


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` with one rounding, as a fused multiply-add: exact in float64 first."""
    return (a.double() * b.double() + c.double()).float()


class QuantizedMatmul(torch.nn.Module):
    """``bf16(x) @ W.T + bias`` for the weight a method's ``QuantizedWeight`` stands for."""

    def __init__(self, linear: torch.nn.Linear, quantization: QuantizationMethod) -> None:
        super().__init__()
        self.quantized: QuantizedWeight = quantization.quantize(linear.weight.detach())
        self.bias = linear.bias
        fmt = self.quantized.format
        if fmt == INT8_PER_CHANNEL:
            self.integers = self.quantized.data.float()
            return
        # uint4: (q - z) * s per group; the kernel sums x (16 + q), then subtracts (16 + z) sum x.
        self.integers = uint4_integers(self.quantized).float() + OFFSET

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.bfloat16().float()
        w = self.quantized
        bias = self.bias if self.bias is not None else torch.zeros(w.out_features)
        if w.format == INT8_PER_CHANNEL:  # sum x q, then one fma with the scale and bias
            return _fma(torch.nn.functional.linear(x, self.integers), w.scales, bias)
        group, k = w.format.group_size, w.in_features
        y = bias.expand(*x.shape[:-1], w.out_features)
        for g in range(w.scales.shape[1]):
            part = slice(g * group, min(k, (g + 1) * group))
            acc = torch.nn.functional.linear(x[..., part], self.integers[:, part])
            total = x[..., part].sum(-1, keepdim=True)
            d = _fma(total, -(OFFSET + w.zero_points[:, g].float()), acc)
            y = _fma(d, w.scales[:, g], y)
        return y
