"""One sequence's life on the gateway side: engine token events in, text steps out.

`generate` submits a validated plan to the model's engine and, per token,
detokenizes incrementally, matches stop strings on the text (holding back what
could begin one) and reports what a client may see now. A matched stop string
or an early close by the caller aborts the engine sequence at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from switchyard.errors import generation_error
from switchyard.models.served import ServedModel, new_request_id
from switchyard.text.detokenizer import IncrementalDetokenizer
from switchyard.text.stops import StopMatcher
from switchyard.validation import GenerationPlan
from switchyard_spec import EngineRequest, FinishReason, TopToken


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


class Step(msgspec.Struct, frozen=True, kw_only=True):
    """What one engine event means for the client.

    `text` is the newly visible text (stop-string hold-back applied), which can
    be empty. `finished` is set on the last step only.
    """

    token: GeneratedToken
    text: str
    finished: Finished | None = None


async def generate(model: ServedModel, plan: GenerationPlan, id_prefix: str) -> AsyncIterator[Step]:
    """Run one sequence and yield a `Step` per generated token.

    Raises `ApiError` (424) if the engine fails the sequence.
    """
    request = EngineRequest(
        request_id=new_request_id(id_prefix),
        prompt_token_ids=plan.prompt_ids,
        sampling=plan.sampling,
        stopping=plan.stopping,
    )
    tokenizer = model.tokenizer
    detok = IncrementalDetokenizer(
        tokenizer, skip_special_tokens=True, prompt_ids=plan.prompt_ids
    )
    stops = StopMatcher(plan.stop_strings, include_stop=plan.include_stop) if plan.stop_strings else None
    text_parts: list[str] = []
    count = 0
    prompt_tokens = len(plan.prompt_ids)
    seed = plan.sampling.seed if plan.sampling.do_sample else None
    events = model.stream(request)
    try:
        async for event in events:
            if event.error is not None:
                raise generation_error(event.error)
            if event.finish_reason is FinishReason.ABORTED:
                raise generation_error("the engine aborted the sequence")
            count += 1
            special = tokenizer.is_special(event.token_id)
            delta = detok.step(event.token_id)
            token = GeneratedToken(
                id=event.token_id,
                text=tokenizer.token_text(event.token_id) if special else delta,
                logprob=event.logprob,
                special=special,
                top_tokens=event.top_tokens,
            )
            reason = event.finish_reason
            if reason is not None:
                delta += detok.flush()  # an incomplete character at the very end
            visible = delta
            if stops is not None:
                visible, matched = stops.feed(delta)
                if matched:
                    reason = FinishReason.STOP_SEQUENCE
                elif reason is not None:
                    visible += stops.flush()
            text_parts.append(visible)
            finished = None
            if reason is not None:
                finished = Finished(
                    reason=reason,
                    generated_text="".join(text_parts),
                    generated_tokens=count,
                    prompt_tokens=event.prompt_tokens or prompt_tokens,
                    seed=seed,
                )
            yield Step(token=token, text=visible, finished=finished)
            if finished is not None:
                return
    finally:
        # Closing the engine stream aborts the sequence if it has not ended.
        await events.aclose()
