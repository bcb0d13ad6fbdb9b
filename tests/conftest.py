"""Fixtures shared by every test package: the locally built random-weight model and a live server."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.live_server import LiveServer, start_server, stop_server


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
    server (`server`). Tests elsewhere that run the system whole carry the mark themselves:
    those that start a server of their own, read the default model (downloaded from PyPI),
    or spread the work over processes (engine ranks, the kernel suites rerun per ISA
    level). `-m 'not e2e'` then runs the unit tests alone."""
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
    from tests.support import kernel_paths

    lines = kernel_paths.summary()
    if lines:
        terminalreporter.section("kernel paths", sep="-")
        for line in lines:
            terminalreporter.write_line(line)
