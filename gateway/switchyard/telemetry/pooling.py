"""Request metrics of the embedding and rerank routes, under TEI's metric names.

text-embeddings-inference counts requests as `te_request_count`,
`te_request_success` and `te_request_failure{err}` and times them with
`te_request_duration`, `te_request_tokenization_duration`,
`te_request_queue_duration` and `te_request_inference_duration`; the same
names are used here, with `model`, `engine` and `route` labels, so a TEI
dashboard reads this server's embedding traffic (and tells routes apart).
`te_request_input_length` counts the tokens of each request. The gauges
`te_queue_size` (inputs waiting for a forward) and `te_batch_current_size`
(inputs in the running forward) and the counter `te_batch_inference_count`
(forwards run) are read from each pooling engine's `stats()` when scraped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from switchyard.errors import ApiError

if TYPE_CHECKING:
    from switchyard.models.pooling import PoolingModel

LABELS = ("model", "engine", "route")
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TOKENS = (8, 32, 128, 512, 2048, 8192, 32768, 131072)


@dataclass
class PoolingRecord:
    """What one embedding or rerank request did; the route fills it in as it learns."""

    route: str
    start: float
    model: str = ""
    engine: str = ""
    tokens: int = 0
    tokenized: float | None = None
    """When tokenization ended (perf_counter)."""
    queue_seconds: float = 0.0
    inference_seconds: float = 0.0


class PoolingMetrics:
    """The te_* instruments, in the gateway's metrics registry."""

    def __init__(self, registry: CollectorRegistry, enabled: bool = True) -> None:
        self.enabled = enabled
        self._registry = registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=registry, buckets=buckets)

        self.count = Counter("te_request_count", "Embedding and rerank requests", LABELS,
                             registry=registry)
        self.success = Counter("te_request_success", "Successful embedding and rerank requests",
                               LABELS, registry=registry)
        self.failure = Counter("te_request_failure", "Failed embedding and rerank requests",
                               (*LABELS, "err"), registry=registry)
        self.duration = histogram("te_request_duration", "Request duration (s)", _SECONDS)
        self.tokenization = histogram("te_request_tokenization_duration",
                                      "Tokenization (s)", _SECONDS)
        self.queue = histogram("te_request_queue_duration",
                               "From submit to the forward that ran it (s)", _SECONDS)
        self.inference = histogram("te_request_inference_duration",
                                   "The forward that ran it (s)", _SECONDS)
        self.input_length = histogram("te_request_input_length", "Tokens of a request",
                                      _TOKENS)

    def watch(self, models: Callable[[], Sequence[PoolingModel]]) -> None:
        """Report the load of the pooling engines `models` returns, read when scraped."""
        self._registry.register(_PoolingGauges(models))

    @contextmanager
    def observe(self, route: str) -> Iterator[PoolingRecord]:
        """Count the request the block serves, as a success or by its error type."""
        record = PoolingRecord(route=route, start=time.perf_counter())
        try:
            yield record
        except ApiError as exc:
            self._finish(record, exc.error_type)
            raise
        except Exception:
            self._finish(record, "internal")
            raise
        self._finish(record, None)

    def _finish(self, record: PoolingRecord, error: str | None) -> None:
        if not self.enabled:
            return
        labels = (record.model, record.engine, record.route)
        self.count.labels(*labels).inc()
        if error is not None:
            self.failure.labels(*labels, error).inc()
            return
        self.success.labels(*labels).inc()
        self.duration.labels(*labels).observe(time.perf_counter() - record.start)
        if record.tokenized is not None:
            self.tokenization.labels(*labels).observe(record.tokenized - record.start)
        self.queue.labels(*labels).observe(record.queue_seconds)
        self.inference.labels(*labels).observe(record.inference_seconds)
        self.input_length.labels(*labels).observe(record.tokens)


class _PoolingGauges(Collector):
    """Queue and batch gauges of every pooling engine, read at scrape time."""

    def __init__(self, models: Callable[[], Sequence[PoolingModel]]) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        """One sample per pooling model of each gauge."""
        queue = GaugeMetricFamily("te_queue_size", "Inputs waiting for a forward",
                                  labels=("model", "engine"))
        batch = GaugeMetricFamily("te_batch_current_size", "Inputs in the running forward",
                                  labels=("model", "engine"))
        forwards = CounterMetricFamily("te_batch_inference_count", "Forwards run",
                                       labels=("model", "engine"))
        for model in self._models():
            stats = model.engine.stats()
            labels = [model.name, model.engine_spec.name]
            queue.add_metric(labels, stats.waiting)
            batch.add_metric(labels, stats.running)
            forwards.add_metric(labels, stats.steps)
        yield queue
        yield batch
        yield forwards
