"""A misbehaving upstream on a loopback port: a raw asyncio HTTP/1.1 server in a thread.

What a real server will not do on purpose: answer garbage, close a stream
midway, answer slowly, or die under load and come back on the same port.
`/health`, `/metrics` and `/v1/models` answer as a healthy server's would;
every POST is answered by the behaviour named by `mode`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Literal

Mode = Literal["garbage", "cut", "slow", "stream"]

_CHUNK = {"id": "x", "object": "text_completion", "created": 0, "model": "fake",
          "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}]}


_TGI_EVENT = {"index": 1, "token": {"id": 1, "text": " tok", "logprob": 0.0, "special": False},
              "generated_text": None, "details": None}


class FakeUpstream:
    """Start with `start()`; `kill()` stops it and drops every open connection."""

    def __init__(self, mode: Mode, port: int = 0, events: int = 20, gap_s: float = 0.05) -> None:
        self.mode = mode
        self.events = events
        self.gap_s = gap_s
        self.posts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeUpstream:
        """Listen (again, after `kill`, on the same port)."""
        async def listen() -> None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port,
                                                      reuse_address=True)
        asyncio.run_coroutine_threadsafe(listen(), self._loop).result(5)
        return self

    def kill(self) -> None:
        """Stop listening and reset every connection, as a crashed process would."""
        async def die() -> None:
            assert self._server is not None
            self._server.close()
            for writer in list(self._writers):
                sock = writer.get_extra_info("socket")
                if sock is not None:  # RST, not FIN: nothing more will come
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                writer.transport.abort()
            self._writers.clear()
        asyncio.run_coroutine_threadsafe(die(), self._loop).result(5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, path = head.split(b" ")[:2]
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = json.loads(await reader.readexactly(length)) if length else {}
            if method == b"GET":
                await self._get(writer, path.decode())
            else:
                self.posts += 1
                await self._post(writer, bool(body.get("stream")) or path == b"/generate_stream",
                                 tgi=not path.startswith(b"/v1/"))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _get(self, writer: asyncio.StreamWriter, path: str) -> None:
        bodies = {"/health": b"", "/metrics": b"tgi_queue_size 0\n",
                  "/v1/models": b'{"object":"list","data":[{"id":"fake","object":"model"}]}'}
        body = bodies.get(path)
        status = b"200 OK" if body is not None else b"404 Not Found"
        await _answer(writer, status, b"application/json", body or b"")

    async def _post(self, writer: asyncio.StreamWriter, stream: bool, tgi: bool) -> None:
        if self.mode == "garbage":
            await _answer(writer, b"200 OK", b"text/event-stream" if stream else b"application/json",
                          b"<html>I am not an API</html>")
        elif self.mode == "slow":
            await asyncio.sleep(3600)  # never answers: outlasts any client's timeout, the scenario
        elif self.mode == "cut" and not stream:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: 500\r\n\r\n{\"choices\":")
            await writer.drain()
        else:  # a stream: "cut" stops after two events; "stream" sends them all
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            count = 2 if self.mode == "cut" else self.events
            for _ in range(count):
                event = b"data: " + json.dumps(_TGI_EVENT if tgi else _CHUNK).encode() + b"\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(self.gap_s)  # gaps between events: the scenario
            if self.mode == "stream":
                done = b"data: [DONE]\n\n"
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
                await writer.drain()
        # "cut": returning closes the connection in the middle of the body


async def _answer(writer: asyncio.StreamWriter, status: bytes, kind: bytes, body: bytes) -> None:
    writer.write(b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n"
                 b"connection: close\r\n\r\n%s" % (status, kind, len(body), body))
    await writer.drain()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
