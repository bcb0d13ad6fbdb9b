"""Token texts and character offsets of an echoed prompt (OpenAI's legacy `echo` with `logprobs`).

An echoed prompt is shown as one text (the prompt string, or the decoded ids
of a token prompt) and, beside it, one entry per prompt token. Every entry's
text must be a piece of that text, so that a client can index it:

- ``"".join(tokens) == text``, and
- ``text[offsets[i]:].startswith(tokens[i])`` for every ``i``.

Byte-level tokenizers split multi-byte characters over several tokens, none of
which has a text of its own. Each token gets the text that decoding the prompt
up to it adds, as a streaming detokenizer (and `IncrementalDetokenizer`)
shows it: ``""`` while the decoded bytes end inside a character, then the
completed characters at once, at the offset where the first of them starts.
String and token prompts of the same tokens get the same texts. Tokens that
add no text (a BOS the tokenizer inserts) get ``""`` too.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from switchyard.text.detokenizer import IncrementalDetokenizer
from switchyard.text.tokenizer import TextTokenizer


class EchoedPrompt(msgspec.Struct, frozen=True):
    """The echoed text and, per prompt token, its text and character offset in it."""

    text: str
    tokens: tuple[str, ...]
    offsets: tuple[int, ...]


def echo_from_offsets(text: str, spans: Sequence[tuple[int, int]]) -> EchoedPrompt:
    """The echo of a prompt string, from its tokens' character spans (the tokenizer's offsets).

    A token whose span reaches into the next covering token's span ends inside
    a character (both carry part of it): its text is "". Any other token's
    text runs from where the previous text ended to its own end. The last
    token that covers text also takes whatever follows it, and text before
    the first one goes to that first one, so the texts add up to `text` even
    when the tokenizer's offsets skip characters (normalizers, trimmed spaces).
    """
    covering = [i for i, (start, stop) in enumerate(spans) if stop > start]
    # next_start[i]: where the next covering token after i starts.
    next_start = [len(text)] * len(spans)
    upcoming = len(text)
    for i in range(len(spans) - 1, -1, -1):
        next_start[i] = upcoming
        start, stop = spans[i]
        if stop > start:
            upcoming = start
    last = covering[-1] if covering else -1
    tokens: list[str] = []
    offsets: list[int] = []
    cursor = 0
    for i, (start, stop) in enumerate(spans):
        if stop <= start:
            cut = cursor
        elif i == last:
            cut = len(text)
        elif stop > next_start[i]:  # ends inside a character the next token completes
            cut = cursor
        else:
            cut = max(cursor, min(stop, len(text)))
        tokens.append(text[cursor:cut])
        offsets.append(cursor)
        cursor = cut
    if tokens and cursor < len(text):  # no token covers any text: the last one holds it
        tokens[-1] += text[cursor:]
    return EchoedPrompt(text=text, tokens=tuple(tokens), offsets=tuple(offsets))


def echo_from_ids(tokenizer: TextTokenizer, ids: Sequence[int]) -> EchoedPrompt:
    """The echo of a token prompt: `tokenizer.decode(ids)`, split by incremental decoding.

    Incremental decoding gives each token the text it completes ("" while a
    character is incomplete), special tokens included. Where it does not add
    up to `decode(ids)` (decoders that rewrite earlier text, e.g. an invalid
    byte run under byte fallback), each token gets what its prefix's decoding
    shares with the whole text beyond the previous token's, which always adds up.
    """
    text = tokenizer.decode(ids, skip_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    pieces = [detok.step(token_id) for token_id in ids]
    if pieces:
        pieces[-1] += detok.flush()
    joined = "".join(pieces)
    if joined != text:
        if pieces and text.startswith(joined):
            pieces[-1] += text[len(joined):]
        else:
            pieces = _split_by_prefixes(tokenizer, ids, text)
    offsets: list[int] = []
    cursor = 0
    for piece in pieces:
        offsets.append(cursor)
        cursor += len(piece)
    return EchoedPrompt(text=text, tokens=tuple(pieces), offsets=tuple(offsets))


def _split_by_prefixes(tokenizer: TextTokenizer, ids: Sequence[int], text: str) -> list[str]:
    """Token texts from decoding every prefix of `ids`: quadratic, for odd decoders only."""
    pieces: list[str] = []
    cursor = 0
    for end in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:end], skip_special_tokens=False)
        same = 0
        limit = min(len(prefix), len(text))
        while same < limit and prefix[same] == text[same]:
            same += 1
        cut = len(text) if end == len(ids) else max(cursor, same)
        pieces.append(text[cursor:cut])
        cursor = cut
    return pieces
