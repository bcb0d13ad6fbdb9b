"""Weight formats: where a quantization method and an engine meet without knowing each other.

A quantization method (``QuantizationMethod``, from any plugin) turns a
linear layer's weight into a ``QuantizedWeight`` in one of the
``WeightFormat`` records it declares. An engine declares the formats its
kernels run (``EngineSpec.weight_formats``) and packs a ``QuantizedWeight``
into whatever layout those kernels want. Neither plugin imports the other:
they agree on a format record, whose fields say exactly which tensors a
``QuantizedWeight`` holds and what they mean. The gateway refuses, before an
engine is built, a ``--quantize`` method none of whose formats the engine runs.

The formats in use are defined here (``INT8_PER_CHANNEL``,
``uint4_group_asym``, ``uint4_group_min``, ``W8A8_SMOOTHQUANT``, ``W8A8_SMOOTHQUANT_STATIC``,
``FP8_E4M3_PER_TENSOR``), so
that two plugins name them alike. A method that must see activations first
(SmoothQuant, FP8) declares a ``Calibration``: the engine runs its prompts through
the model, records ``ActivationStatistics`` at every linear's input, and
quantizes each weight with the statistics of its input. Nothing here
imports torch: the tensors of a ``QuantizedWeight`` are held as opaque
objects (``torch.Tensor`` at run time).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any

import msgspec


class Packing(str, enum.Enum):
    """How ``QuantizedWeight.data`` stores the integers of an [N, K] weight (N outputs, K inputs).

    - ``INT8_ROWS``: ``int8[N, K]``, one signed byte per weight, row-major.
    - ``UINT4_K_INT32``: ``int32[N, ceil(K / 8)]``, eight unsigned 4-bit
      values per 32-bit word along K: weight ``k`` of a row is bits
      ``4 * (k % 8)`` to ``4 * (k % 8) + 3`` of word ``k // 8``, least
      significant first; a ragged last word is padded with zeros. This is the
      layout of ipex's low-precision checkpoints ("N x K, UINT4 compressed
      along K to int32").
    - ``FP8_E4M3_ROWS``: ``float8_e4m3fn[N, K]``, one OCP FP8 E4M3 value per
      weight (finite range +-448, no infinities), row-major. Not integers:
      ``WeightFormat.levels`` does not apply.
    """

    INT8_ROWS = "int8[N,K]"
    UINT4_K_INT32 = "int32[N,ceil(K/8)]"
    FP8_E4M3_ROWS = "float8_e4m3fn[N,K]"


class ActivationQuant(str, enum.Enum):
    """What happens to a linear's input before the matmul, for a weight format.

    - ``NONE``: weight-only; the engine feeds its float activations.
    - ``INT8_PER_TOKEN``: W8A8, dynamic: each row (token) ``m`` of the input,
      divided by the weight's smoothing factors first (``t = x / s``), is
      quantized to int8 at run time with its own scale
      ``a[m] = max_k |t[m, k]| / 127``, ``xq = clamp(round(t / a[m]), -127, 127)``
      (round half to even).
    - ``INT8_PER_TENSOR``: W8A8, static: the same with one scale for every
      row, ``QuantizedWeight.activation_scale``, fixed by calibration.
    - ``FP8_E4M3_PER_TENSOR``: FP8, static, no smoothing: with the layer's
      calibrated scale ``a`` (``QuantizedWeight.activation_scale``), the input
      is ``xq = float8_e4m3fn(clamp(x / a, -448, 448))`` (round to nearest
      even) and stands for ``xq * a``.
    """

    NONE = "none"
    INT8_PER_TOKEN = "int8-per-token-dynamic"
    INT8_PER_TENSOR = "int8-per-tensor-static"
    FP8_E4M3_PER_TENSOR = "fp8-e4m3-per-tensor-static"


class WeightFormat(msgspec.Struct, frozen=True, kw_only=True):
    """A quantized weight format: the integers, their packing, scales and zero points.

    For an [N, K] weight split along K into groups of ``group_size`` (the last
    group may be shorter; ``group_size`` 0 means one group per output
    feature, "per channel"), with ``groups = ceil(K / group_size)``:

    - ``QuantizedWeight.data`` holds integers ``q`` as ``packing`` says;
    - ``QuantizedWeight.scales`` is ``float32[N]`` per channel, else
      ``float32[N, groups]``;
    - with ``zero_point``, ``QuantizedWeight.zero_points`` is
      ``uint8[N, groups]`` (integers in the range of ``q``), else None;
    - with ``group_min``, ``QuantizedWeight.mins`` is ``float32[N, groups]``
      (any float: the group's offset), else None;
    - the weight they stand for is ``(q[n, k] - z[n, g]) * s[n, g]`` with
      zero points, ``q[n, k] * s[n, g] + b[n, g]`` with mins (the product
      rounded to float32, then the sum), or ``q[n, k] * s[n]`` with
      neither, computed in float32, with ``g = k // group_size``.

    With quantized ``activations`` (W8A8) the integers are those of the
    smoothed weight ``W[n, k] * m[k]``, where ``m`` is
    ``QuantizedWeight.smoothing`` (float32 ``[K]``); the layer computes
    ``y[m, n] = a[m] * s[n] * sum_k xq[m, k] q[n, k] (+ bias)`` over the
    input quantized as ``activations`` says (``xq`` and ``a`` from ``x / m``),
    so the weight it stands for, against the unsmoothed input, is
    ``q[n, k] * s[n] / m[k]``.

    Records compare by value: an engine runs a method's output when the
    method's format equals one the engine declares. Use the records defined
    in this module rather than building equal ones by hand.
    """

    name: str
    """Unique and stable, e.g. "int8-per-channel", "uint4-group128-asym"."""
    bits: int
    """Bits per weight: 8 or 4."""
    signed: bool
    """Whether ``q`` is signed (int8: -127..127) or not (uint4: 0..15)."""
    packing: Packing
    group_size: int = 0
    """Weights along K that share a scale (and zero point); 0: the whole row."""
    zero_point: bool = False
    """Asymmetric: a zero point per group (``QuantizedWeight.zero_points``)."""
    group_min: bool = False
    """A float offset per group (``QuantizedWeight.mins``): the weight is ``q * s + b``.
    Never together with ``zero_point``."""
    activations: ActivationQuant = ActivationQuant.NONE
    """How the layer's input is quantized (W8A8), or ``NONE`` (weight-only)."""

    @property
    def levels(self) -> tuple[int, int]:
        """The smallest and largest value of ``q``."""
        if self.signed:
            top = 2 ** (self.bits - 1) - 1
            return -top, top  # symmetric: negating a weight never overflows
        return 0, 2**self.bits - 1


INT8_PER_CHANNEL = WeightFormat(name="int8-per-channel", bits=8, signed=True,
                                packing=Packing.INT8_ROWS)
"""Signed int8, symmetric (-127..127), one float32 scale per output feature."""

W8A8_SMOOTHQUANT = WeightFormat(name="w8a8-smoothquant", bits=8, signed=True,
                                packing=Packing.INT8_ROWS,
                                activations=ActivationQuant.INT8_PER_TOKEN)
"""W8A8: int8 weights as ``INT8_PER_CHANNEL`` (of the smoothed weight), with
``QuantizedWeight.smoothing``; activations int8 per token, quantized at run time."""

W8A8_SMOOTHQUANT_STATIC = WeightFormat(name="w8a8-smoothquant-static", bits=8, signed=True,
                                       packing=Packing.INT8_ROWS,
                                       activations=ActivationQuant.INT8_PER_TENSOR)
"""``W8A8_SMOOTHQUANT`` with one calibrated activation scale per layer
(``QuantizedWeight.activation_scale``) instead of one per token."""

FP8_E4M3_PER_TENSOR = WeightFormat(name="fp8-e4m3-per-tensor", bits=8, signed=True,
                                   packing=Packing.FP8_E4M3_ROWS,
                                   activations=ActivationQuant.FP8_E4M3_PER_TENSOR)
"""FP8 E4M3 weights and activations, each with one scale per tensor.

``data`` is ``float8_e4m3fn[N, K]`` of ``W / s`` (``s = max|W| / 448``,
round to nearest even); ``scales`` is float32 ``[N]`` holding that one ``s``
in every row, so that the weight it stands for is ``data[n, k] * s[n]`` as
for every per-channel format (and the rows of several such weights stack,
e.g. a fused q|k|v, each keeping its own ``s``). The input is quantized as
``ActivationQuant.FP8_E4M3_PER_TENSOR`` with ``activation_scale`` (the
calibrated ``max|x| / 448`` of the layer's input); ``smoothing`` is None.
The layer computes ``y[m, n] = a * s[n] * sum_k xq[m, k] data[n, k] (+ bias)``."""

FP8_E4M3_MAX = 448.0
"""The largest finite float8_e4m3fn value: scales map a tensor's max |value| to it."""

UINT4_GROUP_SIZES = (32, 64, 128)
"""The group sizes of ``uint4_group_asym`` and ``uint4_group_min`` formats in use."""

GGUF_BLOCK_TYPES = ("Q4_0", "Q4_1")
"""GGUF block types that a format defined here holds exactly, every weight bit for bit.

GGUF (llama.cpp's files) quantizes a weight in blocks of 32 weights along a
row (K); the three 32-weight block types:

- ``Q4_0``: an IEEE float16 scale ``d`` and 4-bit ``q`` in 0..15, the weight
  ``d * (q - 8)``: exactly ``uint4_group_asym(32)`` with ``q`` as it is, the
  scale ``float32(d)`` (every float16 is a float32) and the zero point 8.
  The product of an 11-bit significand and an integer of at most 4 bits is
  a float32 with no rounding (and ``gguf.quants.dequantize`` computes the
  same product), so the two agree bit for bit, signed zeros, infinities and
  NaNs included.
- ``Q4_1``: float16 ``d`` and ``m``, the weight ``d * q + m``: exactly
  ``uint4_group_min(32)`` with ``q`` as it is, the scale ``float32(d)`` and
  the min ``float32(m)``. ``q * d`` is exact (as for ``Q4_0``), so the
  format's weight rounds once, in the sum, as ``gguf.quants.dequantize``'s
  ``d * q + m`` (float32) does: bit for bit, ``d == 0`` blocks (the weight
  is ``m``) and non-finite ones included. (An integer zero point would hold
  ``m`` only where ``-m / d`` is an integer in 0..15: 0.27% of the default
  model's blocks.)
- ``Q8_0``: a float16 scale per 32 int8 weights: ``INT8_PER_CHANNEL`` has one
  scale per row, and no format here has int8 groups: not held.

Blocks of other types (``Q8_0``, the K-quants, ...) are dequantized."""

GGUF_BLOCKS_FILE = "gguf-blocks/linears.safetensors"
"""Where a model folder converted from a GGUF file keeps its linears' GGUF blocks.

The gateway converts a GGUF file (``--model-id FILE.gguf``) into a folder of
float32 safetensors; beside them it keeps, in this file (relative to the
folder), the blocks of each linear layer's weight whose GGUF block type is
in ``GGUF_BLOCK_TYPES``, as the file stores them: one ``uint8`` tensor
``[N, K / 32 * bytes per block]`` (18 for ``Q4_0``, 20 for ``Q4_1``) per weight, named as the float weight
(``model.layers.0.mlp.down_proj.weight``), row ``n`` the blocks of output
feature ``n`` in the order of K. The rows are in the float weight's order,
which may be a permutation of the file's (transformers' conversion reorders
the rows of Llama's q and k projections). The file's metadata maps each
name to its block type (``"Q4_0"``, ``"Q4_1"``). The float32 weight of the same name in
the folder is ``gguf.quants.dequantize`` of these blocks, bit for bit: the
conversion checks every row. A checkpoint method whose
``config_quant_method`` is ``"gguf"`` reads this file."""


def uint4_group_asym(group_size: int) -> WeightFormat:
    """Unsigned 4-bit, asymmetric: a float32 scale and uint8 zero point per ``group_size`` weights.

    Named ``uint4-group{group_size}-asym``; ``group_size`` is one of
    ``UINT4_GROUP_SIZES``. The data is packed as ``Packing.UINT4_K_INT32``.
    """
    if group_size not in UINT4_GROUP_SIZES:
        raise ValueError(f"uint4 group size must be one of {UINT4_GROUP_SIZES}, not {group_size}")
    return WeightFormat(name=f"uint4-group{group_size}-asym", bits=4, signed=False,
                        packing=Packing.UINT4_K_INT32, group_size=group_size, zero_point=True)


def uint4_group_min(group_size: int) -> WeightFormat:
    """Unsigned 4-bit with a float32 scale and a float32 min per ``group_size`` weights.

    The weight is ``q * s + b`` (``b``: ``QuantizedWeight.mins``), GGUF
    ``Q4_1``'s form (``d * q + m``): the offset is any float, where
    ``uint4_group_asym``'s is an integer times the scale. Named
    ``uint4-group{group_size}-min``; ``group_size`` is one of
    ``UINT4_GROUP_SIZES``. The data is packed as ``Packing.UINT4_K_INT32``.
    """
    if group_size not in UINT4_GROUP_SIZES:
        raise ValueError(f"uint4 group size must be one of {UINT4_GROUP_SIZES}, not {group_size}")
    return WeightFormat(name=f"uint4-group{group_size}-min", bits=4, signed=False,
                        packing=Packing.UINT4_K_INT32, group_size=group_size, group_min=True)


class QuantizedWeight(msgspec.Struct, frozen=True, kw_only=True):
    """One linear layer's weight in a ``WeightFormat``: what a method hands an engine.

    The tensor fields are ``torch.Tensor`` objects on the CPU laid out as
    ``format`` says; this record is built and read in one process (it is not
    meant to be serialised).
    """

    format: WeightFormat
    out_features: int
    """N: rows of the weight."""
    in_features: int
    """K: columns of the weight (packed data may round it up)."""
    data: Any
    """The integers, packed as ``format.packing``."""
    scales: Any
    """float32 ``[N]`` (per channel) or ``[N, groups]``."""
    zero_points: Any = None
    """uint8 ``[N, groups]`` when ``format.zero_point``, else None."""
    mins: Any = None
    """float32 ``[N, groups]`` when ``format.group_min``, else None."""
    smoothing: Any = None
    """W8A8 formats: float32 ``[K]`` factors ``m`` (positive): ``data`` quantizes
    ``W[n, k] * m[k]``, and the input is divided by ``m`` before it is
    quantized. None for weight-only formats."""
    activation_scale: float = 0.0
    """``ActivationQuant.INT8_PER_TENSOR`` and ``FP8_E4M3_PER_TENSOR`` formats:
    the scale of every input row (after smoothing, if any); 0.0 otherwise."""
    input_order: Any = None
    """None, or an int64 ``[K]`` permutation of the input features (act-order
    GPTQ): the stored column ``j`` (of ``data``, and of the groups along K)
    is input feature ``input_order[j]``, so the layer computes
    ``x[..., input_order] @ W_stored.T``; an engine that runs the format
    gathers each input row in this order before its kernel."""


class ActivationStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What a calibration pass recorded at one linear layer's input.

    ``absmax`` is a float32 ``torch.Tensor`` ``[K]``: per input feature, the
    largest ``|x|`` over every calibration token; ``tokens`` counts the
    tokens (rows) seen. Layers that read the same input (a fused q|k|v)
    get equal statistics.
    """

    absmax: Any
    tokens: int


class Calibration(msgspec.Struct, frozen=True, kw_only=True):
    """How a method that must see activations is calibrated (``QuantizationMethod.calibration``).

    The engine, at start-up and before it packs any weight: calls
    ``prompts(options)`` for the texts, tokenizes each with the model's
    tokenizer (cut to ``max_tokens``), runs them through the unquantized
    model with a forward hook on every linear layer, and hands each layer's
    ``ActivationStatistics`` to ``quantize(weight, statistics, options)``.
    ``options`` are the engine's options (``--engine-option``); the method
    reads the names in ``options`` and ignores the rest. The statistics
    depend only on the model, the texts and ``max_tokens``, so an engine may
    cache them on disk keyed by those (the Xeon engine does: see
    ``switchyard_engine.calibration``) and calibrate once per model.
    ``prompts`` raises ``ValueError`` naming the file when a calibration file
    it was pointed at is unreadable or malformed; the engine turns that into
    a start-up error.
    """

    prompts: Callable[[Mapping[str, str]], tuple[str, ...]]
    """The calibration texts for these engine options; deterministic."""
    quantize: Callable[[Any, ActivationStatistics, Mapping[str, str]], QuantizedWeight]
    """Quantize one float weight ``[N, K]`` given the statistics of its input."""
    max_tokens: int = 512
    """Each text is cut to this many tokens."""
    options: tuple[str, ...] = ()
    """The engine options the method reads (documented with the method)."""


class QuantizedCheckpoint(msgspec.Struct, frozen=True, kw_only=True):
    """Already-quantized weights a checkpoint method read from files: what ``QuantizationMethod.load`` returns.

    ``weights`` maps a linear layer's qualified name in the model built from
    the folder's config.json (``"model.layers.0.self_attn.q_proj"``) to its
    ``QuantizedWeight``, in one of the method's ``formats``; ``biases`` the
    same names to float32 ``[N]`` biases read with them (a layer absent here
    takes its bias from the model's own tensors, if it has one). The engine
    builds the model without those layers' float weights, takes every other
    tensor (embeddings, norms, layers left in float, the LM head when it is
    not quantized) from the folder's safetensors, and ignores the folder's
    tensors named in ``tensors`` (the ones the method consumed, e.g.
    ``...q_proj.qweight``). ``source`` says what was read, for the start-up log.
    """

    weights: Mapping[str, QuantizedWeight]
    biases: Mapping[str, Any] = {}
    tensors: frozenset[str] = frozenset()
    """Names of the folder's safetensors tensors the method read (not float weights)."""
    source: str = ""
    """E.g. "GPTQ (4 bits, group 128, checkpoint_format gptq) from model.safetensors"."""


class QuantizationMethod(msgspec.Struct, frozen=True, kw_only=True):
    """A plugin's declaration of one quantization method, named as users pass it to ``--quantize``.

    ``formats`` lists every format ``quantize`` may return; the gateway
    serves the method only on an engine that runs at least one of them, and
    the engine packs each ``QuantizedWeight`` by its ``format``. ``quantize``
    and ``dequantize`` may import torch when called, never when the plugin's
    hooks are imported. Which weights to quantize (every linear layer, the LM
    head included, or fewer) is the engine's choice, stated in its docs.

    A method that must see activations (SmoothQuant) sets ``calibration``:
    engines that support calibration quantize with
    ``calibration.quantize`` and the statistics they recorded, and
    ``quantize`` stays the uncalibrated fallback (what kernel checks use).
    Methods without it are quantized weight by weight, as before.

    A checkpoint method (GPTQ, AWQ folders) sets ``load``: the weights were
    quantized before, and the engine reads them as ``QuantizedCheckpoint``
    rather than quantizing float ones.
    """

    name: str
    """What users pass to ``--quantize``, e.g. "int8"."""
    description: str
    formats: tuple[WeightFormat, ...]
    """Every format ``quantize`` may return, in the method's order of preference."""
    quantize: Callable[[Any], QuantizedWeight]
    """Quantize one float weight ``[N, K]`` (a ``torch.Tensor``); deterministic."""
    dequantize: Callable[[QuantizedWeight], Any]
    """The float32 ``[N, K]`` weight a ``QuantizedWeight`` stands for (the
    format's formula): what a reference computes with, and what an engine's
    kernels are checked against."""
    calibration: Calibration | None = None
    """Set by methods that quantize from activation statistics; None otherwise."""
    load: Callable[[str, Mapping[str, str]], QuantizedCheckpoint] | None = None
    """Checkpoint methods: read the already-quantized linears of the model folder
    (its path) with these engine options; None for methods that quantize float
    weights. Engines that support it take the layers it returns instead of
    calling ``quantize`` (which stays an RTN fallback in the same formats, for
    kernel checks). Raises ``ValueError`` naming the file and tensor when the
    files are missing, malformed or in a layout the method cannot map exactly
    to its formats; the engine turns that into a start-up error."""
    config_quant_method: str = ""
    """The ``quantization_config.quant_method`` of config.json (transformers'
    name, e.g. "gptq") of the folders ``load`` reads; the gateway serves such a
    folder with this method when ``--quantize`` is not given. "gguf": ``load``
    reads the ``GGUF_BLOCKS_FILE`` of a folder converted from a GGUF file,
    whose other layers (and float copies of these) are in its safetensors;
    the gateway serves such a folder with it when ``--quantize`` is not given
    and the engine runs its formats, and dequantized otherwise. "" for none."""
