"""Whether an engine can still generate: cheap answers normally, a real probe after a failure.

Shared by the engines (toolkit): each gives :class:`Liveness` a way to see
that its loop runs and a way to queue a 1-token generation ahead of its queue.

The loop reports each forward step's outcome (``step_failed`` /
``step_succeeded``). While steps succeed, health is free. After a step fails
(and until one succeeds), the engine checks itself with a real 1-token
generation that the loop runs ahead of its queue; a probe that has not
finished by its deadline counts as failed (the loop is stuck or starved).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from switchyard_spec import EventSink, FinishReason, TokenEvent

logger = logging.getLogger("switchyard.engine")

PROBE_TIMEOUT_S = 30.0
"""How long a probe started by :meth:`Liveness.healthy` may run before it counts as failed."""
PROBE_PREFIX = "__probe__"
"""Request ids of liveness probes start with this."""


@dataclass(eq=False)
class _Probe:
    """One liveness probe in flight: a 1-token generation and its outcome."""

    request_id: str
    deadline: float
    """``time.monotonic()`` after which an unfinished probe counts as failed."""
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False


class Liveness:
    """Health state shared by the engine loop and the health callers.

    ``loop_alive`` says whether the compute loop still runs; ``submit_probe``
    hands the loop a 1-token generation with the given request id, ahead of
    its queue, whose events go to the given sink.
    """

    def __init__(self, loop_alive: Callable[[], bool],
                 submit_probe: Callable[[str, EventSink], None]) -> None:
        self._loop_alive = loop_alive
        self._submit_probe = submit_probe
        # Re-entrant, because a refused probe submit calls the probe's sink on the caller's thread.
        self._lock = threading.RLock()
        self._step_failed = False
        """A forward step failed and none has succeeded since."""
        self._probe_failed = False
        """The last liveness probe failed or overran its deadline."""
        self._probe: _Probe | None = None
        self._probe_ids = itertools.count()

    # ------------------------------------------------------ from the loop
    def step_failed(self) -> None:
        """A forward step raised."""
        with self._lock:
            self._step_failed = True

    def step_succeeded(self) -> None:
        """A forward step went through: the model runs again."""
        if self._step_failed or self._probe_failed:
            with self._lock:
                self._step_failed = self._probe_failed = False

    # ---------------------------------------------------- from the callers
    def healthy(self) -> bool:
        """Cheap and non-blocking: the loop is alive and no liveness probe has failed.

        After a forward step fails (and until one succeeds), each call starts
        a liveness probe in the background if none is running; its outcome
        shows in the answers of later calls.
        """
        if not self._loop_alive():
            return False
        with self._lock:
            self._note_overdue_probe()
            if self._step_failed and self._probe is None:
                self._start_probe(PROBE_TIMEOUT_S)
            return not self._probe_failed

    def probe(self, timeout: float = PROBE_TIMEOUT_S, force: bool = False) -> bool:
        """Whether the engine can still generate; blocks up to ``timeout`` seconds.

        While every step since the last check has succeeded this answers at
        once. After a failed step or probe, or with ``force``, it runs a real
        generation and returns whether it produced a token in time.
        Concurrent callers share one probe.
        """
        if not self._loop_alive():
            return False
        with self._lock:
            self._note_overdue_probe()
            if not (force or self._step_failed or self._probe_failed):
                return True
            probe = self._probe if self._probe is not None else self._start_probe(timeout)
        probe.done.wait(timeout)
        with self._lock:
            # Decided under the lock: the probe may finish between the wait and here.
            if probe.done.is_set():
                return probe.ok
            self._probe_failed = True  # still unfinished: too slow counts as failed
            return False

    # ------------------------------------------------------------ internal
    def _note_overdue_probe(self) -> None:
        """Count a probe past its deadline as failed (the loop is stuck or starved)."""
        probe = self._probe
        if probe is not None and not probe.done.is_set() and time.monotonic() > probe.deadline:
            self._probe_failed = True

    def _start_probe(self, timeout: float) -> _Probe:
        """Submit a probe generation; the caller holds the lock."""
        probe = _Probe(request_id=f"{PROBE_PREFIX}{next(self._probe_ids)}",
                       deadline=time.monotonic() + timeout)
        self._probe = probe

        def sink(event: TokenEvent) -> None:
            if event.finish_reason is None and event.error is None:
                return
            ok = event.error is None and event.finish_reason in (
                FinishReason.LENGTH, FinishReason.EOS_TOKEN)
            with self._lock:
                probe.ok = ok
                self._probe_failed = not ok
                if self._probe is probe:
                    self._probe = None
                probe.done.set()
            if not ok:
                logger.warning("liveness probe failed: %s", event.error or event.finish_reason)

        logger.info("liveness probe %s started", probe.request_id)
        self._submit_probe(probe.request_id, sink)
        return probe
