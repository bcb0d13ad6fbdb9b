"""OpenTelemetry traces of generation requests, exported over OTLP (http/protobuf).

Off unless `--otlp-endpoint` is given (TGI's flag): then there is no tracer
provider at all, `Tracing.enabled` is false and the request path does no
tracing work (no context extraction, no spans).

When on, each generation request becomes one trace subtree, built when the
request is complete from the times its `RequestRecord` holds, so nothing
happens per token and nothing is held open while a request runs:

    POST /generate_stream            (SERVER; model, engine, token counts, status)
    ├── validation                   (arrival -> first sequence submitted)
    ├── queue        [per sequence]  (submitted -> first forward step, as the engine reports)
    ├── prefill      [per sequence]  (first forward step -> first token)
    └── decode       [per sequence]  (first token -> last token)

A W3C `traceparent` header on the request makes the request span a child of
the caller's span. Attribute names follow OpenTelemetry's HTTP and GenAI
semantic conventions (`http.route`, `gen_ai.request.model`,
`gen_ai.usage.input_tokens`, ...) plus `switchyard.engine`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from switchyard.telemetry.request import RequestRecord

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger("switchyard.telemetry")

OTLP_TRACES_PATH = "/v1/traces"
_PROPAGATOR = TraceContextTextMapPropagator()


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for `--otlp-endpoint`.

    A bare collector address (`http://host:4318`) gets OTLP's `/v1/traces`
    path; a URL with a path is used as given.
    """
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + OTLP_TRACES_PATH
    return endpoint


class Tracing:
    """Builds request spans on `tracer`; does nothing when `tracer` is None."""

    def __init__(self, tracer: Tracer | None = None,
                 provider: TracerProvider | None = None) -> None:
        """`provider`, when given, is shut down (its spans flushed) by `shutdown`."""
        self.tracer = tracer
        self._provider = provider

    @property
    def enabled(self) -> bool:
        """Whether requests are traced."""
        return self.tracer is not None

    @classmethod
    def otlp(cls, endpoint: str | None, service_name: str) -> Tracing:
        """Export to an OTLP/HTTP collector at `endpoint`; off when it is None."""
        if not endpoint:
            return cls()
        # Imported only when tracing is on: the SDK and exporter are not free to import.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        url = traces_url(endpoint)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        log.info("tracing: OTLP/HTTP export to %s as service %s", url, service_name)
        return cls(provider.get_tracer("switchyard"), provider)

    def shutdown(self) -> None:
        """Flush and stop the exporter (at server shutdown)."""
        if self._provider is not None:
            self._provider.shutdown()

    def extract(self, headers: Mapping[str, str]) -> Context | None:
        """The caller's trace context from a W3C `traceparent` header, if tracing is on."""
        if self.tracer is None or "traceparent" not in headers:
            return None
        return _PROPAGATOR.extract(headers)

    def export(self, record: RequestRecord, parent: Context | None) -> None:
        """Emit the spans of a finished request (see the module docstring)."""
        tracer = self.tracer
        if tracer is None:
            return
        ns = record.wall_ns
        root = tracer.start_span(
            f"{record.method} {record.route}", context=parent, kind=SpanKind.SERVER,
            start_time=record.arrival_ns, attributes=_request_attributes(record))
        record.trace_id = format(root.get_span_context().trace_id, "032x")
        if not root.is_recording():  # sampled out (OTEL_TRACES_SAMPLER): nothing to build
            root.end(end_time=ns(record.end))
            return
        failure = record.failure
        if failure is not None:
            root.set_attribute("error.type", failure)
            root.set_status(Status(StatusCode.ERROR, failure))
        inside = trace.set_span_in_context(root)

        def child(name: str, start: float, end: float, **attributes: int | str) -> None:
            span = tracer.start_span(name, context=inside, start_time=ns(start),
                                     attributes=attributes)
            span.end(end_time=ns(max(end, start)))

        if record.enqueued is not None:
            child("validation", record.arrival, record.enqueued)
        for seq in record.sequences:
            index = seq.index
            start = seq.batch_start
            child("queue", seq.submitted, start, **{"switchyard.sequence": index})
            if seq.first_event is not None:
                child("prefill", start, seq.first_event, **{
                    "switchyard.sequence": index, "gen_ai.usage.input_tokens": len(seq.prompt)})
                if seq.ended is not None:
                    child("decode", seq.first_event, seq.ended, **{
                        "switchyard.sequence": index,
                        "gen_ai.usage.output_tokens": seq.generated_tokens,
                        "gen_ai.response.finish_reason": seq.finish_reason or "none"})
        root.end(end_time=ns(record.end))


def _request_attributes(record: RequestRecord) -> dict[str, str | int | list[str]]:
    attributes: dict[str, str | int | list[str]] = {
        "http.request.method": record.method,
        "http.route": record.route,
        "http.response.status_code": record.logged_status,
        "gen_ai.request.model": record.model,
        "switchyard.engine": record.engine,
        "gen_ai.usage.input_tokens": record.input_tokens,
        "gen_ai.usage.output_tokens": record.generated_tokens,
        "gen_ai.request.max_tokens": record.max_new_tokens,
        "switchyard.sequences": len(record.sequences),
    }
    reasons = [s.finish_reason for s in record.sequences if s.finish_reason]
    if reasons:
        attributes["gen_ai.response.finish_reasons"] = reasons
    return attributes
