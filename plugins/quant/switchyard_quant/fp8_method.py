"""FP8 E4M3 through the contract (``--quantize fp8``): measure activation maxima, then quantize.

The measure-then-quantize flow of Intel Neural Compressor's ``maxabs``
observer, expressed with the contract's ``Calibration`` so that any engine
that declares ``FP8_E4M3_PER_TENSOR`` runs it:

1. *measure*: the engine runs the calibration texts through the float model
   and records, at every linear layer's input, the largest ``|x|`` per
   feature (``ActivationStatistics``; the toolkit caches them on disk, keyed
   by the model's files and the texts, so a model is measured once);
2. *quantize*: each weight becomes ``float8_e4m3fn`` of ``W / s`` with one
   scale per tensor, ``s = max|W| / 448`` (the largest weight maps to E4M3's
   largest finite value), and the layer's input scale is
   ``a = max_k absmax[k] / 448`` (INC's ``maxabs_arbitrary``: no rounding of
   the scales to powers of two).

Why one weight scale per tensor and not per output feature: E4M3 is a float,
so a weight far below the tensor's maximum keeps its 3 mantissa bits (a
relative error of at most 1/16) down to ``max|W| / 28672`` (``s / 64``); below it
enters the subnormals. An int8 grid, by contrast, loses relative precision
linearly as a row's range shrinks, which is what per-channel scales repair.
Per tensor is also what Gaudi's FP8 matmul takes, so the format is the one
INC produces there.

Without statistics (``QuantizationMethod.quantize``, the uncalibrated
fallback that kernel checks use) the input scale is 1 (INC's
``unit_scale``: inputs are cast to FP8 as they are, clamped to +-448).

Engine options (shared with ``smoothquant``): ``calibration_file`` (JSON
Lines, one ``{"text": ...}`` object or JSON string per line) and
``calibration_samples`` (default 16). The default texts are SmoothQuant's
(the standard library's sources), and so is the token limit (128): the two
methods read the same cached statistics.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from switchyard_spec import (
    FP8_E4M3_MAX,
    FP8_E4M3_PER_TENSOR,
    ActivationStatistics,
    QuantizedWeight,
)

from switchyard_quant.smoothquant import default_texts, read_calibration_file, samples_of

OPTIONS = ("calibration_file", "calibration_samples")
"""The engine options ``fp8`` reads."""
MAX_TOKENS = 128
"""Tokens per calibration text: SmoothQuant's, so that both read one cache file."""
UNIT_SCALE = 1.0
"""The input scale of an uncalibrated layer."""


def scale_of(absmax: float) -> float:
    """``absmax / 448``, or 1 for a tensor of zeros (any scale represents it exactly)."""
    return absmax / FP8_E4M3_MAX if absmax > 0 else 1.0


def to_e4m3(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn(clamp(x / scale, -448, 448))``: round to nearest even, saturating."""
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_fp8(weight: torch.Tensor, activation_scale: float = UNIT_SCALE) -> QuantizedWeight:
    """``weight`` [N, K] as ``FP8_E4M3_PER_TENSOR`` with this input scale."""
    if weight.dim() != 2:
        raise ValueError(f"fp8: a weight must be [N, K], not {tuple(weight.shape)}")
    if not activation_scale > 0 or activation_scale == float("inf"):
        raise ValueError(f"fp8: the activation scale must be positive and finite, not "
                         f"{activation_scale}")
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("fp8: the weight holds non-finite values")
    s = scale_of(float(w.abs().max())) if w.numel() else 1.0
    n, k = w.shape
    return QuantizedWeight(format=FP8_E4M3_PER_TENSOR, out_features=n, in_features=k,
                           data=to_e4m3(w, s).contiguous(),
                           scales=torch.full((n,), s, dtype=torch.float32),
                           activation_scale=float(activation_scale))


def quantize_calibrated(weight: torch.Tensor, statistics: ActivationStatistics,
                        options: Mapping[str, str]) -> QuantizedWeight:
    """``Calibration.quantize``: the input scale from the largest ``|x|`` calibration saw."""
    absmax = statistics.absmax.detach().float()
    if absmax.shape != (weight.shape[1],):
        raise ValueError(f"fp8: statistics of {tuple(absmax.shape)} features for a weight of "
                         f"{weight.shape[1]} inputs")
    return quantize_fp8(weight, scale_of(float(absmax.max())))


def calibration_prompts(options: Mapping[str, str]) -> tuple[str, ...]:
    """``Calibration.prompts``: ``calibration_file``'s texts, or the default ones."""
    samples = samples_of(options)
    path = options.get("calibration_file")
    if path:
        return read_calibration_file(str(path), samples)
    return default_texts(samples)


def dequantize_fp8(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight: ``data[n, k] * scales[n]`` (exact: E4M3 values are float32 values)."""
    return weight.data.float() * weight.scales[:, None]
