"""Xeon engines on small model folders, for the parity tests: start one, take its greedy tokens.

:func:`started_engine` starts an fp32 engine with small blocks and 16-token
prefill chunks (so short prompts still prefill in chunks);
:func:`started_with_log` does the same and keeps the engine's start-up log
lines; :func:`engine_tokens` submits prompts together (their decode steps
batch) and returns each one's greedy tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path

from switchyard_spec import EngineConfig
from switchyard_xeon.engine import XeonEngine

from tests.support.engine_requests import Collector, greedy_request, token_ids
from tests.support.xeon_options import TEST_OPTIONS


def started_engine(folder: Path, dtype: str = "float32", **options: str) -> XeonEngine:
    """A started engine (fp32 unless told) on ``folder``, small blocks, 16-token prefill chunks."""
    engine = XeonEngine(EngineConfig(
        model_path=str(folder), dtype=dtype, max_batch_prefill_tokens=16,
        options={**TEST_OPTIONS, "block_size": "4", **options}))
    engine.start()
    return engine


class _Lines(logging.Handler):
    """Collects the messages of the log records it is given."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def started_with_log(folder: Path, dtype: str = "float32",
                     **options: str) -> tuple[XeonEngine, list[str]]:
    """:func:`started_engine`, and the INFO lines ``switchyard.xeon`` logged while it started
    (collected by a handler of its own, so they outlive pytest's per-test log capture)."""
    records = _Lines()
    log = logging.getLogger("switchyard.xeon")
    level = log.level
    log.addHandler(records)
    log.setLevel(logging.INFO)
    try:
        engine = started_engine(folder, dtype, **options)
    finally:
        log.removeHandler(records)
        log.setLevel(level)
    return engine, records.lines


def engine_tokens(engine: XeonEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Submit every prompt at once (their decode steps batch) and return their greedy tokens."""
    sink = Collector()
    for i, prompt in enumerate(prompts):
        engine.submit(greedy_request(f"r{i}", prompt, new), sink)
    return [token_ids(sink.wait(f"r{i}")) for i in range(len(prompts))]
