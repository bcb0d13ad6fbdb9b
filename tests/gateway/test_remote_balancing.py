"""Remote models' pieces: the choice of replica, queue gauges, SSE cutting, and the relay's
HTTP/1.1 connections (against scripted servers on loopback ports)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import httpx
import pytest
from switchyard.remote.balancer import pick
from switchyard.remote.relay import RelayPool
from switchyard.remote.upstream import Replica, queue_depth
from switchyard.remote.sse import EventCutter, Garbage, stream_ended


def test_two_choices_take_the_less_loaded_and_skip_out_and_tried_replicas():
    busy, idle, out = Replica("http://a", in_flight=5), Replica("http://b", queue=1), \
        Replica("http://c", out_until=1e18)
    rng = random.Random(0)
    assert {pick([busy, idle], rng=rng) for _ in range(50)} == {idle}
    assert pick([busy, idle, out], tried=[idle], rng=rng) is busy
    assert pick([out]) is None and pick([busy], tried=[busy]) is None
    # Equal loads share the requests.
    even = [Replica("http://x"), Replica("http://y")]
    assert {pick(even, rng=rng).url for _ in range(50)} == {"http://x", "http://y"}


def test_failures_in_a_row_take_a_replica_out_and_a_success_resets_them():
    r = Replica("http://a")
    r.failed("x", max_failures=2, cooldown_s=1)
    r.succeeded()
    r.failed("x", max_failures=2, cooldown_s=1)
    assert r.available
    r.failed("x", max_failures=2, cooldown_s=1)
    assert not r.available


def test_queue_depth_reads_tgis_ours_and_vllms_gauges():
    text = (b'# HELP tgi_queue_size x\n# TYPE tgi_queue_size gauge\n'
            b'tgi_queue_size{model="a",engine="xeon"} 3\ntgi_queue_size{model="b"} 2\n'
            b'tgi_queue_size_other 100\nvllm:num_requests_waiting{model_name="m"} 4.0\n'
            b'vllm:num_requests_running 7\n')
    assert queue_depth(text) == 9
    assert queue_depth(b"") == 0


def test_events_are_cut_whole_and_garbage_is_refused():
    cut = EventCutter()
    assert cut.feed(b"data: {\"a\"") == b""
    assert cut.feed(b": 1}\r\n\r\ndata: [DO") == b"data: {\"a\": 1}\r\n\r\n"
    assert cut.feed(b"NE]\n\n") == b"data: [DONE]\n\n"
    with pytest.raises(Garbage):
        EventCutter().feed(b"<html>\n\n")


@pytest.mark.parametrize(("api", "events", "ended"), [
    ("openai", b"data: {}\n\ndata: [DONE]\n\n", True),
    ("openai", b"data: {}\n\n", False),
    ("tgi", b'data: {"token":{},"generated_text":null}\n\n', False),
    ("tgi", b'data: {"token":{},"generated_text":"abc"}\n\n', True),
    ("tgi", b'data: {"error":"x","error_type":"generation"}\n\n', True),
    ("responses", b'event: response.output_text.delta\ndata: {}\n\n', False),
    ("responses", b'event: response.completed\ndata: {}\n\n', True),
    ("responses", b'event: response.incomplete\r\ndata: {}\r\n\r\n', True),
    ("responses", b'event: response.failed\ndata: {}\n\n', True),
    ("responses", b'event: error\ndata: {}\n\n', False),
])
def test_a_stream_ends_as_its_api_ends_it(api, events, ended):
    assert stream_ended(api, events) is ended


def test_crlf_and_lf_streams_are_cut_alike_and_other_fields_pass():
    cut = EventCutter()
    assert cut.feed(b"data: 1\r\n\r\ndata: 2\r\n") == b"data: 1\r\n\r\n"
    assert cut.feed(b"\r\n") == b"data: 2\r\n\r\n"
    mixed = b"event: x\ndata: 1\n\n: comment\n\n\ndata: 2\n\n"
    assert EventCutter().feed(mixed) == mixed
    with pytest.raises(Garbage):
        EventCutter().feed(b"data: 1\r\n\r\n{oops}\r\n\r\n")


Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(script: Script) -> tuple[asyncio.Server, str, list[int]]:
    """A server on a loopback port running `script` for each request; the requests'
    connection numbers, to tell reuse from new connections."""
    seen: list[int] = []
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        number = connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                seen.append(number)
                await script(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def test_the_relay_passes_chunked_streams_in_any_split_and_reuses_its_connections():
    events = [b"data: %d\n\n" % i for i in range(5)]
    wire = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + _chunked(*events))

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        step = len(seen) % 7 + 1  # each request split differently, down to single bytes
        for at in range(0, len(wire), step):
            writer.write(wire[at:at + step])
            await writer.drain()
            await asyncio.sleep(0)

    async def main() -> None:
        nonlocal seen
        server, url, seen = await _serve(script)
        pool = RelayPool()
        try:
            for _ in range(7):
                answer = await pool.post(url + "/v1/completions", b"{}", {}, 5, 5)
                assert answer.status_code == 200
                assert answer.headers["content-type"] == "text/event-stream"
                assert b"".join([c async for c in answer.aiter_raw()]) == b"".join(events)
                await answer.aclose()
            assert seen == [1] * 7  # one keep-alive connection
        finally:
            await pool.aclose()
            server.close()

    seen: list[int] = []
    asyncio.run(main())


def test_the_relay_reads_sized_bodies_and_survives_a_replica_closing_idle_connections():
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(seen) % 2 == 0:  # every second request: closed unanswered, as by a server
            writer.close()      # whose keep-alive timeout ran out as the request crossed it
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: 8\r\n\r\n{\"a\": 1}")
        await writer.drain()

    async def main() -> None:
        nonlocal seen
        server, url, seen = await _serve(script)
        pool = RelayPool()
        try:
            for _ in range(5):
                answer = await pool.post(url, b"{}", {"x-model": "m"}, 5, 5)
                assert await answer.aread() == b'{"a": 1}'
                await answer.aclose()
            # Each connection answered once, then dropped the next request: sent again on a
            # new connection, and no request failed.
            assert seen == [1, 1, 2, 2, 3, 3, 4, 4, 5]
        finally:
            await pool.aclose()
            server.close()

    seen: list[int] = []
    asyncio.run(main())


@pytest.mark.parametrize("how", ["cut", "silent", "refused", "not-http"])
def test_the_relay_reports_broken_replicas_as_httpx_errors(how):
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if how == "silent":
            # Silent past the relay's 0.3 s read timeout (a timer on the same event loop, so
            # it fires first on any machine): the scenario.
            await asyncio.sleep(5)
        elif how == "not-http":
            writer.write(b"<html>hello</html>\r\n\r\n")
        else:  # a stream that stops mid-chunk
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"10\r\ndata: 1\n\n")
        await writer.drain()
        writer.close()

    expected = {"cut": httpx.RemoteProtocolError, "silent": httpx.ReadTimeout,
                "refused": httpx.ConnectError, "not-http": httpx.RemoteProtocolError}[how]

    async def main() -> None:
        server, url, _ = await _serve(script)
        if how == "refused":
            server.close()
            await server.wait_closed()
        pool = RelayPool()
        try:
            with pytest.raises(expected):
                answer = await pool.post(url, b"{}", {}, 0.3, 1)
                async for _ in answer.aiter_raw():
                    pass
        finally:
            await pool.aclose()
            server.close()

    asyncio.run(main())
