"""Observability: Prometheus metrics, OpenTelemetry traces and structured request logs.

- `metrics`: TGI's metric names, types, labels and buckets (plus `model`,
  `engine` labels and KV-cache and warmup gauges), served at `GET /metrics`;
- `tracing`: a span tree per generation request, exported over OTLP/HTTP when
  `--otlp-endpoint` is given, off (no work at all) otherwise;
- `logs`: one logging configuration (text or `--json-output` JSON lines) and
  one log line per finished request;
- `request`: the per-request record the three are made from, and
  `middleware`: where each generation request's record opens and closes.

`Telemetry` bundles them for the app.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from opentelemetry.context import Context

from switchyard.telemetry.logs import log_request
from switchyard.telemetry.metrics import Metrics, ModelList
from switchyard.telemetry.middleware import request_telemetry
from switchyard.telemetry.pooling import PoolingMetrics
from switchyard.telemetry.request import RequestRecord
from switchyard.telemetry.tracing import Tracing
from switchyard_spec import StepObserver

log = logging.getLogger("switchyard.telemetry")


class Telemetry:
    """The app's metrics, tracing and request log.

    With `enabled` false (`--disable-telemetry`, for measuring telemetry's own
    cost) no request is recorded and no step observer is installed; `/metrics`
    still answers, with gauges only.
    """

    def __init__(self, models: ModelList, tracing: Tracing | None = None,
                 enabled: bool = True) -> None:
        self.metrics = Metrics(models)
        self.pooling = PoolingMetrics(self.metrics.registry, enabled)
        """The embedding and rerank routes' request metrics (`telemetry.pooling`)."""
        self.tracing = tracing or Tracing()
        self.enabled = enabled

    def middleware(self) -> list[Callable[..., object]]:
        """The app's middleware list: the request recorder, unless disabled."""
        return [request_telemetry(self)] if self.enabled else []

    def step_observer(self, model: str, engine: str) -> StepObserver | None:
        """What `models.loader` installs on an engine before warmup."""
        return self.metrics.step_observer(model, engine) if self.enabled else None

    def finish(self, record: RequestRecord, parent: Context | None) -> None:
        """A generation request is over: count it, trace it, log it."""
        record.end = time.perf_counter()
        try:
            timings = record.timings()
            self.metrics.record_request(record, timings)
            self.tracing.export(record, parent)
            log_request(record, timings)
        except Exception:  # telemetry must never fail a request
            log.exception("recording a request's telemetry failed")

    def shutdown(self) -> None:
        """Flush what is buffered (spans) at server shutdown."""
        self.tracing.shutdown()


__all__ = ["Metrics", "RequestRecord", "Telemetry", "Tracing"]
