"""``--quantize int4`` on the Xeon engine: the uint4 dot-product panels, how the engine takes it.

The kernel (``kernels/panel_dot_uint4.cpp``) is checked against float64
PyTorch over ragged shapes. Its constraints: the group size is a multiple of
16 (the format's 32, 64 and 128 are); any K (a short last group is padded)
and any N (a short last panel is masked); any number of rows (up to 64 widen
the nibbles in registers, more through a per-thread buffer; chunks of 512).
Greedy parity of whole models is in ``test_xeon_quantized_parity.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from switchyard_spec import (
    EngineConfig,
    EngineStartError,
    Packing,
    QuantizationMethod,
    WeightFormat,
    uint4_group_asym,
)
from switchyard_xeon.engine import XeonEngine
from switchyard_xeon.kernels import load_kernels
from switchyard_xeon.linears import PanelLinear, pack_linears
from switchyard_xeon.quantized import pack_quantized, reference_weight, uint4_words

from tests.support import kernel_paths
from tests.support.quant_methods import method
from tests.support.tiny_models import tiny_llama
from tests.support.xeon_options import TEST_OPTIONS

INT4 = {g: method(name) for g, name in ((32, "int4-g32"), (64, "int4-g64"), (128, "int4"))}


@pytest.fixture
def uint4_panels():
    """The uint4 dot-product panels; skips, with the reason, where the kernels lack them."""
    kernel_paths.require("panel uint4")
    return torch.ops.switchyard_xeon


def test_the_contract_formula_is_what_the_method_dequantizes_to():
    """The engine's reading of the format (its own code) and switchyard-quant's agree exactly."""
    gen = torch.Generator().manual_seed(0)
    for group, quantization in INT4.items():
        weight = quantization.quantize(torch.randn(37, 75, generator=gen))
        assert weight.format == uint4_group_asym(group)
        assert torch.equal(reference_weight(weight), quantization.dequantize(weight))


# (group, N, K): ragged and whole panels, one to nine groups, short last groups, odd K,
# K shorter than one group.
SHAPES = [(32, 45, 75), (32, 16, 32), (64, 130, 200), (64, 1, 9), (128, 33, 130), (128, 64, 96)]


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 13, 33, 64, 65])  # tiles of 4; 65: the buffer
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "g{}-n{}-k{}".format(*s))
def test_uint4_panels_are_a_bf16_matmul_over_the_dequantized_weight(uint4_panels, rows, shape):
    group, out_features, in_features = shape
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    panel = PanelLinear(weight, bias, bf16_dot=True, quantization=INT4[group])
    assert panel.packed_weight.dtype == torch.uint8 and f"group{group}" in repr(panel)
    # Inputs over four decades, as activations after a norm are.
    x = torch.randn(rows, in_features, generator=gen) * torch.logspace(-2, 1, in_features)
    xb = x.bfloat16().double()
    quantized = INT4[group].quantize(weight)
    dequantized = INT4[group].dequantize(quantized).double()
    want = torch.nn.functional.linear(xb, dequantized, bias.double())
    with torch.inference_mode():
        got = panel(x).double()
    # fp32 sums of exact products: within a few ulps of the sum of the terms' magnitudes
    # (the kernel's terms are x (16 + q) s, at most 31 s |x|).
    scales = quantized.scales.double().repeat_interleave(group, 1)[:, :in_features]
    terms = xb.abs() @ (31 * scales).T + bias.double().abs()
    assert bool(((got - want).abs() <= 1e-6 * terms + 1e-6).all()), (got - want).abs().max()
    # It really is the quantized weight: not the bf16 one.
    bf16 = torch.nn.functional.linear(xb, weight.bfloat16().double(), bias.double())
    assert (got - bf16).abs().max() > 1e-3


def test_a_512_row_chunk_and_its_remainder(uint4_panels):
    gen = torch.Generator().manual_seed(7)
    weight, x = torch.randn(40, 64, generator=gen), torch.randn(600, 64, generator=gen)
    quantized = INT4[32].quantize(weight)
    got = uint4_panels.panel_linear(x, pack_quantized(quantized), None, 40)
    want = torch.nn.functional.linear(x.bfloat16().double(), reference_weight(quantized).double())
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


def test_uint4_panels_layout_groups_nibbles_and_constants(uint4_panels):
    """[panels, groups, 8 G + 128]: four k-pair steps per 64-byte quad, then s and -(16 + z)."""
    group, n, k = 32, 20, 40
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(0, 16, (n, 2), generator=gen).to(torch.uint8)
    scales = torch.rand(n, 2, generator=gen)
    packed = uint4_panels.pack_panels_uint4_dot(uint4_words(q), scales, zeros, group, k)
    assert packed.shape == (2, 2, 8 * group + 128) and packed.dtype == torch.uint8
    consts = packed[:, :, 8 * group:].contiguous().view(torch.float32)  # [panels, groups, 32]
    assert torch.equal(consts[0, :, :16].T, scales[:16]) and not consts[1, :, 4:16].any()
    assert torch.equal(consts[1, :, 16:20].T, -(16 + zeros[16:].float()))
    lanes = packed[:, :, : 8 * group].contiguous().view(torch.int16).view(2, 2, group // 8, 32)
    for feature, kk in ((0, 0), (3, 7), (17, 33), (19, 39)):
        g, step = kk // group, kk % group // 2
        lane = lanes[feature // 16, g, step // 4, 2 * (feature % 16) + kk % 2].item() & 0xFFFF
        assert (lane >> (4 * (step % 4))) & 15 == q[feature, kk]
    big = torch.randn(256, 512)
    bf16 = uint4_panels.pack_panels_bf16_dot(big)
    int4 = PanelLinear(big, None, bf16_dot=True, quantization=INT4[128]).packed_weight
    assert int4.nbytes == 0.28125 * bf16.nbytes  # a quarter, plus 2 floats per 128 weights


def test_uint4_panels_reject_bad_inputs(uint4_panels):
    words, scales = uint4_words(torch.zeros(20, 40, dtype=torch.uint8)), torch.ones(20, 2)
    zeros = torch.zeros(20, 2, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        uint4_panels.pack_panels_uint4_dot(words, scales, zeros, 24, 40)
    with pytest.raises(RuntimeError, match="int32"):
        uint4_panels.pack_panels_uint4_dot(words.float(), scales, zeros, 32, 40)
    with pytest.raises(RuntimeError, match="scales"):
        uint4_panels.pack_panels_uint4_dot(words, scales[:, :1], zeros, 32, 40)
    with pytest.raises(RuntimeError, match="0..15"):
        uint4_panels.pack_panels_uint4_dot(words, scales, zeros + 16, 32, 40)
    packed = uint4_panels.pack_panels_uint4_dot(words, scales, zeros, 32, 40)
    with pytest.raises(RuntimeError, match="do not match"):
        uint4_panels.panel_linear(torch.zeros(3, 70), packed, None, 20)  # three groups of 32
    with pytest.raises(RuntimeError, match="does not match"):
        uint4_panels.panel_linear(torch.zeros(3, 40), packed, None, 40)


def test_pack_report_names_uint4_panels(uint4_panels):
    model = tiny_llama(torch.float32)
    report = pack_linears(model, panels=True, bf16_dot=True, quantization=INT4[64])
    assert report.packed == 9
    assert report.describe() == ("panel-packed float32 (9 linears, 4 fused groups; uint4 weights "
                                 "(groups of 64, scales and zero points) and bf16 dot products "
                                 "(AVX512_BF16), fp32 sums)")


def _start(path: str, dtype: str = "auto") -> XeonEngine:
    engine = XeonEngine(EngineConfig(model_path=path, dtype=dtype, quantize="int4",
                                     quantization=method("int4"), options=TEST_OPTIONS))
    engine.start()
    return engine


def test_the_engine_refuses_int4_where_it_has_no_kernel(default_model_path, monkeypatch):
    """Runs everywhere: the missing kernels are simulated on machines that have them."""
    path = str(default_model_path)
    with pytest.raises(EngineStartError, match="--dtype float16; use auto, bfloat16 or float32"):
        _start(path, "float16")
    real = load_kernels()
    with monkeypatch.context() as patch:  # neither AVX512_BF16 nor AVX2 + FMA
        patch.setattr("switchyard_xeon.assembly.bf16_dot_available", lambda options: False)
        patch.setattr("switchyard_xeon.kernels._status",
                      dataclasses.replace(real, bf16_dot=False, uint4_dot=False, quant_fma=False))
        with pytest.raises(EngineStartError, match=r"--quantize int4 runs on the native quantized "
                                                   r"panels, which cannot run it here"):
            _start(path)
    if real.bf16_dot:  # bf16 panels but no uint4 ones (say, a failed check), bf16 asked for
        monkeypatch.setattr("switchyard_xeon.kernels._status",
                            dataclasses.replace(real, uint4_dot=False, quant_fma=False))
        with pytest.raises(EngineStartError, match="uint4 panels failed their check"):
            _start(path, "bfloat16")


def test_the_engine_refuses_a_method_whose_formats_it_has_no_kernel_for(default_model_path):
    """Built by hand, past the gateway's check: the engine checks the formats again at start."""
    fp8 = WeightFormat(name="fp8-e4m3-per-tensor", bits=8, signed=True, packing=Packing.INT8_ROWS)
    method = QuantizationMethod(name="fp8", description="", formats=(fp8,),
                                quantize=lambda w: w, dequantize=lambda q: q)
    engine = XeonEngine(EngineConfig(model_path=str(default_model_path), quantize="fp8",
                                     quantization=method, options=TEST_OPTIONS))
    with pytest.raises(EngineStartError, match="fp8 produces fp8-e4m3-per-tensor weights; its "
                                               "kernels run int8-per-channel, uint4-group32-asym"):
        engine.start()
