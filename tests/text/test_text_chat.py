"""render_chat: the model's template, TGI's continue-final-message rule, errors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from switchyard.text import (
    ChatMessage,
    ChatTemplateError,
    TextTokenizer,
    load_tokenizer,
    render_chat,
)

Factory = Callable[..., Path]  # make_chatml: builds a tokenizer folder variant


def test_renders_with_generation_prompt(chatml: TextTokenizer) -> None:
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi 😀")]
    assert render_chat(chatml, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 😀<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("template_in", ["jinja", "config", "legacy_json"])
def test_every_template_location_renders(make_chatml: Factory, template_in: str) -> None:
    tokenizer = load_tokenizer(make_chatml(template_in=template_in))
    text = render_chat(tokenizer, [ChatMessage("user", "Hi")])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_accepts_records_and_tuples(chatml: TextTokenizer) -> None:
    class Pair(NamedTuple):
        role: str
        content: str

    @dataclasses.dataclass
    class Record:
        role: str
        content: str

    expected = render_chat(chatml, [ChatMessage("user", "a"), ChatMessage("user", "b")])
    assert render_chat(chatml, [Pair("user", "a"), Record("user", "b")]) == expected
    assert render_chat(chatml, [("user", "a"), ("user", "b")]) == expected


def test_continue_final_assistant_message(chatml: TextTokenizer) -> None:
    messages = [ChatMessage("user", "Count to three."), ChatMessage("assistant", "One, two,")]
    assert render_chat(chatml, messages) == (
        "<|im_start|>user\nCount to three.<|im_end|>\n<|im_start|>assistant\nOne, two,"
    )


def test_continue_cuts_at_the_last_occurrence(chatml: TextTokenizer) -> None:
    messages = [
        ChatMessage("user", "yes"),
        ChatMessage("assistant", "yes"),
        ChatMessage("user", "yes"),
        ChatMessage("assistant", "yes"),
    ]
    text = render_chat(chatml, messages)
    assert text.endswith("<|im_start|>user\nyes<|im_end|>\n<|im_start|>assistant\nyes")
    assert text.count("yes") == 4


def test_continue_trims_trailing_whitespace(chatml: TextTokenizer) -> None:
    # TGI trims the end of the cut text, so a content's own trailing space goes too.
    messages = [ChatMessage("user", "Hi"), ChatMessage("assistant", "Sure, \n")]
    assert render_chat(chatml, messages).endswith("<|im_start|>assistant\nSure,")


def test_continue_keeps_full_text_when_content_is_rewritten(make_chatml: Factory) -> None:
    upper = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | upper"
        " + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    tokenizer = load_tokenizer(make_chatml(template=upper))
    text = render_chat(tokenizer, [ChatMessage("user", "hi"), ChatMessage("assistant", "ok then")])
    assert text.endswith("OK THEN<|im_end|>\n<|im_start|>assistant\n")


def test_template_sees_special_tokens(make_chatml: Factory) -> None:
    template = "{% for m in messages %}{{ m['content'] + eos_token }}{% endfor %}"
    tokenizer = load_tokenizer(make_chatml(template=template))
    assert render_chat(tokenizer, [ChatMessage("user", "a")]) == "a<|im_end|>"


def test_missing_template(make_chatml: Factory) -> None:
    tokenizer = load_tokenizer(make_chatml(template_in="none"))
    with pytest.raises(ChatTemplateError) as caught:
        render_chat(tokenizer, [ChatMessage("user", "Hi")])
    assert str(caught.value) == "Template error: template not found"
    assert caught.value.error_type == "template_error"


def test_raise_exception_in_template(make_chatml: Factory) -> None:
    template = (
        "{% for m in messages %}"
        "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception("
        "'Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    tokenizer = load_tokenizer(make_chatml(template=template))
    assert render_chat(tokenizer, [ChatMessage("user", "a"), ChatMessage("assistant", "b")]) == "ab"
    with pytest.raises(ChatTemplateError) as caught:
        render_chat(tokenizer, [ChatMessage("user", "a"), ChatMessage("user", "b")])
    assert str(caught.value) == (
        "Template error: syntax error: "
        "Conversation roles must alternate user/assistant/user/assistant/..."
    )
    assert caught.value.reason.endswith("user/assistant/...")


def test_template_syntax_error(make_chatml: Factory) -> None:
    tokenizer = load_tokenizer(make_chatml(template="{% if %}broken"))
    with pytest.raises(ChatTemplateError, match=r"^Template error: syntax error: "):
        render_chat(tokenizer, [ChatMessage("user", "a")])


def test_template_runtime_error(make_chatml: Factory) -> None:
    tokenizer = load_tokenizer(make_chatml(template="{{ nothing.here }}"))
    with pytest.raises(ChatTemplateError, match=r"^Template error: undefined value: "):
        render_chat(tokenizer, [ChatMessage("user", "a")])


def test_empty_conversation(chatml: TextTokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="no messages"):
        render_chat(chatml, [])


THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n' }}"
    "{% endif %}{% endif %}"
)
"""A Qwen3-style switch: `enable_thinking` false writes an empty thinking section."""


def test_template_kwargs_reach_the_template_as_transformers_passes_them(
        make_chatml: Factory) -> None:
    """vLLM's `chat_template_kwargs`: the same text as transformers' `apply_chat_template`
    with the same keyword arguments."""
    tokenizer = load_tokenizer(make_chatml(template=THINKING_TEMPLATE))
    messages = [ChatMessage("user", "Hi")]
    plain = render_chat(tokenizer, messages)
    off = render_chat(tokenizer, messages, template_kwargs={"enable_thinking": False})
    assert plain != off and off.endswith("<think>\n\n</think>\n")
    conversation = [{"role": "user", "content": "Hi"}]
    assert off == tokenizer.hf_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True, enable_thinking=False)


def test_generation_prompt_and_continue_final_follow_the_flags(chatml: TextTokenizer) -> None:
    """vLLM's `add_generation_prompt: false` ends after the last message; an explicit
    `continue_final_message: false` starts a new turn after a last assistant message."""
    user = [ChatMessage("user", "Hi")]
    assert render_chat(chatml, user, generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"
    reply = [*user, ChatMessage("assistant", "Hello")]
    assert render_chat(chatml, reply, continue_final=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>assistant\n")
