"""Reading PEFT adapter folders: matrices and scaling as PEFT has them, and every refusal.

The reference is PEFT itself: the loaded ``PeftModel``'s LoRA layers hold
each module's ``lora_A``/``lora_B`` weights and its ``scaling`` (alpha/r,
alpha/sqrt(r) with rsLoRA, after ``rank_pattern``/``alpha_pattern``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from switchyard_engine.lora.folder import read_adapter
from switchyard_engine.lora.layouts import llama_family
from switchyard_spec import AdapterError
from transformers import AutoConfig

from tests.support.lora_adapters import ADAPTERS, PeftReference, edit_config


@pytest.fixture(scope="module")
def shapes(default_model_path: Path) -> dict[str, tuple[int, int]]:
    return llama_family(AutoConfig.from_pretrained(default_model_path)).shapes


@pytest.fixture
def copy(tmp_path: Path, adapter_dirs: dict[str, Path]):
    def make(name: str = "attn-r4") -> Path:
        return Path(shutil.copytree(adapter_dirs[name], tmp_path / name))
    return make


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_matrices_and_scaling_are_peft_own(name: str, adapter_dirs: dict[str, Path],
                                           shapes: dict[str, tuple[int, int]],
                                           peft_reference: PeftReference) -> None:
    adapter = read_adapter(name, adapter_dirs[name], shapes, max_rank=64)
    from peft.tuners.lora import LoraLayer

    seen = set()
    for path, layer in peft_reference.model.named_modules():
        if not isinstance(layer, LoraLayer) or name not in layer.lora_A:
            continue
        module = path.removeprefix("base_model.model.")
        seen.add(module)
        ours = adapter.modules[module]
        assert torch.equal(ours.a, layer.lora_A[name].weight)
        assert torch.equal(ours.b, layer.lora_B[name].weight)
        assert ours.scaling == pytest.approx(layer.scaling[name], rel=1e-12)
    assert seen == set(adapter.modules)


def test_regex_targets_rank_and_alpha_patterns(adapter_dirs: dict[str, Path],
                                               shapes: dict[str, tuple[int, int]]) -> None:
    adapter = read_adapter("m", adapter_dirs["mlp-regex"], shapes)
    assert {m.rsplit(".", 1)[-1] for m in adapter.modules} == {"gate_proj", "down_proj"}
    down = adapter.modules["model.layers.0.mlp.down_proj"]
    gate = adapter.modules["model.layers.0.mlp.gate_proj"]
    assert (down.rank, gate.rank) == (6, 2)
    assert down.scaling == pytest.approx(4 / 6 ** 0.5)  # rsLoRA: alpha / sqrt(r)
    assert gate.scaling == pytest.approx(3.0 / 2 ** 0.5)  # alpha_pattern


def test_fan_in_fan_out_reads_the_same_matrices(copy, shapes) -> None:
    folder = copy()
    plain = read_adapter("a", folder, shapes)
    edit_config(folder, fan_in_fan_out=True)
    flipped = read_adapter("a", folder, shapes)
    for module, m in plain.modules.items():
        assert torch.equal(m.a, flipped.modules[module].a)


@pytest.mark.parametrize(("change", "reason"), [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"lora_bias": True}, "bias"),
    ({"peft_type": "IA3"}, "not LoRA"),
    ({"target_modules": ["q_proj", "lm_head"]}, "'lm_head' cannot be adapted"),
    ({"r": 0}, "not positive"),
])
def test_refused_configs_name_the_reason(copy, shapes, change: dict, reason: str) -> None:
    folder = copy()
    edit_config(folder, **change)
    with pytest.raises(AdapterError, match=reason) as info:
        read_adapter("bad", folder, shapes)
    assert "'bad'" in str(info.value)


def test_rank_over_the_limit_is_refused(adapter_dirs, shapes) -> None:
    with pytest.raises(AdapterError, match="rank 16 is greater than max_lora_rank 8"):
        read_adapter("big", adapter_dirs["kv-o-r16"], shapes, max_rank=8)
    with pytest.raises(AdapterError, match="rank 6 is greater than max_lora_rank 4"):
        read_adapter("pat", adapter_dirs["mlp-regex"], shapes, max_rank=4)  # via rank_pattern


def test_corrupt_folders(copy, shapes, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="is not a folder"):
        read_adapter("x", tmp_path / "nowhere", shapes)
    folder = copy()
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(AdapterError, match="corrupt"):
        read_adapter("x", folder, shapes)
    weights.unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        read_adapter("x", folder, shapes)
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not readable JSON"):
        read_adapter("x", folder, shapes)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter("x", folder, shapes)


def test_missing_half_wrong_shape_and_foreign_module(copy, shapes) -> None:
    from safetensors.torch import load_file, save_file

    folder = copy()
    path = folder / "adapter_model.safetensors"
    weights = load_file(path)
    key_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    for edit, reason in [
        (lambda w: w.pop(key_b), "has no lora_B"),
        (lambda w: w.__setitem__(key_b, torch.zeros(7, 4)), "do not fit"),
        (lambda w: w.__setitem__("base_model.model.lm_head.lora_A.weight", torch.zeros(4, 128)),
         "lm_head cannot be adapted"),
        (lambda w: w.__setitem__(
            "base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(4, 9)),
         "not a LoRA A/B matrix"),
        (lambda w: w.__setitem__(key_b, torch.full_like(w[key_b], float("nan"))), "not finite"),
    ]:
        changed = dict(weights)
        edit(changed)
        save_file(changed, path)
        with pytest.raises(AdapterError, match=reason):
            read_adapter("x", folder, shapes)
