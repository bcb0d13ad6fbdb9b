"""`POST /v1/completions`: OpenAI's legacy completions, one prompt or a list.

Each prompt gets `n` choices; every choice is an independent sequence and all
of them are submitted together. Choice `index` is `prompt_index * n + j`, as
OpenAI numbers them; a stream interleaves the choices' chunks.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

import msgspec
from litestar import Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from litestar.response import ServerSentEvent

from switchyard import openapi
from switchyard.errors import ApiError
from switchyard.generation import Finished, Step, close_all, collect_all, interleave, start_all
from switchyard.models.served import ServedModel
from switchyard.protocol import openai as oai
from switchyard.routes.auth import require_api_key
from switchyard.routes.openai_common import DONE, error_event, finish_reason, sse, usage
from switchyard.routes.openai_plans import choice_count, completion_prompts, plan_completion
from switchyard.state import Gateway
from switchyard.validation import GenerationPlan, fan_out


def completion_logprobs(
    model: ServedModel, steps: Sequence[Step], offset: int
) -> tuple[oai.CompletionLogprobs, int]:
    """The legacy `logprobs` object for these steps, and the text offset after them.

    `offset` is where the first token's text starts in the choice's text (after
    the prompt when it is echoed). `top_logprobs` always holds the chosen
    token besides the alternatives asked for, as OpenAI's does.
    """
    tok = model.tokenizer
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float]] = []
    text_offset: list[int] = []
    for step in steps:
        t = step.token
        tokens.append(t.text)
        token_logprobs.append(t.logprob)
        alternatives = {tok.token_text(a.id): a.logprob for a in t.top_tokens}
        alternatives.setdefault(t.text, t.logprob)
        top.append(alternatives)
        text_offset.append(offset)
        if not t.special:  # special tokens are not part of the text
            offset += len(t.text)
    return oai.CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs,
                                  top_logprobs=top, text_offset=text_offset), offset


class _Request(msgspec.Struct, kw_only=True):
    """A validated completion request: a plan per choice and what the answer needs."""

    prompts: list[str]
    n: int
    plans: list[GenerationPlan]
    echo: bool
    logprobs: bool
    include_usage: bool
    ident: str
    created: int
    fingerprint: str

    def prefix(self, index: int) -> str:
        """The text a choice starts with: its prompt when echoed."""
        return self.prompts[index // self.n] if self.echo else ""

    def prompt_tokens(self, finished: Sequence[Finished]) -> int:
        """Prompt tokens of the request: each prompt once, whatever `n` is."""
        return sum(done.prompt_tokens for i, done in enumerate(finished) if i % self.n == 0)


async def completion_response(
    gw: Gateway, data: oai.CompletionRequest
) -> Response[oai.Completion] | ServerSentEvent:
    """Answer a completion request (shared by the route and `/invocations`)."""
    model = gw.model(data.model)
    n = choice_count(data.n)
    plans = [copy for plan in plan_completion(gw, model, data) for copy in fan_out(plan, n)]
    req = _Request(
        prompts=completion_prompts(data), n=n, plans=plans, echo=data.echo,
        logprobs=data.logprobs is not None,
        include_usage=bool(data.stream_options and data.stream_options.include_usage),
        ident=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()),
        fingerprint=gw.system_fingerprint,
    )
    if data.stream:
        model.admission.check()
        return sse(_completion_stream(model, req))
    model.admission.acquire()
    try:
        results = await collect_all(start_all(model, plans, "cmpl"))
    finally:
        model.admission.release()
    choices = []
    for index, r in enumerate(results):
        prefix = req.prefix(index)
        lp = completion_logprobs(model, r.steps, len(prefix))[0] if req.logprobs else None
        choices.append(oai.CompletionChoice(
            index=index, text=prefix + r.finished.generated_text, logprobs=lp,
            finish_reason=finish_reason(r.finished.reason),
        ))
    finished = [r.finished for r in results]
    body = oai.Completion(
        id=req.ident, created=req.created, model=model.name, system_fingerprint=req.fingerprint,
        choices=choices, usage=usage(req.prompt_tokens(finished), finished),
    )
    return Response(body, status_code=200)


async def _completion_stream(model: ServedModel, req: _Request) -> AsyncIterator[str]:
    """Chunks of every choice, interleaved as they are produced, each with its `index`."""

    def chunk(choices: list[oai.CompletionChoice], used: oai.Usage | None = None) -> str:
        return msgspec.json.encode(
            oai.Completion(id=req.ident, created=req.created, model=model.name,
                           system_fingerprint=req.fingerprint, choices=choices, usage=used)
        ).decode()

    try:
        model.admission.acquire()
    except ApiError as exc:
        yield error_event(exc)
        yield DONE
        return
    runs = []
    try:
        runs = start_all(model, req.plans, "cmpl-stream")
        offsets = [len(req.prefix(i)) for i in range(len(runs))]
        if req.echo:
            for index in range(len(runs)):
                yield chunk([oai.CompletionChoice(index=index, text=req.prefix(index),
                                                  logprobs=None, finish_reason=None)])
        finished: list[Finished | None] = [None] * len(runs)
        # Closed here, not left to the garbage collector: a client that goes away
        # must stop the sequences' reader tasks at once.
        async with aclosing(interleave(runs)) as steps:
            async for index, step in steps:
                done = step.finished
                lp = None
                if req.logprobs:
                    lp, offsets[index] = completion_logprobs(model, [step], offsets[index])
                if step.text or done is not None or lp is not None:
                    yield chunk([oai.CompletionChoice(
                        index=index, text=step.text, logprobs=lp,
                        finish_reason=finish_reason(done.reason) if done else None,
                    )])
                if done is not None:
                    finished[index] = done
        ended = [done for done in finished if done is not None]
        if req.include_usage and len(ended) == len(finished):
            yield chunk([], usage(req.prompt_tokens(ended), ended))
    except ApiError as exc:
        yield error_event(exc)
    finally:
        close_all(runs)
        model.admission.release()
    yield DONE


@post("/v1/completions", status_code=200, summary="OpenAI completions", tags=["OpenAI"],
      guards=[require_api_key], **openapi.COMPLETIONS)
async def completions(
    gw: NamedDependency[Gateway], data: JSONBody[oai.CompletionRequest]
) -> Response[oai.Completion] | ServerSentEvent:
    """Complete one prompt or a list of prompts, `n` choices each."""
    return await completion_response(gw, data)
