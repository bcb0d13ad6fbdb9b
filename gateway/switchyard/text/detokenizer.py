"""Turn one sequence's generated token ids into text, token by token.

The work is done by `tokenizers.decoders.DecodeStream`, which keeps the ids of
a character until its UTF-8 bytes are complete and decodes with context so
decoders that strip a leading space (SentencePiece's Metaspace) keep the space
between words.

DecodeStream raises "Invalid prefix" when decoding more ids rewrites text it
already returned; SentencePiece byte-fallback decoders do that when a model
emits an invalid byte run (the run turns into U+FFFD per byte). A generated
sequence must not fail over that, so the sequence then continues with the
prefix/read-offset scheme TGI's servers use, which compares lengths only.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from switchyard.text.tokenizer import TextTokenizer

# How many prompt ids seed the stream's context. TGI's servers decode with the
# last few prompt tokens as prefix for the same reason; more adds cost, not
# correctness, because only the boundary with the first generated token matters.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Incremental text of one generated sequence; create one per sequence.

    `step(id)` returns the text that token adds: "" while a multi-byte
    character is incomplete, so no delta ever holds a broken character.
    Give `prompt_ids` (the sequence's prompt) so the first generated token is
    decoded in context; without them a Metaspace tokenizer drops its leading
    space. The concatenated deltas plus `flush()` equal
    `tokenizer.decode(generated ids)` for byte-level tokenizers, and the text
    after the prompt in `tokenizer.decode(prompt + generated)` in general
    (except after an invalid byte run that a byte-fallback decoder rewrites:
    text already sent is never taken back). Not thread-safe: one sequence,
    one consumer.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        *,
        skip_special_tokens: bool = False,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        # DecodeStream's `ids` (a prefill) is new in tokenizers; pass it only when used.
        self._stream: DecodeStream | None = (
            DecodeStream(ids=self._context, skip_special_tokens=skip_special_tokens)
            if self._context
            else DecodeStream(skip_special_tokens=skip_special_tokens)
        )
        # Context then generated ids. Text is emitted up to _read; _prefix is
        # where the last emitted chunk began (the fallback decodes from there).
        self._all: list[int] = list(self._context)
        self._prefix = 0
        self._read = len(self._all)
        self._parts: list[str] = []
        self._text = ""
        self._joined = 0

    @property
    def token_ids(self) -> list[int]:
        """The generated ids fed so far (a copy)."""
        return self._all[len(self._context) :]

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenated deltas)."""
        if self._joined < len(self._parts):
            self._text = "".join(self._parts)
            self._joined = len(self._parts)
        return self._text

    def step(self, token_id: int) -> str:
        """Feed one generated id; return the new text ("" if none is complete yet)."""
        self._all.append(token_id)
        if self._stream is not None:
            try:
                # None means "not a whole character yet"; ids outside the
                # vocabulary (padded embedding rows) also decode to nothing.
                delta = self._stream.step(self._tokenizer.backend, token_id) or ""
            except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception
                self._stream = None
                delta = self._offset_step()
            else:
                if delta:
                    self._prefix, self._read = self._read, len(self._all)
        else:
            delta = self._offset_step()
        if delta:
            self._parts.append(delta)
        return delta

    def flush(self) -> str:
        """Text still held at the end of the sequence, and count it as emitted.

        That is the tail of an incomplete multi-byte character (decoded as
        U+FFFD, as `decode` would show it) when generation stopped inside one;
        usually "". Call it once the sequence has ended.
        """
        tokenizer = self._tokenizer
        skip = self._skip_special_tokens
        full = tokenizer.decode(self._all, skip_special_tokens=skip)
        prefix = tokenizer.decode(self._context, skip_special_tokens=skip) if self._context else ""
        emitted = self.text
        expected = full[len(prefix) :] if full.startswith(prefix) else full
        if not expected.startswith(emitted) or len(expected) == len(emitted):
            # Nothing pending, or a decoder that rewrote text already sent:
            # what was streamed stands.
            return ""
        rest = expected[len(emitted) :]
        self._parts.append(rest)
        self._prefix = self._read = len(self._all)
        return rest

    def _offset_step(self) -> str:
        # Decode from the start of the last emitted chunk, so the decoder sees
        # context, and emit what lies beyond the text already emitted.
        skip = self._skip_special_tokens
        decode = self._tokenizer.decode
        before = decode(self._all[self._prefix : self._read], skip_special_tokens=skip)
        after = decode(self._all[self._prefix :], skip_special_tokens=skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._all)
        return after[len(before) :]
