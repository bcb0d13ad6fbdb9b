"""Prometheus metrics under TGI's names, types and buckets, plus Switchyard's own.

Why `prometheus_client` rather than `opentelemetry-sdk` with its Prometheus
exporter: the goal is TGI's exposition exactly (dashboards and alerts written
for TGI must keep working), and prometheus_client states it directly: each
histogram gets TGI's bucket boundaries where it is declared, a collector
reads the engines' load at scrape time, and the registry can be rendered by
our own small writer (`telemetry.exposition`) with TGI's counter names. The
OpenTelemetry route would add views to re-state the buckets, unit and
`_total` suffixes to strip, and a second SDK pipeline for the same numbers
(its exporter is built on prometheus_client anyway). Traces, where
OpenTelemetry is the standard, use it (`telemetry.tracing`).

Labels: every series carries `model` (the served name) and `engine` (the
engine's name) besides TGI's own labels (`err`, `method`). TGI has neither,
but queries select series by name and by the labels they name, so
`rate(tgi_request_count[1m])` or `histogram_quantile(0.9, sum by (le)
(rate(tgi_request_duration_bucket[5m])))` work as they do against TGI; with
one model there is one series per TGI series.

Sources:
- request counters and histograms from each finished `RequestRecord`
  (recorded once per HTTP request; TGI counts a chat request twice in
  `tgi_request_count`, we count every request once);
- batch counters and `tgi_batch_forward_duration` from the engine's
  `StepReport`s (a "mixed" step, prefill chunks with decodes, counts as
  "prefill", as TGI's router reports such a step);
- gauges (queue, batch, KV cache) from `Engine.stats()` when scraped, so they
  are current even when the engine is idle; `tgi_batch_max_total_tokens` and
  `switchyard_warmup_duration_seconds` from the warmup report.

Cluster routers (the Gateway API Inference Extension's endpoint picker) read
three of the gauges and two info gauges, the model-server protocol's
TotalQueuedRequests, TotalRunningRequests, KVCacheUtilization, cache
config and LoRA adapters (see `PICKER_METRICS` and docs/deploy.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from switchyard_spec import (
    Engine,
    EngineSpec,
    EngineStats,
    StepObserver,
    StepReport,
    WarmupReport,
)

from switchyard.telemetry.exposition import render
from switchyard.telemetry.request import RequestRecord, Timings

log = logging.getLogger("switchyard.telemetry")

LABELS = ("model", "engine")

CACHE_INFO = "switchyard_cache_config_info"
"""The info gauge (value 1) whose `block_size` and `num_gpu_blocks` labels describe the KV
cache; the endpoint picker reads these two label names (vLLM's `vllm:cache_config_info`)."""

LORA_INFO = "switchyard_lora_requests_info"
"""The LoRA gauge of a model whose engine serves adapters: labels `max_lora` (adapters held
ready at once), `running_lora_adapters` and `waiting_lora_adapters` (the adapters of running
and of waiting sequences, comma-separated, empty when none); value: the Unix time of the
engine stats it shows. The endpoint picker reads these label names (vLLM's
`vllm:lora_requests_info`) and, of several series, the one with the latest value."""

PICKER_METRICS = {
    "queuedRequestsSpec": "tgi_queue_size",
    "runningRequestsSpec": "tgi_batch_current_size",
    "kvUsageSpec": "switchyard_kv_cache_usage_ratio",
    "cacheInfoSpec": CACHE_INFO,
    "loraSpec": LORA_INFO,
}
"""What to give the Inference Extension's endpoint picker (its `engineConfigs` keys) to read
this server: queued and running sequences, KV-cache utilisation (0..1), the cache config,
the LoRA adapters."""


def _duration_buckets() -> tuple[float, ...]:
    # TGI: 35 buckets, 0.0001 * 1.5^k, computed by repeated multiplication (so the
    # bounds are the same floats, and print as the same strings, as TGI's).
    buckets, value = [], 0.0001
    for _ in range(35):
        value *= 1.5
        buckets.append(value)
    return tuple(buckets)


DURATION_BUCKETS = _duration_buckets()


def linear_buckets(limit: int) -> tuple[float, ...]:
    """TGI's token-count buckets: 100 equal steps up to `limit`."""
    return tuple((limit / 100.0) * (x + 1) for x in range(100))


class ServedModelLike(Protocol):
    """What the gauges read of a served model (`models.served.ServedModel` is one)."""

    name: str
    engine: Engine
    engine_spec: EngineSpec
    warmup: WarmupReport | None


ModelList = Callable[[], Sequence[ServedModelLike]]


class _LengthHistograms:
    """TGI's token-count histograms, whose buckets follow the first model's limits."""

    def __init__(self, registry: CollectorRegistry, max_input: int, max_total: int) -> None:
        self.input_length = Histogram(
            "tgi_request_input_length", "Prompt tokens per request", LABELS,
            registry=registry, buckets=linear_buckets(max_input))
        self.generated_tokens = Histogram(
            "tgi_request_generated_tokens", "Generated tokens per request", LABELS,
            registry=registry, buckets=linear_buckets(max_total))
        self.max_new_tokens = Histogram(
            "tgi_request_max_new_tokens", "max_new_tokens per request", LABELS,
            registry=registry, buckets=linear_buckets(max_total))


class Metrics:
    """The gateway's metrics registry and the instruments in it."""

    def __init__(self, models: ModelList = list) -> None:
        """`models` returns the served models, read when scraped (gauges)."""
        registry = self.registry = CollectorRegistry(auto_describe=False)

        def duration(name: str, doc: str, extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, LABELS + extra, registry=registry,
                             buckets=DURATION_BUCKETS)

        self.request_count = Counter("tgi_request_count", "Generation requests", LABELS,
                                     registry=registry)
        self.request_success = Counter("tgi_request_success", "Successful generation requests",
                                       LABELS, registry=registry)
        self.request_failure = Counter("tgi_request_failure", "Failed generation requests",
                                       (*LABELS, "err"), registry=registry)
        self.request_duration = duration("tgi_request_duration", "Request duration (s)")
        self.validation_duration = duration("tgi_request_validation_duration",
                                            "Validation and tokenization (s)")
        self.queue_duration = duration("tgi_request_queue_duration",
                                       "From submit to the first forward step (s)")
        self.inference_duration = duration("tgi_request_inference_duration",
                                           "From the first forward step to the last token (s)")
        self.time_per_token = duration("tgi_request_mean_time_per_token_duration",
                                       "Inference time per generated token (s)")
        self.forward_duration = duration("tgi_batch_forward_duration",
                                         "Forward pass and sampling of one step (s)", ("method",))
        self.inference_count = Counter("tgi_batch_inference_count", "Forward steps",
                                       (*LABELS, "method"), registry=registry)
        self.inference_success = Counter("tgi_batch_inference_success", "Successful forward steps",
                                         (*LABELS, "method"), registry=registry)
        self.inference_failure = Counter("tgi_batch_inference_failure", "Failed forward steps",
                                         (*LABELS, "method"), registry=registry)
        self.lengths: _LengthHistograms | None = None
        self._bound: dict[tuple[str, str], _RequestSeries] = {}
        registry.register(_EngineGauges(models))

    def exposition(self) -> bytes:
        """The registry in TGI's text format."""
        return render([self.registry])

    def add_model(self, max_input_tokens: int, max_total_tokens: int) -> None:
        """Size the token-count histograms for a model's limits (the first model's win)."""
        if self.lengths is None:
            self.lengths = _LengthHistograms(self.registry, max_input_tokens, max_total_tokens)
            self._bound.clear()  # bound before the histograms existed

    def step_observer(self, model: str, engine: str) -> StepObserver:
        """An observer of `engine`'s steps for `model` (installed before warmup)."""
        labels = {m: (model, engine, m) for m in ("prefill", "decode")}
        count = {m: self.inference_count.labels(*v) for m, v in labels.items()}
        success = {m: self.inference_success.labels(*v) for m, v in labels.items()}
        failure = {m: self.inference_failure.labels(*v) for m, v in labels.items()}
        forward = {m: self.forward_duration.labels(*v) for m, v in labels.items()}

        def observe(report: StepReport) -> None:
            method = "decode" if report.method == "decode" else "prefill"
            try:
                count[method].inc()
                if report.ok:
                    success[method].inc()
                    forward[method].observe(report.seconds)
                else:
                    failure[method].inc()
            except Exception:  # an observer must never raise into the engine loop
                log.debug("step metrics failed", exc_info=True)

        return observe

    def _series(self, model: str, engine: str) -> _RequestSeries:
        # Children bound once per (model, engine): `labels()` costs a lock and a lookup.
        series = self._bound.get((model, engine))
        if series is None:
            series = self._bound[(model, engine)] = _RequestSeries(self, (model, engine))
        return series

    def record_request(self, record: RequestRecord, timings: Timings | None) -> None:
        """Count a finished request and, when it succeeded, its durations and tokens."""
        series = self._series(record.model, record.engine)
        series.count.inc()
        lengths = series.lengths
        if record.sequences and lengths is not None:
            lengths[0].observe(record.input_tokens)
            lengths[1].observe(record.max_new_tokens)
        failure = record.failure
        if failure is not None:
            self.request_failure.labels(record.model, record.engine, failure).inc()
            return
        series.success.inc()
        if timings is None:
            return
        series.duration.observe(timings.total)
        series.validation.observe(timings.validation)
        series.queue.observe(timings.queue)
        series.inference.observe(timings.inference)
        series.time_per_token.observe(timings.time_per_token)
        if lengths is not None:
            lengths[2].observe(record.generated_tokens)


class _RequestSeries:
    """The request metrics' children for one (model, engine)."""

    def __init__(self, metrics: Metrics, labels: tuple[str, str]) -> None:
        self.count = metrics.request_count.labels(*labels)
        self.success = metrics.request_success.labels(*labels)
        self.duration = metrics.request_duration.labels(*labels)
        self.validation = metrics.validation_duration.labels(*labels)
        self.queue = metrics.queue_duration.labels(*labels)
        self.inference = metrics.inference_duration.labels(*labels)
        self.time_per_token = metrics.time_per_token.labels(*labels)
        lengths = metrics.lengths
        self.lengths = None if lengths is None else (
            lengths.input_length.labels(*labels), lengths.max_new_tokens.labels(*labels),
            lengths.generated_tokens.labels(*labels))


class _EngineGauges(Collector):
    """Gauges read from each served model's engine when Prometheus scrapes."""

    def __init__(self, models: ModelList) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        def family(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=LABELS)

        queue = family("tgi_queue_size", "Sequences waiting for the engine")
        size = family("tgi_batch_current_size", "Sequences in the running batch")
        tokens = family("tgi_batch_current_max_tokens", "KV-cache tokens the running batch holds")
        total = family("tgi_batch_max_total_tokens", "KV-cache capacity in tokens (after warmup)")
        used = family("switchyard_kv_cache_used_tokens", "KV-cache tokens in use")
        capacity = family("switchyard_kv_cache_capacity_tokens", "KV-cache capacity in tokens")
        ratio = family("switchyard_kv_cache_usage_ratio",
                       "Fraction of the KV cache in use: used/total blocks")
        warmup = family("switchyard_warmup_duration_seconds", "Warmup time of the engine (s)")
        info = GaugeMetricFamily(CACHE_INFO, "KV-cache configuration (labels); value 1",
                                 labels=(*LABELS, "block_size", "num_gpu_blocks"))
        lora = GaugeMetricFamily(
            LORA_INFO, "LoRA adapters: the most held at once, those of running and of waiting "
            "requests (labels); value: Unix time of the engine stats",
            labels=(*LABELS, "max_lora", "running_lora_adapters", "waiting_lora_adapters"))
        spec_labels = (*LABELS, "method")
        drafts = CounterMetricFamily(
            "switchyard_spec_decode_num_drafts", "Sequence steps that fed drafted tokens",
            labels=spec_labels)
        drafted = CounterMetricFamily(
            "switchyard_spec_decode_num_draft_tokens", "Drafted tokens fed to the model",
            labels=spec_labels)
        accepted = CounterMetricFamily(
            "switchyard_spec_decode_num_accepted_tokens",
            "Drafted tokens the model kept (each one emitted without a step of its own)",
            labels=spec_labels)
        rate = GaugeMetricFamily(
            "switchyard_spec_decode_acceptance_rate",
            "Drafted tokens kept per drafted token since start "
            "(num_accepted_tokens / num_draft_tokens)", labels=spec_labels)
        for model in self._models():
            labels = [model.name, model.engine_spec.name]
            try:
                stats = model.engine.stats()
                taken = time.time()
            except Exception:  # a broken engine must not break the scrape
                log.debug("stats of %s failed", model.name, exc_info=True)
                continue
            report = model.warmup
            cap = stats.max_batch_total_tokens or (report.max_batch_total_tokens if report else 0)
            queue.add_metric(labels, stats.waiting)
            size.add_metric(labels, stats.running)
            tokens.add_metric(labels, stats.batch_tokens)
            used.add_metric(labels, stats.batch_tokens)
            capacity.add_metric(labels, cap)
            ratio.add_metric(labels, _usage(stats, cap))
            if stats.kv_blocks_total:
                info.add_metric([*labels, str(stats.kv_block_size), str(stats.kv_blocks_total)], 1)
            if stats.max_lora > 0:
                adapters = [",".join(stats.running_lora_adapters),
                            ",".join(stats.waiting_lora_adapters)]
                lora.add_metric([*labels, str(stats.max_lora), *adapters], taken)
            if report is not None:
                total.add_metric(labels, report.max_batch_total_tokens)
                warmup.add_metric(labels, report.seconds)
            if stats.spec_method:
                method = [*labels, stats.spec_method]
                drafts.add_metric(method, stats.spec_drafts)
                drafted.add_metric(method, stats.spec_draft_tokens)
                accepted.add_metric(method, stats.spec_accepted_tokens)
                if stats.spec_draft_tokens:  # no rate before the first draft
                    rate.add_metric(method, stats.spec_accepted_tokens / stats.spec_draft_tokens)
        yield from (queue, size, tokens, total, used, capacity, ratio, warmup, info)
        yield from (family for family in (lora, drafts, drafted, accepted, rate) if family.samples)


def _usage(stats: EngineStats, capacity_tokens: int) -> float:
    """KV-cache utilisation, 0..1: used/total blocks; tokens for an engine that reports no
    blocks."""
    if stats.kv_blocks_total:
        return stats.kv_blocks_used / stats.kv_blocks_total
    return stats.batch_tokens / capacity_tokens if capacity_tokens else 0.0
