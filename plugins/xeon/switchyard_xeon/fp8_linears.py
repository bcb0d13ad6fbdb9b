"""FP8 E4M3 linears on the Xeon engine (``fp8-e4m3-per-tensor``), in stock PyTorch.

A method declaring ``FP8_E4M3_PER_TENSOR`` (``--quantize fp8``) is calibrated
by the toolkit (:func:`switchyard_engine.calibration.calibrate`), then every
``nn.Linear`` of the model, the LM head included, becomes an
:class:`Fp8Linear` holding only its ``float8_e4m3fn`` weight and scales.
Each call computes the format's math:

- the input is quantized to E4M3 with the layer's static scale
  (``x / a``, clamped to +-448, round to nearest even);
- input and weight are widened to fp32 (through bf16, which holds every
  E4M3 value exactly) and multiplied by an fp32 matmul: every product of
  two E4M3 values is exact in fp32, so only the order of the fp32 sums
  differs from exact arithmetic;
- the result is scaled by ``a * s[n]`` in fp32 and the bias added.

Why fp32 sums and not oneDNN's bf16 matmul: that one rounds each output to
bf16, and the next layer's E4M3 rounding turns those small differences
into whole E4M3 steps now and then; on the tiny test model the logits then
moved by 12% (relative norm) against the format's float64 reference,
against 3e-8 with fp32 sums. Why not ``torch._scaled_mm``: in torch 2.13
it runs FP8 on the CPU (fp32 sums, per-tensor and row-wise scales) but
measured several times slower than this (a 1536 x 576 weight, one row,
one thread: 4.5-8.9 ms against 0.7-1.5 ms on a busy machine).

Where the native kernels have them (any AVX2 + FMA build), the matmul runs
on ``kernels/panel_quant_fma.cpp``'s FP8 panels: the E4M3 bytes widened to
fp32 in registers (exactly, by bit operations that make no denormal on the
way), the output scaled after the sums: the same math over a weight stream
of one byte per weight. Without them each call widens the whole weight in
PyTorch, by bit operations (:func:`widen_e4m3`; the ``float8_e4m3fn`` cast
measured 3.5x slower, 4.9 ms against 1.4 ms for the same weight), which
decodes far slower (on the 135M shape, batch 1, Zen 4: 4.2-4.8 tokens/s
against bf16's 104.5). See docs/quantization.md.

Sibling projections that read one input (q|k|v, gate|up) are quantized one
by one (each its own weight scale, as INC does on Gaudi) and stacked into
one matmul, so the hand-written decoder finds them fused as it expects.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import torch.nn.functional as F


from switchyard_engine.fp8_records import check_fp8_weight
from switchyard_spec import (
    FP8_E4M3_MAX,
    FP8_E4M3_PER_TENSOR,
    ActivationStatistics,
    QuantizationMethod,
    QuantizedWeight,
)

from switchyard_xeon.fusion import SIBLING_GROUPS, FusedSibling, SharedMatmul, fused_name
from switchyard_xeon.weight_formats import WEIGHT_FORMATS
from switchyard_xeon.quantized import pack_quantized

BLOCK_WEIGHTS = 1 << 18
"""Weights widened per block of rows (~1 MiB as fp32); see :meth:`Fp8Linear.forward`."""
_BF16_EXPONENT_SHIFT = torch.tensor(2.0**120, dtype=torch.bfloat16)
"""E4M3's exponent bias is 7, bf16's 127: bits moved into place stand for the value times 2**-120."""


def runs_fp8(method: QuantizationMethod | None) -> bool:
    """Whether ``method`` produces FP8 weights this engine runs (on :class:`Fp8Linear`)."""
    return method is not None and any(f == FP8_E4M3_PER_TENSOR and f in WEIGHT_FORMATS
                                      for f in method.formats)


def _widen_by_bits(codes: torch.Tensor) -> torch.Tensor:
    """bf16 of E4M3 bytes: sign to bit 15, exponent and mantissa to bits 10..4, times 2**120.

    Exact for every finite code, subnormals included (both formats have
    them at these positions), unless denormals are flushed to zero.
    """
    v = codes.to(torch.int16)
    bits = ((v & 0x80) << 8) | ((v & 0x7F) << 4)
    return bits.view(torch.bfloat16) * _BF16_EXPONENT_SHIFT


@functools.cache
def _bits_are_exact() -> bool:
    """Whether :func:`_widen_by_bits` equals PyTorch's cast for all 254 finite codes here."""
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).to(torch.bfloat16)
    finite = ~torch.isnan(want)
    return bool(torch.equal(_widen_by_bits(codes)[finite].view(torch.int16),
                            want[finite].view(torch.int16)))


def widen_e4m3(data: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn`` values as bf16, exactly (the bit path where it checks out, else a cast)."""
    if _bits_are_exact():
        return _widen_by_bits(data.view(torch.uint8))
    return data.to(torch.bfloat16)  # e.g. a process that flushes denormals


class Fp8Linear(torch.nn.Module):
    """One linear layer in ``fp8-e4m3-per-tensor``: E4M3 weight and input, fp32 output scaling."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        check_fp8_weight(weight)
        n, k = weight.out_features, weight.in_features
        self.out_features, self.in_features = n, k
        self.weight_format = weight.format
        self.activation_scale = float(weight.activation_scale)
        self._block_rows = max(16, BLOCK_WEIGHTS // max(k, 1))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(),
                             persistent=False)
        from switchyard_xeon.kernels import load_kernels

        # The native FP8 panels where the kernels have them (the same math, in C++, with
        # a * s[n] in the panels); else the E4M3 weight and the output scales for PyTorch.
        native = load_kernels().quant_fma
        self.register_buffer("packed_weight", pack_quantized(weight) if native else None,
                             persistent=False)
        self.register_buffer("fp8_weight", None if native else weight.data.contiguous(),
                             persistent=False)
        # a * s[n] once: the output scale of every row.
        self.register_buffer("out_scale", None if native else
                             weight.scales.float() * self.activation_scale, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``dequant(xq) @ dequant(W).T + b`` for ``x`` of any leading shape, in ``x``'s dtype."""
        flat = x.reshape(-1, self.in_features)
        xq = (flat.float() / self.activation_scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        xf = xq.to(torch.float8_e4m3fn).float()  # the E4M3 values, exactly
        if self.packed_weight is not None:
            y = torch.ops.switchyard_xeon.panel_linear.default(xf, self.packed_weight, self.bias,
                                                               self.out_features)
            return y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        # A block of rows at a time: its widened copies stay in cache and in memory the
        # allocator reuses (the LM head widened whole took 10x longer per weight).
        step = self._block_rows
        parts = [F.linear(xf, widen_e4m3(self.fp8_weight[n:n + step]).float())
                 for n in range(0, self.out_features, step)]
        y = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)) * self.out_scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"stored={self.weight_format.name}, activation_scale={self.activation_scale:.4g}")


def stack_fp8(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """FP8 records of one K and one input scale as one record of their rows (a fused q|k|v).

    Each keeps its own weight scale in its rows of ``scales``; the input
    scale is shared, as the input is (calibration records equal statistics
    for layers reading one tensor).
    """
    first = weights[0]
    if any(w.format != FP8_E4M3_PER_TENSOR or w.in_features != first.in_features
           or w.activation_scale != first.activation_scale for w in weights):
        raise ValueError("only fp8 records of one K and one activation scale stack")
    return QuantizedWeight(
        format=FP8_E4M3_PER_TENSOR, out_features=sum(w.out_features for w in weights),
        in_features=first.in_features, data=torch.cat([w.data for w in weights]),
        scales=torch.cat([w.scales for w in weights]),
        activation_scale=first.activation_scale)


def pack_fp8_linears(model: torch.nn.Module, method: QuantizationMethod,
                     statistics: Mapping[str, ActivationStatistics] | None,
                     options: Mapping[str, str]) -> str:
    """Replace every ``nn.Linear`` of ``model`` by an :class:`Fp8Linear`, fusing siblings.

    Each layer is quantized with ``method.calibration.quantize`` and the
    statistics of its input (``statistics[name]``, by qualified name before
    fusion), or with ``method.quantize`` (unit input scale) when it has none.
    Returns a phrase for the start-up log.
    """
    stats = statistics or {}
    calibration = method.calibration

    def quantize(name: str, linear: torch.nn.Linear) -> QuantizedWeight:
        weight = linear.weight.detach().float()
        if calibration is not None and name in stats:
            return calibration.quantize(weight, stats[name], options)
        return method.quantize(weight)

    layers = fused = uncalibrated = 0
    for prefix, parent in list(model.named_modules()):
        dot = f"{prefix}." if prefix else ""
        children = dict(parent.named_children())
        for names in SIBLING_GROUPS:
            group = [children.get(n) for n in names]
            if not all(type(m) is torch.nn.Linear for m in group) or len(
                    {m.in_features for m in group}) != 1:  # type: ignore[union-attr]
                continue
            # One input, one scale: every member takes the first member's statistics.
            records = [quantize(dot + names[0], m) for m in group]  # type: ignore[arg-type]
            records = [_with_scale(r, records[0].activation_scale) for r in records]
            bias = None
            if any(m.bias is not None for m in group):  # type: ignore[union-attr]
                bias = torch.cat([m.bias.detach().float() if m.bias is not None  # type: ignore[union-attr]
                                  else torch.zeros(m.out_features) for m in group])  # type: ignore[union-attr]
            shared = SharedMatmul(Fp8Linear(stack_fp8(records), bias),
                                   [m.out_features for m in group])  # type: ignore[union-attr]
            for index, (name, module) in enumerate(zip(names, group, strict=True)):
                setattr(parent, name, FusedSibling(shared, index, module.out_features))  # type: ignore[union-attr]
            parent.register_module(fused_name(names), shared.linear)
            layers += len(group)
            fused += 1
            uncalibrated += len(group) if (dot + names[0]) not in stats else 0
            children = dict(parent.named_children())
        for name, child in children.items():
            if type(child) is torch.nn.Linear:
                setattr(parent, name, Fp8Linear(quantize(dot + name, child), child.bias))
                layers += 1
                uncalibrated += (dot + name) not in stats
    from switchyard_xeon.kernels import load_kernels

    widen = ("the native FP8 panels (AVX2 + FMA)" if load_kernels().quant_fma else
             "PyTorch, widened by " + ("bit operations" if _bits_are_exact() else "a cast"))
    unscaled = f", {uncalibrated} with unit input scales (not calibrated)" if uncalibrated else ""
    return (f"{layers} linears as FP8 E4M3 ({fused} fused groups{unscaled}): weights and "
            f"inputs per-tensor scaled, fp32 matmuls on {widen}")


def _with_scale(weight: QuantizedWeight, scale: float) -> QuantizedWeight:
    import msgspec

    return msgspec.structs.replace(weight, activation_scale=scale)
