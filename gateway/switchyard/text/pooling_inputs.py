"""Inputs of embedding and rerank requests as token ids, within the model's limits.

The folder's own fast tokenizer (the `tokenizers` backend of its transformers
tokenizer, as sentence-transformers and CrossEncoder use it) encodes each text
without special tokens; an input over the limit is refused, or with `truncate`
cut from the side `truncation_direction` names (TEI's parameters); then the
tokenizer's post-processor adds the special tokens ([CLS] ... [SEP], a
decoder's EOS) and a pair's segment ids. Token ids a client sends are taken as
they are, after a check that each is in the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from switchyard.errors import validation_error


@dataclass(frozen=True)
class Encoded:
    """One input as the engine takes it."""

    ids: tuple[int, ...]
    type_ids: tuple[int, ...] = ()


class PoolingTokenizer:
    """A folder's tokenizer with TEI's truncation rules and the gateway's limits."""

    def __init__(self, folder: Path, max_input_tokens: int, vocab_size: int) -> None:
        from transformers import AutoTokenizer

        backend = AutoTokenizer.from_pretrained(folder).backend_tokenizer
        # The limits are ours to apply (and to refuse with): none inside the tokenizer.
        backend.no_truncation()
        backend.no_padding()
        self._tok = backend
        self.max_input_tokens = max_input_tokens
        self.vocab_size = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))

    def texts(self, texts: Sequence[str], truncate: bool = False,
              direction: str = "right", param: str = "input") -> list[Encoded]:
        """Each text with its special tokens; a 4xx naming `param` for an empty or long one."""
        specials = self._tok.num_special_tokens_to_add(False)
        out = []
        for i, text in enumerate(texts):
            if not text:
                raise validation_error(f"`{param}` cannot contain an empty string (item {i})",
                                       param=param)
            enc = self._tok.encode(text, add_special_tokens=False)
            self._fit(enc, None, specials, truncate, direction, param, i)
            done = self._tok.post_process(enc, None, add_special_tokens=True)
            out.append(Encoded(tuple(done.ids)))
        return out

    def pairs(self, query: str, texts: Sequence[str], truncate: bool = False,
              direction: str = "right", param: str = "texts") -> list[Encoded]:
        """(query, text) pairs for a cross-encoder, with their segment ids."""
        if not query:
            raise validation_error("`query` cannot be empty", param="query")
        specials = self._tok.num_special_tokens_to_add(True)
        out = []
        for i, text in enumerate(texts):
            if not text:
                raise validation_error(f"`{param}` cannot contain an empty string (item {i})",
                                       param=param)
            q = self._tok.encode(query, add_special_tokens=False)
            t = self._tok.encode(text, add_special_tokens=False)
            self._fit(t, q, specials, truncate, direction, param, i)
            done = self._tok.post_process(q, t, add_special_tokens=True)
            out.append(Encoded(tuple(done.ids), tuple(done.type_ids)))
        return out

    def token_ids(self, rows: Sequence[Sequence[int]], param: str = "input") -> list[Encoded]:
        """Token ids as sent: each row non-empty, within the limit, every id in the vocabulary."""
        out = []
        for i, row in enumerate(rows):
            if not row:
                raise validation_error(f"`{param}` cannot contain an empty list of token ids "
                                       f"(item {i})", param=param)
            if len(row) > self.max_input_tokens:
                raise validation_error(self._too_long(len(row), i), param=param)
            bad = next((t for t in row if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise validation_error(f"token id {bad} in item {i} is out of the vocabulary "
                                       f"(0..{self.vocab_size - 1})", param=param)
            out.append(Encoded(tuple(row)))
        return out

    def _fit(self, enc, pair, specials: int, truncate: bool,
             direction: str, param: str, index: int) -> None:
        """Refuse an input over the limit, or cut it (the text of a pair) to fit."""
        used = len(enc.ids) + (len(pair.ids) if pair is not None else 0) + specials
        if used <= self.max_input_tokens:
            return
        if not truncate:
            raise validation_error(self._too_long(used, index), param=param)
        keep = len(enc.ids) - (used - self.max_input_tokens)
        if keep < 1:
            raise validation_error(f"item {index}: the query alone exceeds the limit of "
                                   f"{self.max_input_tokens} tokens", param="query")
        enc.truncate(keep, direction=direction)

    def _too_long(self, tokens: int, index: int) -> str:
        return (f"item {index} has {tokens} tokens, over the model's limit of "
                f"{self.max_input_tokens}; shorten it or pass `truncate`")
