"""``--quantize smoothquant`` on the Xeon engine: the W8A8 kernels and the engine's greedy tokens.

Kernels (``kernels/panel_w8a8.cpp``): each path this CPU has (AMX, AVX512-VNNI,
AVX2, scalar; the others are skipped and named at the end of the run) against
a PyTorch reference written from the format's definition
(``tests/support/w8a8_reference.py``): the
activations' integers and scales and the int32 sums equal, the outputs
within an fp32 rounding, over ragged shapes.

Engine: greedy tokens against transformers with every linear replaced by
W8A8 math in PyTorch, smoothed with factors computed by the tests from statistics
the tests record (teacher-forced, near ties allowed: ``assert_greedy_near``).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from switchyard_spec import EngineConfig, EngineStartError
from switchyard_xeon.engine import XeonEngine

from tests.support import kernel_paths
from tests.support.calibration import calibration_prompts
from tests.support.greedy import assert_greedy_near
from tests.support.kernel_paths import W8A8_PATH_NUMBERS
from tests.support.quant_methods import method
from tests.support.w8a8_reference import quantize_rows, smoothquant_twin
from tests.support.xeon_engines import engine_tokens
from tests.support.xeon_options import TEST_OPTIONS

SQ = method("smoothquant")


def _random_layer(n: int, k: int, gen: torch.Generator):
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    q[0, 0] = -127  # the range's ends
    ws = torch.rand(n, generator=gen) / 40 + 1e-3
    m = torch.rand(k, generator=gen) * 4 + 0.05
    return q, ws, m


@pytest.fixture(params=list(W8A8_PATH_NUMBERS))
def w8a8_path(request):
    kernel_paths.require(request.param)
    return W8A8_PATH_NUMBERS[request.param]


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 16, 17, 31, 33, 48, 70])
@pytest.mark.parametrize("out_features,in_features", [(1, 9), (17, 63), (33, 130), (70, 577),
                                                      (48, 64)])
def test_w8a8_kernels_are_integer_exact(w8a8_path, rows, out_features, in_features):
    ops = torch.ops.switchyard_xeon
    gen = torch.Generator().manual_seed(rows * 1000 + out_features * 7 + in_features)
    q, ws, m = _random_layer(out_features, in_features, gen)
    x = torch.randn(rows, in_features, generator=gen) * 3
    x[0, -1] = 40.0  # an outlier feature
    if rows > 3:
        x[3] = 0.0  # a row of zeros: scale 0, output the bias
    bias = torch.randn(out_features, generator=gen)
    packed = ops.pack_panels_w8a8(q, ws, m, 0.0)
    inv = 1.0 / m
    xq, scale = quantize_rows(x, inv)
    got_xq, got_scale = ops.w8a8_quantize_rows(x, packed)
    assert torch.equal(got_xq.long(), xq) and torch.equal(got_scale, scale)
    sums = xq @ q.long().T  # int64: exact
    raw = ops.w8a8_linear(x, packed, bias, out_features, w8a8_path, True)
    assert raw.dtype == torch.int32 and torch.equal(raw.long(), sums)
    y = ops.w8a8_linear(x, packed, bias, out_features, w8a8_path, False)
    want = (sums.double() * (scale[:, None] * ws[None, :]).double() + bias.double()).float()
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    if rows > 3:
        assert torch.equal(y[3], bias)


def test_w8a8_static_scale_clamps(w8a8_path):
    ops = torch.ops.switchyard_xeon
    gen = torch.Generator().manual_seed(9)
    q, ws, m = _random_layer(20, 70, gen)
    x = torch.randn(37, 70, generator=gen)
    static = 0.01  # small: many values clamp to +-127
    packed = ops.pack_panels_w8a8(q, ws, m, static)
    xq, scale = quantize_rows(x, 1.0 / m, static)
    assert int((xq.abs() == 127).sum()) > 100
    got_xq, got_scale = ops.w8a8_quantize_rows(x, packed)
    assert torch.equal(got_xq.long(), xq) and torch.equal(got_scale, scale)
    raw = ops.w8a8_linear(x, packed, None, 20, w8a8_path, True)
    assert torch.equal(raw.long(), xq @ q.long().T)


def test_panel_linear_takes_w8a8_panels_and_refuses_bad_inputs():
    kernel_paths.require("w8a8 scalar")
    ops = torch.ops.switchyard_xeon
    gen = torch.Generator().manual_seed(3)
    q, ws, m = _random_layer(40, 100, gen)
    packed = ops.pack_panels_w8a8(q, ws, m, 0.0)
    x = torch.randn(45, 100, generator=gen)
    auto = ops.panel_linear(x, packed, None, 40)
    assert torch.equal(auto, ops.w8a8_linear(x, packed, None, 40, 4, False))
    with pytest.raises(RuntimeError, match="does not match"):
        ops.panel_linear(torch.zeros(3, 99), packed, None, 40)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.panel_linear(x, packed, None, 41)
    with pytest.raises(RuntimeError, match="bias"):
        ops.panel_linear(x, packed, torch.zeros(39), 40)
    with pytest.raises(RuntimeError, match="smoothing"):
        ops.pack_panels_w8a8(q, ws, torch.zeros(100), 0.0)
    bad = q.clone()
    bad[1, 1] = -128
    with pytest.raises(RuntimeError, match="-127..127"):
        ops.pack_panels_w8a8(bad, ws, m, 0.0)
    with pytest.raises(RuntimeError, match="not available|path"):
        ops.w8a8_linear(x, packed, None, 40, 9, False)


# ------------------------------------------------------------------ engine


def _engine(path, cache, **options: str) -> XeonEngine:
    engine = XeonEngine(EngineConfig(
        model_path=str(path), quantize="smoothquant", quantization=SQ,
        max_batch_prefill_tokens=16,
        options={**TEST_OPTIONS, "block_size": "4", "calibration_cache": str(cache), **options}))
    engine.start()
    return engine


@pytest.mark.parametrize("forward,options", [
    ("auto", {}), ("decoder", {}), ("transformers", {}),
    ("auto", {"smoothquant_alpha": "0.8", "smoothquant_activations": "static"})])
def test_engine_greedy_tokens_match_a_w8a8_reference(default_model_path, tmp_path, caplog,
                                                     forward, options):
    """Prefill in chunks of 16 rows and batched decode steps (the vnni path where the CPU has it)."""
    from transformers import AutoModelForCausalLM

    kernel_paths.note("w8a8 vnni")
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    alpha = float(options.get("smoothquant_alpha", 0.5))
    static = options.get("smoothquant_activations") == "static"
    prompts = [[(t * 37 + 11) % 2000 + 3 for t in range(n)] for n in (21, 6, 40)]
    with caplog.at_level(logging.INFO, logger="switchyard.xeon"):
        engine = _engine(default_model_path, tmp_path, forward=forward, **options)
    try:
        assert "W8A8 int8 weights and activations" in caplog.text
        assert ("static scale" if static else "per token") in caplog.text
        got = engine_tokens(engine, prompts, 8)
        bf16_cache = engine.info.dtype == "bfloat16"  # the cache's dtype, as /info reports
    finally:
        engine.shutdown()
    calibration = calibration_prompts("smoothquant", default_model_path, options)
    reference = smoothquant_twin(model, calibration, alpha, static, bf16_cache)
    assert_greedy_near(reference, prompts, got, 8)
    # The reference is W8A8, not bf16: its logits differ from the float model's.
    with torch.inference_mode():
        ids = torch.tensor([prompts[0]])
        assert (reference(ids).logits - model(ids).logits).abs().max() > 1e-3


def test_calibration_runs_once_and_bad_files_stop_start_up(default_model_path, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="switchyard.xeon"):
        _engine(default_model_path, tmp_path).shutdown()
        assert "calibrated on 16 prompts" in caplog.text
        caplog.clear()
        _engine(default_model_path, tmp_path, smoothquant_alpha="0.7").shutdown()
    assert "calibration statistics from" in caplog.text and "calibrated on" not in caplog.text
    cached = list(tmp_path.glob("*.safetensors"))
    assert len(cached) == 1
    cached[0].write_bytes(cached[0].read_bytes()[:100])  # truncated
    with pytest.raises(EngineStartError, match=f"calibration cache {cached[0]} is corrupt"):
        _engine(default_model_path, tmp_path)
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    with pytest.raises(EngineStartError, match=f"calibration file {bad}: line 2 is not JSON"):
        _engine(default_model_path, tmp_path, calibration_file=str(bad))
    with pytest.raises(EngineStartError, match="smoothquant_alpha must be from 0 to 1"):
        _engine(default_model_path, tmp_path, smoothquant_alpha="1.5")
    with pytest.raises(EngineStartError, match="linears=onednn rules out"):
        _engine(default_model_path, tmp_path, linears="onednn")
