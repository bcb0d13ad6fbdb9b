"""`POST /v1/completions`: OpenAI's legacy completions, one prompt or a list.

Each prompt gets `n` choices; every choice is an independent sequence and all
of them are submitted together (`best_of` candidates per prompt, of which the
`n` with the highest mean token log-probability are returned). Choice `index`
is `prompt_index * n + j`, as OpenAI numbers them; a stream interleaves the
choices' chunks.

Scoring (`echo` with `logprobs`, and `max_tokens: 0`): the prompt's own token
log-probabilities come from the engine's prefill of the first candidate of each
prompt (the others would compute the same numbers), and are put before the
generated tokens' in every choice of that prompt. A stream sends them in each
choice's echo chunk, so that chunk waits for the first candidate's first token.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from litestar.response import ServerSentEvent, Stream

from switchyard import openapi
from switchyard.errors import ApiError
from switchyard.generation import (
    Completed,
    Finished,
    Step,
    close_all,
    collect_all,
    interleave,
    start_all,
)
from switchyard.remote.model import RemoteModel
from switchyard.models.served import ServedModel
from switchyard.protocol import openai as oai
from switchyard.remote import forward as remote
from switchyard.routes.auth import require_api_key
from switchyard.routes.content_type import require_json
from switchyard.routes.disconnect import unless_client_leaves
from switchyard.openai_mapping.completion_logprobs import echo_logprobs, generated_logprobs, joined
from switchyard.openai_mapping.extras import chunk_usage, prompt_logprobs
from switchyard.openai_mapping.streaming import DONE, error_event, finish_reason, sse, usage
from switchyard.openai_mapping.plans import CompletionPlan, plan_completion
from switchyard.state import Gateway
from switchyard.text.echo import EchoedPrompt
from switchyard.planning.plan import fan_out


class _Answer:
    """A validated completion request and what every choice of its answer needs."""

    def __init__(self, gw: Gateway, model: ServedModel, data: oai.CompletionRequest) -> None:
        self.model = model
        self.plan: CompletionPlan = plan_completion(gw, model, data)
        req = self.plan
        self.echo = data.echo
        self.logprobs = data.logprobs is not None
        self.alternatives = data.logprobs or 0
        """`logprobs`: alternatives per token (the engine may report more, for
        `prompt_logprobs`)."""
        self.extras = self.plan.extras
        self.include_usage = bool(data.stream_options and data.stream_options.include_usage)
        self.ident = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.fingerprint = gw.system_fingerprint
        tokenizer = model.tokenizer
        self.prefixes = [p.echo_text(tokenizer) if self.echo else "" for p in req.prompts]
        """Per prompt: the text its choices start with (the prompt, when echoed)."""
        self.echoes: list[EchoedPrompt | None] = [
            p.echoed(tokenizer) if self.echo and self.logprobs else None for p in req.prompts]
        """Per prompt: its tokens' texts and offsets, when echoed with logprobs."""
        self.candidates = [copy for plan in req.plans for copy in fan_out(plan, req.best_of)]
        """`best_of` candidates per prompt; each prompt's first one scores the prompt."""

    def prompt_of(self, run: int) -> int:
        """The prompt a run (a candidate) belongs to."""
        return run // self.plan.best_of

    def chunk(self, choices: list[oai.CompletionChoice], used: oai.Usage | None = None,
              generated: int | None = None) -> str:
        """One streamed event (with `continuous_usage_stats`, its choice's usage so far:
        ``generated`` tokens)."""
        if used is None and generated is not None and self.extras.continuous_usage:
            prompt = self.plan.prompts[self.prompt_of(choices[0].index)]
            used = chunk_usage(len(prompt.ids), generated)
        return msgspec.json.encode(oai.Completion(
            id=self.ident, created=self.created, model=self.model.name,
            system_fingerprint=self.fingerprint, choices=choices, usage=used)).decode()

    def usage(self, finished: Sequence[Finished]) -> oai.Usage:
        """Usage of the whole request: each prompt once, every candidate's tokens."""
        firsts = [done for i, done in enumerate(finished) if i % self.plan.best_of == 0]
        # Scoring generated one token per sequence to drop it: none reached the client.
        return usage(firsts, [] if self.plan.score_only else finished)

    def echo_part(self, prompt: int, scores: Step | Finished) -> oai.CompletionLogprobs | None:
        """The echoed prompt's `logprobs` entries (None unless echoed with logprobs)."""
        echoed = self.echoes[prompt]
        if echoed is None:
            return None
        return echo_logprobs(self.model, echoed, scores.prompt_logprobs,
                             scores.prompt_top_tokens, self.alternatives)

    def prompt_extras(self, prompt: int, scores: Finished | None
                      ) -> tuple[list[int] | msgspec.UnsetType,
                                 oai.PromptLogprobs | msgspec.UnsetType]:
        """A choice's `prompt_token_ids` and `prompt_logprobs`, each where asked for."""
        extras = self.extras
        ids = self.plan.plans[prompt].prompt_ids
        token_ids = list(ids) if extras.token_ids else msgspec.UNSET
        logprobs: oai.PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
        if extras.prompt_logprobs is not None and scores is not None:
            logprobs = prompt_logprobs(self.model, ids, scores.prompt_logprobs,
                                       scores.prompt_top_tokens, extras.prompt_logprobs)
        return token_ids, logprobs

    def choice(self, prompt: int, index: int, result: Completed,
               echoed: oai.CompletionLogprobs | None,
               scores: Finished | None = None) -> oai.CompletionChoice:
        """One choice of a non-streamed answer (``scores``: the prompt's first candidate's
        end, which carries the prompt's log-probabilities)."""
        prefix = self.prefixes[prompt]
        done = result.finished
        steps = [] if self.plan.score_only else result.steps
        lp = None
        if self.logprobs:
            lp = generated_logprobs(self.model, steps, len(prefix), self.alternatives,
                                    self.extras.tokens_as_ids)[0]
            if echoed is not None:
                lp = joined(echoed, lp)
        text = prefix if self.plan.score_only else prefix + done.generated_text
        prompt_ids, prompt_lp = self.prompt_extras(prompt, scores)
        return oai.CompletionChoice(
            index=index, text=text, logprobs=lp, finish_reason=self.finish(done),
            token_ids=[s.token.id for s in steps] if self.extras.token_ids else msgspec.UNSET,
            prompt_token_ids=prompt_ids, prompt_logprobs=prompt_lp)

    def finish(self, done: Finished) -> oai.FinishReasonOpenAI:
        """The choice's finish reason; scoring generates nothing, up to its limit of 0."""
        return "length" if self.plan.score_only else finish_reason(done.reason)


async def completion_response(
    gw: Gateway, data: oai.CompletionRequest, raw: bytes | None = None
) -> Response[oai.Completion] | ServerSentEvent | Stream:
    """Answer a completion request (shared by the route and `/invocations`).

    ``raw``, the body as sent, is what a remote model's replica is sent.
    """
    target = gw.resolve(data.model)
    if isinstance(target, RemoteModel) and raw is not None:
        return await remote.forward(target, "openai", "/v1/completions", raw, bool(data.stream))
    model = gw.model(data.model)
    answer = _Answer(gw, model, data)
    if data.stream:
        model.admission.check()
        return sse(_completion_stream(answer))
    model.admission.acquire()
    try:
        results = await collect_all(start_all(model, answer.candidates, "cmpl"))
    finally:
        model.admission.release()
    req = answer.plan
    choices = []
    for prompt in range(len(req.prompts)):
        group = results[prompt * req.best_of : (prompt + 1) * req.best_of]
        echoed = answer.echo_part(prompt, group[0].finished)
        # The best candidates first; with best_of == n all of them, in order.
        chosen = (group if req.best_of == req.n
                  else sorted(group, key=lambda r: r.mean_logprob, reverse=True)[: req.n])
        for j, result in enumerate(chosen):
            choices.append(answer.choice(prompt, prompt * req.n + j, result, echoed,
                                         group[0].finished))
    body = oai.Completion(
        id=answer.ident, created=answer.created, model=model.name,
        system_fingerprint=answer.fingerprint, choices=choices,
        usage=answer.usage([r.finished for r in results]),
    )
    return Response(body, status_code=200)


class _StreamState:
    """Per choice: where its next token's text starts, and how it ended.

    A stream never has more candidates than choices (`best_of` > `n` is not
    streamed), so run `i` is choice `i`.
    """

    def __init__(self, answer: _Answer) -> None:
        self.answer = answer
        count = len(answer.candidates)
        self.offsets = [len(answer.prefixes[answer.prompt_of(i)]) for i in range(count)]
        self.finished: list[Finished | None] = [None] * count
        self.generated = [0] * count
        """Per choice: tokens generated so far (`continuous_usage_stats`)."""
        self.sent_prompt = [False] * count
        """Per choice: whether its `prompt_token_ids` went out (on its first chunk)."""
        # Echo chunks that carry the prompt's scores wait for them (its first run's first
        # step); steps of the prompt's other runs that arrive before wait with them.
        waiting = answer.echo and answer.logprobs
        self.open = [not waiting] * len(answer.plan.prompts)
        self.held: list[list[tuple[int, Step]]] = [[] for _ in answer.plan.prompts]

    def echo_chunks(self, prompt: int, scores: Step | None) -> list[str]:
        """The echo chunk of each choice of `prompt`, with the prompt's scores when asked."""
        a = self.answer
        n = a.plan.n
        lp = a.echo_part(prompt, scores) if scores is not None else None
        return [a.chunk([oai.CompletionChoice(index=index, text=a.prefixes[prompt], logprobs=lp,
                                              finish_reason=None)], generated=0)
                for index in range(prompt * n, (prompt + 1) * n)]

    def feed(self, index: int, step: Step) -> list[str]:
        """The chunks one step of run `index` releases (several when it opens its prompt)."""
        a = self.answer
        prompt = a.prompt_of(index)
        if self.open[prompt]:
            return self._step_chunk(index, step)
        if index % a.plan.best_of:
            self.held[prompt].append((index, step))
            return []
        self.open[prompt] = True
        out = self.echo_chunks(prompt, step)
        for held_index, held_step in [*self.held[prompt], (index, step)]:
            out += self._step_chunk(held_index, held_step)
        self.held[prompt] = []
        return out

    def _step_chunk(self, index: int, step: Step) -> list[str]:
        a = self.answer
        done = step.finished
        if done is not None:
            self.finished[index] = done
        self.generated[index] += 1
        text, lp = step.text, None
        if a.plan.score_only:
            text = ""  # the token scoring generated is dropped
        elif a.logprobs:
            lp, self.offsets[index] = generated_logprobs(
                a.model, [step], self.offsets[index], a.alternatives, a.extras.tokens_as_ids)
        ids = [step.token.id] if a.extras.token_ids and not a.plan.score_only else None
        if not (text or done is not None or lp is not None or ids):
            return []
        # The prompt's ids go with a choice's first chunk (prompt logprobs are not streamed).
        prompt_ids = (a.prompt_extras(a.prompt_of(index), None)[0]
                      if not self.sent_prompt[index] else msgspec.UNSET)
        self.sent_prompt[index] = True
        return [a.chunk([oai.CompletionChoice(
            index=index, text=text, logprobs=lp,
            finish_reason=a.finish(done) if done is not None else None,
            token_ids=ids if ids is not None else msgspec.UNSET, prompt_token_ids=prompt_ids)],
            generated=0 if a.plan.score_only else self.generated[index])]


async def _completion_stream(answer: _Answer) -> AsyncIterator[str]:
    """Chunks of every choice, interleaved as they are produced, each with its `index`."""
    model = answer.model
    try:
        model.admission.acquire()
    except ApiError as exc:
        yield error_event(exc)
        yield DONE
        return
    runs = []
    state = _StreamState(answer)
    try:
        runs = start_all(model, answer.candidates, "cmpl-stream")
        if answer.echo and not answer.logprobs:  # nothing to wait for: echo at once
            for prompt in range(len(answer.plan.prompts)):
                for event in state.echo_chunks(prompt, None):
                    yield event
        # Closed here, not left to the garbage collector: a client that goes away
        # must stop the sequences' reader tasks at once.
        async with aclosing(interleave(runs)) as steps:
            async for index, step in steps:
                for event in state.feed(index, step):
                    yield event
        ended = [done for done in state.finished if done is not None]
        if answer.include_usage and len(ended) == len(state.finished):
            yield answer.chunk([], answer.usage(ended))
    except ApiError as exc:
        yield error_event(exc)
    finally:
        close_all(runs)
        model.admission.release()
    yield DONE


@post("/v1/completions", status_code=200, summary="OpenAI completions", tags=["OpenAI"],
      guards=[require_api_key, require_json], **openapi.COMPLETIONS)
async def completions(
    gw: NamedDependency[Gateway], data: JSONBody[oai.CompletionRequest],
    request: Request[Any, Any, Any],
) -> Response[oai.Completion] | ServerSentEvent:
    """Complete one prompt or a list of prompts, `n` choices each (of `best_of` candidates)."""
    return await unless_client_leaves(request,
                                      completion_response(gw, data, await request.body()))
