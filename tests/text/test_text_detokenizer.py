"""IncrementalDetokenizer: deltas are whole characters and add up to decode()."""

from __future__ import annotations

import random

import pytest

from switchyard.text import IncrementalDetokenizer, TextTokenizer

IM_END = 2  # the trainer gives <|im_end|> the third id


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.step(i) for i in ids]


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_deltas_add_up_to_decode(
    chatml: TextTokenizer, mixed_text: str, skip_special_tokens: bool
) -> None:
    ids = chatml.encode(mixed_text)
    detok = IncrementalDetokenizer(chatml, skip_special_tokens=skip_special_tokens)
    deltas = stream(detok, ids)
    assert "".join(deltas) == chatml.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detok.text == "".join(deltas)
    assert detok.flush() == ""
    assert detok.token_ids == ids


def test_no_delta_holds_a_broken_character(chatml: TextTokenizer, mixed_text: str) -> None:
    ids = chatml.encode(mixed_text)
    split_pieces = [i for i in ids if "\ufffd" in chatml.token_text(i)]
    assert split_pieces, "the fixture must split some characters across tokens"
    deltas = stream(IncrementalDetokenizer(chatml), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some tokens completed no character


@pytest.mark.parametrize("char", ["😀", "🎉", "👍🏽", "世", "語", "é"])
def test_multibyte_character_arrives_whole(chatml: TextTokenizer, char: str) -> None:
    ids = chatml.encode(f"a{char}")
    deltas = stream(IncrementalDetokenizer(chatml), ids)
    assert "".join(deltas) == f"a{char}"
    assert all("\ufffd" not in d for d in deltas)
    # However its bytes were split over tokens, each code point lands in one delta.
    for code_point in char:
        assert any(code_point in d for d in deltas)


def test_special_tokens_skipped_or_kept(chatml: TextTokenizer) -> None:
    ids = [*chatml.encode("ok"), IM_END]
    kept = IncrementalDetokenizer(chatml, skip_special_tokens=False)
    skipped = IncrementalDetokenizer(chatml, skip_special_tokens=True)
    assert stream(kept, ids)[-1] == "<|im_end|>"
    assert stream(skipped, ids)[-1] == ""
    assert skipped.text == "ok"


def test_flush_releases_an_unfinished_character(chatml: TextTokenizer) -> None:
    ids = chatml.encode("ok 🦊")  # not in the training text: split into bytes
    cut = ids[:-1]  # generation stopped inside the emoji
    assert chatml.decode(cut).endswith("\ufffd"), "the fixture must split this emoji"
    detok = IncrementalDetokenizer(chatml)
    deltas = stream(detok, cut)
    assert "".join(deltas) == "ok"
    rest = detok.flush()
    assert rest and set(rest.strip()) == {"\ufffd"}
    assert detok.text == chatml.decode(cut)
    assert detok.flush() == ""


def test_corpus_lines_stream_exactly(chatml: TextTokenizer, corpus_lines: list[str]) -> None:
    for line in corpus_lines:
        ids = chatml.encode(line)
        detok = IncrementalDetokenizer(chatml)
        assert "".join(stream(detok, ids)) + detok.flush() == line


def test_random_ids_add_up_to_decode(chatml: TextTokenizer) -> None:
    # Arbitrary id sequences include invalid UTF-8; whatever decode() makes of
    # them, the stream plus flush must make the same.
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(chatml.vocab_size) for _ in range(rng.randrange(1, 30))]
        for skip in (False, True):
            detok = IncrementalDetokenizer(chatml, skip_special_tokens=skip)
            text = "".join(stream(detok, ids)) + detok.flush()
            assert text == chatml.decode(ids, skip_special_tokens=skip), ids


def test_prompt_context_keeps_the_leading_space(metaspace: TextTokenizer) -> None:
    prompt = metaspace.encode("Hello", add_special_tokens=False)
    full = metaspace.encode("Hello world the fox", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    generated = full[len(prompt) :]

    alone = IncrementalDetokenizer(metaspace)
    assert not "".join(stream(alone, generated)).startswith(" ")  # the decoder strips it

    seeded = IncrementalDetokenizer(metaspace, prompt_ids=prompt)
    text = "".join(stream(seeded, generated)) + seeded.flush()
    assert text == " world the fox"
    assert text == metaspace.decode(full)[len(metaspace.decode(prompt)) :]


def test_prompt_context_with_byte_level(chatml: TextTokenizer) -> None:
    prompt = chatml.encode("<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n")
    generated = chatml.encode("Hi 😀 there")
    detok = IncrementalDetokenizer(chatml, skip_special_tokens=True, prompt_ids=prompt)
    assert "".join(stream(detok, generated)) + detok.flush() == "Hi 😀 there"


def test_unknown_id_adds_nothing(chatml: TextTokenizer) -> None:
    detok = IncrementalDetokenizer(chatml)
    assert detok.step(chatml.vocab_size + 10) == ""
    assert detok.step(chatml.encode("a")[0]) == "a"


def test_byte_fallback_streams_whole_characters(byte_fallback: TextTokenizer) -> None:
    ids = byte_fallback.encode("ab 😀 你", add_special_tokens=False)
    assert "<0xF0>" in byte_fallback.backend.encode("😀", add_special_tokens=False).tokens
    detok = IncrementalDetokenizer(byte_fallback)
    deltas = stream(detok, ids)
    assert "".join(deltas) + detok.flush() == "ab 😀 你"
    assert "😀" in deltas


def test_rewritten_byte_run_does_not_fail(byte_fallback: TextTokenizer) -> None:
    # C3 9F is "ß"; a second 9F makes the run invalid, and the byte-fallback
    # decoder then shows every byte of it as U+FFFD, rewriting the "ß" that was
    # already sent. DecodeStream raises here; the detokenizer must go on.
    byte = {b: byte_fallback.backend.token_to_id(f"<0x{b:02X}>") for b in (0xC3, 0x9F)}
    a, e_acute = byte_fallback.backend.token_to_id("a"), byte_fallback.backend.token_to_id("é")
    detok = IncrementalDetokenizer(byte_fallback)
    deltas = stream(detok, [byte[0xC3], byte[0x9F], byte[0x9F], a, e_acute, a])
    assert deltas[1] == "ß"
    assert "".join(deltas).startswith("ß") and "".join(deltas).endswith("aéa")
    assert detok.text == "".join(deltas)


def test_random_byte_runs_never_fail(byte_fallback: TextTokenizer) -> None:
    rng = random.Random(3)
    pieces = [f"<0x{b:02X}>" for b in (0xF0, 0x9F, 0x98, 0x80, 0xE4, 0xBD, 0xA0, 0xC3, 0xA9, 0x41)]
    pool = [byte_fallback.backend.token_to_id(p) for p in [*pieces, "a", "▁a", "é", "</s>"]]
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 12))]
        for prompt in (None, byte_fallback.encode("ab", add_special_tokens=False)):
            detok = IncrementalDetokenizer(byte_fallback, prompt_ids=prompt)
            deltas = stream(detok, ids)
            detok.flush()
            assert detok.text.startswith("".join(deltas))
