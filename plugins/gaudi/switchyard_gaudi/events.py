"""From sampled tokens to the gateway's events, with exactly one ending per sequence.

Sinks are called from the engine's thread; a failing sink is logged and never
allowed to stop the loop. The first event of a sequence carries its queue
time (submit to the start of its prefill step) and, when asked, its prompt's
log-probabilities. ``TokenEvent.cached_tokens`` stays 0: the engine has no
prefix cache (every prefill computes its whole prompt into its row).
"""

from __future__ import annotations

from switchyard_engine.lifecycle import deliver, finish_reason
from switchyard_engine.sampling import SampledToken
from switchyard_spec import FinishReason, TokenEvent

from switchyard_gaudi.sequence import GaudiSequence


def record(seq: GaudiSequence, sampled: SampledToken) -> FinishReason | None:
    """Append a sampled token to ``seq``, send its event, and say whether it finished."""
    seq.tokens.append(sampled.token_id)
    seq.sampler.record(sampled.token_id)
    finish = finish_reason(seq, sampled.token_id)
    first = seq.generated == 1
    event = TokenEvent(
        request_id=seq.request_id, token_id=sampled.token_id, logprob=sampled.logprob,
        top_tokens=sampled.top_tokens, finish_reason=finish, seed=seq.sampler.seed,
        prompt_tokens=seq.prompt_len,
        prompt_logprobs=tuple(seq.prompt_logprobs) if first else (),
        prompt_top_tokens=tuple(seq.prompt_top_tokens) if first else (),
        queue_seconds=_queue_seconds(seq) if first else None,
    )
    if first:  # delivered: not held for the sequence's life
        seq.forget_prompt_scores()
    deliver(seq.sink, event)
    return finish


def end(seq: GaudiSequence, finish: FinishReason | None = None, error: str | None = None) -> None:
    """End ``seq`` without a token: aborted, shut down, or failed (``error``)."""
    deliver(seq.sink, TokenEvent(
        request_id=seq.request_id, token_id=-1, finish_reason=finish, error=error,
        seed=seq.sampler.seed, prompt_tokens=seq.prompt_len,
        queue_seconds=_queue_seconds(seq) if seq.generated == 0 else None))


def _queue_seconds(seq: GaudiSequence) -> float | None:
    return None if seq.started_at is None else seq.started_at - seq.queued_at
