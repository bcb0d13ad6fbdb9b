"""Responses being generated in this process: their events, their tasks, their followers.

A `LiveResponse` numbers each event (`sequence_number`), keeps it when the
response is streamed or runs in the background (so `GET ...?stream=true`
can replay it), and wakes everyone following the stream. `Responses` is the
gateway's one place for the store and the running responses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from switchyard.protocol.responses_events import TERMINAL, Event
from switchyard.responses.store import MemoryResponseStore, NoStore, ResponseStore, StoredResponse


class LiveResponse:
    """One response while it runs: its record, its events so far, and its task."""

    def __init__(self, record: StoredResponse, keep_events: bool) -> None:
        self.record = record
        self.keep_events = keep_events
        self.events: list[Event] = record.events
        self.sent = 0
        """Events numbered so far (kept or not)."""
        self.task: asyncio.Task[None] | None = None
        """The background task generating it (None for a request's own generation)."""
        self._grew = asyncio.Event()

    def emit(self, event: Event) -> Event:
        """Number the event, keep it if asked, and wake the followers."""
        event.sequence_number = self.sent
        self.sent += 1
        if self.keep_events:
            self.events.append(event)
        grew, self._grew = self._grew, asyncio.Event()
        grew.set()
        return event

    async def follow(self, after: int = -1) -> AsyncIterator[Event]:
        """The kept events numbered above `after`, then each new one, to the last."""
        at = 0
        while True:
            grew = self._grew
            while at < len(self.events):
                event = self.events[at]
                at += 1
                if event.sequence_number > after:
                    yield event
                if isinstance(event, TERMINAL):
                    return
            await grew.wait()


def replay(record: StoredResponse, after: int = -1) -> list[Event]:
    """A finished response's kept events numbered above `after`."""
    return [e for e in record.events if e.sequence_number > after]


class Responses:
    """The store and the responses running in this process."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.store: ResponseStore = (MemoryResponseStore(max_entries, max_bytes)
                                     if max_entries > 0 else NoStore())
        self.enabled = max_entries > 0
        """False when the server stores nothing (`--responses-store-max-entries 0`)."""
        self.running: dict[str, LiveResponse] = {}

    def live(self, response_id: str) -> LiveResponse | None:
        """The response if it is running in this process."""
        return self.running.get(response_id)
