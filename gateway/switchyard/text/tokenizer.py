"""Load a model's tokenizer from a local folder and wrap it in a small typed API.

Encoding and decoding go straight to the Rust `tokenizers.Tokenizer` (as TGI's
router does): it is what `DecodeStream` needs, and it skips transformers'
Python-side clean-ups (`clean_up_tokenization_spaces`), so whole-sequence
decoding and incremental decoding agree. The transformers tokenizer is kept for
what only it knows: the chat template and the special-token names.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import msgspec
from tokenizers import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


_T = TypeVar("_T")


class TokenizerLoadError(RuntimeError):
    """The folder holds no tokenizer that can be loaded as a fast (Rust) tokenizer."""


class TokenSpan(msgspec.Struct, frozen=True):
    """One token of an encoded text, as TGI's `/tokenize` route returns it.

    `start` and `stop` are UTF-8 byte offsets into the input, as the Rust
    tokenizer reports them; `text` is the input between them (tokens that carry
    only part of a multi-byte character span the whole character). Tokens the
    post-processor adds (BOS and the like) have `start == stop == 0` and no text.
    """

    id: int
    text: str
    start: int
    stop: int


class _EosField(msgspec.Struct):
    eos_token_id: int | list[int] | None = None


class _ModelConfig(msgspec.Struct):
    eos_token_id: int | list[int] | None = None
    # Multimodal configs keep the language model's ids here.
    text_config: _EosField | None = None


class _LegacyChatTemplate(msgspec.Struct):
    chat_template: str | None = None


class TextTokenizer:
    """A model's tokenizer: encode, decode, special tokens, EOS ids and chat template.

    Build one with `load_tokenizer`. Thread-safe for reads; the underlying Rust
    tokenizer is shared by every `IncrementalDetokenizer` of the model.
    """

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int]) -> None:
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise TokenizerLoadError(
                f"{type(hf_tokenizer).__name__} is not backed by a Rust `tokenizers.Tokenizer`"
            )
        self._hf = hf_tokenizer
        self._backend = backend
        self._eos_token_ids = tuple(eos_token_ids)
        # The backend's own notion of "special" is the one DecodeStream and
        # decode(skip_special_tokens=True) use, so is_special must agree with it.
        self._special_ids = frozenset(
            token_id
            for token_id, token in backend.get_added_tokens_decoder().items()
            if token.special
        )

    @property
    def backend(self) -> Tokenizer:
        """The Rust tokenizer (what `tokenizers.decoders.DecodeStream.step` takes)."""
        return self._backend

    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer (chat template, special-token names)."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: generation_config.json, config.json, then the tokenizer's."""
        return self._eos_token_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the tokenizer's special added tokens."""
        return self._special_ids

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return bool(self._hf.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` runs the post-processor (BOS, ...)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str, add_special_tokens: bool = True) -> list[TokenSpan]:
        """Tokens of `text` with their byte offsets and text, for TGI's `/tokenize`."""
        encoding = self._backend.encode(text, add_special_tokens=add_special_tokens)
        # The Python binding reports character offsets; TGI (Rust) reports
        # bytes. byte_at[i] is the byte offset of character i.
        byte_at = [0] * (len(text) + 1)
        total = 0
        for index, char in enumerate(text):
            byte_at[index] = total
            total += len(char.encode("utf-8"))
        byte_at[len(text)] = total
        raw = text.encode("utf-8")
        spans: list[TokenSpan] = []
        for token_id, (char_start, char_stop) in zip(encoding.ids, encoding.offsets, strict=True):
            start, stop = byte_at[char_start], byte_at[char_stop]
            piece = raw[start:stop].decode("utf-8", errors="replace")
            spans.append(TokenSpan(id=token_id, text=piece, start=start, stop=stop))
        return spans

    def encode_with_char_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` and each token's (start, stop) *character* offsets in it.

        The ids are those of `encode`. Tokens that carry part of a multi-byte
        character span the whole character; tokens the post-processor adds
        span nothing (`start == stop`).
        """
        encoding = self._backend.encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids, [(int(a), int(b)) for a, b in encoding.offsets]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; incomplete UTF-8 at the edges becomes U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text as TGI shows it for prefill and top-n tokens.

        That is the token decoded alone with special tokens kept, so a special
        token shows its content and a lone byte of a multi-byte character shows
        U+FFFD. (A generated token's text in a stream is the incremental
        detokenizer's delta instead.)
        """
        return self._backend.decode([token_id], skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special token (skipped by `skip_special_tokens`)."""
        return token_id in self._special_ids


def load_tokenizer(model_path: str | Path) -> TextTokenizer:
    """Load the tokenizer of the model in local folder `model_path`, offline.

    Chat templates are read as transformers reads them (`chat_template.jinja`,
    `additional_chat_templates/`, or `tokenizer_config.json`), plus the legacy
    processor file `chat_template.json` when the tokenizer has none.
    Raises `TokenizerLoadError` when no fast tokenizer can be built.
    """
    path = Path(model_path)
    if not path.is_dir():
        raise TokenizerLoadError(f"model folder not found: {path}")
    hf = _load_hf_tokenizer(path)
    if not hf.chat_template:
        legacy = _read_json(path / "chat_template.json", _LegacyChatTemplate)
        if legacy is not None and legacy.chat_template:
            hf.chat_template = legacy.chat_template
    return TextTokenizer(hf, _eos_token_ids(path, hf))


def _load_hf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    # transformers (and through it torch) loads here, not when the gateway's
    # request validation imports the text package.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        # trust_remote_code=False said outright: left unset, transformers asks
        # on stdin (and waits) when the folder ships custom tokenizer code.
        return AutoTokenizer.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=False
        )
    except Exception as auto_error:  # noqa: BLE001 - any failure gets one fallback
        # The folder may want custom tokenizer code (auto_map), which we never
        # run; its tokenizer.json alone still describes the tokenizer fully.
        if not (path / "tokenizer.json").is_file():
            raise TokenizerLoadError(
                f"cannot load a tokenizer from {path}: {auto_error}"
            ) from auto_error
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        except Exception as fast_error:  # noqa: BLE001
            raise TokenizerLoadError(
                f"cannot load a tokenizer from {path}: {fast_error}"
            ) from fast_error


def _eos_token_ids(path: Path, hf: PreTrainedTokenizerBase) -> list[int]:
    # The generation config is what generate() stops on; config.json and the
    # tokenizer are fallbacks that often name only one of several EOS tokens.
    found: list[int] = []
    generation = _read_json(path / "generation_config.json", _EosField)
    if generation is not None:
        found += _as_ids(generation.eos_token_id)
    config = _read_json(path / "config.json", _ModelConfig)
    if config is not None:
        found += _as_ids(config.eos_token_id)
        if config.text_config is not None:
            found += _as_ids(config.text_config.eos_token_id)
    tokenizer_eos = hf.eos_token_id
    if isinstance(tokenizer_eos, int):
        found.append(tokenizer_eos)
    return list(dict.fromkeys(found))


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return list(value)


def _read_json(file: Path, kind: type[_T]) -> _T | None:
    """Decode `file` into `kind`, or None when it is missing or does not fit."""
    if not file.is_file():
        return None
    try:
        return msgspec.json.decode(file.read_bytes(), type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError):
        # A config we cannot read must not stop the model from loading; the
        # other EOS sources still apply.
        return None
