"""Quantized weights in fp32 math on AVX2 + FMA (``kernels/panel_quant_fma.cpp``).

Where the kernels lack AVX512_BF16 (Zen 2/3, Haswell to Ice Lake), or
``--dtype float32`` is asked for, ``--quantize int8`` / ``int4`` and the
checkpoint formats run on these panels, and FP8 linears do everywhere the
build has AVX2. Checked against ``F.linear`` over the weight each format
defines (from the contract, :func:`~switchyard_xeon.quantized.reference_weight`,
not from the packing), and end to end against transformers with that weight.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from switchyard_spec import (
    FP8_E4M3_PER_TENSOR,
    INT8_PER_CHANNEL,
    EngineConfig,
    EngineStartError,
    uint4_group_asym,
)
from switchyard_xeon.engine import XeonEngine

from tests.support import kernel_paths
from tests.support.dequantized_reference import with_dequantized_weights
from tests.support.engine_requests import prompt_of
from tests.support.gptq_reference import NEW, PROMPTS, gptq_fp32_reference
from tests.support.greedy import assert_greedy_near
from tests.support.quant_methods import method
from tests.support.tiny_models import tiny_llama
from tests.support.xeon_engines import engine_tokens
from tests.support.xeon_options import TEST_OPTIONS

FORMATS = {"int8": INT8_PER_CHANNEL, "int4-g32": uint4_group_asym(32),
           "int4-g64": uint4_group_asym(64), "int4-g128": uint4_group_asym(128),
           "fp8": FP8_E4M3_PER_TENSOR}


@pytest.fixture(scope="module")
def fma_panels():
    """The AVX2 + FMA quantized panels; skips, with the reason, where the build lacks them."""
    from switchyard_xeon.kernels import load_kernels

    load_kernels()
    kernel_paths.require("panel quant fma")


def _record(name: str, out: int, inner: int, seed: int):
    from switchyard_xeon.kernels.checks import _random_quantized

    return _random_quantized(FORMATS[name], out, inner, torch.Generator().manual_seed(seed))


def _seen(weight) -> torch.Tensor:
    """The fp32 weight the panels multiply their input by, from the format's definition."""
    from switchyard_xeon.kernels.checks import fp8_reference_weight
    from switchyard_xeon.quantized import reference_weight

    if weight.format == FP8_E4M3_PER_TENSOR:
        return fp8_reference_weight(weight)
    return reference_weight(weight)


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 16, 17, 70, 515])
@pytest.mark.parametrize("shape", [(1, 1), (17, 2), (37, 75), (16, 64), (50, 130), (33, 257)])
def test_fma_panels_are_f_linear_over_the_format_weight(fma_panels, name, rows, shape):
    """Ragged N and K (short last groups, K below one step pair), no rows, rows in registers
    and through the widened buffer, and past one 512-row chunk; with and without a bias."""
    from switchyard_xeon.quantized import pack_quantized

    out, inner = shape
    weight = _record(name, out, inner, seed=rows * 7 + inner)
    packed = pack_quantized(weight, fma=True)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inner, generator=gen)
    bias = torch.randn(out, generator=gen) if rows % 2 else None
    got = torch.ops.switchyard_xeon.panel_linear(x, packed, bias, out)
    want = F.linear(x.double(), _seen(weight).double(), None if bias is None else bias.double())
    torch.testing.assert_close(got.double(), want, atol=2e-5 * inner ** 0.5, rtol=1e-5)


def test_fp8_codes_widen_exactly_subnormals_and_signs_included(fma_panels):
    """Each of the 254 finite E4M3 codes, one per input feature: the output is their sum."""
    from switchyard_spec import QuantizedWeight
    from switchyard_xeon.quantized import pack_quantized

    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).double()
    weight = QuantizedWeight(format=FP8_E4M3_PER_TENSOR, out_features=1,
                             in_features=len(codes), data=codes[None].view(torch.float8_e4m3fn),
                             scales=torch.ones(1), activation_scale=1.0)
    packed = pack_quantized(weight, fma=True)
    for j in range(len(codes)):  # one-hot inputs read one widened code each
        x = torch.zeros(1, len(codes))
        x[0, j] = 1.0
        got = torch.ops.switchyard_xeon.panel_linear(x, packed, None, 1)
        assert got.item() == values[j].item(), (hex(codes[j].item()), got.item())


def test_fma_panels_reject_bad_inputs(fma_panels):
    ops = torch.ops.switchyard_xeon
    int8 = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="kind must be"):
        ops.pack_panels_quant_fma(9, int8, torch.ones(4), None, 0, 8)
    with pytest.raises(RuntimeError, match="int8 data must be int8"):
        ops.pack_panels_quant_fma(1, int8.float(), torch.ones(4), None, 0, 8)
    with pytest.raises(RuntimeError, match="scales must be float32"):
        ops.pack_panels_quant_fma(1, int8, torch.ones(3), None, 0, 8)
    words = torch.zeros(4, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="zero points must be uint8 0..15"):
        ops.pack_panels_quant_fma(2, words, torch.ones(4, 1), torch.full((4, 1), 16, dtype=torch.uint8), 32, 8)
    with pytest.raises(RuntimeError, match="zero points"):
        ops.pack_panels_quant_fma(2, words, torch.ones(4, 1), None, 32, 8)
    packed = ops.pack_panels_quant_fma(1, int8, torch.ones(4), None, 0, 8)
    with pytest.raises(RuntimeError, match="do not match x or N"):
        ops.panel_linear(torch.zeros(2, 9), packed, None, 4)
    with pytest.raises(RuntimeError, match="do not match x or N"):
        ops.panel_linear(torch.zeros(2, 8), packed, None, 5)


def test_int4_decode_reads_about_an_eighth_of_fp32s_bytes(fma_panels):
    """The layout: one byte per weight for int8 and fp8, half for uint4, plus the constants
    (uint4: an fp32 scale and zero point per 16 features and group, 1/8 more at group 128)."""
    from switchyard_xeon.quantized import pack_quantized

    out, inner = 64, 512
    fp32_bytes = out * inner * 4
    sizes = {n: pack_quantized(_record(n, out, inner, 0), fma=True).numel()
             for n in ("int8", "int4-g128", "fp8")}
    assert sizes["int8"] < fp32_bytes / 4 * 1.05 and sizes["fp8"] == sizes["int8"]
    assert sizes["int4-g128"] < fp32_bytes / 8 * 1.15


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_engine_in_fp32_matches_transformers_over_the_dequantized_weights(
        fma_panels, family_model, name, caplog):
    """``--dtype float32 --quantize``: greedy tokens are transformers' over the dequantized
    weights, in the native layer loop, the Python one and transformers' forward."""
    folder, model = family_model
    reference = with_dequantized_weights(model, name)
    prompts = [[t % 500 + 1 for t in prompt_of(n, start=s)] for n, s in ((21, 1), (6, 2))]
    with torch.inference_mode():
        x = torch.tensor([prompts[0]])
        assert not torch.allclose(model(x).logits, reference(x).logits, atol=1e-4)
    for forward in ("auto", "decoder", "transformers"):
        caplog.clear()
        with caplog.at_level("INFO", logger="switchyard.xeon"):
            engine = XeonEngine(EngineConfig(
                model_path=str(folder), dtype="float32", quantize=name,
                quantization=method(name), max_batch_prefill_tokens=16,
                options={**TEST_OPTIONS, "block_size": "4", "forward": forward}))
            engine.start()
        try:
            assert engine.info is not None and engine.info.dtype == "float32"
            assert "in fp32 math (AVX2 + FMA)" in caplog.text
            if forward == "auto":
                assert engine._runner._forward.native is not None  # decode_layers.cpp
            assert_greedy_near(reference, prompts, engine_tokens(engine, prompts, 10), 10,
                               tol=1e-4)
        finally:
            engine.shutdown()


def test_int4_group_sizes_in_fp32_each_match_their_reference(fma_panels, tmp_path):
    torch.manual_seed(0)
    model = tiny_llama(torch.float32)
    model.save_pretrained(tmp_path)
    prompts = [[t % 90 + 1 for t in prompt_of(n, start=s)] for n, s in ((17, 1), (5, 3))]
    for name in ("int4-g32", "int4-g64"):
        reference = with_dequantized_weights(model, name)
        engine = XeonEngine(EngineConfig(model_path=str(tmp_path), dtype="float32",
                                         quantize=name, quantization=method(name),
                                         options={**TEST_OPTIONS, "block_size": "4"}))
        engine.start()
        try:
            assert_greedy_near(reference, prompts, engine_tokens(engine, prompts, 8), 8,
                               tol=1e-4)
        finally:
            engine.shutdown()


def test_bfloat16_without_bf16_dot_products_is_refused_clearly(default_model_path, monkeypatch):
    """Where the bf16 dot panels are missing, ``--dtype bfloat16 --quantize int8`` names why."""
    import dataclasses

    from switchyard_xeon import kernels

    status = kernels.load_kernels()
    if status.fn is None or not status.quant_fma:
        pytest.skip(f"native kernels: {status.reason}")
    monkeypatch.setattr(kernels, "_status", dataclasses.replace(status, bf16_dot=False,
                                                                uint4_dot=False))
    engine = XeonEngine(EngineConfig(model_path=str(default_model_path), dtype="bfloat16",
                                     quantize="int8", quantization=method("int8"),
                                     options=dict(TEST_OPTIONS)))
    with pytest.raises(EngineStartError, match="--dtype auto runs fp32 math"):
        engine.start()


def test_a_gptq_folder_serves_in_fp32_the_greedy_tokens_of_its_weights(
        fma_panels, default_model_path, tmp_path, caplog):
    """A checkpoint's uint4 layers on the fma panels: transformers over its dequantized weights."""
    from switchyard_quant.checkpoints.writer import write_gptq

    folder = tmp_path / "gptq"
    write_gptq(default_model_path, folder, 64)
    reference = gptq_fp32_reference(folder)
    caplog.set_level("INFO")
    engine = XeonEngine(EngineConfig(model_path=str(folder), dtype="float32", quantize="gptq",
                                     quantization=method("gptq"), options=dict(TEST_OPTIONS)))
    engine.start()
    try:
        got = engine_tokens(engine, PROMPTS, NEW)
    finally:
        engine.shutdown()
    assert_greedy_near(reference, PROMPTS, got, NEW, tol=1e-4)
    assert ("uint4 weights (groups of 64, scales and zero points) from the checkpoint "
            "(28 linears)") in caplog.text
    assert "in fp32 math (AVX2 + FMA)" in caplog.text
