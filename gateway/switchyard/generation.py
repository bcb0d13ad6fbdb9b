"""Sequences on the gateway side: engine token events in, text steps out.

`start` submits a validated plan to the model's engine at once and returns a
`SequenceRun`; its `steps()` detokenizes incrementally, matches stop strings on
the text (holding back what could begin one) and reports what a client may see
now. A matched stop string, an engine failure or `close()` aborts the engine
sequence at once.

Requests with several sequences (OpenAI `n` and multiple prompts, TGI
`best_of`) start all of them before awaiting any, so they reach the engine
together and share its batch; `collect_all` and `interleave` then read them
concurrently.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import msgspec

from switchyard.errors import ApiError, generation_error
from switchyard.models.served import EventStream, ServedModel, new_request_id
from switchyard.telemetry.request import note_sequence
from switchyard.text.detokenizer import IncrementalDetokenizer
from switchyard.text.stops import StopMatcher
from switchyard.planning.plan import GenerationPlan
from switchyard_spec import EngineRequest, FinishReason, TokenEvent, TopToken

log = logging.getLogger("switchyard.generation")


class GeneratedToken(msgspec.Struct, frozen=True, kw_only=True):
    """A generated token with the text it added and its alternatives."""

    id: int
    text: str
    logprob: float
    special: bool
    top_tokens: tuple[TopToken, ...] = ()


class Finished(msgspec.Struct, frozen=True, kw_only=True):
    """How a sequence ended, with its whole text (stop string handling applied)."""

    reason: FinishReason
    generated_text: str
    generated_tokens: int
    prompt_tokens: int
    seed: int | None
    cached_tokens: int = 0
    """Prompt tokens the engine took from its prefix cache instead of computing."""
    prompt_logprobs: tuple[float, ...] = ()
    """Log-probabilities of prompt tokens 1.. (empty unless the plan asked for them
    and the engine reported them)."""
    prompt_top_tokens: tuple[tuple[TopToken, ...], ...] = ()
    """The most likely tokens at each of those positions (when `top_n_tokens` was asked)."""


class Step(msgspec.Struct, frozen=True, kw_only=True):
    """What one engine event means for the client.

    `text` is the newly visible text (stop-string hold-back applied), which can
    be empty. `finished` is set on the last step only.
    """

    token: GeneratedToken
    text: str
    finished: Finished | None = None
    prompt_logprobs: tuple[float, ...] = ()
    """On the first step only: the engine's prompt log-probabilities (see `Finished`),
    so that a stream can send them before the sequence ends."""
    prompt_top_tokens: tuple[tuple[TopToken, ...], ...] = ()
    """On the first step only: the alternatives at each scored prompt position."""


class Completed(msgspec.Struct, frozen=True, kw_only=True):
    """A whole sequence: every step, and how it ended."""

    steps: list[Step]
    finished: Finished

    @property
    def mean_logprob(self) -> float:
        """Mean log-probability of the generated tokens (TGI's `best_of` score)."""
        if not self.steps:
            return float("-inf")
        return sum(s.token.logprob for s in self.steps) / len(self.steps)


class SequenceRun:
    """One sequence submitted to the engine; read it once with `steps()`.

    The engine starts working on it when the run is built. `close()` aborts it
    if it is still running (idempotent); `steps()` closes it when it ends.
    """

    def __init__(self, model: ServedModel, plan: GenerationPlan, id_prefix: str) -> None:
        self.model = model
        self.plan = plan
        request = EngineRequest(
            request_id=new_request_id(id_prefix),
            prompt_token_ids=plan.prompt_ids,
            sampling=plan.sampling,
            stopping=plan.stopping,
            prompt_logprobs=plan.prompt_logprobs,
            constraint=plan.constraint,
            images=plan.images,
            adapter_id=model.adapter_id,
        )
        # The request's telemetry times each sequence: submit, first event, end.
        self._record = note_sequence(
            plan.prompt_ids, 0 if plan.score_only else plan.stopping.max_new_tokens)
        self._events: EventStream = model.submit(request)

    def close(self) -> None:
        """Abort the engine sequence unless it already ended."""
        self._events.close()

    async def steps(self) -> AsyncIterator[Step]:
        """Yield a `Step` per generated token; the last one has `finished` set.

        Raises `ApiError` (424) if the engine fails the sequence, and marks the
        model unhealthy then (TGI does the same after a generation error).
        """
        model, plan = self.model, self.plan
        tokenizer = model.tokenizer
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=plan.skip_special_tokens,
                                       prompt_ids=plan.prompt_ids)
        stops = (StopMatcher(plan.stop_strings, include_stop=plan.include_stop)
                 if plan.stop_strings else None)
        text_parts: list[str] = []
        count = 0
        prompt_logprobs: tuple[float, ...] = ()
        prompt_top: tuple[tuple[TopToken, ...], ...] = ()
        cached = 0
        seed = plan.sampling.seed if plan.sampling.do_sample else None
        record = self._record
        try:
            async for event in self._events:
                if count == 0 and record is not None:
                    record.first(event.queue_seconds)
                _raise_if_failed(model, event)
                first = count == 0
                if first:
                    prompt_logprobs, prompt_top = event.prompt_logprobs, event.prompt_top_tokens
                    cached = event.cached_tokens
                count += 1
                special = tokenizer.is_special(event.token_id)
                delta = detok.step(event.token_id)
                reason = event.finish_reason
                if reason is not None:
                    # An incomplete character at the very end; it belongs to the last
                    # token, so that token texts still add up to the generated text.
                    delta += detok.flush()
                token = GeneratedToken(
                    id=event.token_id,
                    text=tokenizer.token_text(event.token_id) if special else delta,
                    logprob=event.logprob,
                    special=special,
                    top_tokens=event.top_tokens,
                )
                visible = delta
                if reason is FinishReason.EOS_TOKEN and not plan.include_stop:
                    # The end token's own text (a `stop_token_ids` token, or EOS kept by
                    # `skip_special_tokens: false`) is left out of the text, as vLLM does.
                    visible = ""
                if stops is not None:
                    # vLLM's `min_tokens`: no stop string ends the text before then.
                    visible, matched = stops.feed(
                        visible, armed=count >= plan.stopping.min_new_tokens)
                    if matched:
                        reason = FinishReason.STOP_SEQUENCE
                    elif reason is not None:
                        visible += stops.flush()
                text_parts.append(visible)
                finished = None
                if reason is not None:
                    if record is not None:
                        record.end(0 if plan.score_only else count, reason.value)
                    model.healthy = True
                    finished = Finished(
                        reason=reason,
                        generated_text="".join(text_parts),
                        generated_tokens=count,
                        prompt_tokens=event.prompt_tokens or len(plan.prompt_ids),
                        seed=seed,
                        cached_tokens=cached,
                        prompt_logprobs=prompt_logprobs,
                        prompt_top_tokens=prompt_top,
                    )
                yield Step(token=token, text=visible, finished=finished,
                           prompt_logprobs=prompt_logprobs if first else (),
                           prompt_top_tokens=prompt_top if first else ())
                if finished is not None:
                    return
        finally:
            if record is not None and record.ended is None:  # failed or cut short
                record.end(count, None)
            self.close()


def _raise_if_failed(model: ServedModel, event: TokenEvent) -> None:
    if event.error is not None:
        model.healthy = False
        raise generation_error(event.error)
    if event.finish_reason is FinishReason.ABORTED:
        # Only the engine shutting down aborts a sequence the gateway still reads.
        raise generation_error("the engine aborted the sequence")


def start(model: ServedModel, plan: GenerationPlan, id_prefix: str) -> SequenceRun:
    """Submit one sequence to the engine now."""
    return SequenceRun(model, plan, id_prefix)


def start_all(
    model: ServedModel, plans: Sequence[GenerationPlan], id_prefix: str
) -> list[SequenceRun]:
    """Submit several sequences back to back, so the engine batches them together."""
    runs: list[SequenceRun] = []
    try:
        for plan in plans:
            runs.append(SequenceRun(model, plan, id_prefix))
    except BaseException:
        close_all(runs)
        raise
    return runs


def close_all(runs: Sequence[SequenceRun]) -> None:
    """Abort every run that is still going."""
    for run in runs:
        run.close()


async def collect(run: SequenceRun) -> Completed:
    """Read a run to its end."""
    steps: list[Step] = []
    async for step in run.steps():
        steps.append(step)
        if step.finished is not None:
            return Completed(steps=steps, finished=step.finished)
    raise ApiError(500, "Incomplete generation", "incomplete_generation")


async def collect_all(runs: Sequence[SequenceRun]) -> list[Completed]:
    """Read every run to its end, in order; the first failure aborts the others."""
    try:
        return list(await asyncio.gather(*(collect(run) for run in runs)))
    finally:
        close_all(runs)


class _RunDone(msgspec.Struct, frozen=True):
    index: int


async def interleave(runs: Sequence[SequenceRun]) -> AsyncIterator[tuple[int, Step]]:
    """Steps of all runs as they are produced, each with its run's index.

    Raises the first run's `ApiError` as soon as it happens, after aborting the
    other runs; closing the iterator early aborts every run too.
    """
    queue: asyncio.Queue[tuple[int, Step] | _RunDone | ApiError] = asyncio.Queue()

    async def pump(index: int, run: SequenceRun) -> None:
        try:
            async for step in run.steps():
                queue.put_nowait((index, step))
        except ApiError as exc:
            queue.put_nowait(exc)
        except Exception:  # a bug here must still end the client's stream with an error
            log.exception("sequence %d of a multi-sequence request failed", index)
            queue.put_nowait(ApiError(500, "Incomplete generation stream",
                                      "incomplete_generation_stream"))
        finally:
            queue.put_nowait(_RunDone(index))

    tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(runs)]
    try:
        live = len(tasks)
        while live:
            item = await queue.get()
            if isinstance(item, _RunDone):
                live -= 1
            elif isinstance(item, ApiError):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        close_all(runs)


async def generate(model: ServedModel, plan: GenerationPlan, id_prefix: str) -> AsyncIterator[Step]:
    """Run one sequence and yield a `Step` per generated token (see `SequenceRun.steps`)."""
    run = start(model, plan, id_prefix)
    try:
        async for step in run.steps():
            yield step
    finally:
        run.close()
