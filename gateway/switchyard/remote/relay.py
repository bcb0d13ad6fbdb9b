"""The HTTP/1.1 client that carries a remote model's forwarded requests to its replicas.

Not httpx (which still carries the replicas' scrapes and probes,
`remote/upstream.py`): under 64 concurrent streams its pool walked every
connection, and asked each idle one's socket whether it was readable, on each
request and each response closed (30% of a loaded gateway's CPU), and a body
read passed through h11 and anyio per piece. Here a request is one write, a
stream's bytes go out as they come (chunked framing removed), and
connections are kept alive and reused last in, first out. Errors are httpx's
exception classes, so the routes handle both clients alike.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx

KEEPALIVE_S = 4.0
"""How long an idle relay connection is kept: under uvicorn's 5 s (vLLM's, Switchyard's), so
the gateway seldom sends on a connection the replica is closing."""
_MAX_IDLE = 512
"""Idle relay connections kept per replica address; more are closed when freed."""
_MAX_HEAD = 1 << 16
"""The longest status line and headers accepted from a replica."""
_PAUSE_AT = 1 << 20
"""Unread bytes from a replica past which its socket is not read (the client is slow)."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to a replica: bytes in, a waiter woken, a lazy read timeout."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.received = 0
        """Bytes received since the current request was sent."""
        self.closed = False
        """The replica closed it, or it broke: nothing more will come."""
        self.error: BaseException | None = None
        self.idle_since = 0.0
        self.timeout = 300.0
        self._waiter: asyncio.Future[None] | None = None
        self._wait_since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data  # the buffer is empty most times: no copy then
        self.received += len(data)
        if len(self.buffer) > _PAUSE_AT and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.error = exc
        self._wake()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def fill(self) -> None:
        """Wait until more bytes arrived, or the connection ended (`closed`).

        `httpx.ReadTimeout` after `timeout` seconds without a byte. One timer per
        connection, moved on lazily when it fires, rather than one per read."""
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        if self.closed:
            return
        waiter = self._waiter = self.loop.create_future()
        self._wait_since = self.loop.time()
        if self._timer is None:
            self._timer = self.loop.call_at(self._wait_since + self.timeout, self._on_timer)
        await waiter

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        due = self._wait_since + self.timeout
        if self.loop.time() >= due - 0.001:
            self._waiter = None
            waiter.set_exception(httpx.ReadTimeout(
                f"no byte from the replica in {self.timeout:g}s"))
        else:
            self._timer = self.loop.call_at(due, self._on_timer)

    def broken(self, what: str) -> httpx.TransportError:
        """The error for a connection that ended while `what` was still expected."""
        if self.error is not None:
            return httpx.ReadError(f"{what}: {self.error!r}")
        return httpx.RemoteProtocolError(f"the replica closed the connection {what}")

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class RelayResponse:
    """A replica's answer on a relay connection: its status and headers, its body to come.

    `aiter_raw` yields the body's bytes as they arrive (chunked framing removed,
    never decompressed: nothing asks for compression). `aclose` frees the
    connection for the next request when the body was read whole, else closes it."""

    def __init__(self, pool: RelayPool, key: tuple[str, str, int], conn: _Connection,
                 status_code: int, headers: dict[str, str], keep_alive: bool) -> None:
        self._pool, self._key, self._conn = pool, key, conn
        self.status_code = status_code
        self.headers = headers
        self._keep_alive = keep_alive
        self._done = False
        self._released = False
        if status_code in (204, 304):
            self._mode, self._left = "none", 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._mode, self._left = "chunked", -1  # -1: a chunk's size line is next
        elif "content-length" in headers:
            try:
                self._mode, self._left = "length", int(headers["content-length"])
            except ValueError:
                raise httpx.RemoteProtocolError("a Content-Length that is not a number") from None
        else:
            self._mode, self._left, self._keep_alive = "close", 0, False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes, each piece as soon as it arrived. Once only."""
        conn = self._conn
        self._done = self._mode == "none" or (self._mode == "length" and self._left == 0)
        while not self._done:
            data, conn.buffer = conn.buffer, b""
            if data:
                if self._mode == "chunked":
                    data = self._dechunk(data)  # an incomplete size line or CRLF goes back
                elif self._mode == "length":
                    if len(data) > self._left:  # more than announced: never reused
                        data, conn.buffer, self._keep_alive = data[:self._left], b"", False
                    self._left -= len(data)
                    self._done = self._left == 0
                left_over = len(conn.buffer)
                if data:
                    yield data  # more may arrive meanwhile: read it before waiting again
                if self._done or len(conn.buffer) > left_over:
                    continue
            if conn.closed:
                if self._mode == "close" and conn.error is None:
                    self._done = True
                    return
                raise conn.broken("in the middle of the body")
            await conn.fill()

    def _dechunk(self, data: bytes) -> bytes:
        """The payload in `data` (chunked transfer coding); what is left over goes back."""
        out: list[bytes] = []
        at, end = 0, len(data)
        while at < end:
            left = self._left
            if left > 0:  # inside a chunk's data
                take = min(left, end - at)
                out.append(data[at:at + take])
                at += take
                self._left = left - take
                if self._left == 0:
                    self._left = -2  # its CRLF is next
            elif left == -2:  # the CRLF after a chunk's data
                if end - at < 2:
                    break
                if data[at:at + 2] != b"\r\n":
                    raise httpx.RemoteProtocolError("a chunk's data is not followed by CRLF")
                at += 2
                self._left = -1
            elif left == -1:  # a size line
                line_end = data.find(b"\r\n", at)
                if line_end < 0:
                    if end - at > 1024:
                        raise httpx.RemoteProtocolError("a chunk size line too long")
                    break
                try:
                    size = int(data[at:line_end].split(b";", 1)[0], 16)
                except ValueError:
                    raise httpx.RemoteProtocolError("a chunk size that is not hex") from None
                at = line_end + 2
                self._left = size if size else -3
            else:  # -3: after the last chunk, trailer lines up to an empty one
                line_end = data.find(b"\r\n", at)
                if line_end < 0:
                    break
                empty = line_end == at
                at = line_end + 2
                if empty:
                    self._done = True
                    break
        if at < end:
            self._conn.buffer = data[at:] + self._conn.buffer
        return out[0] if len(out) == 1 else b"".join(out)

    async def aread(self) -> bytes:
        """The whole body."""
        return b"".join([piece async for piece in self.aiter_raw()])

    async def aclose(self) -> None:
        """Free the connection for another request (body read whole) or close it."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        if self._done and self._keep_alive and not conn.closed and not conn.buffer:
            self._pool._put(self._key, conn)
        else:
            conn.close()


class RelayPool:
    """Keep-alive HTTP/1.1 connections to a model's replicas, for the requests it forwards.

    Errors are httpx's exception classes: `ConnectError`/`ConnectTimeout`,
    `ReadTimeout`, `ReadError` (reset), `RemoteProtocolError` (closed early, not HTTP).
    """

    def __init__(self, keepalive_s: float = KEEPALIVE_S) -> None:
        self._keepalive_s = keepalive_s
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, headers: dict[str, str], timeout_s: float,
                   connect_timeout_s: float) -> RelayResponse:
        """Send `body` to `url`; the answer once its status line and headers arrived.

        A reused connection that ends before any byte of the answer (the replica closed
        it as idle just as it was reused) is given up for a new one, once."""
        key, target, host = _split(url)
        head = [b"POST ", target, b" HTTP/1.1\r\nhost: ", host,
                b"\r\ncontent-length: ", str(len(body)).encode()]
        for name, value in headers.items():
            head += (b"\r\n", name.encode("latin-1"), b": ", value.encode("latin-1"))
        head.append(b"\r\n\r\n")
        request = b"".join(head) + body
        for retry in (True, False):
            conn = self._take(key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key, connect_timeout_s)
            conn.timeout = timeout_s
            conn.received = 0
            assert conn.transport is not None
            try:
                conn.transport.write(request)
                status, answer_headers, keep_alive = await _read_head(conn)
            except (httpx.ReadError, httpx.RemoteProtocolError):
                conn.close()
                if reused and retry and conn.received == 0:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            try:
                return RelayResponse(self, key, conn, status, answer_headers, keep_alive)
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    def _take(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and not conn.buffer and now - conn.idle_since < self._keepalive_s:
                return conn
            conn.close()
        return None

    def _put(self, key: tuple[str, str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        now = time.monotonic()
        while idle and (idle[0].closed or now - idle[0].idle_since >= self._keepalive_s):
            idle.pop(0).close()  # the oldest first: what LIFO reuse leaves to expire
        if len(idle) >= _MAX_IDLE:
            conn.close()
            return
        conn.idle_since = now
        idle.append(conn)

    async def _connect(self, key: tuple[str, str, int], timeout_s: float) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        context = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), host, port, ssl=context)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection within {timeout_s:g}s") from None
        except OSError as exc:
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}") from None
        return conn

    async def aclose(self) -> None:
        """Close every idle connection (the ones in use close when their answers do)."""
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


@functools.lru_cache(maxsize=256)
def _split(url: str) -> tuple[tuple[str, str, int], bytes, bytes]:
    """A replica URL's pool key (scheme, host, port), its request target and its Host header."""
    parts = urlsplit(url)
    scheme = parts.scheme or "http"
    port = parts.port or (443 if scheme == "https" else 80)
    host = parts.hostname or ""
    netloc = parts.netloc.rpartition("@")[2]
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return (scheme, host, port), target.encode(), netloc.encode("idna")


async def _read_head(conn: _Connection) -> tuple[int, dict[str, str], bool]:
    """The answer's status, headers (names lower-cased) and whether it keeps the connection;
    1xx answers skipped."""
    while True:
        end = conn.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.buffer) > _MAX_HEAD:
                raise httpx.RemoteProtocolError("an answer whose headers never end")
            if conn.closed:
                raise conn.broken("before answering")
            await conn.fill()
            continue
        head, conn.buffer = conn.buffer[:end], conn.buffer[end + 4:]
        lines = head.split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        try:
            status = int(rest[:3])
        except ValueError:
            raise httpx.RemoteProtocolError("an answer that is not HTTP") from None
        if not version.startswith(b"HTTP/1."):
            raise httpx.RemoteProtocolError("an answer that is not HTTP/1.x")
        if 100 <= status < 200:
            continue
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon:
                raise httpx.RemoteProtocolError("a header line without a colon")
            key = name.strip().lower().decode("latin-1")
            text = value.strip().decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        tokens = headers.get("connection", "").lower()
        keep_alive = "close" not in tokens if version == b"HTTP/1.1" else "keep-alive" in tokens
        return status, headers, keep_alive
