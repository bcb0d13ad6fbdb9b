"""switchyard.engine.loading: dtype choice, clear start errors, ModelInfo."""

from __future__ import annotations

import json

import pytest
import torch

from switchyard.engine.loading import cpu_flags, load_causal_lm, resolve_dtype
from switchyard_spec import EngineStartError


def test_auto_dtype_follows_cpu_flags():
    assert resolve_dtype("auto", frozenset({"avx512f", "avx512_bf16"})) is torch.bfloat16
    assert resolve_dtype("auto", frozenset({"amx_bf16"})) is torch.bfloat16
    assert resolve_dtype("auto", frozenset({"avx2"})) is torch.float32
    expected = torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & cpu_flags() else torch.float32
    assert resolve_dtype("auto") is expected


def test_explicit_dtypes():
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("float16") is torch.float16
    with pytest.raises(EngineStartError, match="unknown dtype"):
        resolve_dtype("int3")


def test_missing_folder(tmp_path):
    with pytest.raises(EngineStartError, match="does not exist"):
        load_causal_lm(tmp_path / "absent")


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(EngineStartError, match="config.json"):
        load_causal_lm(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(EngineStartError, match="safetensors"):
        load_causal_lm(tmp_path)


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(EngineStartError, match="no-such-arch"):
        load_causal_lm(tmp_path)


def test_architecture_that_is_not_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(EngineStartError, match="not a causal language model"):
        load_causal_lm(tmp_path)


def test_an_encoder_decoder_is_named_as_one(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5",
                                                      "architectures": ["T5ForConditionalGeneration"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(EngineStartError, match="T5ForConditionalGeneration.*encoder-decoder"):
        load_causal_lm(tmp_path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loads_the_default_model(default_model_path, dtype):
    loaded = load_causal_lm(default_model_path, dtype=dtype)
    info = loaded.info
    assert info.model_type == "llama" and info.dtype == dtype and info.device == "cpu"
    assert info.vocab_size == 2048 and info.max_position_embeddings == 4096
    assert info.eos_token_ids == (2,)
    assert next(loaded.model.parameters()).dtype == getattr(torch, dtype)
    assert not loaded.model.training
