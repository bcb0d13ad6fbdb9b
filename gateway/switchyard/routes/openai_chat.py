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
from switchyard.openai_mapping.extras import (
    AnswerExtras,
    chunk_usage,
    prompt_logprobs,
    token_label,
)
from switchyard.openai_mapping.plans import choice_count, plan_chat_call
from switchyard.tools.openai import ToolSetup, ToolStreamer, tool_message
from switchyard.state import Gateway
from switchyard.planning.plan import GenerationPlan, fan_out


def chat_logprobs(model: ServedModel, steps: Sequence[Step], alternatives: int | None = None,
                  extras: AnswerExtras = AnswerExtras()) -> oai.ChoiceLogprobs:
    """`logprobs.content` of a chat choice (or of one chunk) for these steps, with at most
    ``alternatives`` top tokens each (the engine may have reported more for
    `prompt_logprobs`)."""
    tok = model.tokenizer
    content = []
    for step in steps:
        t = step.token
        text = token_label(model, t.id, t.text if not t.special else tok.token_text(t.id),
                           extras)
        content.append(
            oai.TokenLogprob(
                token=text,
                logprob=t.logprob,
                bytes=list(text.encode()),
                top_logprobs=[
                    oai.TopLogprob(token=(label := token_label(model, a.id,
                                                               tok.token_text(a.id), extras)),
                                   logprob=a.logprob, bytes=list(label.encode()))
                    for a in t.top_tokens[:alternatives]
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
    alternatives: int = 0
    """`top_logprobs`: alternatives per token."""
    extras: AnswerExtras = AnswerExtras()
    echo: str = ""
    """vLLM's `echo`: the text the message starts with."""


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
            tools=tools, alternatives=data.top_logprobs or 0, extras=chat_plan.extras,
            echo=chat_plan.echo,
        )
        return sse(_chat_stream(model, plans, options))
    model.admission.acquire()
    try:
        results = await collect_all(start_all(model, plans, "chat"))
    finally:
        model.admission.release()
    extras = chat_plan.extras
    choices = []
    for index, r in enumerate(results):
        if tools is None:
            message = oai.ChatMessageOut(role="assistant",
                                         content=chat_plan.echo + r.finished.generated_text)
            reason: oai.ChatFinishReason = finish_reason(r.finished.reason)
        else:
            message, reason = tool_message(tools, r.steps, r.finished)
        choices.append(oai.ChatChoice(
            index=index, message=message,
            logprobs=chat_logprobs(model, r.steps, data.top_logprobs or 0, extras)
            if want_logprobs else None,
            finish_reason=reason,
            token_ids=[s.token.id for s in r.steps] if extras.token_ids else msgspec.UNSET,
        ))
    first = results[0].finished
    body = oai.ChatCompletion(
        id=ident,
        created=created,
        model=model.name,
        system_fingerprint=gw.system_fingerprint,
        choices=choices,
        usage=usage([first], [r.finished for r in results]),
        prompt_token_ids=list(chat_plan.plan.prompt_ids) if extras.token_ids else msgspec.UNSET,
        prompt_logprobs=prompt_logprobs(
            model, chat_plan.plan.prompt_ids, first.prompt_logprobs, first.prompt_top_tokens,
            extras.prompt_logprobs) if extras.prompt_logprobs is not None else msgspec.UNSET,
    )
    return Response(body, status_code=200)


async def _chat_stream(
    model: ServedModel, plans: list[GenerationPlan], o: _ChatStream
) -> AsyncIterator[str]:
    prompt_tokens = len(plans[0].prompt_ids)
    generated = [0] * len(plans)

    def chunk(choices: list[oai.ChatChunkChoice], used: oai.Usage | None = None,
              prompt_ids: list[int] | msgspec.UnsetType = msgspec.UNSET) -> str:
        if used is None and o.extras.continuous_usage and choices:
            used = chunk_usage(prompt_tokens, generated[choices[0].index])
        return msgspec.json.encode(
            oai.ChatCompletionChunk(id=o.ident, created=o.created, model=model.name,
                                    system_fingerprint=o.fingerprint, choices=choices,
                                    usage=used, prompt_token_ids=prompt_ids)
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
        ids = list(plans[0].prompt_ids) if o.extras.token_ids else msgspec.UNSET
        for index in range(len(runs)):
            # With tools the content is left out (null until there is text), so that a
            # message that only calls tools accumulates to `content: null`.
            role = (oai.ChatDelta(role="assistant") if o.tools is not None
                    else oai.ChatDelta(role="assistant", content=o.echo))
            yield chunk([oai.ChatChunkChoice(index=index, delta=role, logprobs=None,
                                             finish_reason=None)],
                        prompt_ids=ids if index == 0 else msgspec.UNSET)
        finished: dict[int, Finished] = {}
        streamers = [ToolStreamer(o.tools) for _ in runs] if o.tools is not None else []
        # Closed here, not left to the garbage collector: a client that goes away
        # must stop the sequences' reader tasks at once.
        async with aclosing(interleave(runs)) as steps:
            async for index, step in steps:
                done = step.finished
                generated[index] += 1
                lp = (chat_logprobs(model, [step], o.alternatives, o.extras)
                      if o.want_logprobs else None)
                token_ids = [step.token.id] if o.extras.token_ids else None
                if streamers:
                    for text in _tool_chunks(streamers[index], index, step, lp, chunk,
                                             token_ids):
                        yield text
                elif step.text or done is not None or lp is not None or token_ids:
                    yield chunk([oai.ChatChunkChoice(
                        index=index, delta=oai.ChatDelta(content=step.text), logprobs=lp,
                        finish_reason=finish_reason(done.reason) if done else None,
                        token_ids=token_ids if token_ids is not None else msgspec.UNSET,
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
                 chunk: Callable[[list[oai.ChatChunkChoice]], str],
                 token_ids: list[int] | None = None) -> list[str]:
    """A tool-calling choice's chunks for one step: its deltas (the step's logprobs and
    token id on the first, or on an empty delta when it has none), and at its end an empty
    delta with the finish reason."""
    deltas = streamer.feed(step)
    reason: oai.ChatFinishReason | None = None
    if step.finished is not None:
        more, reason = streamer.finish(step.finished)
        deltas += more
    if (lp is not None or token_ids) and not deltas:
        deltas = [oai.ChatDelta()]
    out = [chunk([oai.ChatChunkChoice(
        index=index, delta=delta, logprobs=lp if i == 0 else None, finish_reason=None,
        token_ids=token_ids if i == 0 and token_ids is not None else msgspec.UNSET)])
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
