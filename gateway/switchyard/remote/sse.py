"""Server-sent events relayed from a replica: cut at event boundaries, checked, and their end known.

A relayed stream goes to the client one whole event (or several) at a time,
never half of one: if the replica breaks mid-stream, the error event that
follows must not be glued onto a half-written one, which no client could parse.
"""

from __future__ import annotations

import re
from typing import Literal

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
"""The blank line that ends an event (SSE allows each of the three line endings)."""
_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")
"""How a line of an event may begin (a comment, `:`, included)."""
_TGI_LAST = re.compile(rb'"generated_text"\s*:\s*(null)?|"error"\s*:')
"""In TGI's stream, the last event has `generated_text` set; an error event also ends it."""


class Garbage(Exception):
    """A replica's answer that is not what its API sends."""


class EventCutter:
    """Holds a replica's bytes until they complete an event, then hands out the whole events.

    Called for every piece of every relayed stream, so the common case costs a few
    scans in C: events that each begin with `data:` and end with a blank `\n\n`
    (what TGI, vLLM and Switchyard send) are checked by counting; anything else
    (`\r` line ends, other fields, comments, extra blank lines) by the full cut.
    """

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """The whole events `chunk` completes (b"" if none yet); `Garbage` if one is not SSE."""
        pending = self._pending + chunk if self._pending else chunk
        if b"\r" not in pending:  # every line ends with LF
            return self._cut(pending, b"\n\n")
        lines = pending.count(b"\r\n")
        if lines == pending.count(b"\n") == pending.count(b"\r"):  # every one with CRLF
            return self._cut(pending, b"\r\n\r\n")
        ends = [at + len(blank) for blank in (b"\r\n\r\n", b"\n\n", b"\r\r")
                if (at := pending.rfind(blank)) >= 0]
        if not ends:
            self._pending = pending
            return b""
        cut = max(ends)
        events, self._pending = pending[:cut], pending[cut:]
        _check(events)
        return events

    def _cut(self, pending: bytes, blank: bytes) -> bytes:
        """`feed` where every line ends alike, so that `blank` is the one boundary."""
        cut = pending.rfind(blank) + len(blank)
        if cut < len(blank):
            self._pending = pending
            return b""
        if cut == len(pending):
            events, self._pending = pending, b""
        else:
            events, self._pending = pending[:cut], pending[cut:]
        if not (events.startswith(b"data:")
                and events.count(blank) == events.count(blank + b"data:") + 1
                and blank + blank[:len(blank) // 2] not in events):
            _check(events)  # not only `data:` events one after another: the full check
        return events


def _check(events: bytes) -> None:
    """`Garbage` unless each event of a run of whole events begins as SSE's lines may."""
    for event in _BOUNDARY.split(events):
        event = event.lstrip(b"\r\n")
        if event and not event.startswith(_FIELDS):
            raise Garbage("its stream holds something that is not a server-sent event")


def last_event(events: bytes) -> bytes:
    """The last non-empty event of a run of whole events."""
    parts = [part for part in _BOUNDARY.split(events) if part.strip()]
    return parts[-1] if parts else b""


_RESPONSES_END = re.compile(rb"^event: ?response\.(completed|incomplete|failed)\s*$", re.MULTILINE)


def stream_ended(api: Literal["openai", "tgi", "responses"], events: bytes) -> bool:
    """Whether `events` (the last ones relayed) end the stream as the API ends it.

    A replica that closes its connection cleanly mid-stream (no chunked-encoding
    error) is told apart from one that finished only by this: OpenAI's stream
    ends with `data: [DONE]`, TGI's with an event whose `generated_text` is set, the
    Responses API's with a `response.completed`, `.incomplete` or `.failed` event.
    """
    event = last_event(events)
    if api == "responses":
        return _RESPONSES_END.search(event) is not None
    if api == "openai":
        return b"[DONE]" in event
    found = _TGI_LAST.search(event)
    return found is not None and found[1] is None
