"""From sampled tokens to the gateway's events, with exactly one ending per sequence.

Every engine sends its events through these three functions, so every engine
means the same by them:

- :func:`emit_token`: a sampled token is appended, recorded in the sampler,
  checked for a finish (:func:`~switchyard_engine.lifecycle.finish_reason`) and
  sent; the first token's event carries the prompt's scores (then dropped)
  and the queue time.
- :func:`end`: a sequence ends without a token (aborted, shut down, failed).
- :func:`refuse`: a request ends before it became a sequence.

Sinks are called from the engine's compute thread; a failing sink is logged
(:func:`~switchyard_engine.lifecycle.deliver`), never allowed to stop the loop.
"""

from __future__ import annotations

import time

from switchyard_spec import EngineRequest, EventSink, FinishReason, TokenEvent, TopToken

from switchyard_engine.lifecycle import deliver, finish_reason
from switchyard_engine.sampling import SampledToken
from switchyard_engine.sequence import BaseSequence


def emit_token(seq: BaseSequence, sampled: SampledToken,
               recorded: bool = False) -> FinishReason | None:
    """Append ``sampled`` to ``seq``, send its event, and say whether ``seq`` finished.

    ``recorded``: the sampler has seen the token already (speculative decoding records
    a step's kept tokens while it verifies the next one).
    """
    seq.tokens.append(sampled.token_id)
    if not recorded:
        seq.sampler.record(sampled.token_id)
    finish = finish_reason(seq, sampled.token_id)
    first = seq.generated == 1
    prompt_logprobs: tuple[float, ...] = ()
    prompt_top: tuple[tuple[TopToken, ...], ...] = ()
    if first:  # delivered with this event: not held for the sequence's life
        prompt_logprobs, prompt_top = tuple(seq.prompt_logprobs), tuple(seq.prompt_top_tokens)
        seq.forget_prompt_scores()
    deliver(seq.sink, TokenEvent(
        request_id=seq.request_id, token_id=sampled.token_id, logprob=sampled.logprob,
        top_tokens=sampled.top_tokens, finish_reason=finish, seed=seq.sampler.seed,
        prompt_tokens=seq.prompt_len, cached_tokens=seq.cached_tokens or 0,
        prompt_logprobs=prompt_logprobs, prompt_top_tokens=prompt_top,
        queue_seconds=seq.queue_seconds() if first else None))
    return finish


def end(seq: BaseSequence, finish: FinishReason | None = None, error: str | None = None) -> None:
    """End ``seq`` without a token: ``finish`` (aborted, shut down) or ``error`` (failed)."""
    deliver(seq.sink, TokenEvent(
        request_id=seq.request_id, token_id=-1, finish_reason=finish, error=error,
        seed=seq.sampler.seed, prompt_tokens=seq.prompt_len,
        cached_tokens=seq.cached_tokens or 0,
        queue_seconds=seq.queue_seconds() if seq.generated == 0 else None))


def refuse(request: EngineRequest, sink: EventSink, error: str | None,
           queued_at: float | None = None, finish: FinishReason | None = None) -> None:
    """End a request that never became a sequence (refused at admission, or the engine is
    shut down); ``queued_at`` (``time.monotonic``) gives its queue time."""
    deliver(sink, TokenEvent(
        request_id=request.request_id, token_id=-1, error=error, finish_reason=finish,
        prompt_tokens=len(request.prompt_token_ids),
        queue_seconds=None if queued_at is None else time.monotonic() - queued_at))
