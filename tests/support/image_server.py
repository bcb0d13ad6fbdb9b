"""A loopback HTTP server that serves images (and bad answers) to the image tests.

The tests run without network: every http(s) image they fetch comes from
here. Each path answers as registered: a body with a status and headers,
optionally after a delay or sent slowly, or a redirect.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Answer:
    """What one path answers."""

    body: bytes = b""
    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "image/png"})
    delay_s: float = 0.0
    """Seconds to wait before answering."""
    chunked: bool = False
    """Send the body in chunks without a Content-Length."""


class ImageServer:
    """Serves registered answers on a loopback port, from a thread, while used as a context.

    ``with ImageServer() as server: url = server.route("/a.png", Answer(png))``.
    """

    def __init__(self) -> None:
        self.routes: dict[str, Answer] = {}
        self.hits: dict[str, int] = {}
        routes, hits = self.routes, self.hits

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                hits[self.path] = hits.get(self.path, 0) + 1
                answer = routes.get(self.path, Answer(b"not found", 404, {}))
                if answer.delay_s:
                    # A slow host is what such a route exercises (fetch time limits).
                    time.sleep(answer.delay_s)
                try:
                    self.send_response(answer.status)
                    for key, value in answer.headers.items():
                        self.send_header(key, value)
                    if answer.chunked:
                        self.send_header("Transfer-Encoding", "chunked")
                        self.end_headers()
                        for start in range(0, len(answer.body), 16384):
                            piece = answer.body[start:start + 16384]
                            self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                        self.wfile.write(b"0\r\n\r\n")
                    else:
                        self.send_header("Content-Length", str(len(answer.body)))
                        self.end_headers()
                        self.wfile.write(answer.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (over a limit): expected

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        """The port it listens on."""
        return self._server.server_address[1]

    def url(self, path: str) -> str:
        """The loopback URL of ``path``."""
        return f"http://127.0.0.1:{self.port}{path}"

    def route(self, path: str, answer: Answer) -> str:
        """Serve ``answer`` at ``path``; returns its URL."""
        self.routes[path] = answer
        return self.url(path)

    def redirect(self, path: str, location: str) -> str:
        """Answer ``path`` with a 302 to ``location``; returns its URL."""
        return self.route(path, Answer(b"", 302, {"Location": location}))

    def __enter__(self) -> ImageServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
