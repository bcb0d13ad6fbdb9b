"""A live ``switchyard serve`` process for the tests: start it on a loopback port, stop it.

:func:`start_server` runs the real CLI and waits until ``/health`` answers;
without a model named it serves the random-weight model (:data:`RANDOM_MODEL`).
The session-wide server (the ``server`` fixture in ``tests/conftest.py``) is one of these.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.waiting import eventually

RANDOM_MODEL = "switchyard/tiny-llama-random"
"""The served name of the random-weight model the suite's servers serve by default."""


def free_port() -> int:
    """A loopback port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    """A `switchyard serve` process on a loopback port."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        """What the server printed so far."""
        return self.log_path.read_text(errors="replace")


def start_server(cache: Path, log_dir: Path, *args: str, env: dict[str, str] | None = None,
                 timeout: float = 180.0, port: int | None = None, python: str = sys.executable,
                 inherit_env: bool = True) -> LiveServer:
    """Start the real CLI and wait until `/health` answers 200 (on `port`, or a free one).

    Without `--model-id` (or a config entry's `model_id`) it serves the random-weight model
    (`MODEL_ID`, TGI's variable for the flag), not the default one: fast, and built locally.
    """
    port = port or free_port()
    log_path = log_dir / f"server-{port}-{time.monotonic_ns()}.log"
    # The server never touches a hub: everything it loads is built locally.
    # `python` and `inherit_env=False`: another interpreter (a venv) in an environment of
    # exactly `env` and these variables.
    full_env = {**(os.environ if inherit_env else {}), "SWITCHYARD_CACHE": str(cache),
                "HF_HUB_OFFLINE": "1",
                "MODEL_ID": RANDOM_MODEL, **(env or {})}
    cmd = [python, "-m", "switchyard.cli", "serve", "--hostname", "127.0.0.1",
           "--port", str(port), *args]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    server = LiveServer(url=f"http://127.0.0.1:{port}", process=proc, log_path=log_path)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        return httpx.get(f"{server.url}/health", timeout=2).status_code == 200

    try:
        eventually(healthy, timeout=timeout, interval=0.3, ignoring=(httpx.HTTPError,))
    except AssertionError:
        stop_server(server)
        raise RuntimeError(f"server not healthy after {timeout}s:\n{server.log()}") from None
    return server


def stop_server(server: LiveServer) -> None:
    """Stop the process, forcefully if it does not stop in time."""
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
