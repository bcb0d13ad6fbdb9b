"""OpenAI routes: `/v1/chat/completions`, `/v1/completions` and `/v1/models`.

Requests are mapped onto TGI's parameters and validated by the same rules
(`switchyard.validation`), then answered in OpenAI's shapes: real ids,
`finish_reason` "stop" for EOS and stop strings, stop text left out.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import msgspec
from litestar import Response, Router, get, post
from litestar.response import ServerSentEvent

from switchyard.errors import ApiError, validation_error
from switchyard.generation import Finished, Step, generate
from switchyard.models.served import ServedModel
from switchyard.protocol import openai as oai
from switchyard.protocol.tgi import GenerateParameters
from switchyard.routes.errors import openai_error_json, openai_exception_handlers
from switchyard.state import Gateway
from switchyard.text.chat import ChatMessage, ChatTemplateError, render_chat
from switchyard.validation import GenerationPlan, build_plan, check_parameters
from switchyard_spec import FinishReason

DONE = "[DONE]"


def _finish(reason: FinishReason) -> oai.FinishReasonOpenAI:
    return "length" if reason is FinishReason.LENGTH else "stop"


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _parameters(
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    stop: str | list[str] | None,
    seed: int | None,
    frequency_penalty: float | None,
    presence_penalty: float | None,
    top_n_tokens: int,
    logit_bias: dict[str, float] | None,
    n: int | None,
) -> GenerateParameters:
    """Map OpenAI sampling fields onto TGI's, with OpenAI's ranges checked first."""
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise validation_error("`temperature` must be >= 0.0 and <= 2.0", param="temperature")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise validation_error("`top_p` must be > 0.0 and <= 1.0", param="top_p")
    if presence_penalty is not None and not -2.0 <= presence_penalty <= 2.0:
        raise validation_error(
            "`presence_penalty` must be >= -2.0 and <= 2.0", param="presence_penalty"
        )
    if max_tokens is not None and max_tokens <= 0:
        raise validation_error("`max_tokens` must be strictly positive", param="max_tokens")
    if n is not None and n != 1:
        raise validation_error("`n` other than 1 is not supported by this server yet", param="n")
    if logit_bias:
        raise validation_error("`logit_bias` is not supported by this server yet", param="logit_bias")
    greedy = temperature == 0.0
    return GenerateParameters(
        # OpenAI's default temperature is 1: absent temperature samples, 0 is greedy.
        do_sample=not greedy,
        temperature=None if greedy else temperature,
        top_p=None if top_p is None or top_p >= 1.0 else top_p,
        max_new_tokens=max_tokens,
        stop=_stops(stop),
        seed=seed,
        frequency_penalty=frequency_penalty,
        top_n_tokens=top_n_tokens,
        details=True,
    )


def _message_text(message: oai.ChatMessageIn) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise validation_error(
                f"content part of type {part.type!r} is not supported by this model",
                param="messages",
            )
        parts.append(part.text)
    return "".join(parts)


def plan_chat(gw: Gateway, model: ServedModel, req: oai.ChatCompletionRequest) -> GenerationPlan:
    """Validate a chat request, render its template and tokenize it."""
    if not req.messages:
        raise validation_error("`messages` cannot be empty", param="messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise validation_error("`top_logprobs` requires `logprobs` to be true", param="top_logprobs")
    params = _parameters(
        max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=req.stop,
        seed=req.seed,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        top_n_tokens=req.top_logprobs or 0,
        logit_bias=req.logit_bias,
        n=req.n,
    )
    check_parameters(params, gw.settings)
    messages = [ChatMessage(role=m.role, content=_message_text(m)) for m in req.messages]
    try:
        prompt = render_chat(model.tokenizer, messages)
    except ChatTemplateError as exc:
        raise ApiError(422, str(exc), "template_error") from exc
    ids = model.tokenizer.encode(prompt, add_special_tokens=False)
    return build_plan(
        ids, params, model.limits, model.info.eos_token_ids,
        presence_penalty=req.presence_penalty or 0.0, include_stop=False,
    )


def _logprobs(model: ServedModel, steps: Sequence[Step]) -> oai.ChoiceLogprobs:
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


async def _run(model: ServedModel, plan: GenerationPlan, prefix: str) -> tuple[list[Step], Finished]:
    steps: list[Step] = []
    async for step in generate(model, plan, prefix):
        steps.append(step)
        if step.finished is not None:
            return steps, step.finished
    raise ApiError(500, "Incomplete generation", "incomplete_generation")


def _sse(events: AsyncIterator[str]) -> ServerSentEvent:
    return ServerSentEvent(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@post("/v1/chat/completions", status_code=200, summary="OpenAI chat completions", tags=["OpenAI"])
async def chat_completions(
    gw: Gateway, data: oai.ChatCompletionRequest
) -> Response[oai.ChatCompletion] | ServerSentEvent:
    """Answer a chat conversation, as one JSON body or as server-sent chunks."""
    model = gw.model(data.model)
    plan = plan_chat(gw, model, data)
    ident = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    want_logprobs = bool(data.logprobs)
    if data.stream:
        # 429 before the stream starts; the stream takes its permit when it runs, so a
        # stream that never runs holds none.
        model.admission.check()
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        return _sse(_chat_stream(gw, model, plan, ident, created, want_logprobs, include_usage))
    model.admission.acquire()
    try:
        steps, done = await _run(model, plan, "chat")
    finally:
        model.admission.release()
    body = oai.ChatCompletion(
        id=ident,
        created=created,
        model=model.name,
        system_fingerprint=gw.system_fingerprint,
        choices=[
            oai.ChatChoice(
                index=0,
                message=oai.ChatMessageOut(role="assistant", content=done.generated_text),
                logprobs=_logprobs(model, steps) if want_logprobs else None,
                finish_reason=_finish(done.reason),
            )
        ],
        usage=oai.Usage(
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.generated_tokens,
            total_tokens=done.prompt_tokens + done.generated_tokens,
        ),
    )
    return Response(body, status_code=200)


async def _chat_stream(
    gw: Gateway,
    model: ServedModel,
    plan: GenerationPlan,
    ident: str,
    created: int,
    want_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    def chunk(delta: oai.ChatDelta, finish: FinishReason | None, lp: oai.ChoiceLogprobs | None) -> str:
        choice = oai.ChatChunkChoice(
            index=0, delta=delta, logprobs=lp, finish_reason=_finish(finish) if finish else None
        )
        return msgspec.json.encode(
            oai.ChatCompletionChunk(
                id=ident, created=created, model=model.name,
                system_fingerprint=gw.system_fingerprint, choices=[choice],
            )
        ).decode()

    try:
        model.admission.acquire()
    except ApiError as exc:
        yield openai_error_json(exc).decode()
        yield DONE
        return
    try:
        yield chunk(oai.ChatDelta(role="assistant", content=""), None, None)
        async for step in generate(model, plan, "chat-stream"):
            done = step.finished
            lp = _logprobs(model, [step]) if want_logprobs else None
            if step.text or done is not None or lp is not None:
                yield chunk(oai.ChatDelta(content=step.text), done.reason if done else None, lp)
            if done is not None and include_usage:
                usage = oai.Usage(
                    prompt_tokens=done.prompt_tokens,
                    completion_tokens=done.generated_tokens,
                    total_tokens=done.prompt_tokens + done.generated_tokens,
                )
                yield msgspec.json.encode(
                    oai.ChatCompletionChunk(
                        id=ident, created=created, model=model.name,
                        system_fingerprint=gw.system_fingerprint, choices=[], usage=usage,
                    )
                ).decode()
    except ApiError as exc:
        yield openai_error_json(exc).decode()
    finally:
        model.admission.release()
    yield DONE


def plan_completion(gw: Gateway, model: ServedModel, req: oai.CompletionRequest) -> list[GenerationPlan]:
    """Validate a completion request: one plan per prompt."""
    prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
    if not prompts:
        raise validation_error("`prompt` cannot be empty", param="prompt")
    if len(prompts) > gw.settings.max_client_batch_size:
        raise ApiError(
            422,
            "Number of prompts exceeds the maximum allowed batch size of "
            f"{gw.settings.max_client_batch_size}",
            "batch size exceeded",
            param="prompt",
        )
    if req.suffix is not None:
        raise ApiError(
            422,
            "Suffix is not supported and can be achieved by preprocessing the prompt.",
            "suffix not supported",
            param="suffix",
        )
    if req.logprobs:
        raise validation_error("`logprobs` is not supported on completions yet", param="logprobs")
    params = _parameters(
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, stop=req.stop,
        seed=req.seed, frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty, top_n_tokens=0, logit_bias=req.logit_bias, n=req.n,
    )
    if req.repetition_penalty is not None:
        params.repetition_penalty = req.repetition_penalty
    check_parameters(params, gw.settings)
    plans = []
    for prompt in prompts:
        if not prompt:
            raise validation_error("`prompt` cannot be empty", param="prompt")
        ids = model.tokenizer.encode(prompt, add_special_tokens=True)
        plans.append(
            build_plan(ids, params, model.limits, model.info.eos_token_ids,
                       presence_penalty=req.presence_penalty or 0.0, include_stop=False)
        )
    return plans


@post("/v1/completions", status_code=200, summary="OpenAI completions", tags=["OpenAI"])
async def completions(
    gw: Gateway, data: oai.CompletionRequest
) -> Response[oai.Completion] | ServerSentEvent:
    """Complete one prompt or a list of prompts (each an independent sequence)."""
    model = gw.model(data.model)
    plans = plan_completion(gw, model, data)
    prompts = [data.prompt] if isinstance(data.prompt, str) else list(data.prompt)
    ident = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if data.stream:
        model.admission.check()
        return _sse(_completion_stream(gw, model, plans, prompts, data.echo, ident, created))
    model.admission.acquire()
    try:
        results = await asyncio.gather(*(_run(model, p, "cmpl") for p in plans))
    finally:
        model.admission.release()
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for index, ((_, done), prompt) in enumerate(zip(results, prompts, strict=True)):
        text = prompt + done.generated_text if data.echo else done.generated_text
        choices.append(oai.CompletionChoice(index=index, text=text, logprobs=None,
                                            finish_reason=_finish(done.reason)))
        prompt_tokens += done.prompt_tokens
        completion_tokens += done.generated_tokens
    body = oai.Completion(
        id=ident, created=created, model=model.name, system_fingerprint=gw.system_fingerprint,
        choices=choices,
        usage=oai.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                        total_tokens=prompt_tokens + completion_tokens),
    )
    return Response(body, status_code=200)


async def _completion_stream(
    gw: Gateway,
    model: ServedModel,
    plans: list[GenerationPlan],
    prompts: list[str],
    echo: bool,
    ident: str,
    created: int,
) -> AsyncIterator[str]:
    """Chunks of all prompts, interleaved as they are produced, each with its `index`."""
    queue: asyncio.Queue[tuple[int, Step] | ApiError | None] = asyncio.Queue()

    async def pump(index: int, plan: GenerationPlan) -> None:
        try:
            async for step in generate(model, plan, "cmpl-stream"):
                await queue.put((index, step))
        except ApiError as exc:
            await queue.put(exc)
        finally:
            await queue.put(None)

    def chunk(index: int, text: str, finish: FinishReason | None) -> str:
        choice = oai.CompletionChoice(index=index, text=text, logprobs=None,
                                      finish_reason=_finish(finish) if finish else None)
        return msgspec.json.encode(
            oai.Completion(id=ident, created=created, model=model.name,
                           system_fingerprint=gw.system_fingerprint, choices=[choice])
        ).decode()

    try:
        model.admission.acquire()
    except ApiError as exc:
        yield openai_error_json(exc).decode()
        yield DONE
        return
    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(plans)]
    try:
        if echo:
            for index, prompt in enumerate(prompts):
                yield chunk(index, prompt, None)
        live = len(tasks)
        while live:
            item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, ApiError):
                yield openai_error_json(item).decode()
            else:
                index, step = item
                done = step.finished
                if step.text or done is not None:
                    yield chunk(index, step.text, done.reason if done else None)
    finally:
        for task in tasks:
            task.cancel()
        model.admission.release()
    yield DONE


@get("/v1/models", summary="Served models", tags=["OpenAI"])
async def list_models(gw: Gateway) -> oai.ModelList:
    """The names clients may put in `model`."""
    return oai.ModelList(
        data=[oai.ModelCard(id=m.name, created=0, owned_by=m.model_id.split("/")[0])
              for m in gw.registry.models()]
    )


router = Router(
    path="/",
    route_handlers=[chat_completions, completions, list_models],
    exception_handlers=openai_exception_handlers(),
)
