"""Tiny random-weight transformers models the engine tests build in memory and save as folders.

- :data:`DECODER_FAMILIES`: the families the hand-written Llama-family decoder
  claims (Llama, Mistral with a short sliding window, Qwen2 with biased
  projections and sliding layers, Phi-3 with partial rotary), head_dim 64.
- :func:`tiny_llama`: a 2-layer Llama of 97 tokens, in a given dtype.
- :func:`fallback_family`: the families that take the paged path through
  transformers' attention interface or the fallback runner (Bloom, MPT,
  StableLM, Gemma 2, Falcon, GPT-NeoX, GPT-J, OPT, GPT-BigCode), 2 layers, hidden 64.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
             initializer_range=0.1)
"""head_dim 64: the size the native prefill kernel is built for, so the parity tests cover it
(and the decode kernel's vector path) on AVX-512 machines."""


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**SMALL))


def mistral() -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(sliding_window=8, **SMALL))


def qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # Window on the first layer only (max_window_layers=1); q/k/v carry biases.
    config = Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **SMALL)
    model = Qwen2ForCausalLM(config)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    return model


def phi3() -> torch.nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(partial_rotary_factor=0.5, pad_token_id=0, **SMALL)
    return Phi3ForCausalLM(config)


DECODER_FAMILIES: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": llama, "mistral": mistral, "qwen2": qwen2, "phi3": phi3,
}


def tiny_llama(dtype: torch.dtype, bias: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         attention_bias=bias, mlp_bias=bias)
    return LlamaForCausalLM(config).to(dtype).eval()


IDS = dict(vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2)
"""Larger weights than the default 0.02, so attention is far from uniform and a position or
cache error changes the tokens."""
LAYERS = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128)

MIXED_PROMPTS = [[(7 * i + s) % 500 + 3 for i in range(n)] for n, s in ((21, 1), (6, 2), (33, 3))]
"""Three prompts of 21, 6 and 33 tokens in the 512-token vocabulary of :data:`IDS`: submitted
together they share steps, and the longer ones prefill in 16-token chunks."""


def fallback_family(name: str) -> torch.nn.Module:
    """A tiny random model of family ``name`` (see the module's docstring)."""
    import transformers as T

    if name == "bloom":
        return T.BloomForCausalLM(T.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **IDS))
    if name == "mpt":
        return T.MptForCausalLM(T.MptConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
                                            expansion_ratio=2, **IDS))
    if name == "stablelm":
        return T.StableLmForCausalLM(T.StableLmConfig(intermediate_size=128,
                                                      num_key_value_heads=2, **LAYERS, **IDS))
    if name == "gemma2":  # soft-capped logits, and a window shorter than the long prompts
        return T.Gemma2ForCausalLM(T.Gemma2Config(intermediate_size=128, num_key_value_heads=2,
                                                  head_dim=16, sliding_window=8, **LAYERS, **IDS))
    if name == "falcon":
        return T.FalconForCausalLM(T.FalconConfig(**LAYERS, **IDS))
    if name == "gpt_neox":
        return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(intermediate_size=128, **LAYERS, **IDS))
    if name == "gptj":
        return T.GPTJForCausalLM(T.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                              n_positions=128, **IDS))
    if name == "opt":
        return T.OPTForCausalLM(T.OPTConfig(ffn_dim=128, word_embed_proj_dim=64, **LAYERS, **IDS))
    if name == "gpt_bigcode":
        return T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=4,
                                                          n_positions=128, **IDS))
    raise KeyError(name)


def saved_fallback_family(name: str, folder: Path) -> torch.nn.Module:
    """:func:`fallback_family` ``name`` (seed 0), saved as a model folder at ``folder``."""
    torch.manual_seed(0)
    model = fallback_family(name).eval()
    model.save_pretrained(folder)
    return model
