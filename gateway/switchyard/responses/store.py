"""Where responses are kept for `GET`, chaining (`previous_response_id`) and input items.

`ResponseStore` is the interface a shared backend (Redis, a SQL table) would
implement so that several gateway replicas see one another's responses; the
in-memory `MemoryResponseStore` is the one this server ships. A stored
record holds what a later turn needs to continue the conversation token for
token: the items so far, and the prompt text with the token ids it was
tokenized to (`Anchor`), so that the next turn's prompt extends them exactly
and hits the prefix cache.

The task of a running response and the wake-ups of its stream's followers
are not part of a record: they live with the process that runs it
(`switchyard.responses.live`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol

import msgspec

from switchyard.protocol.responses import Item, Response
from switchyard.protocol.responses_events import Event

ACTIVE = frozenset({"queued", "in_progress"})
"""Statuses of a response still being generated: never evicted."""


class Anchor(msgspec.Struct, frozen=True, kw_only=True):
    """A conversation's text up to some point and the token ids it stands for.

    A later prompt whose text starts with `text` is tokenized as `ids` plus
    the rest, so its tokens extend these exactly.
    """

    text: str
    ids: tuple[int, ...]


class StoredResponse(msgspec.Struct, kw_only=True):
    """One response and the conversation behind it."""

    response: Response
    history: list[Item]
    """The items of the earlier turns (`previous_response_id`'s chain), oldest first."""
    inputs: list[Item]
    """This request's own input items (`GET .../input_items` lists them)."""
    anchors: tuple[Anchor, ...] = ()
    """Prompt text and tokens this turn ended with, longest first."""
    events: list[Event] = msgspec.field(default_factory=list)
    """The stream's events, for a streamed or background response (replayed by `GET`)."""

    @property
    def conversation(self) -> list[Item]:
        """Everything a next turn continues: the history, these inputs, then the output."""
        return [*self.history, *self.inputs, *self.response.output]

    def size(self) -> int:
        """Bytes this record takes, roughly (its JSON and 8 bytes a token id)."""
        body = len(msgspec.json.encode((self.response, self.history, self.inputs,
                                         self.events)))
        return body + sum(len(a.text) + 8 * len(a.ids) for a in self.anchors)


class ResponseStore(Protocol):
    """What the Responses routes need from a store. Records are keyed by response id.

    Implementations must be safe to call from the event loop and must not
    evict a record whose response is queued or in progress.
    """

    def get(self, response_id: str) -> StoredResponse | None:
        """The record, or None if it is unknown, deleted or evicted (reading refreshes it)."""
        ...

    def put(self, record: StoredResponse) -> None:
        """Add the record or replace it (called again as its status changes)."""
        ...

    def delete(self, response_id: str) -> bool:
        """Forget the record; False if there was none."""
        ...


class MemoryResponseStore:
    """An in-process store bounded by record count and bytes, least recently used out first.

    A record whose response is queued or in progress is never evicted, so the
    bounds can be passed while many responses run; they are enforced again
    as those finish.
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    @property
    def bytes(self) -> int:
        """Bytes held now (as `StoredResponse.size` counts them)."""
        return self._bytes

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._records.get(response_id)
            if entry is None:
                return None
            self._records.move_to_end(response_id)
            return entry[0]

    def put(self, record: StoredResponse) -> None:
        size = record.size()
        with self._lock:
            old = self._records.pop(record.response.id, None)
            if old is not None:
                self._bytes -= old[1]
            self._records[record.response.id] = (record, size)
            self._bytes += size
            self._evict()

    def delete(self, response_id: str) -> bool:
        with self._lock:
            old = self._records.pop(response_id, None)
            if old is None:
                return False
            self._bytes -= old[1]
            return True

    def _evict(self) -> None:
        """Drop the least recently used finished records until both bounds hold."""
        for key in list(self._records):
            if len(self._records) <= self.max_entries and self._bytes <= self.max_bytes:
                return
            record, size = self._records[key]
            if record.response.status in ACTIVE:
                continue
            del self._records[key]
            self._bytes -= size


class NoStore:
    """The store when `--responses-store-max-entries 0` turns storing off: keeps nothing."""

    def get(self, response_id: str) -> StoredResponse | None:
        return None

    def put(self, record: StoredResponse) -> None:
        return None

    def delete(self, response_id: str) -> bool:
        return False
