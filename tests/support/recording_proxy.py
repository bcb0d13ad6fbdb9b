"""A loopback HTTP proxy that relays requests to a live server and keeps what passed through.

A client under test (the Codex CLI) is pointed at the proxy, so a test can
compare what the client printed with what the server answered, byte for
byte, without trusting either side's account of it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

_HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


@dataclass
class Exchange:
    """One request and the answer the server gave it."""

    method: str
    path: str
    request_body: bytes
    status: int = 0
    response_body: bytes = b""


@dataclass
class Recording:
    """Every exchange the proxy relayed, in order."""

    url: str
    exchanges: list[Exchange] = field(default_factory=list)


@contextmanager
def recording_proxy(upstream: str) -> Iterator[Recording]:
    """A proxy on a free loopback port in front of ``upstream`` (a base URL), for the block."""
    recording = Recording(url="")

    class Relay(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _relay(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            exchange = Exchange(self.command, self.path, body)
            recording.exchanges.append(exchange)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            with httpx.Client(timeout=600) as client, client.stream(
                    self.command, upstream + self.path, content=body, headers=headers) as r:
                exchange.status = r.status_code
                self.send_response(r.status_code)
                for key, value in r.headers.items():
                    if key.lower() not in _HOP | {"content-encoding"}:
                        self.send_header(key, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for chunk in r.iter_bytes():
                    exchange.response_body += chunk
                    self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        do_GET = do_POST = _relay

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # the test reads the recording, not a log

    server = ThreadingHTTPServer(("127.0.0.1", 0), Relay)
    recording.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield recording
    finally:
        server.shutdown()
        server.server_close()
