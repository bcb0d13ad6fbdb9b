"""From a step's results to the gateway's events: append tokens, decide who stops, emit.

Every submitted sequence ends with exactly one event that has ``finish_reason``
or ``error`` set; sinks are called from the loop thread and a failing sink is
logged, never allowed to stop the loop.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from switchyard_engine.lifecycle import deliver, finish_reason
from switchyard_engine.sampling import SampledToken
from switchyard_spec import FinishReason, TokenEvent, TopToken

from switchyard_xeon.scheduler import Scheduler
from switchyard_xeon.sequence import Sequence


def record_results(sched: Scheduler, batch: Seq[Sequence],
                   results: Seq[SampledToken | None]) -> None:
    """After a successful step: commit it, append each new token, finish and emit.

    A ``None`` result is a prefill chunk short of its prompt's end: no token yet.
    """
    sched.complete(list(batch))
    for seq, res in zip(batch, results, strict=True):
        if res is None:
            continue
        if res.error is not None:  # this row could not be served (its grammar failed)
            sched.finish(seq)
            emit(seq, -1, error=res.error)
            continue
        seq.tokens.append(res.token_id)
        seq.sampler.record(res.token_id)
        finish = finish_reason(seq, res.token_id)
        if finish is not None:
            sched.finish(seq)
        prompt_logprobs: tuple[float, ...] = ()
        prompt_top: tuple[tuple[TopToken, ...], ...] = ()
        if seq.generated == 1 and seq.request.prompt_logprobs:
            prompt_logprobs = tuple(seq.prompt_logprobs)
            prompt_top = tuple(seq.prompt_top_tokens)
            seq.forget_prompt_scores()  # delivered: do not hold them for the sequence's life
        emit(seq, res.token_id, res.logprob, res.top_tokens, finish=finish,
             prompt_logprobs=prompt_logprobs, prompt_top_tokens=prompt_top)


def emit(seq: Sequence, token_id: int, logprob: float = 0.0,
         top_tokens: tuple[TopToken, ...] = (), finish: FinishReason | None = None,
         error: str | None = None, prompt_logprobs: tuple[float, ...] = (),
         prompt_top_tokens: tuple[tuple[TopToken, ...], ...] = ()) -> None:
    """Send one event of ``seq`` to its sink."""
    deliver(seq.sink, TokenEvent(
        request_id=seq.request_id, token_id=token_id, logprob=logprob,
        top_tokens=top_tokens, finish_reason=finish, error=error,
        seed=seq.sampler.seed, prompt_tokens=seq.prompt_len,
        cached_tokens=seq.cached_tokens or 0,
        prompt_logprobs=prompt_logprobs, prompt_top_tokens=prompt_top_tokens,
    ))

