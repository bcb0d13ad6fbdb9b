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


def usage(prompts: Iterable[Finished], finished: Iterable[Finished]) -> oai.Usage:
    """Usage of a request: each prompt counted once (by the sequence in `prompts` that
    stands for it, whose cache hits are the prompt's), every choice's tokens summed."""
    counted = list(prompts)
    prompt_tokens = sum(done.prompt_tokens for done in counted)
    completion = sum(done.generated_tokens for done in finished)
    return oai.Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=oai.PromptTokensDetails(
            cached_tokens=sum(done.cached_tokens for done in counted)),
        completion_tokens_details=oai.CompletionTokensDetails(),
    )


def error_event(exc: ApiError) -> str:
    """An error after the stream began: OpenAI's error object as one event (then `[DONE]`)."""
    return openai_error_json(exc).decode()


def sse(events: AsyncIterator[str]) -> ServerSentEvent:
    """An OpenAI event stream."""
    return ServerSentEvent(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
