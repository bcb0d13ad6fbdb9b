"""Render a conversation into a prompt with the model's chat template.

Rendering is transformers' `apply_chat_template` (sandboxed Jinja, the same
template variables the model was trained with). On top of it sits TGI's
continue-final-message rule: TGI always renders with the generation prompt, and
when the last message is the assistant's it cuts the text right after that
message's content, so the model continues the message instead of starting a
new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import jinja2
import msgspec

from switchyard.text.tokenizer import TextTokenizer


class ChatMessage(msgspec.Struct, frozen=True):
    """One message of a conversation, its content already flattened to text.

    Tool calling adds three optional fields, handed to the template only when
    set (Hugging Face's message format): an assistant message's `tool_calls`
    (`[{"id", "type": "function", "function": {"name", "arguments": {...}}}]`,
    arguments as an object), a `tool` message's `tool_call_id`, and a `name`.
    """

    role: str
    content: str
    tool_calls: tuple[dict[str, Any], ...] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatMessageLike(Protocol):
    """Anything with a `role` and a text `content` (Structs, dataclasses, named tuples)."""

    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...


class ChatTemplateError(Exception):
    """The model has no chat template, or the template refused to render.

    The message follows TGI (`Template error: <reason>`), which answers it with
    HTTP 422 and error type `template_error`.
    """

    error_type: ClassVar[str] = "template_error"

    def __init__(self, reason: str) -> None:
        super().__init__(f"Template error: {reason}")
        self.reason = reason


def render_chat(
    tokenizer: TextTokenizer,
    messages: Sequence[ChatMessageLike | tuple[str, str]],
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    template_kwargs: dict[str, Any] | None = None,
    generation_prompt: bool = True,
    continue_final: bool | None = None,
) -> str:
    """The prompt text for `messages`, ready to tokenize without special tokens.

    `tools` (Hugging Face's format, `[{"type": "function", "function": {...}}]`)
    are handed to the template, which renders them if it knows how.

    `template_kwargs` are more variables for the template (vLLM's
    `chat_template_kwargs`). Renders with the generation prompt unless
    `generation_prompt` is false. If the last message is from the assistant and
    `continue_final` is not false (None: TGI's rule), the text ends right after
    that message's content (trailing whitespace trimmed, as TGI does), with no
    generation prompt; `continue_final` false starts a new turn after it (vLLM).
    Raises `ChatTemplateError` when the model has no template, when `messages`
    is empty, or when rendering fails (e.g. the template's `raise_exception`).
    """
    if not tokenizer.has_chat_template:
        # TGI's wording: minijinja's TemplateNotFound kind.
        raise ChatTemplateError("template not found")
    turns = [_as_message(message) for message in messages]
    if not turns:
        raise ChatTemplateError("the conversation has no messages")
    conversation = [_as_dict(turn) for turn in turns]
    extra: dict[str, Any] = dict(template_kwargs or {})
    if tools:
        extra["tools"] = list(tools)
    last = turns[-1]
    continuing = last.role == "assistant" and continue_final is not False
    try:
        rendered = tokenizer.hf_tokenizer.apply_chat_template(
            conversation, tokenize=False,
            # Continuing renders as TGI does (with the generation prompt), then cuts after
            # the message's content.
            add_generation_prompt=generation_prompt or continuing, **extra
        )
    except Exception as error:  # noqa: BLE001 - templates are untrusted code
        # Whatever a template does wrong is the request's problem (422), never
        # a server fault; the reason goes back to the client.
        raise ChatTemplateError(_reason(error)) from error
    if not isinstance(rendered, str):
        raise ChatTemplateError(f"the template rendered {type(rendered).__name__}, not text")
    if continuing:
        rendered = _continue_final_message(rendered, last.content)
    return rendered


def _continue_final_message(rendered: str, content: str) -> str:
    # The last occurrence of the content is the final message (earlier turns
    # may repeat it). A template that rewrites the content leaves nothing to
    # find; TGI then keeps the full text, and so do we.
    index = rendered.rfind(content)
    if index < 0:
        return rendered
    return rendered[: index + len(content)].rstrip()


def _as_dict(turn: ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.tool_calls is not None:
        message["tool_calls"] = list(turn.tool_calls)
    if turn.tool_call_id is not None:
        message["tool_call_id"] = turn.tool_call_id
    if turn.name is not None:
        message["name"] = turn.name
    return message


def _as_message(message: ChatMessageLike | tuple[str, str]) -> ChatMessage:
    if isinstance(message, ChatMessage):
        return message
    if isinstance(message, tuple) and not hasattr(message, "role"):
        role, content = message
        return ChatMessage(role=role, content=content)
    return ChatMessage(role=message.role, content=message.content)


def _reason(error: Exception) -> str:
    # Reasons use minijinja's error kinds, as TGI's messages do; a template's
    # raise_exception() is a plain jinja2 TemplateError and a "syntax error" in TGI.
    detail = str(error) or type(error).__name__
    if isinstance(error, jinja2.TemplateSyntaxError) or type(error) is jinja2.TemplateError:
        return f"syntax error: {detail}"
    if isinstance(error, jinja2.UndefinedError):
        return f"undefined value: {detail}"
    if isinstance(error, jinja2.TemplateError):
        return f"invalid operation: {detail}"
    return detail
