"""Requests to an engine and the events it answers with, for the engine tests (Xeon and Gaudi).

:func:`greedy_request` builds a greedy request (EOS ignored unless told),
:func:`prompt_of` a deterministic prompt of ordinary ids, :class:`Collector`
is the thread-safe sink an engine sends each request's events to, and
:func:`token_ids` reads the generated ids back from a finished request's events.
"""

from __future__ import annotations

import threading

from switchyard_spec import EngineRequest, SamplingParams, StoppingParams, TokenEvent

WAIT_S = 60.0


class Collector:
    """A thread-safe sink that records events per request and signals when each ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, list[TokenEvent]] = {}
        self._done: dict[str, threading.Event] = {}
        self._arrived = threading.Condition(self._lock)
        self.order: list[tuple[str, int]] = []
        """(request_id, index within that request) of every event, in arrival order."""

    def __call__(self, event: TokenEvent) -> None:
        with self._lock:
            events = self._events.setdefault(event.request_id, [])
            self.order.append((event.request_id, len(events)))
            events.append(event)
            if event.finish_reason is not None or event.error is not None:
                self._flag(event.request_id).set()
            self._arrived.notify_all()

    def _flag(self, rid: str) -> threading.Event:
        return self._done.setdefault(rid, threading.Event())

    def wait(self, rid: str, timeout: float = WAIT_S) -> list[TokenEvent]:
        """All events of ``rid`` once it has ended."""
        with self._lock:
            flag = self._flag(rid)
        assert flag.wait(timeout), f"{rid} did not finish within {timeout}s"
        return self.events(rid)

    def wait_tokens(self, rid: str, count: int, timeout: float = WAIT_S) -> list[TokenEvent]:
        """Block until ``rid`` has at least ``count`` events."""
        with self._arrived:
            ok = self._arrived.wait_for(lambda: len(self._events.get(rid, [])) >= count, timeout)
        assert ok, f"{rid} produced fewer than {count} events within {timeout}s"
        return self.events(rid)

    def events(self, rid: str) -> list[TokenEvent]:
        """A copy of the events seen so far for ``rid``."""
        with self._lock:
            return list(self._events.get(rid, []))


def greedy_request(rid: str, prompt: list[int], max_new: int, **stopping: object) -> EngineRequest:
    """A greedy request that ignores EOS unless told otherwise."""
    stopping.setdefault("ignore_eos", True)
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new, **stopping),  # type: ignore[arg-type]
    )


def token_ids(events: list[TokenEvent]) -> list[int]:
    """The generated ids of a finished sequence's events."""
    return [e.token_id for e in events if e.error is None and e.token_id >= 0]


def prompt_of(length: int, start: int = 5) -> list[int]:
    """A deterministic prompt of ``length`` ordinary ids (away from the special tokens)."""
    return [(start + 7 * i) % 1900 + 10 for i in range(length)]
