"""After a successful step: commit it in the scheduler, then each new token's event.

The events themselves are the toolkit's (:mod:`switchyard_engine.events`):
every submitted sequence ends with exactly one event that has
``finish_reason`` or ``error`` set.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from switchyard_engine.events import emit_token, end
from switchyard_engine.sampling import SampledToken

from switchyard_xeon.scheduler import Scheduler
from switchyard_xeon.sequence import Sequence


def record_results(sched: Scheduler, batch: Seq[Sequence],
                   results: Seq[SampledToken | None]) -> None:
    """Commit the step, then append each new token, emit it, and finish who stopped.

    A ``None`` result is a prefill chunk short of its prompt's end: no token yet.
    A sequence stops at the first token that finishes it, even mid-way through the
    tokens a speculative step kept.
    """
    sched.complete(list(batch), results)
    for seq, res in zip(batch, results, strict=True):
        if res is None:
            continue
        if res.error is not None:  # this row could not be served (its grammar failed)
            sched.finish(seq)
            end(seq, error=res.error)
            continue
        # A step that verified drafts emits the kept ones and its own token after them; the
        # sampler recorded all but the last while verifying (``runner._verify``).
        emitted = (res, *res.more)
        for i, token in enumerate(emitted):
            if emit_token(seq, token, recorded=i < len(emitted) - 1) is not None:
                sched.finish(seq)
                break
