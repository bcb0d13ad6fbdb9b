"""SmoothQuant W8A8 (switchyard-quant): smoothing factors, int8 weights, calibration texts.

Checked against float64 math written here; the W8A8 layer itself (activations
quantized per token) is written here too, from the format's definition.
"""

from __future__ import annotations

import json

import pytest
import torch

from switchyard_quant import plugin
from switchyard_quant.smoothquant import (
    calibration_prompts,
    default_texts,
    dequantize_w8a8,
    quantize_calibrated,
    quantize_smoothquant,
    smoothing_factors,
)
from switchyard_spec import (
    W8A8_SMOOTHQUANT,
    W8A8_SMOOTHQUANT_STATIC,
    ActivationQuant,
    ActivationStatistics,
)


def _layer(seed: int = 0, n: int = 48, k: int = 96):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(64, k, generator=gen)
    x[:, [3, 40, 77]] *= 60  # outlier input features, as transformers' activations have
    return weight, x


def _w8a8(x: torch.Tensor, qw) -> torch.Tensor:
    """The layer a W8A8 weight defines, in float64: int8 rows of ``x / m``, integer products."""
    t = x.double() / qw.smoothing.double()
    if qw.format.activations is ActivationQuant.INT8_PER_TENSOR:
        scale = torch.full((x.shape[0], 1), qw.activation_scale, dtype=torch.float64)
    else:
        scale = t.abs().amax(1, keepdim=True) / 127
    xq = torch.round(t / scale).clamp(-127, 127)
    return (xq @ qw.data.double().T) * scale * qw.scales.double()[None, :]


def test_smoothing_factors_follow_the_formula_and_spare_dead_features():
    weight, x = _layer()
    absmax = x.abs().amax(0)
    absmax[5] = 0.0  # never seen
    weight[:, 9] = 0.0  # a dead column
    for alpha in (0.0, 0.5, 0.85, 1.0):
        m = smoothing_factors(absmax, weight, alpha)
        want = absmax.double() ** alpha / weight.double().abs().amax(0) ** (1 - alpha)
        want[5] = want[9] = 1.0
        torch.testing.assert_close(m.double(), want.clamp(1e-5, 1e5), rtol=1e-6, atol=0)
        assert m.dtype == torch.float32


def test_weights_round_to_nearest_after_smoothing():
    weight, x = _layer(1)
    stats = ActivationStatistics(absmax=x.abs().amax(0), tokens=64)
    qw = quantize_calibrated(weight, stats, {})
    assert qw.format == W8A8_SMOOTHQUANT and qw.activation_scale == 0.0
    assert qw.data.dtype == torch.int8 and qw.data.shape == weight.shape
    assert int(qw.data.abs().max()) == 127 and int(qw.data.min()) >= -127
    m = smoothing_factors(stats.absmax, weight, 0.5)
    assert torch.equal(qw.smoothing, m)
    smoothed = weight.double() * m.double()
    torch.testing.assert_close(qw.scales.double(), smoothed.abs().amax(1) / 127, rtol=1e-6, atol=0)
    # Within half a step of the smoothed weight, so within step / 2m of the weight.
    step = qw.scales.double()[:, None]
    assert bool(((qw.data.double() * step - smoothed).abs() <= step / 2 * (1 + 1e-5)).all())
    restored = dequantize_w8a8(qw).double()
    assert bool(((restored - weight.double()).abs() <= step / 2 / m.double() * (1 + 1e-5)).all())
    assert torch.equal(quantize_calibrated(weight, stats, {}).data, qw.data)  # deterministic


def test_smoothing_lowers_the_error_of_w8a8_on_outlier_activations():
    weight, x = _layer(2)
    exact = x.double() @ weight.double().T
    stats = ActivationStatistics(absmax=x.abs().amax(0), tokens=64)

    def error(qw) -> float:
        return float((_w8a8(x, qw) - exact).norm() / exact.norm())

    plain = error(quantize_smoothquant(weight))
    smoothed = error(quantize_calibrated(weight, stats, {}))
    weight_only = float((x.double() @ dequantize_w8a8(quantize_smoothquant(weight)).double().T
                         - exact).norm() / exact.norm())
    assert smoothed < plain / 3, (smoothed, plain)
    assert weight_only < 0.01 and smoothed < 0.02  # int8 weights alone cost little


def test_static_activations_take_the_calibrated_range():
    weight, x = _layer(3)
    stats = ActivationStatistics(absmax=x.abs().amax(0), tokens=64)
    qw = quantize_calibrated(weight, stats, {"smoothquant_activations": "static",
                                             "smoothquant_alpha": "0.7"})
    assert qw.format == W8A8_SMOOTHQUANT_STATIC
    m = smoothing_factors(stats.absmax, weight, 0.7)
    want = float((stats.absmax.double() / m.double()).max()) / 127
    assert qw.activation_scale == pytest.approx(want, rel=1e-6)
    exact = x.double() @ weight.double().T
    assert float((_w8a8(x, qw) - exact).norm() / exact.norm()) < 0.03


def test_calibration_texts_are_deterministic_and_files_are_checked(tmp_path):
    first, again = default_texts(), calibration_prompts({})
    assert first == again and len(first) == 16 and len(set(first)) == 16
    assert all(len(t) > 500 for t in first)
    assert len(calibration_prompts({"calibration_samples": "4"})) == 4
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "a b c"}) + "\n\n" + json.dumps("d e") + "\n")
    assert calibration_prompts({"calibration_file": str(good)}) == ("a b c", "d e")
    for content, why in (("{oops\n", "line 1 is not JSON"), ('{"text": 3}\n', "line 1 is neither"),
                         ("\n", "holds no texts"), (b"\xff\xfe", "cannot be read")):
        bad = tmp_path / "bad.jsonl"
        bad.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(ValueError, match=f"calibration file {bad}: {why}"):
            calibration_prompts({"calibration_file": str(bad)})
    with pytest.raises(ValueError, match=f"calibration file {tmp_path / 'missing'}"):
        calibration_prompts({"calibration_file": str(tmp_path / "missing")})
    for options, why in (({"smoothquant_alpha": "x"}, "smoothquant_alpha must be a number"),
                         ({"smoothquant_alpha": "-0.1"}, "from 0 to 1"),
                         ({"smoothquant_activations": "per-channel"}, "dynamic or static"),
                         ({"calibration_samples": "0"}, "positive integer")):
        with pytest.raises(ValueError, match=why):
            calibration_prompts(options)


def test_the_plugin_declares_smoothquant_with_its_calibration():
    methods = {m.name: m for m in plugin.switchyard_quantization_methods()}
    sq = methods["smoothquant"]
    assert sq.formats == (W8A8_SMOOTHQUANT, W8A8_SMOOTHQUANT_STATIC)
    assert sq.calibration is not None and sq.calibration.max_tokens == 128
    assert "smoothquant_alpha" in sq.calibration.options
    assert methods["int8"].calibration is None
    weight, x = _layer(4)
    qw = sq.calibration.quantize(weight, ActivationStatistics(absmax=x.abs().amax(0), tokens=1),
                                 {})
    torch.testing.assert_close(sq.dequantize(qw), dequantize_w8a8(qw))
    assert sq.quantize(weight).smoothing.eq(1).all()
