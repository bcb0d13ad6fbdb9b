"""``--quantize int8``: the quantizer, the int8 dot-product panels, and how the engine takes it.

Greedy parity of whole models with int8 weights (four families, three
forward passes) is in ``test_xeon_decoder.py``.
"""

from __future__ import annotations

import pytest
import torch

from switchyard_spec import EngineConfig, EngineStartError
from switchyard_xeon.engine import XeonEngine
from switchyard_xeon.kernels import load_kernels
from switchyard_xeon.linears import PanelLinear, pack_linears
from switchyard_xeon.quantization import INT8_LEVELS, quantize_int8

from tests.xeon.conftest import TEST_OPTIONS
from tests.xeon.test_xeon_fast_path import tiny_llama


def test_quantize_int8_rounds_each_row_to_its_own_scale():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 33, generator=gen) * torch.logspace(-3, 1, 40)[:, None]
    weight[7] = 0.0  # an all-zero feature must not divide by zero
    quantized = quantize_int8(weight)
    assert quantized.q.dtype == torch.int8 and quantized.q.shape == weight.shape
    assert quantized.scale.dtype == torch.float32 and quantized.scale.shape == (40,)
    assert int(quantized.q.abs().max()) == INT8_LEVELS  # each row's absmax maps to +-127
    assert quantized.scale[7] == 1.0 and not quantized.q[7].any()
    # Round to nearest: within half a step of each row's own scale.
    error = (quantized.dequantize() - weight).abs()
    assert bool((error <= quantized.scale[:, None] / 2 * (1 + 1e-5)).all())
    assert torch.equal(quantize_int8(weight).q, quantized.q)  # deterministic


@pytest.fixture
def int8_panels():
    """The int8 dot-product panels; skips where the kernels lack AVX512_BF16."""
    if not load_kernels().bf16_dot:
        pytest.skip("no AVX512_BF16 here: the kernels have no dot-product panels")
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
    panel = PanelLinear(weight, bias, bf16_dot=True, int8=True)
    assert panel.packed_weight.dtype == torch.int8 and "int8" in repr(panel)
    x = torch.randn(rows, in_features, generator=gen)
    want = torch.nn.functional.linear(x.bfloat16().float(), quantize_int8(weight).dequantize(),
                                      bias)
    with torch.inference_mode():
        got = panel(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    # It really is the quantized weight: not the bf16 one.
    bf16 = torch.nn.functional.linear(x.bfloat16().float(), weight.bfloat16().float(), bias)
    assert not torch.allclose(got, bf16, atol=1e-4, rtol=0)


def test_int8_panels_hold_scales_after_the_weights_and_half_the_bytes(int8_panels):
    weight = torch.randn(20, 9)
    quantized = quantize_int8(weight)
    packed = int8_panels.pack_panels_int8_dot(quantized.q, quantized.scale)
    # [panels, k pairs + 2 steps of scales, 16 features x 2]
    assert packed.shape == (2, 5 + 2, 32) and packed.dtype == torch.int8
    scales = packed[:, 5:].contiguous().view(torch.float32).reshape(-1)
    assert torch.equal(scales[:20], quantized.scale) and not scales[20:].any()
    big = torch.randn(256, 512)
    bf16 = int8_panels.pack_panels_bf16_dot(big)
    int8 = PanelLinear(big, None, bf16_dot=True, int8=True).packed_weight
    assert int8.nbytes < 0.51 * bf16.nbytes


def test_int8_panels_reject_bad_inputs(int8_panels):
    quantized = quantize_int8(torch.randn(20, 9))
    with pytest.raises(RuntimeError, match="int8"):
        int8_panels.pack_panels_int8_dot(quantized.q.float(), quantized.scale)
    with pytest.raises(RuntimeError, match="scale"):
        int8_panels.pack_panels_int8_dot(quantized.q, quantized.scale[:5])
    packed = int8_panels.pack_panels_int8_dot(quantized.q, quantized.scale)
    with pytest.raises(RuntimeError, match="does not match"):
        int8_panels.panel_linear(torch.zeros(3, 11), packed, None, 20)
    with pytest.raises(RuntimeError, match="does not match"):
        int8_panels.panel_linear(torch.zeros(3, 9), packed, None, 40)
    with pytest.raises(ValueError, match="bf16_dot"):
        PanelLinear(torch.randn(4, 4), None, int8=True)


def test_pack_report_names_int8_panels(int8_panels):
    model = tiny_llama(torch.float32)
    report = pack_linears(model, panels=True, bf16_dot=True, int8=True)
    assert report.packed == 9 and report.int8
    assert report.describe() == ("panel-packed float32 (9 linears, 4 fused groups; int8 weights "
                                 "(per-feature scales) and bf16 dot products (AVX512_BF16), "
                                 "fp32 sums)")
    assert all(m.int8 for m in model.modules() if isinstance(m, PanelLinear))


def _start(path: str, dtype: str, quantize: str) -> XeonEngine:
    engine = XeonEngine(EngineConfig(model_path=path, dtype=dtype, quantize=quantize,
                                     options=TEST_OPTIONS))
    engine.start()
    return engine


def test_the_engine_refuses_what_it_cannot_quantize(default_model_path, monkeypatch):
    path = str(default_model_path)
    with pytest.raises(EngineStartError, match=r"'gptq' is not supported \(it implements: int8\)"):
        _start(path, "auto", "gptq")
    with pytest.raises(EngineStartError, match="use --dtype auto or bfloat16, not float32"):
        _start(path, "float32", "int8")
    # A CPU without AVX512_BF16 (or linears that rule the panels out) cannot run it.
    monkeypatch.setattr(XeonEngine, "_bf16_dot_available", lambda self: False)
    with pytest.raises(EngineStartError, match="int8 runs on the AVX512_BF16 dot-product kernels"):
        _start(path, "auto", "int8")
