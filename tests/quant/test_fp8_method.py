"""``--quantize fp8`` as a contract method: its format, quantize-dequantize bounds, calibration, refusals.

The bounds come from E4M3 itself: 3 mantissa bits, so a value in the normal
range rounds within 2**-4 of itself (half a step of 2**-3), and below the
smallest normal (2**-6 times the scale) within half a subnormal step
(2**-10 times the scale).
"""

from __future__ import annotations

import json

import pytest
import torch

from switchyard.plugins import PluginHost
from switchyard_quant import plugin
from switchyard_spec import (
    FP8_E4M3_PER_TENSOR,
    INT8_PER_CHANNEL,
    ActivationQuant,
    ActivationStatistics,
    DeviceInfo,
    EngineSpec,
    Packing,
    UnsupportedQuantizationError,
)

FP8 = {m.name: m for m in plugin.switchyard_quantization_methods()}["fp8"]


def test_the_method_declares_the_fp8_format_and_a_calibration():
    assert FP8.formats == (FP8_E4M3_PER_TENSOR,)
    assert FP8_E4M3_PER_TENSOR.name == "fp8-e4m3-per-tensor"
    assert FP8_E4M3_PER_TENSOR.packing is Packing.FP8_E4M3_ROWS
    assert FP8_E4M3_PER_TENSOR.activations is ActivationQuant.FP8_E4M3_PER_TENSOR
    assert FP8.calibration is not None and FP8.calibration.max_tokens == 128
    assert FP8.calibration.options == ("calibration_file", "calibration_samples")
    # The same texts and token limit as SmoothQuant: both read one cached set of statistics.
    smoothquant = {m.name: m for m in plugin.switchyard_quantization_methods()}["smoothquant"]
    assert FP8.calibration.prompts({}) == smoothquant.calibration.prompts({})
    assert FP8.calibration.max_tokens == smoothquant.calibration.max_tokens


@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 300)])
def test_quantize_dequantize_stays_within_e4m3_rounding(shape):
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    weight = torch.randn(*shape, generator=gen) * torch.logspace(-4, 0, shape[1])  # wide range
    q = FP8.quantize(weight)
    s = float(weight.abs().max()) / 448
    assert q.format == FP8_E4M3_PER_TENSOR and (q.out_features, q.in_features) == shape
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == shape
    assert q.scales.dtype == torch.float32 and torch.equal(q.scales, torch.full((shape[0],), s))
    assert q.activation_scale == 1.0 and q.smoothing is None  # uncalibrated: unit input scale
    assert float(q.data.float().abs().max()) == 448.0  # the largest weight maps to E4M3's max
    restored = FP8.dequantize(q)
    assert restored.dtype == torch.float32 and restored.shape == shape
    err = (restored.double() - weight.double()).abs()
    bound = torch.maximum(weight.double().abs() * 2**-4, torch.full_like(err, s * 2**-10))
    assert bool((err <= bound * (1 + 1e-6)).all())
    # PyTorch's own cast, independently: the integers are E4M3 of W / s.
    assert torch.equal(q.data.view(torch.uint8),
                       (weight / torch.tensor(s)).to(torch.float8_e4m3fn).view(torch.uint8))


def test_a_zero_weight_and_bad_weights():
    q = FP8.quantize(torch.zeros(3, 4))
    assert torch.equal(q.scales, torch.ones(3)) and not bool(q.data.float().any())
    with pytest.raises(ValueError, match=r"must be \[N, K\]"):
        FP8.quantize(torch.zeros(4))
    with pytest.raises(ValueError, match="non-finite"):
        FP8.quantize(torch.tensor([[1.0, float("nan")]]))


def test_calibrated_input_scale_is_the_largest_input_over_448():
    weight = torch.randn(5, 6)
    absmax = torch.tensor([0.5, 3.0, 1.0, 0.0, 2.0, 8.96])
    q = FP8.calibration.quantize(weight, ActivationStatistics(absmax=absmax, tokens=9), {})
    assert q.activation_scale == pytest.approx(8.96 / 448, rel=1e-7)
    silent = FP8.calibration.quantize(weight, ActivationStatistics(
        absmax=torch.zeros(6), tokens=9), {})
    assert silent.activation_scale == 1.0  # an input never seen nonzero: any scale is exact
    with pytest.raises(ValueError, match=r"statistics of \(5,\) features for a weight of 6"):
        FP8.calibration.quantize(weight, ActivationStatistics(absmax=torch.ones(5), tokens=1), {})


def test_calibration_texts_and_bad_files(tmp_path):
    texts = FP8.calibration.prompts({})
    assert len(texts) == 16 and texts == FP8.calibration.prompts({})  # deterministic
    assert len(FP8.calibration.prompts({"calibration_samples": "3"})) == 3
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "one"}) + "\n" + json.dumps("two") + "\n")
    assert FP8.calibration.prompts({"calibration_file": str(good)}) == ("one", "two")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match=f"calibration file {bad}: cannot be read"):
        FP8.calibration.prompts({"calibration_file": str(bad)})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=f"calibration file {empty}: holds no texts"):
        FP8.calibration.prompts({"calibration_file": str(empty)})
    with pytest.raises(ValueError, match="calibration_samples must be a positive integer"):
        FP8.calibration.prompts({"calibration_samples": "0"})


def _engine(name: str, formats: tuple) -> EngineSpec:
    return EngineSpec(name=name, description="", factory=lambda config: None,
                      probe=lambda: DeviceInfo(available=True, name=name),
                      weight_formats=formats)


def test_an_engine_without_the_format_refuses_fp8_naming_what_it_runs():
    host = PluginHost.from_entry_points()
    assert host.resolve_quantization("fp8", host.engines()["xeon"]) is not None
    with pytest.raises(UnsupportedQuantizationError) as refused:
        host.resolve_quantization("fp8", _engine("int8only", (INT8_PER_CHANNEL,)))
    assert str(refused.value) == (
        "--quantize 'fp8' produces fp8-e4m3-per-tensor weights, which engine 'int8only' has no "
        "kernels for; it can run: int8 (int8-per-channel)")
    with pytest.raises(UnsupportedQuantizationError, match="engine 'plain'.*it can run: none"):
        host.resolve_quantization("fp8", _engine("plain", ()))


def test_switchyard_plugins_lists_fp8_with_both_engines():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "switchyard.cli", "plugins"], check=False,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.strip().startswith("fp8 "))
    assert "formats=fp8-e4m3-per-tensor engines=" in line
    engines = line.split(" engines=", 1)[1].split(":", 1)[0]
    assert sorted(engines.split(", ")) == ["gaudi", "xeon"]
