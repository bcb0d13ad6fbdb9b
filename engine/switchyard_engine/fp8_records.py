"""The check every engine's FP8 linear makes of the record it is given.

Engines run ``fp8-e4m3-per-tensor`` weights on their own kernels (the xeon
engine's FP8 panels, the gaudi engine's device seam); what they accept is the
contract's definition of the format, so the check lives here once.
"""

from __future__ import annotations

import torch

from switchyard_spec import FP8_E4M3_PER_TENSOR, QuantizedWeight


def check_fp8_weight(weight: QuantizedWeight) -> None:
    """ValueError unless ``weight`` is an ``fp8-e4m3-per-tensor`` record of its own shape:
    ``float8_e4m3fn[N, K]`` data, ``scales[N]`` and a positive ``activation_scale``."""
    if weight.format != FP8_E4M3_PER_TENSOR:
        raise ValueError(f"Fp8Linear runs {FP8_E4M3_PER_TENSOR.name} weights, not "
                         f"{weight.format.name}")
    n, k = weight.out_features, weight.in_features
    if tuple(weight.data.shape) != (n, k) or weight.data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 weight data must be float8_e4m3fn[{n}, {k}], not "
                         f"{weight.data.dtype}{list(weight.data.shape)}")
    if tuple(weight.scales.shape) != (n,) or not weight.activation_scale > 0:
        raise ValueError("fp8 weight needs scales[N] and a positive activation_scale")
