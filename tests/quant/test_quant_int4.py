"""Weight-only int4 (switchyard-quant): group-wise asymmetric uint4 RTN, against float64 math."""

from __future__ import annotations

import pytest
import torch

from switchyard_quant.int4 import (
    dequantize_uint4,
    pack_uint4_along_k,
    quantize_uint4,
    unpack_uint4_along_k,
)
from switchyard_spec import UINT4_GROUP_SIZES, Packing, uint4_group_asym


def test_packing_eight_nibbles_per_int32_along_k_round_trips():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (5, 21), generator=gen).to(torch.uint8)  # 21: a ragged last word
    q[0, 7] = 15  # a top nibble >= 8: the word's sign bit
    words = pack_uint4_along_k(q)
    assert words.dtype == torch.int32 and words.shape == (5, 3)
    assert torch.equal(unpack_uint4_along_k(words, 21), q)
    # Least significant nibble first, independently of the code above:
    row = words[0].tolist()
    for k in range(21):
        assert (row[k // 8] >> (4 * (k % 8))) & 15 == q[0, k]
    assert (row[2] >> 20) == 0  # padding nibbles are zero
    assert words[0, 0] < 0


@pytest.mark.parametrize("group", UINT4_GROUP_SIZES)
@pytest.mark.parametrize("in_features", [7, 64, 200, 256])  # shorter than a group, ragged, whole
def test_quantize_uint4_is_round_to_nearest_per_group(group, in_features):
    gen = torch.Generator().manual_seed(group + in_features)
    weight = torch.randn(24, in_features, generator=gen) * torch.logspace(-3, 1, 24)[:, None]
    weight[3] = 0.0  # all-zero groups
    weight[5] = weight[5].abs() + 0.5  # one sign only: the range is widened to include 0
    quantized = quantize_uint4(weight, group)
    groups = -(-in_features // group)
    assert quantized.format == uint4_group_asym(group)
    assert quantized.format.packing is Packing.UINT4_K_INT32 and quantized.format.zero_point
    assert quantized.data.shape == (24, -(-in_features // 8))
    assert quantized.data.dtype == torch.int32
    assert quantized.scales.shape == (24, groups) and quantized.scales.dtype == torch.float32
    assert quantized.zero_points.shape == (24, groups)
    assert quantized.zero_points.dtype == torch.uint8 and int(quantized.zero_points.max()) <= 15
    # Scales and zero points as float64 computes them from each group's range.
    w = torch.zeros(24, groups * group, dtype=torch.float64)
    w[:, :in_features] = weight.double()
    low = w.view(24, groups, group).amin(-1).clamp(max=0)
    high = w.view(24, groups, group).amax(-1).clamp(min=0)
    scale = torch.where(high > low, (high - low) / 15, torch.ones_like(high))
    torch.testing.assert_close(quantized.scales.double(), scale, rtol=1e-6, atol=0)
    assert torch.equal(quantized.zero_points.double(), torch.round(-low / scale))
    # Every weight within half a step of its group's scale; zero stays exactly zero.
    steps = quantized.scales.double().repeat_interleave(group, 1)[:, :in_features]
    restored = dequantize_uint4(quantized).double()
    assert bool(((restored - weight.double()).abs() <= steps / 2 * (1 + 1e-5)).all())
    assert not restored[3].any()
    q = unpack_uint4_along_k(quantized.data, in_features).double()
    zero = quantized.zero_points.double().repeat_interleave(group, 1)[:, :in_features]
    torch.testing.assert_close(restored, (q - zero) * steps, rtol=1e-7, atol=0)
    assert torch.equal(quantize_uint4(weight, group).data, quantized.data)  # deterministic


def test_uint4_error_is_bounded_and_smaller_with_smaller_groups():
    """RMS error of a Gaussian weight: under half a step, and group 32 < 64 < 128."""
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(3)) * 0.02
    errors = {}
    for group in UINT4_GROUP_SIZES:
        restored = dequantize_uint4(quantize_uint4(weight, group)).double()
        errors[group] = (restored - weight.double()).pow(2).mean().sqrt().item()
    assert errors[32] < errors[64] < errors[128]
    # A uniform rounding error has RMS step / sqrt(12); the steps here are about
    # (range of 128 Gaussians) / 15 ~ 5.6 sigma / 15.
    assert errors[128] < 0.02 * 5.6 / 15 / 12**0.5 * 1.2


def test_uint4_refuses_unknown_group_sizes_and_shapes():
    with pytest.raises(ValueError, match="group size"):
        quantize_uint4(torch.randn(4, 64), 48)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize_uint4(torch.randn(64), 32)
