"""load_tokenizer and TextTokenizer against real trained tokenizers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer, processors
from transformers import PreTrainedTokenizerFast

from switchyard.text import TextTokenizer, TokenizerLoadError, TokenSpan, load_tokenizer

# The trainer gives the special tokens the first ids, in the order listed.
ENDOFTEXT, IM_START, IM_END = 0, 1, 2


def test_loads_a_fast_tokenizer(chatml: TextTokenizer) -> None:
    assert isinstance(chatml.backend, Tokenizer)
    assert chatml.vocab_size == chatml.backend.get_vocab_size(with_added_tokens=True)
    assert chatml.has_chat_template


def test_encode_decode_round_trip(chatml: TextTokenizer, mixed_text: str) -> None:
    assert chatml.backend.token_to_id("<|im_end|>") == IM_END
    ids = chatml.encode(mixed_text)
    assert IM_END in ids  # special tokens in the text are matched as tokens
    assert chatml.decode(ids) == mixed_text
    assert chatml.decode(ids, skip_special_tokens=True) == mixed_text.replace("<|im_end|>", "")


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("fixture", ["chatml", "metaspace"])
def test_encode_matches_transformers(
    fixture: str, add_special_tokens: bool, request: pytest.FixtureRequest
) -> None:
    tokenizer: TextTokenizer = request.getfixturevalue(fixture)
    text = "Hello world, 你好 😀"
    expected = tokenizer.hf_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


def test_special_tokens(chatml: TextTokenizer) -> None:
    assert chatml.special_token_ids == {ENDOFTEXT, IM_START, IM_END}
    assert chatml.is_special(IM_END)
    assert not chatml.is_special(chatml.encode("Hello")[0])


def test_token_text(chatml: TextTokenizer) -> None:
    assert chatml.token_text(IM_START) == "<|im_start|>"
    hello = chatml.encode("Hello")
    assert "".join(chatml.token_text(i) for i in hello) == "Hello"
    emoji = chatml.encode("🎉")
    assert len(emoji) > 1, "the emoji must be split for this test to mean anything"
    # A lone piece of a multi-byte character shows as U+FFFD, as in TGI's details.
    assert "\ufffd" in chatml.token_text(emoji[0])


def test_offsets_are_utf8_bytes(chatml: TextTokenizer, mixed_text: str) -> None:
    spans = chatml.encode_with_offsets(mixed_text)
    assert [s.id for s in spans] == chatml.encode(mixed_text)
    raw = mixed_text.encode("utf-8")
    for span in spans:
        assert isinstance(span, TokenSpan)
        assert 0 <= span.start <= span.stop <= len(raw)
        assert span.text == raw[span.start : span.stop].decode("utf-8")
    # Pieces of one emoji all span the whole character's 4 bytes.
    emoji_at = raw.index("🎉".encode())
    emoji_spans = [s for s in spans if s.start <= emoji_at < s.stop]
    assert len(emoji_spans) > 1
    assert all(s.stop - emoji_at == 4 for s in emoji_spans)
    assert all(s.text.endswith("🎉") for s in emoji_spans)


def test_offsets_cover_ascii_exactly(chatml: TextTokenizer) -> None:
    text = "Hello world! def add(x, y)"
    spans = chatml.encode_with_offsets(text)
    assert "".join(s.text for s in spans) == text
    assert spans[0].start == 0 and spans[-1].stop == len(text)


def test_post_processor_tokens_have_empty_span(tmp_path: Path, chatml: TextTokenizer) -> None:
    backend = Tokenizer.from_str(chatml.backend.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", ENDOFTEXT)]
    )
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>").save_pretrained(
        tmp_path
    )
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.encode("Hello") == [ENDOFTEXT, *chatml.encode("Hello")]
    assert tokenizer.encode("Hello", add_special_tokens=False) == chatml.encode("Hello")
    first = tokenizer.encode_with_offsets("Hello")[0]
    assert first == TokenSpan(id=ENDOFTEXT, text="", start=0, stop=0)


def test_eos_ids_from_generation_config_first(chatml: TextTokenizer) -> None:
    # generation_config.json says [im_end, endoftext]; config.json and the tokenizer say im_end.
    assert chatml.eos_token_ids == (IM_END, ENDOFTEXT)


def test_eos_ids_from_config_list(make_chatml: Callable[..., Path]) -> None:
    folder = make_chatml(config_eos=[ENDOFTEXT, IM_END], generation_eos=None)
    assert load_tokenizer(folder).eos_token_ids == (ENDOFTEXT, IM_END)


def test_eos_ids_from_tokenizer_only(make_chatml: Callable[..., Path]) -> None:
    folder = make_chatml(config_eos=None, generation_eos=None)
    assert load_tokenizer(folder).eos_token_ids == (IM_END,)


def test_eos_ids_from_text_config(make_chatml: Callable[..., Path]) -> None:
    folder = make_chatml(config_eos=None, generation_eos=None)
    (folder / "config.json").write_text(
        json.dumps({"eos_token_id": None, "text_config": {"eos_token_id": ENDOFTEXT}})
    )
    assert load_tokenizer(folder).eos_token_ids == (ENDOFTEXT, IM_END)


def test_unreadable_generation_config_is_skipped(make_chatml: Callable[..., Path]) -> None:
    folder = make_chatml(config_eos=None)
    (folder / "generation_config.json").write_text("{not json")
    assert load_tokenizer(folder).eos_token_ids == (IM_END,)


@pytest.mark.parametrize("template_in", ["jinja", "config", "legacy_json"])
def test_chat_template_locations(make_chatml: Callable[..., Path], template_in: str) -> None:
    assert load_tokenizer(make_chatml(template_in=template_in)).has_chat_template


def test_no_chat_template(make_chatml: Callable[..., Path]) -> None:
    assert not load_tokenizer(make_chatml(template_in="none")).has_chat_template


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="not found"):
        load_tokenizer(tmp_path / "nope")


def test_folder_without_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(TokenizerLoadError):
        load_tokenizer(tmp_path)


def test_custom_code_tokenizer_falls_back_to_tokenizer_json(
    make_chatml: Callable[..., Path], mixed_text: str
) -> None:
    folder = make_chatml()
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": ["custom.CustomTokenizer", "custom.CustomTokenizerFast"]}
    config_path.write_text(json.dumps(config))
    tokenizer = load_tokenizer(folder)
    assert tokenizer.decode(tokenizer.encode(mixed_text)) == mixed_text
    assert tokenizer.has_chat_template
