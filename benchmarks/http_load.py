"""HTTP peers: start a server on loopback, wait until it is ready, drive N streams.

The streaming client and its token-by-token timing are `switchyard.bench`'s,
so Switchyard, vLLM and llama.cpp's server are timed by the same code.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx
from switchyard.bench.client import Endpoint, RequestResult, RequestSpec, send


class ServerError(RuntimeError):
    """The server exited or never became ready."""


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, lines: int = 8) -> str:
    """The end of a server log, for a skip reason."""
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """A server subprocess in its own process group, stopped (with its children) on exit."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], log_path: Path,
                 ready_url: str, start_timeout_s: float) -> None:
        self.argv, self.env, self.log_path = list(argv), env, log_path
        self.ready_url, self.start_timeout_s = ready_url, start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        # A new session makes the server a group leader: stopping the group also stops
        # the engine workers that vLLM forks, and nothing else.
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env}, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with {self.proc.returncode}: "
                                  f"{log_tail(self.log_path)}")
            try:
                if httpx.get(self.ready_url, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(2)
        raise ServerError(f"not ready after {self.start_timeout_s:.0f}s: {log_tail(self.log_path)}")

    def stop(self) -> None:
        """SIGTERM the group, then SIGKILL it if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


async def _wave(endpoint: Endpoint, specs: Sequence[RequestSpec],
                timeout_s: float) -> tuple[list[RequestResult], float]:
    """All requests at once; wall time from the first send to the last end."""
    limits = httpx.Limits(max_connections=len(specs) + 4, max_keepalive_connections=len(specs))
    timeout = httpx.Timeout(timeout_s, connect=30)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestResult:
            try:
                return await asyncio.wait_for(send(client, endpoint, spec, 0.0), timeout_s)
            except TimeoutError:
                return RequestResult(sent_at=0.0, e2e_s=timeout_s,
                                     error=f"timeout after {timeout_s:g}s")

        results = await asyncio.gather(*(one(s) for s in specs))
        return list(results), time.perf_counter() - start


def run_wave(endpoint: Endpoint, prompts: Sequence[tuple[str, int]], new_tokens: int,
             timeout_s: float) -> tuple[list[RequestResult], float]:
    """Send one request per prompt concurrently (greedy, EOS ignored) and time them."""
    specs = [RequestSpec(prompt=text, prompt_tokens=count, max_tokens=new_tokens,
                         temperature=0.0, ignore_eos=True) for text, count in prompts]
    return asyncio.run(_wave(endpoint, specs, timeout_s))
