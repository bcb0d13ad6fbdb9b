"""Pieces the OpenAI chat and completion routes share: SSE framing, finish reasons, usage."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from litestar.response import ServerSentEvent

from switchyard.errors import ApiError
from switchyard.generation import Finished
from switchyard.protocol import openai as oai
from switchyard.routes.errors import openai_error_json
from switchyard_spec import FinishReason

DONE = "[DONE]"
"""The last event of every OpenAI stream, errors included."""


def finish_reason(reason: FinishReason) -> oai.FinishReasonOpenAI:
    """OpenAI's finish reason: "length", or "stop" for EOS and stop strings alike."""
    return "length" if reason is FinishReason.LENGTH else "stop"


def usage(prompt_tokens: int, finished: Iterable[Finished]) -> oai.Usage:
    """Usage of a request: its prompts counted once, every choice's tokens summed."""
    completion = sum(done.generated_tokens for done in finished)
    return oai.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                     total_tokens=prompt_tokens + completion)


def error_event(exc: ApiError) -> str:
    """An error after the stream began: OpenAI's error object as one event (then `[DONE]`)."""
    return openai_error_json(exc).decode()


def sse(events: AsyncIterator[str]) -> ServerSentEvent:
    """An OpenAI event stream."""
    return ServerSentEvent(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
