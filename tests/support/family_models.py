"""Tiny random models of every decoder-only family in issue 25's list, with the default
model's tokenizer.

Each family is a real transformers model folder: 2 layers, hidden 64, random
weights from a fixed seed with ``initializer_range=0.2`` (far from uniform
attention, so a position or cache error changes the tokens, as in
``tests/xeon/test_xeon_fallback.py``), saved as safetensors, plus the default
model's byte-level BPE tokenizer files and ChatML template. Vocabulary size,
EOS and padding ids match that tokenizer (2,048 ids, ``<|im_end|>``,
``<|endoftext|>``; no BOS), so text prompts and chat messages work as with the
default model. Built once into the test cache, atomically.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

BUILD_VERSION = "2"
SEED = 0
VOCAB = 2048
EOS_ID = 2  # <|im_end|>
PAD_ID = 0  # <|endoftext|>
MAX_POSITIONS = 256

IDS = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
           initializer_range=0.2)
LAYERS = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=MAX_POSITIONS)
GQA = dict(LAYERS, num_key_value_heads=2)
UNTIED = {"gemma", "gemma2", "bloom", "opt"}
"""Families whose tied embeddings make greedy output one token over and over (the last
token's own embedding dominates the logits): their heads get weights of their own."""

FAMILIES = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "phi", "phi3", "gemma",
    "gemma2", "gpt2", "gpt_bigcode", "gptj", "codegen", "gpt_neox", "falcon", "opt", "bloom",
    "mpt", "stablelm", "starcoder2", "olmo2", "granite",
)

_WEIGHTS_AND_CONFIG = {"model.safetensors", "config.json", "generation_config.json"}


def build_model(name: str):  # -> transformers.PreTrainedModel
    """A fresh random model of family ``name`` (seed it first)."""
    import transformers as T

    builders = {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(intermediate_size=96, **GQA, **IDS)),
        # A window shorter than the longest prompt.
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(
            intermediate_size=96, sliding_window=16, **GQA, **IDS)),
        "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(
            intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, **GQA, **IDS)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(intermediate_size=96, **GQA, **IDS)),
        "qwen2_moe": lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            moe_intermediate_size=48, intermediate_size=96, shared_expert_intermediate_size=96,
            num_experts=4, num_experts_per_tok=2, **GQA, **IDS)),
        "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(
            intermediate_size=96, head_dim=16, **GQA, **IDS)),
        "phi": lambda: T.PhiForCausalLM(T.PhiConfig(
            intermediate_size=128, partial_rotary_factor=0.5, **LAYERS, **IDS)),
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(
            intermediate_size=96, partial_rotary_factor=0.5, **GQA, **IDS)),
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(
            intermediate_size=96, head_dim=16, **GQA, **IDS)),
        # Soft-capped logits, and a window shorter than the long prompts.
        "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(
            intermediate_size=128, head_dim=16, sliding_window=8, **GQA, **IDS)),
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=MAX_POSITIONS, **IDS)),
        "gpt_bigcode": lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(
            n_embd=64, n_layer=2, n_head=4, n_positions=MAX_POSITIONS, **IDS)),
        "gptj": lambda: T.GPTJForCausalLM(T.GPTJConfig(
            n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=MAX_POSITIONS, **IDS)),
        "codegen": lambda: T.CodeGenForCausalLM(T.CodeGenConfig(
            n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=MAX_POSITIONS,
            n_ctx=MAX_POSITIONS, **IDS)),
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            intermediate_size=128, **LAYERS, **IDS)),
        "falcon": lambda: T.FalconForCausalLM(T.FalconConfig(**LAYERS, **IDS)),
        "opt": lambda: T.OPTForCausalLM(T.OPTConfig(
            ffn_dim=128, word_embed_proj_dim=64, **LAYERS, **IDS)),
        "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(
            hidden_size=64, n_layer=2, n_head=4, **IDS)),
        "mpt": lambda: T.MptForCausalLM(T.MptConfig(
            d_model=64, n_heads=4, n_layers=2, max_seq_len=MAX_POSITIONS, expansion_ratio=2,
            **IDS)),
        "stablelm": lambda: T.StableLmForCausalLM(T.StableLmConfig(
            intermediate_size=128, **GQA, **IDS)),
        "starcoder2": lambda: T.Starcoder2ForCausalLM(T.Starcoder2Config(
            intermediate_size=128, **GQA, **IDS)),
        "olmo2": lambda: T.Olmo2ForCausalLM(T.Olmo2Config(intermediate_size=96, **GQA, **IDS)),
        # Granite's multipliers away from 1, so each one matters.
        "granite": lambda: T.GraniteForCausalLM(T.GraniteConfig(
            intermediate_size=96, embedding_multiplier=2.0, residual_multiplier=0.5,
            attention_multiplier=0.2, logits_scaling=2.0, **GQA, **IDS)),
    }
    model = builders[name]()
    if name in UNTIED:  # a config of the same shape, its lm_head untied
        config = model.config
        config.tie_word_embeddings = False
        model = type(model)(config)
    return model


def _build(name: str, default_model: Path, out: Path) -> None:
    import torch

    for item in default_model.iterdir():
        if item.is_file() and item.name not in _WEIGHTS_AND_CONFIG:
            shutil.copy2(item, out / item.name)
    torch.manual_seed(SEED)
    model = build_model(name).to(torch.float32).eval()
    assert model.config.vocab_size == VOCAB, (name, model.config.vocab_size)
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = EOS_ID, PAD_ID, None
    model.save_pretrained(out, safe_serialization=True)


def ensure_family(name: str, default_model: Path, cache: Path) -> Path:
    """The folder of family ``name``'s tiny model, built on first use."""
    target = cache / f"family-{name}-v{BUILD_VERSION}"
    if (target / "config.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{name}-", dir=cache))
    try:
        _build(name, default_model, tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process built it at the same time: keep theirs.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
