"""The in-memory response store: bounded by count and bytes, least recently used out
first, never evicting a response that is queued or running."""

from __future__ import annotations

from switchyard.protocol import responses as rs
from switchyard.responses.store import Anchor, MemoryResponseStore, NoStore, StoredResponse


def _record(rid: str, status: rs.ResponseStatus = "completed", text: str = "x") -> StoredResponse:
    message = rs.MessageItem(id=f"msg_{rid}", role="user", content=[rs.InputText(text=text)])
    return StoredResponse(response=rs.Response(id=rid, created_at=0, model="m", status=status),
                          history=[], inputs=[message])


def test_the_least_recently_used_record_goes_first():
    store = MemoryResponseStore(max_entries=2, max_bytes=10**9)
    store.put(_record("a"))
    store.put(_record("b"))
    assert store.get("a") is not None  # reading refreshes "a": "b" is now the oldest
    store.put(_record("c"))
    assert store.get("b") is None
    assert store.get("a") is not None and store.get("c") is not None
    assert len(store) == 2


def test_running_responses_are_never_evicted_and_go_once_they_finish():
    store = MemoryResponseStore(max_entries=1, max_bytes=10**9)
    running = _record("run", "in_progress")
    store.put(running)
    store.put(_record("queued", "queued"))
    assert store.get("run") is not None and store.get("queued") is not None
    running.response.status = "completed"
    store.put(running)  # finished: now the least recently used finished record goes
    assert len(store) == 1
    assert store.get("queued") is not None


def test_the_byte_bound_counts_each_record_once():
    one = _record("a", text="y" * 1000)
    store = MemoryResponseStore(max_entries=100, max_bytes=int(one.size() * 2.5))
    store.put(one)
    store.put(one)  # replacing a record does not count it twice
    assert store.bytes == one.size()
    store.put(_record("b", text="y" * 1000))
    store.put(_record("c", text="y" * 1000))
    assert store.get("a") is None and len(store) == 2
    assert store.bytes <= store.max_bytes


def test_anchors_count_their_token_ids():
    record = _record("a")
    before = record.size()
    record.anchors = (Anchor(text="abc", ids=tuple(range(100))),)
    assert record.size() == before + 3 + 800


def test_delete_and_the_store_that_keeps_nothing():
    store = MemoryResponseStore(max_entries=5, max_bytes=10**9)
    store.put(_record("a"))
    assert store.delete("a") and not store.delete("a")
    assert store.bytes == 0
    off = NoStore()
    off.put(_record("a"))
    assert off.get("a") is None and not off.delete("a")
