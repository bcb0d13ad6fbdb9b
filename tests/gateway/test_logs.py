"""Logging: one configuration for the process (text or JSON lines), one line per request."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator

import pytest
from litestar.testing import TestClient

from switchyard.app import create_app
from switchyard.errors import validation_error
from switchyard.plugins import PluginHost
from switchyard.settings import ServeSettings
from switchyard.telemetry.logs import configure_logging, log_request
from switchyard.telemetry.request import RequestRecord, SequenceRecord


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _finished_request() -> RequestRecord:
    """A /generate request that took 1 ms to validate, 2 ms queued, 40 ms for 4 tokens."""
    record = RequestRecord(method="POST", route="/generate", arrival=100.0, arrival_ns=0,
                           model="tiny", engine="xeon", status=200, completed=True, end=100.05)
    record.sequences.append(SequenceRecord(
        index=0, prompt=(1, 2, 3), max_new_tokens=4, submitted=100.001, queue_seconds=0.002,
        first_event=100.013, ended=100.043, generated_tokens=4, finish_reason="length"))
    return record


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_request_is_one_json_line_with_its_timings(capsys):
    configure_logging("info", json_output=True)
    record = _finished_request()
    log_request(record, record.timings())
    (line,) = _lines(capsys.readouterr().err)
    assert line["level"] == "INFO" and line["target"] == "switchyard.request"
    assert line["timestamp"].endswith("Z")
    request = line["request"]
    assert request["route"] == "/generate" and request["status"] == 200
    assert request["model"] == "tiny" and request["engine"] == "xeon"
    assert request["error"] is None and request["finish_reasons"] == ["length"]
    assert request["input_tokens"] == 3 and request["generated_tokens"] == 4
    assert request["max_new_tokens"] == 4
    assert request["validation_seconds"] == pytest.approx(0.001)
    assert request["queue_seconds"] == pytest.approx(0.002)
    assert request["inference_seconds"] == pytest.approx(0.040)
    assert request["time_per_token_seconds"] == pytest.approx(0.010)
    assert request["total_seconds"] == pytest.approx(0.05)


def test_a_failed_request_logs_a_warning_with_its_error(capsys):
    configure_logging("info", json_output=True)
    record = RequestRecord(method="POST", route="/generate", arrival=1.0, arrival_ns=0,
                           status=422, completed=True, end=1.001,
                           error=validation_error("`inputs` cannot be empty"))
    log_request(record, record.timings())
    (line,) = _lines(capsys.readouterr().err)
    assert line["level"] == "WARNING"
    assert line["request"]["error"] == "validation"
    assert line["request"]["inference_seconds"] is None


def test_text_lines_say_the_same(capsys):
    configure_logging("info", json_output=False)
    record = _finished_request()
    log_request(record, record.timings())
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "INFO switchyard.request: POST /generate 200 model=tiny engine=xeon" in err
    assert "tokens=3+4 finish=length" in err and "per_token=10.0ms" in err


def test_the_app_keeps_the_cli_logging(capsys):
    """Litestar installs no configuration of its own: start-up logs in our format."""
    configure_logging("info", json_output=True)
    root_handlers = list(logging.getLogger().handlers)

    def fail(settings, plugins):
        raise RuntimeError("no weights here")

    failed = threading.Event()
    app = create_app(ServeSettings(), plugins=PluginHost(), loader=fail,
                     on_startup_failure=failed.set)
    with TestClient(app) as client:
        assert failed.wait(10)
        assert client.get("/health").status_code == 503
    assert logging.getLogger().handlers == root_handlers
    lines = _lines(capsys.readouterr().err)  # every line is JSON
    failure = next(line for line in lines if line["message"] == "start-up failed")
    assert failure["level"] == "ERROR" and "RuntimeError: no weights here" in failure["exception"]
