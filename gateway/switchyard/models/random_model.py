"""The random-weight model: small, built locally and deterministically, no network.

`switchyard/tiny-llama-random` is a tiny Llama-architecture model the gateway
builds itself: a byte-level BPE tokenizer trained with `tokenizers` on Python's
own standard library sources, random weights from a fixed seed saved as
safetensors, and a ChatML chat template. It is loaded through exactly the same
code path as a real model folder. Its text is meaningless; its shapes and
behaviour are real, and it loads and runs in a fraction of a second, which is
what the test suite and the gateway benchmarks serve it for
(`--model-id switchyard/tiny-llama-random`). The default model is a trained
one (`switchyard.models.default_model`).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import sysconfig
from pathlib import Path

from switchyard.models.cache import cache_root, prepare_folder

log = logging.getLogger("switchyard.models")

RANDOM_MODEL_NAME = "switchyard/tiny-llama-random"
# Bump when anything below changes what gets built, so old caches are rebuilt.
BUILD_VERSION = "1"
SEED = 1234

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VOCAB_SIZE = 2048
# Larger than transformers' 0.02 so the logits of a random model have clear
# margins: greedy decoding then does not flip on rounding noise between batch shapes.
INIT_RANGE = 0.1
MODEL_SHAPE = dict(
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# A little non-ASCII text so the tokenizer learns a few multi-byte merges.
_EXTRA_TEXT = "naïve café — 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский текст.\n" * 50


def ensure_random_model(cache_dir: Path | None = None) -> Path:
    """Return the folder of the random-weight model, building it first if it is missing.

    Built atomically into ``cache_dir`` (default: the model cache,
    :func:`switchyard.models.cache.cache_root`), see :func:`prepare_folder`.
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / f"tiny-llama-v{BUILD_VERSION}"
    if target.is_dir():
        return target
    log.info("building %s into %s (first use only)", RANDOM_MODEL_NAME, target)
    return prepare_folder(target, _build, what=RANDOM_MODEL_NAME)


def _corpus(max_chars: int = 2_000_000) -> list[str]:
    """Sorted standard-library sources: present on every Python install, no download."""
    stdlib = sysconfig.get_paths()["stdlib"]
    texts, total = [_EXTRA_TEXT], len(_EXTRA_TEXT)
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def _build_tokenizer(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    # A small corpus may learn fewer merges than asked; pad so the size is exact.
    missing = VOCAB_SIZE - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # Older tools read the template from tokenizer_config.json only.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}


def _build(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = _build_tokenizer(out)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        initializer_range=INIT_RANGE,
        **MODEL_SHAPE,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out, safe_serialization=True)
