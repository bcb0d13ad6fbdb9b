"""``--quantize int8`` on the Xeon engine: the int8 dot-product panels, and how the engine takes it.

The quantizer is switchyard-quant's (its tests: ``tests/quant``); the engine
gets it as the gateway hands it over (``tests/support/quant_methods.py``). Greedy
parity of whole models with int8 weights (four families, three forward
passes) is in ``test_xeon_quantized_parity.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from switchyard_spec import EngineConfig, EngineStartError
from switchyard_xeon.engine import XeonEngine
from switchyard_xeon.kernels import load_kernels
from switchyard_xeon.linears import PanelLinear, pack_linears

from tests.support import kernel_paths
from tests.support.quant_methods import method
from tests.support.tiny_models import tiny_llama
from tests.support.xeon_options import TEST_OPTIONS

INT8 = method("int8")


def _dequantized(weight: torch.Tensor) -> torch.Tensor:
    return INT8.dequantize(INT8.quantize(weight))


@pytest.fixture
def int8_panels():
    """The int8 dot-product panels; skips where the kernels lack AVX512_BF16."""
    kernel_paths.require("panel int8")
    return torch.ops.switchyard_xeon


# Rows: micro-kernel tails, the last row count widened in registers (24) and the
# first widened through the per-thread buffer (25), row chunks of 512.
@pytest.mark.parametrize("rows", [1, 5, 7, 24, 25, 97, 600])
@pytest.mark.parametrize("out_features", [1, 16, 45, 130])  # ragged, odd and even panel counts
@pytest.mark.parametrize("in_features", [72, 9])  # whole k pairs, a padded last pair
def test_int8_panels_are_a_bf16_matmul_over_the_dequantized_weight(int8_panels, rows,
                                                                   out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    panel = PanelLinear(weight, bias, bf16_dot=True, quantization=INT8)
    assert panel.packed_weight.dtype == torch.int8 and "int8-per-channel" in repr(panel)
    x = torch.randn(rows, in_features, generator=gen)
    want = torch.nn.functional.linear(x.bfloat16().float(), _dequantized(weight), bias)
    with torch.inference_mode():
        got = panel(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    # It really is the quantized weight: not the bf16 one.
    bf16 = torch.nn.functional.linear(x.bfloat16().float(), weight.bfloat16().float(), bias)
    assert not torch.allclose(got, bf16, atol=1e-4, rtol=0)


def test_int8_panels_hold_scales_after_the_weights_and_half_the_bytes(int8_panels):
    weight = torch.randn(20, 9)
    quantized = INT8.quantize(weight)
    packed = int8_panels.pack_panels_int8_dot(quantized.data, quantized.scales)
    # [panels, k pairs + 2 steps of scales, 16 features x 2]
    assert packed.shape == (2, 5 + 2, 32) and packed.dtype == torch.int8
    scales = packed[:, 5:].contiguous().view(torch.float32).reshape(-1)
    assert torch.equal(scales[:20], quantized.scales) and not scales[20:].any()
    big = torch.randn(256, 512)
    bf16 = int8_panels.pack_panels_bf16_dot(big)
    int8 = PanelLinear(big, None, bf16_dot=True, quantization=INT8).packed_weight
    assert int8.nbytes < 0.51 * bf16.nbytes


def test_int8_panels_reject_bad_inputs(int8_panels):
    quantized = INT8.quantize(torch.randn(20, 9))
    with pytest.raises(RuntimeError, match="int8"):
        int8_panels.pack_panels_int8_dot(quantized.data.float(), quantized.scales)
    with pytest.raises(RuntimeError, match="scale"):
        int8_panels.pack_panels_int8_dot(quantized.data, quantized.scales[:5])
    packed = int8_panels.pack_panels_int8_dot(quantized.data, quantized.scales)
    with pytest.raises(RuntimeError, match="does not match"):
        int8_panels.panel_linear(torch.zeros(3, 11), packed, None, 20)
    with pytest.raises(RuntimeError, match="does not match"):
        int8_panels.panel_linear(torch.zeros(3, 9), packed, None, 40)
    # Without bf16 dot products int8 weights are not refused: they take the AVX2 + FMA
    # panels (fp32 math) since those exist on every x86-64 level.
    assert PanelLinear(torch.randn(4, 4), None, quantization=INT8).fma


def test_pack_report_names_int8_panels(int8_panels):
    model = tiny_llama(torch.float32)
    report = pack_linears(model, panels=True, bf16_dot=True, quantization=INT8)
    assert report.packed == 9 and report.quantized == "int8 weights (per-feature scales)"
    assert report.describe() == ("panel-packed float32 (9 linears, 4 fused groups; int8 weights "
                                 "(per-feature scales) and bf16 dot products (AVX512_BF16), "
                                 "fp32 sums)")
    assert all(m.weight_format == INT8.formats[0] for m in model.modules()
               if isinstance(m, PanelLinear))


def _start(path: str, dtype: str, quantize: str) -> XeonEngine:
    engine = XeonEngine(EngineConfig(model_path=path, dtype=dtype, quantize=quantize,
                                     quantization=method(quantize), options=TEST_OPTIONS))
    engine.start()
    return engine


def test_the_engine_refuses_what_it_cannot_quantize(default_model_path, monkeypatch):
    path = str(default_model_path)
    # A name the gateway did not resolve (an EngineConfig built by hand).
    with pytest.raises(EngineStartError, match="--quantize gptq came without its method"):
        XeonEngine(EngineConfig(model_path=path, quantize="gptq", options=TEST_OPTIONS)).start()
    with pytest.raises(EngineStartError, match="--dtype float16; use auto, bfloat16 or float32"):
        _start(path, "float16", "int8")
    # A CPU with neither AVX512_BF16 nor AVX2 + FMA (or linears that rule the panels out).
    monkeypatch.setattr("switchyard_xeon.assembly.bf16_dot_available", lambda options: False)
    real = load_kernels()
    monkeypatch.setattr("switchyard_xeon.kernels._status",
                        dataclasses.replace(real, bf16_dot=False, quant_fma=False))
    why = real.reason if real.fn is None else "neither AVX512_BF16 nor AVX2 + FMA"
    with pytest.raises(EngineStartError, match="int8 runs on the native quantized panels, "
                                               "which cannot run it here") as refused:
        _start(path, "auto", "int8")
    assert why in str(refused.value)
