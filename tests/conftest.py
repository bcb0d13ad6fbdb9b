"""Fixtures shared by every test package: the locally built random-weight model and a live server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.waiting import eventually

RANDOM_MODEL = "switchyard/tiny-llama-random"
"""The served name of the random-weight model the suite's servers serve by default."""


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder shared by the session, so the default model is built once."""
    root = os.environ.get("SWITCHYARD_TEST_CACHE")
    return Path(root) if root else tmp_path_factory.mktemp("switchyard-cache")


@pytest.fixture(scope="session")
def default_model_path(model_cache: Path) -> Path:
    """The random-weight model (`switchyard/tiny-llama-random`), built deterministically into
    the test cache: what the suite's servers serve unless a test names another model."""
    from switchyard.models.random_model import ensure_random_model

    return ensure_random_model(model_cache)


def _free_port() -> int:
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
    port = port or _free_port()
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


@pytest.fixture(scope="session")
def server(default_model_path: Path, model_cache: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server on the default model for the whole session (fp32, so greedy is exact)."""
    live = start_server(model_cache, tmp_path_factory.mktemp("logs"), "--dtype", "float32",
                        "--max-total-tokens", "512", "--max-input-tokens", "400")
    yield live
    stop_server(live)


E2E = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark as `e2e` every test under tests/e2e/ and every test that uses the session's live
    server (`server`); tests elsewhere that start a server of their own carry the mark
    themselves. `-m 'not e2e'` then runs the unit tests alone."""
    for item in items:
        if item.path.is_relative_to(E2E) or "server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def gated_compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every grammar compile (the engine toolkit's ``GrammarSupport``, on either engine) waits
    until the returned event is set; it is set at teardown."""
    from switchyard_engine.grammar import GrammarSupport

    gate = threading.Event()
    original = GrammarSupport._compile

    def compile_when_open(self, constraint):
        assert gate.wait(30), "the test never opened the gate"
        return original(self, constraint)

    monkeypatch.setattr(GrammarSupport, "_compile", compile_when_open)
    yield gate
    gate.set()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> Iterator[None]:
    """Name the native kernel paths this run exercised on this CPU, and those it could not.

    A wrapper around the terminal reporter's own summary, so the lines come after its
    short test summary, right above the final counts.
    """
    yield
    from tests import kernel_paths

    lines = kernel_paths.summary()
    if lines:
        terminalreporter.section("kernel paths", sep="-")
        for line in lines:
            terminalreporter.write_line(line)
