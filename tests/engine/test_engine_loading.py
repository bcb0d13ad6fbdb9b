"""switchyard_engine.loading: dtype choice, clear start errors, ModelInfo, and no model
served with weights its checkpoint does not have."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from switchyard_engine.loading import cpu_flags, load_causal_lm, resolve_dtype
from switchyard_spec import EngineStartError
from tests.support.bad_checkpoints import BAD_CHECKPOINTS, EXPECTED, build_bad_checkpoint


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


@pytest.mark.parametrize("kind", BAD_CHECKPOINTS)
def test_a_checkpoint_that_would_serve_invented_weights_is_refused(kind, default_model_path,
                                                                   tmp_path):
    folder = build_bad_checkpoint(kind, default_model_path, tmp_path / kind)
    with pytest.raises(EngineStartError) as refused:
        load_causal_lm(folder, dtype="float32")
    message = str(refused.value)
    assert EXPECTED[kind] in message
    if kind == "bert":  # what an encoder is for, and what it lacks as a generator
        assert "it is for embeddings and search, classification, or filling in masked " \
               "words, and it does not generate text" in message
        assert "Loaded as one (BertLMHeadModel), it would have 6 weights the checkpoint " \
               "does not have" in message and "cls.predictions.decoder.bias" in message
        assert "2 weights in the checkpoint that the model does not use: pooler.dense.bias, " \
               "pooler.dense.weight" in message
    if kind == "truncated":
        whole = (default_model_path / "model.safetensors").stat().st_size
        assert f"is cut short or damaged: it has {whole // 2} bytes, its header describes " \
               f"{whole} ({whole - whole // 2} missing" in message


def test_an_encoder_with_every_weight_is_still_no_generator(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32)
    BertForMaskedLM(config).save_pretrained(tmp_path)
    with pytest.raises(EngineStartError, match=r"holds an encoder model \(bert: BertForMaskedLM\)"
                                               r".*does not generate text"):
        load_causal_lm(tmp_path)


def test_a_shard_the_index_names_must_be_there(default_model_path, tmp_path):
    folder = tmp_path / "sharded"
    shutil.copytree(default_model_path, folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "lm_head.weight": "model.safetensors", "model.norm.weight": "model-00002.safetensors"}}))
    with pytest.raises(EngineStartError, match="names weight files that are not there: "
                                               "model-00002.safetensors"):
        load_causal_lm(folder)
