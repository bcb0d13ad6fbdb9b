"""Faster linear layers on the CPU: packed weights, fused siblings.

Two changes to a loaded transformers model, neither of which touches its
architecture code (:class:`PanelLinear`, the engine's own fp32 kernel, takes
the place of :class:`PackedLinear` where the engine chooses it, and keeps
weights that hold only bf16 values as bf16):

- every fp32 or bf16 ``nn.Linear`` (the LM head included) becomes a
  :class:`PackedLinear`, whose weight oneDNN reordered once at load time into
  its blocked layout, so no step pays for that reorder and every matmul takes
  oneDNN's kernels rather than the BLAS behind ``F.linear``. Measured on the
  SmolLM2-135M shape: in bf16 (AVX-512 machine) a weight sweep streams 22 GB/s
  instead of 17; in fp32 on a 2-core AMD EPYC (AVX2), where MKL's sgemm runs
  far below the cores' FMA peak, a sweep takes 41 ms instead of 54 at one row,
  59 instead of 107 at 8 and 98 instead of 171 at 32
  (``benchmarks/kernels/linear_sweep.py``). bf16 packing needs AVX-512 or
  AVX-NE-CONVERT;
- projections that read the same input, ``q_proj``/``k_proj``/``v_proj`` and
  ``gate_proj``/``up_proj`` in Llama, Mistral, Qwen2 and kin, run as one
  matmul over their concatenated weights: the first sibling called computes
  all of them and the others take their slice (:class:`FusedSibling`). Fewer,
  larger calls matter because each oneDNN call costs ~16-20 us whatever its size.

The oneDNN operators are private to PyTorch, so :func:`pack_linears` first
checks them against ``F.linear`` on the model's own first layer and leaves the
model alone when they are missing or disagree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from switchyard_engine.checkpoint import QuantizedLinear
from switchyard_spec import ActivationStatistics, QuantizationMethod, QuantizedWeight

from switchyard_xeon.fusion import SIBLING_GROUPS, FusedSibling, SharedMatmul, fused_name

logger = logging.getLogger("switchyard.xeon")

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
"""Weight dtypes oneDNN's linear takes in a packed layout."""


class PackedLinear(torch.nn.Module):
    """An fp32 or bf16 ``nn.Linear`` whose weight is held in oneDNN's packed layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # No batch-size hint: oneDNN's default layout measured as fast as one
        # tuned for 64 rows at 1 to 64 rows (benchmarks/kernels/linear_sweep.py).
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` for ``x`` of any leading shape."""
        flat = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def holds_bf16(weight: torch.Tensor) -> bool:
    """True when every value of fp32 ``weight`` is a bf16 value (its low 16 bits are zero).

    That is the case for any bf16 checkpoint loaded in fp32, the usual way to
    run one on a CPU without bf16 arithmetic: such weights can be stored as
    bf16 again without changing a single value.
    """
    if weight.dtype != torch.float32:
        return False
    low_bits = weight.detach().contiguous().view(torch.int32).bitwise_and(0xFFFF)
    return not bool(low_bits.any())


class PanelLinear(torch.nn.Module):
    """An fp32 ``nn.Linear`` on the engine's own kernel (``kernels/panel_gemm.cpp``).

    The weight is repacked once into panels of 16 output features, k-major.
    With ``narrow`` (the default), a weight whose values are all bf16 values
    (see :func:`holds_bf16`) is stored as bf16 and widened back in the kernel:
    the same fp32 math over half the bytes, which is what bounds decoding.
    With ``bf16_dot`` (a CPU with AVX512_BF16, ``kernels/panel_dot_bf16.cpp``)
    the weight is rounded to bf16 and the matmul is a bf16 one: each call
    rounds its input rows to bf16 and sums the products in fp32, twice the
    multiply-adds per instruction of fp32 math; input and output stay fp32.
    With a ``quantization`` method as well (``--quantize``), the weight is
    quantized by it and packed for the kernel of its format
    (:mod:`switchyard_xeon.quantized`): int8 per output feature (half the
    bytes of bf16) or uint4 per group (a quarter), the same bf16 dot products
    over the integers; or, for a W8A8 method (``--quantize smoothquant``),
    int8 weights and int8 activations (``kernels/panel_w8a8.cpp``, any
    build), quantized with ``statistics`` of this layer's input and the
    engine ``options`` when the method has a ``Calibration``. Without
    ``bf16_dot``, weight-only quantized weights go to the AVX2 + FMA panels
    (``kernels/panel_quant_fma.cpp``): the same formats in fp32 math. Call
    :func:`~switchyard_xeon.kernels.load_kernels` first: the operators exist
    only once the native library is loaded.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 narrow: bool = True, bf16_dot: bool = False,
                 quantization: QuantizationMethod | None = None,
                 statistics: ActivationStatistics | None = None,
                 options: dict[str, str] | None = None,
                 quantized: QuantizedWeight | None = None) -> None:
        super().__init__()
        from switchyard_xeon.quantized import pack_quantized, runs_w8a8

        w8a8 = quantization is not None and runs_w8a8(quantization)
        # Weight-only quantized weights without bf16 dot products: fp32 math on AVX2 + FMA.
        self.fma = (quantization is not None or quantized is not None) and not bf16_dot and not w8a8
        self.bf16_dot = bf16_dot
        self.weight_format = None
        """The ``WeightFormat`` of quantized weights; None for float ones."""
        self.narrowed = False
        if quantized is not None:  # already quantized (a checkpoint's layer): pack it as it is
            self.out_features, self.in_features = quantized.out_features, quantized.in_features
            self.weight_format = quantized.format
            self.register_buffer("packed_weight", pack_quantized(quantized, fma=self.fma),
                                 persistent=False)
            self.register_buffer("bias", None if bias is None else
                                 bias.detach().float().contiguous().clone(), persistent=False)
            return
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        self.narrowed = (not bf16_dot and quantization is None and narrow
                         and holds_bf16(weight))
        if quantization is not None:
            calibration = quantization.calibration
            if statistics is not None and calibration is not None:
                quantized = calibration.quantize(weight, statistics, options or {})
            else:
                quantized = quantization.quantize(weight)
            self.weight_format = quantized.format
            packed = pack_quantized(quantized, fma=self.fma)
        elif bf16_dot:
            packed = torch.ops.switchyard_xeon.pack_panels_bf16_dot(weight)
        else:
            stored = weight.to(torch.bfloat16) if self.narrowed else weight
            packed = torch.ops.switchyard_xeon.pack_panels(stored)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous().clone(),
                             persistent=False)

    @property
    def row_tile(self) -> int:
        """Rows of ``x`` one micro-kernel call multiplies while a weight panel is hot
        (``kRows`` of the kernel this weight runs on: 4 on the bf16-dot uint4 panels,
        6 on the others). A call of up to this many rows costs about one of a single
        row; each further tile costs a pass of its own."""
        uint4_dot = (self.weight_format is not None and not self.fma
                     and self.weight_format.name.startswith("uint4"))
        return 4 if uint4_dot else 6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` for ``x`` of any leading shape."""
        flat = x.reshape(-1, self.in_features).contiguous()
        return self.rows(flat).view(*x.shape[:-1], self.out_features)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` for a contiguous 2-D ``x``: the op alone, no module plumbing."""
        return torch.ops.switchyard_xeon.panel_linear.default(x, self.packed_weight, self.bias,
                                                              self.out_features)

    def extra_repr(self) -> str:
        storage = "bf16, bf16 dot products" if self.bf16_dot else (
            "bf16" if self.narrowed else "fp32")
        if self.weight_format is not None:
            from switchyard_xeon.quantized import is_w8a8

            storage = f"{self.weight_format.name}, " + (
                "int8 dot products" if is_w8a8(self.weight_format) else
                "fp32 math" if self.fma else "bf16 dot products")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"packed=panels, stored={storage}")


Packer = Callable[..., torch.nn.Module]
"""Makes the packed module for a weight and optional bias (and, from
:func:`pack_linears`, the layer's qualified name, for its calibration statistics)."""


@dataclass(frozen=True)
class PackReport:
    """What :func:`pack_linears` did, for the start-up log."""

    packed: int = 0
    fused_groups: int = 0
    reason: str = ""
    dtype: str = ""
    layout: str = "oneDNN"
    narrowed: int = 0
    bf16_dot: bool = False
    quantized: str = ""
    """How the quantized weights are stored, e.g. "int8 weights (per-feature scales)"."""
    w8a8: str = ""
    """W8A8 linears: the kernel paths they take (``KernelStatus.w8a8``)."""
    fma: bool = False
    """Quantized weights on the AVX2 + FMA panels, in fp32 math."""

    def describe(self) -> str:
        """A phrase such as "oneDNN-packed bfloat16 (151 linears, 60 fused groups)"."""
        fused = f"{self.fused_groups} fused groups"
        if not self.packed:
            return f"stock, {fused} ({self.reason})" if self.fused_groups else f"stock ({self.reason})"
        stored = (f"; {self.narrowed} hold only bf16 values and are stored as bf16"
                  if self.narrowed else "")
        if self.w8a8:
            stored = f"; {self.quantized}, int32 sums on {self.w8a8}, fp32 outputs"
        elif self.fma and self.quantized:
            stored = f"; {self.quantized} in fp32 math (AVX2 + FMA)"
        elif self.bf16_dot:
            weights = self.quantized or "bf16 weights"
            stored = f"; {weights} and bf16 dot products (AVX512_BF16), fp32 sums"
        return f"{self.layout}-packed {self.dtype} ({self.packed} linears, {fused}{stored})"


def pack_linears(model: torch.nn.Module, fuse: bool = True, pack: bool = True,
                 panels: bool = False, narrow: bool = True, bf16_dot: bool = False,
                 quantization: QuantizationMethod | None = None,
                 statistics: dict[str, ActivationStatistics] | None = None,
                 options: dict[str, str] | None = None) -> PackReport:
    """Fuse sibling projections of ``model`` in place and, for fp32 or bf16 weights, pack them.

    With ``panels`` (the native kernels are loaded), fp32 weights go to
    :class:`PanelLinear` (stored as bf16 where that is exact and ``narrow``
    allows it; rounded to bf16 for bf16 matmuls with ``bf16_dot``, which
    needs the kernels' AVX512_BF16 build; quantized by ``quantization`` too,
    every linear the LM head included); otherwise, and for bf16, to oneDNN's
    :class:`PackedLinear`. Packing bf16 needs oneDNN's bf16 reorder, which
    wants AVX-512 (or AVX-NE-CONVERT); where packing is unavailable (or
    ``pack`` is False), disagrees with ``F.linear`` or the weights are of
    another dtype (fp16, mixed) the linears stay stock and only the fusion
    applies (one plain matmul per group: fewer calls in any dtype).

    A W8A8 ``quantization`` needs ``panels`` only (not ``bf16_dot``); each
    layer is quantized with ``statistics[name]`` (its qualified name in
    ``model``, before fusion; a fused group takes its first member's, since
    they share an input) and ``options``. A weight-only one (and a
    checkpoint's quantized layers) without ``bf16_dot`` takes the AVX2 + FMA
    panels, where the kernels have them (``KernelStatus.quant_fma``).
    """
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    prequantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if not linears and not prequantized:
        return PackReport(reason="no linear layers")
    reason = ""
    dtypes = {m.weight.dtype for m in linears} or {torch.float32}
    dtype = next(iter(dtypes))
    use_panels = panels and dtype == torch.float32
    dot = use_panels and bf16_dot
    from switchyard_xeon.kernels import load_kernels
    from switchyard_xeon.quantized import runs_w8a8

    w8a8 = use_panels and quantization is not None and runs_w8a8(quantization)
    fma = use_panels and not dot and not w8a8 and load_kernels().quant_fma and (
        quantization is not None or bool(prequantized))
    # A checkpoint method's layers come quantized (QuantizedLinear); float ones stay bf16.
    checkpoint = quantization is not None and quantization.load is not None
    method = quantization if (dot or w8a8 or fma) and not checkpoint else None
    stats = statistics or {}

    def packer(weight: torch.Tensor | None, bias: torch.Tensor | None, name: str = "",
               quantized: QuantizedWeight | None = None) -> torch.nn.Module:
        if quantized is not None:
            from switchyard_xeon.quantized import with_input_order

            return with_input_order(PanelLinear(None, bias, bf16_dot=dot,  # type: ignore[arg-type]
                                                quantized=quantized), quantized)
        if use_panels:
            return PanelLinear(weight, bias, narrow=narrow, bf16_dot=dot, quantization=method,
                               statistics=stats.get(name), options=options)
        return PackedLinear(weight, bias)

    if not pack:
        reason = "linears=stock"
    elif len(dtypes) > 1 or dtype not in PACKABLE_DTYPES:
        reason = f"weights are {', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))}"
    elif prequantized and not (dot or fma):
        reason = "a checkpoint's quantized layers need the native quantized panels"
    else:
        reason = _check_packing(linears[0], packer, bf16_inputs=dot and not w8a8,
                                quantization=method) if linears else ""
        if not reason and prequantized:
            reason = _check_prequantized(prequantized[0], packer)
        if reason:
            logger.info("packed linears unavailable, using stock ones: %s", reason)
    pack = not reason
    packed = fused = 0
    for prefix, parent in list(model.named_modules()):
        children = dict(parent.named_children())
        dot_prefix = f"{prefix}." if prefix else ""
        if fuse:
            for names in SIBLING_GROUPS:
                group = [children.get(n) for n in names]
                if pack and _fusable_quantized(group):
                    _fuse_quantized(parent, names, group, packer)  # type: ignore[arg-type]
                    packed += 1
                    fused += 1
                    children = dict(parent.named_children())
                    continue
                if all(type(m) is torch.nn.Linear for m in group) and _same_input_size(group):
                    _fuse(parent, names, group, packer if pack else None,
                          dot_prefix + names[0])
                    packed += pack
                    fused += 1
                    children = dict(parent.named_children())
        if pack:
            for name, child in children.items():
                if type(child) is torch.nn.Linear:
                    setattr(parent, name, packer(child.weight, child.bias, dot_prefix + name))
                    packed += 1
                elif isinstance(child, QuantizedLinear):
                    setattr(parent, name, packer(None, child.bias, quantized=child.quantized))
                    packed += 1
    narrowed = sum(isinstance(m, PanelLinear) and m.narrowed for m in model.modules())
    formats = {m.weight_format for m in model.modules() if isinstance(m, PanelLinear)}
    quantized = ""
    if method is not None and pack and None not in formats:
        from switchyard_xeon.quantized import describe

        quantized = " and ".join(sorted(describe(f) for f in formats if f is not None))
    elif checkpoint and pack and prequantized:
        from switchyard_xeon.quantized import describe

        kinds = " and ".join(sorted(describe(f) for f in formats if f is not None))
        quantized = (f"{kinds} from the checkpoint ({len(prequantized)} linears)"
                     + ((", bf16 weights for the rest" if dot else ", fp32 math for the rest")
                        if None in formats else ""))
    paths = ""
    if w8a8 and pack and quantized:
        paths = load_kernels().w8a8
    return PackReport(packed=packed, fused_groups=fused, reason=reason,
                      dtype=str(dtype).removeprefix("torch."),
                      layout="panel" if use_panels else "oneDNN", narrowed=narrowed,
                      bf16_dot=dot and pack and not paths, quantized=quantized, w8a8=paths,
                      fma=fma and pack)


def weight_memory(model: torch.nn.Module) -> str:
    """What the linears' weights take in memory as the kernels hold them, by how they are stored.

    For the start-up log: "129.9 MiB: uint4-group32-asym 75.9 MiB (120 matmuls), bf16 54.0
    MiB (1 matmul)". Packed weights count with their scales and zero points; a fused group
    (q|k|v, gate|up) is one matmul; biases and embeddings are not counted.
    """
    sizes: dict[str, list[int]] = {}
    for module in model.modules():
        kind, size = _stored(module)
        if kind:
            entry = sizes.setdefault(kind, [0, 0])
            entry[0] += size
            entry[1] += 1
    total = sum(size for size, _ in sizes.values())
    parts = ", ".join(f"{kind} {size / 2**20:.1f} MiB ({count} matmul{'s' if count != 1 else ''})"
                      for kind, (size, count) in sorted(sizes.items(), key=lambda i: -i[1][0]))
    return f"{total / 2**20:.1f} MiB: {parts}" if sizes else "no linear layers"


def _stored(module: torch.nn.Module) -> tuple[str, int]:
    """How one linear module stores its weight, and its bytes; ("", 0) for other modules."""
    from switchyard_xeon.fp8_linears import Fp8Linear

    if isinstance(module, PanelLinear):
        kind = (module.weight_format.name if module.weight_format is not None else
                "bf16" if module.bf16_dot or module.narrowed else "float32")
        return kind, module.packed_weight.nbytes
    if isinstance(module, PackedLinear):
        return _dtype_kind(module.packed_weight.dtype), module.packed_weight.nbytes
    if isinstance(module, Fp8Linear):
        buffers = (module.packed_weight, module.fp8_weight, module.out_scale)
        return module.weight_format.name, sum(b.nbytes for b in buffers if b is not None)
    if type(module) is torch.nn.Linear:
        return _dtype_kind(module.weight.dtype), module.weight.nbytes
    if isinstance(module, QuantizedLinear):
        quantized = module.quantized
        tensors = (quantized.data, quantized.scales, quantized.zero_points, quantized.mins)
        return quantized.format.name, sum(t.nbytes for t in tensors if t is not None)
    return "", 0


def _dtype_kind(dtype: torch.dtype) -> str:
    """"bf16", "float32", ...: a float dtype as :func:`weight_memory` names it."""
    return "bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch.")


def _fusable_quantized(group: list[torch.nn.Module | None]) -> bool:
    """Whether ``group`` is all checkpoint layers of one format and one input size."""
    if not all(isinstance(m, QuantizedLinear) for m in group):
        return False
    from switchyard_xeon.quantized import same_input_order

    records = [m.quantized for m in group]  # type: ignore[union-attr]
    return len({(r.format, r.in_features) for r in records}) == 1 and same_input_order(records)


def _fuse_quantized(parent: torch.nn.Module, names: tuple[str, ...],
                    group: list[QuantizedLinear], packer: Packer) -> None:
    """:func:`_fuse` for checkpoint layers: their records stacked along N, packed once."""
    from switchyard_xeon.quantized import stack_rows

    weight = stack_rows([m.quantized for m in group])
    bias = None
    if any(m.bias is not None for m in group):
        bias = torch.cat([m.bias.detach().float() if m.bias is not None
                          else torch.zeros(m.out_features) for m in group])
    linear = packer(None, bias, quantized=weight)
    shared = SharedMatmul(linear, [m.out_features for m in group])
    for index, (name, module) in enumerate(zip(names, group, strict=True)):
        setattr(parent, name, FusedSibling(shared, index, module.out_features))
    parent.register_module(fused_name(names), shared.linear)


def _check_prequantized(sample: QuantizedLinear, packer: Packer) -> str:
    """'' when a checkpoint layer on the panels agrees with ``F.linear`` over its method's
    ``dequantize`` (bf16 inputs), else why not: the reader and the packing agree on the format."""
    try:
        packed = packer(None, sample.bias, quantized=sample.quantized)
        x = torch.randn(3, sample.in_features, generator=torch.Generator().manual_seed(0))
        x = x.bfloat16().float()
        with torch.inference_mode():
            got = packed(x).float()
            want = F.linear(x, sample.method.dequantize(sample.quantized).float(), sample.bias)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    err = (got - want).abs().max().item()
    if not err <= 1e-4 * (want.abs().max().item() or 1.0):
        return f"packed checkpoint layer differs from F.linear by {err:.3g}"
    return ""


def _same_input_size(group: list[torch.nn.Module | None]) -> bool:
    sizes = {m.in_features for m in group if isinstance(m, torch.nn.Linear)}
    return len(sizes) == 1


def _fuse(parent: torch.nn.Module, names: tuple[str, ...], group: list[torch.nn.Linear],
          packer: Packer | None, name: str = "") -> None:
    """Swap the siblings ``names`` of ``parent`` for slices of one (packed) matmul."""
    weight = torch.cat([m.weight.detach() for m in group])
    biases = [m.bias for m in group]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([
            b.detach() if b is not None else m.weight.new_zeros(m.out_features)
            for m, b in zip(group, biases, strict=True)
        ])
    if packer is not None:
        linear: torch.nn.Module = packer(weight, bias, name)
    else:
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                                 device=weight.device, dtype=weight.dtype)
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    shared = SharedMatmul(linear, [m.out_features for m in group])
    for index, (name, module) in enumerate(zip(names, group, strict=True)):
        setattr(parent, name, FusedSibling(shared, index, module.out_features))
    # The shared matmul is no submodule of anyone: keep it reachable (inspection, the decoder).
    parent.register_module(fused_name(names), shared.linear)


def fused_module(parent: torch.nn.Module, names: tuple[str, ...]) -> torch.nn.Module | None:
    """The one matmul :func:`pack_linears` made of ``parent``'s children ``names``, if it did."""
    module = getattr(parent, fused_name(names), None)
    return module if isinstance(module, torch.nn.Module) else None


def _check_packing(sample: torch.nn.Linear, packer: Packer = PackedLinear,
                   bf16_inputs: bool = False,
                   quantization: QuantizationMethod | None = None) -> str:
    """'' when a ``packer`` copy of ``sample`` agrees with ``F.linear``, else why not.

    With ``bf16_inputs`` the packed copy is a bf16 matmul: the reference rounds
    input and weight to bf16 first (with ``quantization``, the weight is the
    one the method's ``dequantize`` gives instead: the method and the
    engine's packing must agree on the format).
    """
    try:
        packed = packer(sample.weight, sample.bias)
        x = torch.randn(3, sample.in_features, generator=torch.Generator().manual_seed(0))
        x = x.to(sample.weight.dtype)
        with torch.inference_mode():
            weight = sample.weight
            if bf16_inputs:
                x, weight = x.bfloat16().float(), weight.bfloat16().float()
            want = None
            if quantization is not None:
                from switchyard_xeon.quantized import is_w8a8, w8a8_reference

                quantized = quantization.quantize(sample.weight)
                if is_w8a8(quantized.format):  # int8 activations too: the format's own math
                    want = w8a8_reference(x, quantized, sample.bias)
                weight = quantization.dequantize(quantized)
            got = packed(x).float()
            if want is None:
                want = F.linear(x, weight, sample.bias).float()
    except Exception as exc:  # private operators: absent or changed in this torch
        return f"{type(exc).__name__}: {exc}"
    err = (got - want).abs().max().item()
    scale = want.abs().max().item() or 1.0
    # Summation order differs; fp32 keeps ~7 digits, bf16 ~3.
    tolerance = 1e-4 if sample.weight.dtype == torch.float32 else 2e-2
    if not err <= tolerance * scale:
        return f"packed linear differs from F.linear by {err:.3g}"
    return ""
