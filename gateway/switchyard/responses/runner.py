"""One response generated: the engine's steps in, events and the final object out.

Every way a response runs (answered as JSON, streamed, or in the background)
goes through `run_turn`, so the stream, the stored object and a replay all
come from the same events. A cancelled run (its client left, or `cancel`)
aborts the engine sequence at once and ends `cancelled`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
from switchyard_spec import FinishReason

from switchyard.errors import ApiError
from switchyard.generation import Finished, start
from switchyard.models.served import ServedModel
from switchyard.openai_mapping.plans import ChatPlan
from switchyard.protocol import responses as rs
from switchyard.protocol import responses_events as ev
from switchyard.responses.live import LiveResponse, Responses
from switchyard.responses.output import OutputBuilder
from switchyard.responses.store import Anchor
from switchyard.responses.tools import ToolSet


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """A planned turn: the model, the chat plan, and whether text logprobs were asked."""

    model: ServedModel
    plan: ChatPlan
    logprobs: bool
    tools: ToolSet = msgspec.field(default_factory=lambda: ToolSet(tools=[]))
    """The client's tools, which the model's calls are mapped back to."""


def snapshot(response: rs.Response) -> rs.Response:
    """A copy of the response as it is now (events keep it; the original changes)."""
    return msgspec.structs.replace(response, output=list(response.output))


def _usage(finished: Finished) -> rs.ResponseUsage:
    return rs.ResponseUsage(
        input_tokens=finished.prompt_tokens, output_tokens=finished.generated_tokens,
        total_tokens=finished.prompt_tokens + finished.generated_tokens,
        input_tokens_details=rs.InputTokensDetails(cached_tokens=finished.cached_tokens))


def _error_code(exc: ApiError) -> str:
    return "rate_limit_exceeded" if exc.status == 429 else "server_error"


def _anchors(turn: Turn, output_ids: list[int]) -> tuple[Anchor, ...]:
    """What the next turn can reuse: this prompt with the tokens generated, then alone."""
    prompt = Anchor(text=turn.plan.prompt_text, ids=tuple(turn.plan.plan.prompt_ids))
    if not output_ids:
        return (prompt,)
    written = turn.model.tokenizer.decode(output_ids, skip_special_tokens=False)
    return (Anchor(text=prompt.text + written, ids=prompt.ids + tuple(output_ids)), prompt)


async def run_turn(turn: Turn, live: LiveResponse, responses: Responses) -> None:
    """Generate the response, emitting its events; the record is stored as it changes."""
    record = live.record
    response = record.response
    storing = response.store
    response.status = "in_progress"
    live.emit(ev.ResponseInProgress(response=snapshot(response)))
    if storing:
        responses.store.put(record)
    builder = OutputBuilder(turn.model.tokenizer, turn.plan.tools, turn.logprobs, turn.tools)
    run = start(turn.model, turn.plan.plan, "responses")
    output_ids: list[int] = []
    try:
        finished: Finished | None = None
        async for step in run.steps():
            output_ids.append(step.token.id)
            for event in builder.feed(step):
                live.emit(event)
            finished = step.finished
        if finished is None:
            raise ApiError(500, "Incomplete generation", "incomplete_generation")
        for event in builder.finish(finished):
            live.emit(event)
        response.output = list(builder.items)
        response.usage = _usage(finished)
        response.completed_at = int(time.time())
        record.anchors = _anchors(turn, output_ids)
        if finished.reason is FinishReason.LENGTH:
            response.status = "incomplete"
            response.incomplete_details = rs.IncompleteDetails(reason="max_output_tokens")
            live.emit(ev.ResponseIncomplete(response=snapshot(response)))
        else:
            response.status = "completed"
            live.emit(ev.ResponseCompleted(response=snapshot(response)))
    except ApiError as exc:
        response.output = list(builder.items)
        _fail(live, exc)
    except asyncio.CancelledError:
        response.output = list(builder.items)
        response.status = "cancelled"
        live.emit(ev.ResponseFailed(response=snapshot(response)))
        raise
    finally:
        run.close()
        if storing:
            responses.store.put(record)


def _fail(live: LiveResponse, exc: ApiError) -> ev.Event:
    """End the response `failed` with the error, emitting its last event."""
    response = live.record.response
    response.status = "failed"
    response.error = rs.ResponseError(code=_error_code(exc), message=exc.message)
    return live.emit(ev.ResponseFailed(response=snapshot(response)))


async def run_background(turn: Turn, live: LiveResponse, responses: Responses) -> None:
    """A background response's task: take a permit, generate, and let go of the response."""
    model = turn.model
    try:
        try:
            model.admission.acquire()
        except ApiError as exc:
            _fail(live, exc)
            responses.store.put(live.record)
            return
        try:
            await run_turn(turn, live, responses)
        finally:
            model.admission.release()
    finally:
        responses.running.pop(live.record.response.id, None)


async def stream_turn(turn: Turn, live: LiveResponse, responses: Responses
                      ) -> AsyncIterator[str]:
    """A streamed response's frames, generated as they are read; closing the stream (the
    client left) cancels the generation."""
    model = turn.model
    try:
        model.admission.acquire()
    except ApiError as exc:
        responses.running.pop(live.record.response.id, None)
        yield ev.sse_frame(_fail(live, exc))
        return
    task = asyncio.ensure_future(run_turn(turn, live, responses))
    try:
        async for event in live.follow():
            yield ev.sse_frame(event)
        await task
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        model.admission.release()
        responses.running.pop(live.record.response.id, None)
