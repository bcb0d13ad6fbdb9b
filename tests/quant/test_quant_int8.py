"""Weight-only int8 (switchyard-quant): symmetric per-feature RTN, checked against float64 math."""

from __future__ import annotations

import pytest
import torch

from switchyard_quant.int8 import INT8_LEVELS, dequantize_int8, quantize_int8
from switchyard_spec import INT8_PER_CHANNEL


def test_quantize_int8_rounds_each_row_to_its_own_scale():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 33, generator=gen) * torch.logspace(-3, 1, 40)[:, None]
    weight[7] = 0.0  # an all-zero feature must not divide by zero
    quantized = quantize_int8(weight)
    assert quantized.format == INT8_PER_CHANNEL
    assert (quantized.out_features, quantized.in_features) == (40, 33)
    assert quantized.data.dtype == torch.int8 and quantized.data.shape == weight.shape
    assert quantized.scales.dtype == torch.float32 and quantized.scales.shape == (40,)
    assert quantized.zero_points is None
    assert int(quantized.data.abs().max()) == INT8_LEVELS == 127  # each row's absmax maps to 127
    assert quantized.scales[7] == 1.0 and not quantized.data[7].any()
    # The scale is absmax / 127, as float64 computes it, to fp32 precision.
    want = weight.double().abs().amax(1) / 127
    want[7] = 1.0
    torch.testing.assert_close(quantized.scales.double(), want, rtol=1e-7, atol=0)
    # Round to nearest: within half a step of each row's own scale.
    error = (dequantize_int8(quantized).double() - weight.double()).abs()
    assert bool((error <= quantized.scales.double()[:, None] / 2 * (1 + 1e-6)).all())
    assert torch.equal(quantize_int8(weight).data, quantized.data)  # deterministic


def test_dequantize_int8_is_integers_times_scales():
    quantized = quantize_int8(torch.randn(5, 8))
    want = quantized.data.double() * quantized.scales.double()[:, None]
    torch.testing.assert_close(dequantize_int8(quantized).double(), want, rtol=1e-7, atol=0)


def test_quantize_int8_takes_a_bf16_weight_and_refuses_other_shapes():
    weight = torch.randn(4, 6).bfloat16()
    assert torch.equal(quantize_int8(weight).data, quantize_int8(weight.float()).data)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize_int8(torch.randn(2, 3, 4))
