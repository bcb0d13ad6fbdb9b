"""`POST /v1/chat/completions`: OpenAI chat, as one JSON body or as server-sent chunks.

`n` choices are generated as independent sequences submitted together; their
chunks interleave in a stream, each carrying its choice's `index`. With tools
(`switchyard.tools.openai`) each choice's text is read into `tool_calls`,
and its stream ends with an empty delta that carries the finish reason.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from litestar.response import ServerSentEvent, Stream

from switchyard import openapi
from switchyard.errors import ApiError
from switchyard.generation import Finished, Step, close_all, collect_all, interleave, start_all
from switchyard.media import chat_images
from switchyard.remote.model import RemoteModel
from switchyard.models.served import ServedModel
from switchyard.protocol import openai as oai
from switchyard.remote import forward as remote
from switchyard.routes.auth import require_api_key
from switchyard.routes.content_type import require_json
from switchyard.routes.disconnect import unless_client_leaves
from switchyard.openai_mapping.streaming import DONE, error_event, finish_reason, sse, usage
from switchyard.openai_mapping.plans import choice_count, plan_chat_call
from switchyard.tools.openai import ToolSetup, ToolStreamer, tool_message
from switchyard.state import Gateway
from switchyard.planning.plan import GenerationPlan, fan_out


def chat_logprobs(model: ServedModel, steps: Sequence[Step]) -> oai.ChoiceLogprobs:
    """`logprobs.content` of a chat choice (or of one chunk) for these steps."""
    tok = model.tokenizer
    content = []
    for step in steps:
        t = step.token
        text = t.text if not t.special else tok.token_text(t.id)
        content.append(
            oai.TokenLogprob(
                token=text,
                logprob=t.logprob,
                bytes=list(text.encode()),
                top_logprobs=[
                    oai.TopLogprob(token=tok.token_text(a.id), logprob=a.logprob,
                                   bytes=list(tok.token_text(a.id).encode()))
                    for a in t.top_tokens
                ],
            )
        )
    return oai.ChoiceLogprobs(content=content)


class _ChatStream(msgspec.Struct, kw_only=True):
    """What a chat stream needs besides the model and its plans."""

    ident: str
    created: int
    fingerprint: str
    want_logprobs: bool
    include_usage: bool
    tools: ToolSetup | None = None


async def chat_response(
    gw: Gateway, data: oai.ChatCompletionRequest, raw: bytes | None = None
) -> Response[oai.ChatCompletion] | ServerSentEvent | Stream:
    """Answer a chat request (shared by the route and `/invocations`).

    ``raw``, the body as sent, is what a remote model's replica is sent.
    """
    target = gw.resolve(data.model)
    if isinstance(target, RemoteModel) and raw is not None:
        return await remote.forward(target, "openai", "/v1/chat/completions", raw,
                                    bool(data.stream))
    model = gw.model(data.model)
    data, images = await chat_images(gw, model, data)  # image_url parts become ![](URL)
    chat_plan = plan_chat_call(gw, model, data, images)
    plans = fan_out(chat_plan.plan, choice_count(data.n))
    tools = chat_plan.tools
    ident = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    want_logprobs = bool(data.logprobs)
    if data.stream:
        # 429 before the stream starts; the stream takes its permit when it runs, so a
        # stream that never runs holds none.
        model.admission.check()
        options = _ChatStream(
            ident=ident, created=created, fingerprint=gw.system_fingerprint,
            want_logprobs=want_logprobs,
            include_usage=bool(data.stream_options and data.stream_options.include_usage),
            tools=tools,
        )
        return sse(_chat_stream(model, plans, options))
    model.admission.acquire()
    try:
        results = await collect_all(start_all(model, plans, "chat"))
    finally:
        model.admission.release()
    choices = []
    for index, r in enumerate(results):
        if tools is None:
            message = oai.ChatMessageOut(role="assistant", content=r.finished.generated_text)
            reason: oai.ChatFinishReason = finish_reason(r.finished.reason)
        else:
            message, reason = tool_message(tools, r.steps, r.finished)
        choices.append(oai.ChatChoice(
            index=index, message=message,
            logprobs=chat_logprobs(model, r.steps) if want_logprobs else None,
            finish_reason=reason,
        ))
    body = oai.ChatCompletion(
        id=ident,
        created=created,
        model=model.name,
        system_fingerprint=gw.system_fingerprint,
        choices=choices,
        usage=usage([results[0].finished], [r.finished for r in results]),
    )
    return Response(body, status_code=200)


async def _chat_stream(
    model: ServedModel, plans: list[GenerationPlan], o: _ChatStream
) -> AsyncIterator[str]:
    def chunk(choices: list[oai.ChatChunkChoice], used: oai.Usage | None = None) -> str:
        return msgspec.json.encode(
            oai.ChatCompletionChunk(id=o.ident, created=o.created, model=model.name,
                                    system_fingerprint=o.fingerprint, choices=choices, usage=used)
        ).decode()

    try:
        model.admission.acquire()
    except ApiError as exc:
        yield error_event(exc)
        yield DONE
        return
    runs = []
    try:
        runs = start_all(model, plans, "chat-stream")
        for index in range(len(runs)):
            # With tools the content is left out (null until there is text), so that a
            # message that only calls tools accumulates to `content: null`.
            role = (oai.ChatDelta(role="assistant") if o.tools is not None
                    else oai.ChatDelta(role="assistant", content=""))
            yield chunk([oai.ChatChunkChoice(index=index, delta=role, logprobs=None,
                                             finish_reason=None)])
        finished: dict[int, Finished] = {}
        streamers = [ToolStreamer(o.tools) for _ in runs] if o.tools is not None else []
        # Closed here, not left to the garbage collector: a client that goes away
        # must stop the sequences' reader tasks at once.
        async with aclosing(interleave(runs)) as steps:
            async for index, step in steps:
                done = step.finished
                lp = chat_logprobs(model, [step]) if o.want_logprobs else None
                if streamers:
                    for text in _tool_chunks(streamers[index], index, step, lp, chunk):
                        yield text
                elif step.text or done is not None or lp is not None:
                    yield chunk([oai.ChatChunkChoice(
                        index=index, delta=oai.ChatDelta(content=step.text), logprobs=lp,
                        finish_reason=finish_reason(done.reason) if done else None,
                    )])
                if done is not None:
                    finished[index] = done
        if o.include_usage and len(finished) == len(runs):
            yield chunk([], usage([finished[0]], finished.values()))
    except ApiError as exc:
        yield error_event(exc)
    finally:
        close_all(runs)
        model.admission.release()
    yield DONE


def _tool_chunks(streamer: ToolStreamer, index: int, step: Step,
                 lp: oai.ChoiceLogprobs | None,
                 chunk: Callable[[list[oai.ChatChunkChoice]], str]) -> list[str]:
    """A tool-calling choice's chunks for one step: its deltas (the step's logprobs on the
    first, or on an empty delta when it has none), and at its end an empty delta with
    the finish reason."""
    deltas = streamer.feed(step)
    reason: oai.ChatFinishReason | None = None
    if step.finished is not None:
        more, reason = streamer.finish(step.finished)
        deltas += more
    if lp is not None and not deltas:
        deltas = [oai.ChatDelta()]
    out = [chunk([oai.ChatChunkChoice(index=index, delta=delta,
                                      logprobs=lp if i == 0 else None, finish_reason=None)])
           for i, delta in enumerate(deltas)]
    if reason is not None:
        out.append(chunk([oai.ChatChunkChoice(index=index, delta=oai.ChatDelta(),
                                              logprobs=None, finish_reason=reason)]))
    return out


@post("/v1/chat/completions", status_code=200, summary="OpenAI chat completions", tags=["OpenAI"],
      guards=[require_api_key, require_json], **openapi.CHAT_COMPLETIONS)
async def chat_completions(
    gw: NamedDependency[Gateway], data: JSONBody[oai.ChatCompletionRequest],
    request: Request[Any, Any, Any],
) -> Response[oai.ChatCompletion] | ServerSentEvent:
    """Answer a chat conversation, as one JSON body or as server-sent chunks."""
    return await unless_client_leaves(request, chat_response(gw, data, await request.body()))
