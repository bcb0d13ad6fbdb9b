"""Logging: one configuration for the whole process, text or JSON lines; one line per request.

`configure_logging` runs once, in the CLI, before anything logs. Litestar and
uvicorn are told not to install their own configurations (`logging_config=None`
and `log_config=None`), so every logger - ours, uvicorn's, Litestar's, Python
warnings - goes through the root handler set here, in one format:

- text: `2025-01-01 12:00:00,000 INFO switchyard.models: model x: warming up`;
- JSON (`--json-output`, TGI's flag): one object per line, `{"timestamp",
  "level", "target", "message"}`, plus `"request"` on request lines and
  `"exception"` when there is a traceback.

Every finished generation request logs one line on `switchyard.request`
(INFO; WARNING when it failed) with its route, status, model, engine, tokens,
finish reasons and TGI's timings; nothing is logged per token.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys

import msgspec

from switchyard.telemetry.request import RequestRecord, Timings

request_log = logging.getLogger("switchyard.request")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RequestLog(msgspec.Struct, kw_only=True):
    """The facts of one finished generation request (the `request` of a JSON line)."""

    method: str
    route: str
    status: int
    model: str
    engine: str
    error: str | None
    """`tgi_request_failure`'s `err` label when the request failed."""
    finish_reasons: list[str]
    sequences: int
    input_tokens: int
    generated_tokens: int
    max_new_tokens: int
    total_seconds: float
    validation_seconds: float | None
    queue_seconds: float | None
    inference_seconds: float | None
    time_per_token_seconds: float | None
    trace_id: str | None


class LogLine(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One JSON log line."""

    timestamp: str
    level: str
    target: str
    """The logger's name (TGI's JSON lines call it `target` too)."""
    message: str
    request: RequestLog | None = None
    exception: str | None = None


_encoder = msgspec.json.Encoder()


class JsonFormatter(logging.Formatter):
    """Formats records as `LogLine` JSON."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        request = getattr(record, "request", None)
        line = LogLine(
            timestamp=stamp.isoformat(timespec="microseconds").replace("+00:00", "Z"),
            level=record.levelname,
            target=record.name,
            message=record.getMessage(),
            request=request if isinstance(request, RequestLog) else None,
            exception=self.formatException(record.exc_info) if record.exc_info else None,
        )
        return _encoder.encode(line).decode()


def configure_logging(level: str, json_output: bool = False) -> None:
    """Send every logger to standard error in one format, at `level` (debug ... error)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_output else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)
    # Progress bars (transformers' "Loading weights") write to stderr past logging
    # and would break JSON lines; start-up logs its own steps instead.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    _adopt_torch_logger()


def _adopt_torch_logger() -> None:
    """Send torch's log records through the root handler, in the one format.

    Importing torch gives its "torch" logger a stderr handler of its own, with
    propagation off, so its warnings (and those of libraries logging under it,
    such as torchao's at import) would be written past the format set here.
    torch is imported by every engine anyway; importing it first lets its
    handler be replaced before anything logs through it.
    """
    import torch  # noqa: F401  (its import installs the handler replaced below)

    torch_logger = logging.getLogger("torch")
    for old in list(torch_logger.handlers):
        torch_logger.removeHandler(old)
    torch_logger.propagate = True


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}ms"


def log_request(record: RequestRecord, timings: Timings | None) -> None:
    """Log a finished request: one line, INFO when it succeeded, WARNING when it failed."""
    failure = record.failure
    level = logging.INFO if failure is None else logging.WARNING
    if not request_log.isEnabledFor(level):
        return
    reasons = [s.finish_reason for s in record.sequences if s.finish_reason]
    entry = RequestLog(
        method=record.method, route=record.route, status=record.logged_status, model=record.model,
        engine=record.engine, error=failure, finish_reasons=reasons,
        sequences=len(record.sequences), input_tokens=record.input_tokens,
        generated_tokens=record.generated_tokens, max_new_tokens=record.max_new_tokens,
        total_seconds=record.end - record.arrival,
        validation_seconds=timings.validation if timings else None,
        queue_seconds=timings.queue if timings else None,
        inference_seconds=timings.inference if timings else None,
        time_per_token_seconds=timings.time_per_token if timings else None,
        trace_id=record.trace_id,
    )
    text = (f"{entry.method} {entry.route} {entry.status} model={entry.model or '-'} "
            f"engine={entry.engine or '-'} tokens={entry.input_tokens}+{entry.generated_tokens}")
    if failure is not None:
        text += f" error={failure}"
    if reasons:
        text += f" finish={','.join(reasons)}"
    if timings is not None:
        text += (f" validation={_ms(timings.validation)} queue={_ms(timings.queue)} "
                 f"inference={_ms(timings.inference)} per_token={_ms(timings.time_per_token)}")
    text += f" total={_ms(entry.total_seconds)}"
    request_log.log(level, "%s", text, extra={"request": entry})
