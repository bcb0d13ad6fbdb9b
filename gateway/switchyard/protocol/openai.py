"""OpenAI's wire types for chat completions, completions and models, as msgspec Structs.

These follow the OpenAI API rather than TGI's deviations from it (real ids,
`finish_reason` "stop" for stop strings, `logit_bias` as a token-id map).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a multi-part message content; only `text` parts carry text."""

    type: str
    text: str | None = None
    image_url: dict[str, Any] | None = None


class ChatMessageIn(msgspec.Struct, kw_only=True):
    """A message in a chat request."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    """`stream_options` of a streamed request."""

    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, kw_only=True):
    """Body of `POST /v1/chat/completions`."""

    messages: list[ChatMessageIn]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None


class CompletionRequest(msgspec.Struct, kw_only=True):
    """Body of `POST /v1/completions`."""

    prompt: str | list[str]
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class Usage(msgspec.Struct):
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(msgspec.Struct):
    """An alternative token in `logprobs.content[].top_logprobs`."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct):
    """A chosen token's entry in `logprobs.content`."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct):
    """`logprobs` of a chat choice."""

    content: list[TokenLogprob]


class ChatMessageOut(msgspec.Struct):
    """The assistant's message in a chat answer."""

    role: str
    content: str | None


FinishReasonOpenAI = Literal["stop", "length"]


class ChatChoice(msgspec.Struct):
    """One choice of a chat answer."""

    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReasonOpenAI


class ChatCompletion(msgspec.Struct):
    """Body of a non-streamed chat answer."""

    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    """The incremental message of a chunk: `role` on the first chunk only."""

    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    """One choice of a streamed chunk."""

    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReasonOpenAI | None


class ChatCompletionChunk(msgspec.Struct):
    """One streamed chat event."""

    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class CompletionLogprobs(msgspec.Struct):
    """Legacy `logprobs` of a completion choice."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    """One choice of a completion answer or chunk."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReasonOpenAI | None


class Completion(msgspec.Struct):
    """Body of a completion answer, or one streamed completion chunk."""

    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct):
    """One entry of `GET /v1/models`."""

    id: str
    created: int
    owned_by: str
    object: str = "model"


class ModelList(msgspec.Struct):
    """Body of `GET /v1/models`."""

    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(msgspec.Struct):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """OpenAI's error body."""

    error: ErrorDetail
