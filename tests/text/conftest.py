"""Real tokenizers for the text package's tests, trained locally in milliseconds.

`chatml_dir` is a byte-level BPE (GPT-2 / Qwen style) with ChatML special
tokens and template; its vocabulary is small enough that emoji and most CJK
characters are split across several tokens. `metaspace` is a
SentencePiece-style (Llama-2 style) tokenizer whose decoder strips the leading
space of the first token, the case where incremental decoding needs context.
`byte_fallback` is a Llama-2 style tokenizer with <0xNN> byte tokens, whose
decoder rewrites invalid byte runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from switchyard.text import TextTokenizer, load_tokenizer

from tests.support.chatml_tokens import ENDOFTEXT, IM_END, SPECIAL_TOKENS

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog. Hello there, hello again.\n",
    "def add(x, y):\n    return x + y\n\nprint(add(1, 2))\n",
    "你好，世界。我们今天学习中文。日本語のテキストです。\n",
    "naïve café, crème brûlée, Ελληνικά, русский текст.\n",
    "Emoji: 😀 🎉 👍🏽 🚀 and more 😀😀.\n",
] * 10

# Text the tests decode: multi-byte characters of 2, 3 and 4 bytes, a
# skin-tone modifier sequence, and a special token in the middle.
MIXED_TEXT = "Hello 世界! café 😀🎉 naïve 👍🏽 <|im_end|> 日本語 done"


def _train_byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _write_json(path: Path, payload: object) -> None:
    path.write_text(json.dumps(payload, ensure_ascii=False, indent=1), encoding="utf-8")


def _build_chatml(
    out: Path,
    *,
    template_in: str = "jinja",
    template: str = CHATML_TEMPLATE,
    config_eos: int | list[int] | None = IM_END,
    generation_eos: int | list[int] | None = [IM_END, ENDOFTEXT],  # noqa: B006 - read only
) -> Path:
    """Save a ChatML tokenizer folder as transformers does, template where asked.

    template_in: "jinja" (chat_template.jinja, what save_pretrained writes),
    "config" (tokenizer_config.json), "legacy_json" (chat_template.json), or
    "none".
    """
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_train_byte_level(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.save_pretrained(out)
    for leftover in ("chat_template.jinja", "chat_template.json"):
        (out / leftover).unlink(missing_ok=True)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    if template_in == "jinja":
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    elif template_in == "config":
        config["chat_template"] = template
    elif template_in == "legacy_json":
        _write_json(out / "chat_template.json", {"chat_template": template})
    elif template_in != "none":
        raise ValueError(template_in)
    _write_json(config_path, config)
    if config_eos is not None:
        _write_json(out / "config.json", {"model_type": "llama", "eos_token_id": config_eos})
    if generation_eos is not None:
        _write_json(out / "generation_config.json", {"eos_token_id": generation_eos})
    return out


@pytest.fixture(scope="session")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE ChatML tokenizer folder, template in chat_template.jinja."""
    return _build_chatml(tmp_path_factory.mktemp("chatml"))


@pytest.fixture(scope="session")
def chatml(chatml_dir: Path) -> TextTokenizer:
    """The ChatML tokenizer, loaded."""
    return load_tokenizer(chatml_dir)


@pytest.fixture
def make_chatml(tmp_path: Path) -> Callable[..., Path]:
    """Build a ChatML folder variant: `make_chatml(template_in=..., template=..., ...)`."""
    counter = iter(range(1000))

    def build(**options: object) -> Path:
        folder = tmp_path / f"variant{next(counter)}"
        return _build_chatml(folder, **options)  # type: ignore[arg-type]

    return build


@pytest.fixture(scope="session")
def metaspace(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    """A SentencePiece-style BPE (▁ for spaces, leading space stripped on decode)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    out = tmp_path_factory.mktemp("metaspace")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(out)
    return load_tokenizer(out)


@pytest.fixture(scope="session")
def mixed_text() -> str:
    """Text with 2-, 3- and 4-byte characters, a modifier sequence and a special token."""
    return MIXED_TEXT


@pytest.fixture(scope="session")
def corpus_lines() -> list[str]:
    """The distinct lines the tokenizers were trained on."""
    return list(dict.fromkeys(CORPUS))


@pytest.fixture(scope="session")
def byte_fallback(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    """A SentencePiece-style BPE with byte fallback: unknown characters become <0xNN> tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    for piece in ("▁", "a", "b", "▁a", "ab", "é", "你"):
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("a", "b")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    out = tmp_path_factory.mktemp("byte_fallback")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(out)
    return load_tokenizer(out)
