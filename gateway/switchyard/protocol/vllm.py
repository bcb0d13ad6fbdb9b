"""vLLM's own routes on the wire: `/tokenize`, `/detokenize`, `/version`, as msgspec Structs.

`/tokenize` is TGI's route too; the two are told apart by the body: TGI's
has `inputs`, vLLM's `prompt` (text) or `messages` (a chat, templated).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from switchyard.protocol.openai import ChatMessageIn, Tool


class TokenizeShape(msgspec.Struct, kw_only=True):
    """The fields that tell a `/tokenize` body's API: TGI's `inputs`, or vLLM's `prompt` or
    `messages` (other fields are read by the shape's own type)."""

    inputs: Any = msgspec.UNSET
    prompt: Any = msgspec.UNSET
    messages: Any = msgspec.UNSET


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `/tokenize` body for a text prompt."""

    prompt: Annotated[str, Meta(description="The text to tokenize.")]
    model: str | None = None
    add_special_tokens: Annotated[bool, Meta(
        description="Add the tokenizer's special tokens (BOS), as a completion does.")] = True
    return_token_strs: Annotated[bool, Meta(description="Also return each token's text.")
                                 ] = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `/tokenize` body for a chat: the messages through the model's chat template."""

    messages: list[ChatMessageIn]
    model: str | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, kw_only=True):
    """vLLM's `/tokenize` answer."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of `POST /detokenize`."""

    tokens: Annotated[list[int], Meta(description="Token ids to turn back into text.")]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    """`POST /detokenize`'s answer."""

    prompt: str


class VersionResponse(msgspec.Struct, kw_only=True):
    """`GET /version`'s answer."""

    version: str
