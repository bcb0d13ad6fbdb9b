"""SmoothQuant W8A8: int8 weights and int8 activations, the outliers of activations moved into weights.

Activations of a transformer have a few input features (channels) far larger
than the rest, which makes per-token int8 quantization of the activations
coarse; weights are even. SmoothQuant divides input feature ``k`` by a factor
``m[k]`` and multiplies column ``k`` of the weight by it, which leaves the
product unchanged and moves part of the range from activations to weights:

    m[k] = max|X[:, k]| ** alpha / max|W[:, k]| ** (1 - alpha)

over calibration inputs ``X`` (``alpha`` 0.5 by default: the two ranges meet
in the middle; larger moves more into the weights). The smoothed weight is
quantized as ``INT8_PER_CHANNEL`` (symmetric, a scale per output feature,
round to nearest) and the engine quantizes each input row to int8 at run
time (``W8A8_SMOOTHQUANT``), or with one calibrated scale per layer
(``W8A8_SMOOTHQUANT_STATIC``: ``max_k max|X[:, k]| / m[k] / 127``).

The factors are kept in the ``QuantizedWeight`` (``smoothing``) rather than
folded into the preceding RMSNorm's weight, as the paper does for q|k|v and
gate|up: the engine divides by them in the same pass that quantizes the
input (one multiply per input value, next to the matmul's N per value), and
o_proj and down_proj, whose inputs follow no norm, need them there anyway.
Folding would change modules that are not linear layers, which the contract
does not hand to a method.

Calibration (``Calibration`` in the contract): by default 16 texts cut from
the Python standard library's sources (deterministic for a Python version,
and the corpus the default model's tokenizer is trained on), each cut to 128
tokens. Engine options: ``smoothquant_alpha`` (0 to 1, default 0.5),
``smoothquant_activations`` (``dynamic``, the default, or ``static``),
``calibration_file`` (a JSON Lines file, one ``{"text": ...}`` object or
JSON string per line, instead of the default texts) and
``calibration_samples`` (how many texts, default 16).
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Mapping

import torch

from switchyard_spec import (
    W8A8_SMOOTHQUANT,
    W8A8_SMOOTHQUANT_STATIC,
    ActivationStatistics,
    QuantizedWeight,
)

from switchyard_quant.int8 import INT8_LEVELS

DEFAULT_ALPHA = 0.5
DEFAULT_SAMPLES = 16
SAMPLE_CHARS = 1200
"""Characters per default calibration text (over 128 tokens of code for a BPE tokenizer)."""
OPTIONS = ("smoothquant_alpha", "smoothquant_activations", "calibration_file",
           "calibration_samples")
MIN_FACTOR, MAX_FACTOR = 1e-5, 1e5
"""Smoothing factors are clamped to this range (a dead input feature or weight column)."""


def alpha_of(options: Mapping[str, str]) -> float:
    """``smoothquant_alpha`` (default 0.5); ValueError outside 0..1."""
    text = str(options.get("smoothquant_alpha", DEFAULT_ALPHA))
    try:
        alpha = float(text)
    except ValueError:
        raise ValueError(f"smoothquant_alpha must be a number from 0 to 1, not {text!r}") from None
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothquant_alpha must be from 0 to 1, not {alpha}")
    return alpha


def static_of(options: Mapping[str, str]) -> bool:
    """Whether ``smoothquant_activations`` asks for one static scale per layer."""
    value = str(options.get("smoothquant_activations", "dynamic")).lower()
    if value not in ("dynamic", "static"):
        raise ValueError(f"smoothquant_activations must be dynamic or static, not {value!r}")
    return value == "static"


def samples_of(options: Mapping[str, str]) -> int:
    text = str(options.get("calibration_samples", DEFAULT_SAMPLES))
    try:
        samples = int(text)
    except ValueError:
        samples = 0
    if samples < 1:
        raise ValueError(f"calibration_samples must be a positive integer, not {text!r}")
    return samples


def default_texts(samples: int = DEFAULT_SAMPLES) -> tuple[str, ...]:
    """``samples`` texts from the standard library's sources, spread over its sorted files."""
    files = sorted(p for p in glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))
                   if os.path.getsize(p) >= 2 * SAMPLE_CHARS)  # no stubs of a few lines
    if not files:
        raise ValueError("no Python standard library sources found for the default calibration "
                         "texts; set calibration_file")
    texts = []
    for i in range(samples):
        path = files[i * len(files) // samples]
        with open(path, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read(SAMPLE_CHARS))
    return tuple(texts)


def read_calibration_file(path: str, samples: int) -> tuple[str, ...]:
    """The first ``samples`` texts of a JSON Lines file; ValueError naming the file when it is bad."""
    texts: list[str] = []
    try:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"calibration file {path}: line {number} is not JSON "
                                     f"({exc.msg})") from None
                text = item.get("text") if isinstance(item, dict) else item
                if not isinstance(text, str) or not text.strip():
                    raise ValueError(f"calibration file {path}: line {number} is neither a "
                                     "non-empty string nor an object with a \"text\" string")
                texts.append(text)
                if len(texts) == samples:
                    break
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"calibration file {path}: cannot be read ({exc})") from None
    if not texts:
        raise ValueError(f"calibration file {path}: holds no texts")
    return tuple(texts)


def calibration_prompts(options: Mapping[str, str]) -> tuple[str, ...]:
    """The calibration texts the options ask for (``Calibration.prompts``)."""
    alpha_of(options)  # a bad option stops start-up before the model is run
    static_of(options)
    samples = samples_of(options)
    path = options.get("calibration_file")
    if path:
        return read_calibration_file(str(path), samples)
    return default_texts(samples)


def smoothing_factors(absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """``max|X_k| ** alpha / max|W_k| ** (1 - alpha)`` per input feature ``k``, float32.

    A feature that calibration never saw nonzero, or a weight column of
    zeros, keeps factor 1; the rest are clamped to 1e-5..1e5.
    """
    x = absmax.detach().double()
    w = weight.detach().double().abs().amax(0)
    factors = x.pow(alpha) / w.pow(1.0 - alpha)
    dead = (x <= 0) | (w <= 0) | ~torch.isfinite(factors)
    factors = torch.where(dead, torch.ones_like(factors), factors)
    return factors.clamp(MIN_FACTOR, MAX_FACTOR).float().contiguous()


def quantize_smoothed(weight: torch.Tensor, smoothing: torch.Tensor,
                      activation_scale: float = 0.0) -> QuantizedWeight:
    """``weight * smoothing`` rounded to int8 per output feature, with what W8A8 needs."""
    if weight.dim() != 2:
        raise ValueError(f"smoothquant: a weight must be [N, K], not {tuple(weight.shape)}")
    w = weight.detach().float() * smoothing[None, :]
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / INT8_LEVELS, torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    fmt = W8A8_SMOOTHQUANT_STATIC if activation_scale > 0 else W8A8_SMOOTHQUANT
    return QuantizedWeight(format=fmt, out_features=w.shape[0], in_features=w.shape[1],
                           data=q.contiguous(), scales=scale.contiguous(),
                           smoothing=smoothing.contiguous(), activation_scale=activation_scale)


def quantize_smoothquant(weight: torch.Tensor) -> QuantizedWeight:
    """Without statistics: plain W8A8 (factors 1, per-token activations); what checks use."""
    return quantize_smoothed(weight, torch.ones(weight.shape[1]))


def quantize_calibrated(weight: torch.Tensor, statistics: ActivationStatistics,
                        options: Mapping[str, str]) -> QuantizedWeight:
    """``Calibration.quantize``: smooth with the input's statistics, then quantize."""
    absmax = statistics.absmax.detach().float()
    if absmax.shape != (weight.shape[1],):
        raise ValueError(f"smoothquant: statistics of {tuple(absmax.shape)} features for a "
                         f"weight of {weight.shape[1]} inputs")
    factors = smoothing_factors(absmax, weight, alpha_of(options))
    scale = 0.0
    if static_of(options):
        # The largest smoothed input calibration saw, computed as the engine smooths: x * (1 / m).
        top = float((absmax * (1.0 / factors)).max())
        scale = top / INT8_LEVELS if top > 0 else 1.0
    return quantize_smoothed(weight, factors, scale)


def dequantize_w8a8(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight against the unsmoothed input: ``q * s[n] / m[k]``.

    The activations' quantization is not a property of the weight: a
    reference of the layer quantizes its input as the format says.
    """
    return weight.data.float() * weight.scales[:, None] / weight.smoothing[None, :]
