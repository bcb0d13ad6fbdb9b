"""switchyard.text.echo: each echoed prompt token's text and offset index the echoed text."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, processors
from transformers import PreTrainedTokenizerFast

from switchyard.text import TextTokenizer, load_tokenizer
from switchyard.text.echo import EchoedPrompt, echo_from_ids, echo_from_offsets

from tests.support.chatml_tokens import ENDOFTEXT


def _assert_indexes(echo: EchoedPrompt, count: int) -> None:
    assert len(echo.tokens) == len(echo.offsets) == count
    assert "".join(echo.tokens) == echo.text
    for token, offset in zip(echo.tokens, echo.offsets, strict=True):
        assert echo.text[offset:].startswith(token)
    assert list(echo.offsets) == sorted(echo.offsets)


def _from_text(tokenizer: TextTokenizer, text: str) -> EchoedPrompt:
    ids, spans = tokenizer.encode_with_char_offsets(text)
    echo = echo_from_offsets(text, spans)
    _assert_indexes(echo, len(ids))
    return echo


def test_byte_level_split_characters_go_to_the_token_completing_them(chatml: TextTokenizer,
                                                          mixed_text: str) -> None:
    ids = chatml.encode(mixed_text)
    assert len(ids) > len(mixed_text.split())
    by_offsets = _from_text(chatml, mixed_text)
    by_ids = echo_from_ids(chatml, ids)
    _assert_indexes(by_ids, len(ids))
    assert by_ids.text == mixed_text
    # Partial tokens are "" and whole characters land on the token completing them.
    assert "" in by_offsets.tokens and "😀" in "".join(by_offsets.tokens)
    assert all("\ufffd" not in t for t in by_offsets.tokens + by_ids.tokens)
    assert "<|im_end|>" in by_offsets.tokens and "<|im_end|>" in by_ids.tokens


def test_both_schemes_agree_on_a_byte_level_tokenizer(chatml: TextTokenizer,
                                                      corpus_lines: list[str]) -> None:
    for line in corpus_lines:
        ids = chatml.encode(line)
        assert _from_text(chatml, line) == echo_from_ids(chatml, ids)


def test_metaspace_first_token_keeps_no_leading_space(metaspace: TextTokenizer) -> None:
    text = "Hello world, hello again"
    by_offsets = _from_text(metaspace, text)
    assert by_offsets.text == text
    ids = metaspace.encode(text)
    by_ids = echo_from_ids(metaspace, ids)
    _assert_indexes(by_ids, len(ids))
    assert by_ids.text == metaspace.decode(ids) == text


def test_byte_fallback_invalid_bytes_still_add_up(byte_fallback: TextTokenizer) -> None:
    # 0xE4 0xBD starts a three-byte character that never completes: the decoder
    # rewrites those bytes, so incremental decoding alone does not add up.
    ids = [byte_fallback.encode("ab")[-1], 3 + 0xE4, 3 + 0xBD, *byte_fallback.encode("ab")]
    echo = echo_from_ids(byte_fallback, ids)
    _assert_indexes(echo, len(ids))
    assert echo.text == byte_fallback.decode(ids)
    text = "ab 你 é z"
    assert _from_text(byte_fallback, text).text == text


def test_tokens_the_post_processor_adds_have_no_text(tmp_path: Path,
                                                     chatml: TextTokenizer) -> None:
    backend = Tokenizer.from_str(chatml.backend.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A <|endoftext|>", special_tokens=[("<|endoftext|>", ENDOFTEXT)])
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>").save_pretrained(
        tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    echo = _from_text(tokenizer, "Hello there")
    assert echo.tokens[0] == echo.tokens[-1] == ""
    assert echo.text == "Hello there"
    # A token prompt echoes its ids' decoding, special tokens included.
    ids = tokenizer.encode("Hello there")
    by_ids = echo_from_ids(tokenizer, ids)
    _assert_indexes(by_ids, len(ids))
    assert by_ids.tokens[0] == "<|endoftext|>" and by_ids.text.startswith("<|endoftext|>Hello")


@pytest.mark.parametrize(("text", "spans", "tokens"), [
    ("abc", [(0, 1), (1, 3)], ("a", "bc")),
    ("日本", [(0, 1), (0, 2), (1, 2)], ("", "", "日本")),  # bytes of both in the middle one
    ("  x", [(2, 3)], ("  x",)),  # text no token covers goes to a neighbour
    ("ab", [(0, 0), (0, 0)], ("", "ab")),  # nothing covers any text
    ("a b", [(0, 1), (2, 3), (3, 3)], ("a", " b", "")),
])
def test_offsets_scheme(text: str, spans: list[tuple[int, int]], tokens: tuple[str, ...]) -> None:
    echo = echo_from_offsets(text, spans)
    assert echo.tokens == tokens
    _assert_indexes(echo, len(spans))
