"""switchyard_quant.fp8_inc: reading a QUANT_CONFIG for a device, and INC's flow on a toy model.

The reading is pure (no INC): what each device keeps, rewrites (each with a
note) or refuses. The flow runs INC for real on a two-layer model: the
measured maxabs against the inputs' own maximum, and the converted layers
against FP8 E4M3 rounding computed here with torch's own float8 dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from switchyard_quant import fp8_inc
from switchyard_quant.fp8_inc import Fp8Error, Fp8Plan, read_config


def _write(folder: Path, **options: object) -> str:
    path = folder / "config.json"
    path.write_text(json.dumps(options))
    return str(path)


def test_cpu_rewrites_what_only_a_gaudi_honours_and_says_so(tmp_path):
    path = _write(tmp_path, method="HOOKS", mode="quantize", observer="maxabs",
                  scale_method="maxabs_hw", dump_stats_path="./hqt_output/measure",
                  device_for_scales="GAUDI2")
    plan = read_config(path, "cpu", "bfloat16", cwd="/srv/work")
    assert plan.mode == "QUANTIZE"
    assert plan.options["use_qdq"] is True and plan.options["scale_method"] == "maxabs_pow2"
    assert plan.options["hp_dtype"] == "bf16" and "device_for_scales" not in plan.options
    assert plan.dump_stats_path == "/srv/work/hqt_output/measure"  # against the working dir
    assert [n.split("=")[0].split(" ")[0] for n in plan.notes] == [
        "method", "use_qdq", "device_for_scales", "scale_method"]
    # On an HPU the same file is handed to INC as written, but for the resolved path.
    on_hpu = read_config(path, "hpu", "bfloat16", cwd="/srv/work")
    assert on_hpu.options["scale_method"] == "maxabs_hw" and "use_qdq" not in on_hpu.options
    assert on_hpu.options["device_for_scales"] == "GAUDI2"
    assert [n.split("=")[0] for n in on_hpu.notes] == ["method"]


def test_hp_dtype_follows_the_serving_dtype_or_refuses(tmp_path):
    plan = read_config(_write(tmp_path, mode="MEASURE"), "cpu", "float32")
    assert plan.options["hp_dtype"] == "fp32"
    assert any("hp_dtype is not set: fp32" in n for n in plan.notes)
    with pytest.raises(Fp8Error, match="'bf16' is not the serving dtype float32"):
        read_config(_write(tmp_path, mode="MEASURE", hp_dtype="bf16"), "cpu", "float32")
    assert read_config(_write(tmp_path, mode="MEASURE", hp_dtype="BF16"), "hpu",
                       "bfloat16").options["hp_dtype"] == "bf16"


def test_measurement_files_match_the_prefix_observer_and_rank(tmp_path):
    plan = read_config(_write(tmp_path, mode="QUANTIZE", scale_method="maxabs_pow2",
                              dump_stats_path=str(tmp_path / "stats" / "m")), "cpu", "float32")
    assert plan.needs_measurements and plan.measurement_files() == []
    (tmp_path / "stats").mkdir()
    for name in ("m_hooks_maxabs.npz", "m_hooks_maxabs_0_2.json", "m_hooks_maxabs_MAXABS_POW2.npz",
                 "m_hooks_shape.json", "other_hooks_maxabs.npz"):
        (tmp_path / "stats" / name).write_text("")
    assert [Path(p).name for p in plan.measurement_files()] == [
        "m_hooks_maxabs.npz", "m_hooks_maxabs_0_2.json"]
    fixed = read_config(_write(tmp_path, mode="QUANTIZE", scale_method="unit_scale"), "cpu",
                        "float32")
    assert not fixed.needs_measurements  # unit scales: nothing measured is read


def test_fp8_weight_elements_follow_inc_name_rules():
    shapes = {"model.embed_tokens.weight": (100, 8), "model.layers.0.q_proj.weight": (8, 8),
              "model.layers.0.mlp.up_proj.weight": (16, 8), "model.norm.weight": (8,),
              "lm_head.weight": (100, 8), "model.layers.0.q_proj.bias": (8,)}
    plan = Fp8Plan(path="x", mode="QUANTIZE", device="cpu",
                   options={"blocklist": {"names": ["lm_head"]}, "dump_stats_path": "/x"})
    assert fp8_inc.fp8_weight_elements(shapes, plan) == 64 + 128
    legacy = Fp8Plan(path="x", mode="QUANTIZE", device="cpu",
                     options={"blacklist": {"names": ["lm_head", "mlp"]}, "dump_stats_path": "/x"})
    assert fp8_inc.fp8_weight_elements(shapes, legacy) == 64
    measuring = Fp8Plan(path="x", mode="MEASURE", device="cpu", options={})
    assert fp8_inc.fp8_weight_elements(shapes, measuring) == 0


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32, bias=False)
        self.fc2 = torch.nn.Linear(32, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_measure_then_quantize_a_toy_model_on_the_cpu(tmp_path):
    pytest.importorskip("neural_compressor.torch.quantization")
    torch.manual_seed(0)
    toy = _Toy().eval()
    weights = {k: v.clone() for k, v in toy.state_dict().items()}
    calibration = torch.randn(64, 16) * 3
    stats = str(tmp_path / "hqt" / "measure")
    measure = read_config(_write(tmp_path, mode="MEASURE", observer="maxabs",
                                 dump_stats_path=stats), "cpu", "float32")
    done = fp8_inc.apply(toy, measure)
    assert done.patched == 2
    with torch.inference_mode():
        toy(calibration)
    files = done.finish()
    assert [Path(f).name for f in files] == ["measure_hooks_maxabs.json",
                                             "measure_hooks_maxabs.npz"]
    nodes = json.loads(Path(files[0]).read_text())["Nodes"]
    assert nodes["fc1"]["inputs"][0][0][0] == pytest.approx(float(calibration.abs().max()))

    fresh = _Toy().eval()
    fresh.load_state_dict(weights)
    quant = read_config(_write(tmp_path, mode="QUANTIZE", observer="maxabs",
                               scale_method="maxabs_arbitrary", dump_stats_path=stats),
                        "cpu", "float32")
    converted = fp8_inc.apply(fresh, quant).model
    assert fp8_inc.fp8_bytes(converted) == 16 * 32 + 32 * 8
    # fc1 by hand: weight and input each scaled so their maxabs lands on E4M3's 448
    # (with INC's backoffs, 0.5 for weights and 0.25 for inputs), rounded through float8.
    e4m3 = torch.finfo(torch.float8_e4m3fn).max
    x = torch.randn(5, 16) * 3
    w = weights["fc1.weight"]
    w_scale = float(w.abs().max()) / (e4m3 * 0.5)
    x_scale = float(calibration.abs().max()) / (e4m3 * 0.25)
    w_q = (w / w_scale).to(torch.float8_e4m3fn).float() * w_scale
    x_q = (x / x_scale).clamp(-e4m3, e4m3).to(torch.float8_e4m3fn).float() * x_scale
    with torch.inference_mode():
        torch.testing.assert_close(converted.fc1(x), x_q @ w_q.T, rtol=1e-5, atol=1e-5)
