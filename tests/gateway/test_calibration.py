"""The engine toolkit's calibration (``switchyard_engine.calibration``): statistics, cache, errors."""

from __future__ import annotations

import pytest
import torch

from switchyard_engine import calibration
from switchyard_spec import Calibration, EngineStartError


class _Toy(torch.nn.Module):
    """Embedding, two linears and a ReLU, called as transformers models are (``input_ids=``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 8)
        self.fc1 = torch.nn.Linear(8, 12)
        self.fc2 = torch.nn.Linear(12, 4)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.embed(input_ids))))


def test_statistics_are_each_inputs_absmax_and_deterministic():
    toy = _Toy()
    prompts = [[1, 2, 3], [4, 5], [49, 0, 7, 7]]
    stats = calibration.collect_statistics(toy, prompts)
    assert set(stats) == {"fc1", "fc2"}
    with torch.no_grad():  # per prompt, shaped as the forward passes ran: [1, tokens]
        xs = [toy.embed(torch.tensor([p])) for p in prompts]
        x = torch.cat([e[0] for e in xs])
        h = torch.cat([torch.relu(toy.fc1(e))[0] for e in xs])
    assert torch.equal(stats["fc1"].absmax, x.abs().amax(0))
    assert torch.equal(stats["fc2"].absmax, h.abs().amax(0))
    assert stats["fc1"].tokens == stats["fc2"].tokens == 9
    again = calibration.collect_statistics(toy, prompts)
    assert all(torch.equal(again[n].absmax, stats[n].absmax) for n in stats)
    assert not toy.fc1._forward_pre_hooks  # the hooks are gone


def test_calibrate_caches_by_model_and_texts(default_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    calls = []

    def prompts(options):
        calls.append(options)
        return ("def f(x):\n    return x + 1\n", "import os\nprint(os.sep)\n")

    spec = Calibration(prompts=prompts, quantize=lambda w, s, o: None, max_tokens=8)
    options = {"calibration_cache": str(tmp_path)}
    first, line = calibration.calibrate(model, str(default_model_path), spec, options, "sq")
    assert line.startswith("calibrated on 2 prompts") and len(list(tmp_path.iterdir())) == 1
    second, line = calibration.calibrate(model, str(default_model_path), spec, options, "sq")
    assert line.startswith("calibration statistics from")
    assert set(first) == set(second) and all(
        torch.equal(first[n].absmax, second[n].absmax) and first[n].tokens == second[n].tokens
        for n in first)
    assert first["lm_head"].tokens <= 16  # two prompts of at most 8 tokens
    # Other texts or another token limit: another cache entry.
    other = Calibration(prompts=lambda o: ("x = 1\n",), quantize=spec.quantize, max_tokens=8)
    calibration.calibrate(model, str(default_model_path), other, options)
    assert len(list(tmp_path.iterdir())) == 2


def test_a_bad_prompt_file_or_cache_stops_start_up(default_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()

    def bad(options):
        raise ValueError("calibration file /x.jsonl: line 3 is not JSON (oops)")

    spec = Calibration(prompts=bad, quantize=lambda w, s, o: None)
    with pytest.raises(EngineStartError, match="--quantize sq: calibration file /x.jsonl: line 3"):
        calibration.calibrate(model, str(default_model_path), spec, {}, "sq")
    good = Calibration(prompts=lambda o: ("hello world",), quantize=spec.quantize)
    options = {"calibration_cache": str(tmp_path)}
    calibration.calibrate(model, str(default_model_path), good, options)
    (cached,) = tmp_path.iterdir()
    cached.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(EngineStartError, match=f"calibration cache {cached} is corrupt"):
        calibration.calibrate(model, str(default_model_path), good, options)
