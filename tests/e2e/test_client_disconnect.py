"""A client that goes away is not a server error, and its work stops at once.

Raw sockets against the live server: a body shorter than its Content-Length
followed by a close (Litestar raises a 500-class exception while reading it),
and a stream closed after its first event. Each must be logged as a dropped
request without a traceback and counted as `tgi_request_failure{err="dropped"}`.
A non-streamed request whose client times out must leave the engine's batch at
once (its sequences aborted), not run to its `max_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time

import httpx
import pytest

from tests.support.abandoned import (
    CHAT,
    COMPLETION,
    MAX_NEW,
    RESPONSES,
    TGI,
    abandon,
    decode_steps,
    dropped_lines,
    request_lines,
    wait_until_idle,
)
from tests.support.live_server import LiveServer

_FAILURE = re.compile(r'^tgi_request_failure\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.M)


def _failures(live: LiveServer) -> dict[str, float]:
    """`tgi_request_failure` by label set."""
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    return {m["labels"]: float(m["value"]) for m in _FAILURE.finditer(text)}


def _connect(live: LiveServer) -> socket.socket:
    host, port = live.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _truncated_body(live: LiveServer, path: str) -> None:
    """Announce 500 bytes, send a few, then close the connection."""
    with _connect(live) as sock:
        sock.sendall(_head(path, 500) + b'{"prompt": "hello", "max_')
        # The scenario itself: a client that stalls part way through its body, then leaves
        # (the server has begun reading it; no event of the server's marks that).
        time.sleep(0.2)


def _drop_stream(live: LiveServer, path: str, body: dict[str, object]) -> None:
    """Start a stream, read until its first event, then close the connection."""
    payload = json.dumps(body).encode()
    with _connect(live) as sock:
        sock.sendall(_head(path, len(payload)) + payload)
        received = b""
        while b"data:" not in received:
            chunk = sock.recv(4096)
            assert chunk, "the server closed the stream first"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200")


def test_truncated_bodies_and_dropped_streams_are_not_server_errors(server):
    before = _failures(server)
    start = len(server.log())
    _truncated_body(server, "/v1/completions")
    _truncated_body(server, "/generate")
    _drop_stream(server, "/v1/completions", {"prompt": "hello", "max_tokens": 400,
                                             "stream": True})
    _drop_stream(server, "/generate_stream", {"inputs": "hello",
                                              "parameters": {"max_new_tokens": 400}})
    lines = request_lines(server, start, 4)
    assert len(lines) == 4, server.log()[start:]
    assert all("error=dropped" in line and "WARNING" in line for line in lines), lines
    statuses = sorted(int(line.split("switchyard.request: POST ")[1].split()[1]) for line in lines)
    # One status for a client that left, whether before its status line went out or after.
    assert statuses == [499, 499, 499, 499]
    new_log = server.log()[start:]
    assert "Traceback" not in new_log and " ERROR " not in new_log
    after = _failures(server)
    grown = {labels: after[labels] - before.get(labels, 0.0) for labels in after
             if after[labels] != before.get(labels, 0.0)}
    assert set(grown) <= {labels for labels in grown if 'err="dropped"' in labels}, grown
    assert sum(grown.values()) == 4
    # The server still answers.
    r = httpx.post(f"{server.url}/generate", timeout=60,
                   json={"inputs": "hello", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200


def test_a_dropped_responses_stream_leaves_the_batch_and_ends_cancelled(server):
    """A Responses stream whose client leaves after `response.created` aborts its engine
    sequence (fewer decode steps than its tokens take) and its stored response reads
    `cancelled`, with the events sent so far kept for replay."""
    model = "switchyard/tiny-llama-random"
    steps = decode_steps(server, model)
    payload = json.dumps({**RESPONSES, "stream": True}).encode()
    with _connect(server) as sock:
        sock.sendall(_head("/v1/responses", len(payload)) + payload)
        received = b""
        while b"\n\n" not in received.partition(b"data: ")[2]:
            chunk = sock.recv(4096)
            assert chunk, "the server closed the stream first"
            received += chunk
    created = json.loads(received.partition(b"data: ")[2].partition(b"\n")[0])
    assert created["type"] == "response.created"
    wait_until_idle(server, model, steps)
    rid = created["response"]["id"]
    stored = httpx.get(f"{server.url}/v1/responses/{rid}", timeout=30).json()
    assert stored["status"] == "cancelled"
    replay = httpx.get(f"{server.url}/v1/responses/{rid}?stream=true", timeout=30).text
    assert replay.startswith("event: response.created\n")
    assert replay.rstrip().splitlines()[-2] == "event: response.failed"


# ------------------------------------------- abandoned non-streaming requests

@pytest.mark.parametrize(("path", "body", "count"), [
    ("/v1/chat/completions", CHAT, 8),
    ("/v1/chat/completions", {**CHAT, "n": 4, "temperature": 1.0, "seed": 3}, 2),
    ("/v1/completions", COMPLETION, 8),
    ("/generate", TGI, 4),
    ("/", TGI, 2),
    ("/v1/responses", RESPONSES, 4),
], ids=["chat", "chat-n4", "completions", "tgi-generate", "tgi-compat", "responses"])
def test_abandoned_json_requests_leave_the_batch_at_once(server, path, body, count):
    """A client that leaves a non-streamed request while its sequences run frees their batch
    slots at once (after fewer decode steps than its MAX_NEW tokens take), is logged as
    dropped, never as a server error, and the capacity it held serves the next request."""
    model = "switchyard/tiny-llama-random"
    start = len(server.log())
    before = _failures(server)
    steps = decode_steps(server, model)
    abandon(server, path, body, count, model, sequences=int(body.get("n", 1)))
    wait_until_idle(server, model, steps)
    dropped_lines(server, start, count, int(body.get("n", 1)))
    assert "Traceback" not in server.log()[start:]
    grown = {k: v - before.get(k, 0.0) for k, v in _failures(server).items()
             if v != before.get(k, 0.0)}
    assert list(grown.values()) == [count] and 'err="dropped"' in next(iter(grown)), grown
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ------------------------------------------- a client that cancels mid-stream, then goes on

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions",
                                  "/generate_stream", "/v1/responses"])
def test_a_stream_cancelled_mid_way_ends_at_once_and_the_pool_goes_on(server, path):
    """A load generator's pattern (guidellm at a level change): an async client cancels an
    in-flight stream, then sends its next request through the same connection pool. The
    cancelled request ends at once as one `499 error=dropped` line, its sequence leaves the
    batch, no permit stays held, and the next request is answered."""
    model = "switchyard/tiny-llama-random"
    bodies = {"/v1/chat/completions": {**CHAT, "max_tokens": MAX_NEW, "stream": True},
              "/v1/completions": {**COMPLETION, "max_tokens": MAX_NEW, "stream": True},
              "/generate_stream": {**TGI, "parameters": {**TGI["parameters"],
                                                         "max_new_tokens": MAX_NEW}},
              "/v1/responses": {**RESPONSES, "stream": True}}
    steps = decode_steps(server, model)
    start = len(server.log())

    async def scenario() -> int:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            got_events = asyncio.Event()

            async def read_stream() -> None:
                async with client.stream("POST", path, json=bodies[path]) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            got_events.set()

            task = asyncio.create_task(read_stream())
            await asyncio.wait_for(got_events.wait(), 60)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            # The next request takes the pool's one connection (a fresh one: the cancelled
            # stream's was closed with it).
            after = await client.post("/v1/completions",
                                      json={**COMPLETION, "max_tokens": 2, "stream": False})
            return after.status_code

    assert asyncio.run(asyncio.wait_for(scenario(), 120)) == 200
    wait_until_idle(server, model, steps)
    lines = request_lines(server, start, 2)
    (cancelled,) = [line for line in lines if f"POST {path} " in line and " 200 " not in line]
    assert " 499 " in cancelled and "error=dropped" in cancelled, lines
    generated = int(re.search(r"tokens=\d+\+(\d+)", cancelled)[1])
    assert generated < MAX_NEW, cancelled  # cut short, not run to its end
    assert sum(" 200 " in line for line in lines) == 1, lines
