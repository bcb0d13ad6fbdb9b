"""Quantized weights on the Xeon engine's dot-product panels: formats, packing, references.

The engine runs no quantizer of its own. ``--quantize`` reaches it as a
``QuantizationMethod`` in ``EngineConfig.quantization`` (found by the gateway
in whichever plugin declares it); the engine calls its ``quantize`` on every
linear weight and packs the ``QuantizedWeight`` it gets, by format, for its
kernels:

- ``int8-per-channel``: ``kernels/panel_dot_bf16.cpp``'s int8 panels (the
  integers widened to bf16, per-feature scales after the sums);
- ``uint4-group{32,64,128}-asym``: ``kernels/panel_dot_uint4.cpp`` (nibbles
  widened to bf16 ``16 + q`` by bit operations, the offset and zero point
  folded into a per-group correction);
- ``uint4-group{32,64,128}-min`` (``q * s + b``, GGUF ``Q4_1``): the same
  panels, given float zero points ``z = -b / s`` (:func:`kernel_constants`).

Both compute ``bf16(x) @ W.T`` in fp32 sums over the weight the format
defines, and need the AVX512_BF16 build of the kernels. Where that build is
missing (Zen 2/3, Haswell to Ice Lake), ``kernels/panel_quant_fma.cpp`` runs
the same formats in fp32 math on AVX2 + FMA (``fma=True``: fp32 inputs, the
integers widened to fp32 in registers), and the model runs in fp32. A record with an
``input_order`` (act-order GPTQ: the columns stored sorted by group) runs
behind :class:`InputOrdered`, which gathers each input row in that order
first.

- ``w8a8-smoothquant`` (``-static``): ``kernels/panel_w8a8.cpp``, int8
  activations quantized per token (or with the layer's static scale) in the
  call, int32 sums by AMX, AVX512-VNNI, AVX2 or scalar code, whichever this
  CPU has; any x86-64 build of the kernels runs it. The method is calibrated
  first (:func:`switchyard_engine.calibration.calibrate`).
"""

from __future__ import annotations

import torch

from switchyard_spec import (
    INT8_PER_CHANNEL,
    ActivationQuant,
    EngineConfig,
    EngineStartError,
    Packing,
    QuantizationMethod,
    QuantizedWeight,
    WeightFormat,
)

from switchyard_xeon.weight_formats import WEIGHT_FORMATS


def check_method(config: EngineConfig) -> QuantizationMethod | None:
    """The method to quantize with, or a start-up error saying why this engine cannot.

    ``config.quantize`` must come resolved (``config.quantization``, as the
    gateway builds it) to a method with a format the engine's kernels run.
    (A GGUF folder's blocks that the panels cannot run here are served
    dequantized instead: :func:`switchyard_xeon.assembly.serve_gguf_blocks`.)
    """
    method = config.quantization
    if config.quantize is None and method is None:
        return None
    if method is None:
        raise EngineStartError(
            f"xeon engine: --quantize {config.quantize} came without its method; the gateway "
            f"resolves it (switchyard.plugins.PluginHost.resolve_quantization)")
    if not any(f in WEIGHT_FORMATS for f in method.formats):
        formats = ", ".join(f.name for f in method.formats)
        runs = ", ".join(f.name for f in WEIGHT_FORMATS)
        raise EngineStartError(f"xeon engine: --quantize {method.name} produces {formats} "
                               f"weights; its kernels run {runs}")
    return method


def is_w8a8(fmt: WeightFormat) -> bool:
    """Whether ``fmt`` quantizes activations too (W8A8), not only weights."""
    return fmt.activations is not ActivationQuant.NONE


def runs_w8a8(method: QuantizationMethod) -> bool:
    """Whether the engine runs ``method`` on the W8A8 kernels (its formats are W8A8 ones)."""
    return any(is_w8a8(f) and f in WEIGHT_FORMATS for f in method.formats)


W8A8_PATHS = {1: "amx (tdpbusd)", 2: "avx512-vnni (vpdpbusd)", 3: "avx2 (vpmaddubsw)",
              4: "scalar"}
"""``kernels/panel_w8a8.cpp``'s paths by number (its ``path`` argument)."""


def runs_on_fma(weight: QuantizedWeight) -> int:
    """``kernels/panel_quant_fma.cpp``'s kind for ``weight``'s format (1 int8, 2 uint4, 3 FP8)."""
    packing = weight.format.packing
    if packing is Packing.INT8_ROWS and not is_w8a8(weight.format):
        return 1
    if packing is Packing.UINT4_K_INT32:
        return 2
    if packing is Packing.FP8_E4M3_ROWS:
        return 3
    raise ValueError(f"the AVX2 + FMA panels do not run {weight.format.name} weights")


def pack_quantized(weight: QuantizedWeight, fma: bool = False) -> torch.Tensor:
    """``weight`` in the panel layout of its format's kernel.

    The bf16 dot-product layouts by default (they need the AVX512_BF16
    kernels); with ``fma``, the AVX2 + FMA ones of ``panel_quant_fma.cpp``
    (fp32 math). W8A8 formats have one layout either way; FP8 has only the
    fma one, whose kernel takes inputs already divided by the activation
    scale and rounded to E4M3, and scales each output by
    ``activation_scale * scales[n]`` (``switchyard_xeon.fp8_linears``).
    """
    ops = torch.ops.switchyard_xeon
    fmt = weight.format
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"the xeon kernels do not run {fmt.name} weights")
    data, scales, zeros = weight.data, weight.scales, weight.zero_points
    if fmt.group_min:
        data, scales, zeros = kernel_constants(weight)
    if fma or fmt.packing is Packing.FP8_E4M3_ROWS:
        kind = runs_on_fma(weight)
        scales = scales.float()
        if kind == 3:
            scales = scales * float(weight.activation_scale)
            data = data.view(torch.uint8)
        return ops.pack_panels_quant_fma(kind, data, scales, zeros, fmt.group_size,
                                         weight.in_features)
    if is_w8a8(fmt):
        return ops.pack_panels_w8a8(weight.data, weight.scales, weight.smoothing,
                                    float(weight.activation_scale))
    if fmt.packing is Packing.INT8_ROWS:
        return ops.pack_panels_int8_dot(weight.data, weight.scales)
    return ops.pack_panels_uint4_dot(data, scales, zeros, fmt.group_size, weight.in_features)


def kernel_constants(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``uint4_group_min`` record as the uint4 panels take it: ``(data, scales, zeros)``
    with float32 zero points, the weight ``(q - z) * s`` standing for ``q * s + b``.

    ``z = -b / s``, divided in float64 and rounded once to float32, so the
    panels' weight ``(q - z) * s`` (rounded three times: ``z``, ``q - z``,
    the product) is within 3 fp32 ulps of ``max(|b|, |q * s + b|)`` of the
    record's ``q * s + b`` (rounded once); 1 at most over the default
    model's Q4_1 weights. A group with ``s == 0`` stands for ``b`` whatever
    its ``q``: it becomes ``q = 0``, ``s = b``, ``z = -1``, which is ``b``
    exactly.
    """
    scales = weight.scales.float()
    mins = weight.mins.float()
    flat = scales == 0
    zeros = torch.where(flat, -1.0, -mins.double() / torch.where(flat, 1.0, scales.double()))
    data = weight.data
    if bool(flat.any()):
        group = weight.format.group_size
        q = uint4_integers(weight)
        q[flat.repeat_interleave(group, dim=1)[:, : weight.in_features]] = 0
        data = uint4_words(q)
    return (data, torch.where(flat, mins, scales).contiguous(),
            zeros.float().contiguous())


def stack_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Weight-only records of one format and K as one record of their rows stacked (a fused q|k|v).

    Every tensor of a weight-only format is indexed by output feature first,
    so stacking the outputs is stacking each tensor along dim 0.
    """
    first = weights[0]
    if any(w.format != first.format or w.in_features != first.in_features for w in weights) or (
            is_w8a8(first.format)) or not same_input_order(weights):
        raise ValueError("only weight-only records of one format, K and input order stack")
    return QuantizedWeight(
        format=first.format, out_features=sum(w.out_features for w in weights),
        in_features=first.in_features, data=torch.cat([w.data for w in weights]),
        scales=torch.cat([w.scales for w in weights]),
        zero_points=None if first.zero_points is None else torch.cat(
            [w.zero_points for w in weights]),
        mins=None if first.mins is None else torch.cat([w.mins for w in weights]),
        input_order=first.input_order)


def same_input_order(weights: list[QuantizedWeight]) -> bool:
    """Whether every record stores its columns in the same order (all None, or equal orders).

    Siblings (q|k|v) read one input, so GPTQ gives them one Hessian and one
    order; records whose orders differ (a checkpoint made otherwise) cannot
    share one matmul.
    """
    first = weights[0].input_order
    if first is None:
        return all(w.input_order is None for w in weights)
    return all(w.input_order is not None and torch.equal(w.input_order, first)
               for w in weights)


class InputOrdered(torch.nn.Module):
    """A linear over weights stored with their columns in ``order``: gathers the input first.

    ``forward(x)`` is ``linear(x[..., order])``, one ``index_select`` per
    call (a copy of the input rows, which the kernel reads anyway; the
    fastest of PyTorch's gathers along the last dimension, measured against
    indexing, ``gather`` and a transposed copy). It is no ``PanelLinear``, so
    the decoder's one-call native layer loop, which hands the panels to C++
    directly, is not taken for a model that has one.
    """

    def __init__(self, linear: torch.nn.Module, order: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.in_features = int(order.shape[0])
        self.out_features = linear.out_features
        self.register_buffer("order", order.to(torch.int64).contiguous(), persistent=False)
        # A panel linear's op on 2-D rows, without a second module call per step.
        self._rows = getattr(linear, "rows", None)

    @property
    def bias(self) -> torch.Tensor | None:
        """The wrapped linear's bias."""
        return self.linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` for ``x`` of any leading shape, ``W`` in the inputs' order."""
        if self._rows is None:
            return self.linear(x.index_select(-1, self.order))
        flat = x.reshape(-1, self.in_features).index_select(1, self.order)  # contiguous
        return self._rows(flat).view(*x.shape[:-1], self.out_features)


def with_input_order(linear: torch.nn.Module, weight: QuantizedWeight) -> torch.nn.Module:
    """``linear`` (packed from ``weight``) behind :class:`InputOrdered` when ``weight`` has an
    ``input_order``; ``linear`` itself otherwise."""
    if weight.input_order is None:
        return linear
    return InputOrdered(linear, weight.input_order)


def describe(fmt: WeightFormat) -> str:
    """How the start-up log names weights of ``fmt``, e.g. "int8 weights (per-feature scales)"."""
    if fmt == INT8_PER_CHANNEL:
        return "int8 weights (per-feature scales)"
    if is_w8a8(fmt):
        act = "per token" if fmt.activations is ActivationQuant.INT8_PER_TOKEN else "static scale"
        return f"W8A8 int8 weights and activations ({act}, SmoothQuant factors)"
    if fmt.group_min:
        return f"uint4 weights (groups of {fmt.group_size}, scales and mins)"
    return f"uint4 weights (groups of {fmt.group_size}, scales and zero points)"


def reference_weight(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight ``weight`` stands for, from the format's definition in the contract.

    Written here, apart from any method's ``dequantize``, so that the kernels
    are checked against the contract rather than against the code that
    produced their input.
    """
    if is_w8a8(weight.format):
        return weight.data.float() * weight.scales[:, None] / weight.smoothing[None, :]
    if weight.format.packing is Packing.INT8_ROWS:
        return weight.data.float() * weight.scales[:, None]
    groups = torch.arange(weight.in_features) // weight.format.group_size
    q = uint4_integers(weight).float()
    if weight.format.group_min:
        stored = q * weight.scales[:, groups] + weight.mins.float()[:, groups]
    else:
        stored = (q - weight.zero_points.float()[:, groups]) * weight.scales[:, groups]
    if weight.input_order is None:
        return stored
    inputs = torch.empty_like(stored)  # stored column j is input input_order[j]
    inputs[:, weight.input_order] = stored
    return inputs


def uint4_integers(weight: QuantizedWeight) -> torch.Tensor:
    """The integers ``q`` (0..15) of a ``Packing.UINT4_K_INT32`` weight as ``int64[N, K]``."""
    shifts = torch.arange(8, dtype=torch.int64) * 4
    words = weight.data.to(torch.int64) & 0xFFFFFFFF  # the int32 words' bits, unsigned
    nibbles = (words[..., None] >> shifts) & 15
    return nibbles.reshape(weight.out_features, -1)[:, : weight.in_features]


def uint4_words(q: torch.Tensor) -> torch.Tensor:
    """``uint8[N, K]`` values 0..15 as ``Packing.UINT4_K_INT32`` words (for checks and tests)."""
    n, k = q.shape
    padded = torch.zeros(n, -(-k // 8) * 8, dtype=torch.int64)
    padded[:, :k] = q.to(torch.int64)
    words = (padded.view(n, -1, 8) << (torch.arange(8, dtype=torch.int64) * 4)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def w8a8_reference(x: torch.Tensor, weight: QuantizedWeight,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """A W8A8 layer from the format's definition, in PyTorch: quantize ``x`` [M, K], int matmul.

    The input is divided by the smoothing factors (times ``1 / m``, as the
    kernel does), quantized per row (or with the static scale), multiplied
    with the integers exactly (int64), and scaled: what ``panel_w8a8.cpp``
    computes, up to the last rounding of each output.
    """
    t = x.float() * (1.0 / weight.smoothing)
    if weight.format.activations is ActivationQuant.INT8_PER_TENSOR:
        a = torch.full((t.shape[0],), float(weight.activation_scale))
        step = 1.0 / a
    else:
        amax = t.abs().amax(1)
        a = amax / 127.0
        step = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round((t * step[:, None]).clamp(-127, 127)).long()
    acc = xq @ weight.data.long().T
    y = acc.double() * (a[:, None] * weight.scales[None, :]).double()
    if bias is not None:
        y = y + bias.double()
    return y.float()
