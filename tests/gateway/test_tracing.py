"""Traces of generation requests: the span tree and attributes, W3C `traceparent`, off by default.

The app is built in-process with the real Xeon engine on the default model
(one thread, float32) and an in-memory span exporter in place of OTLP.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import msgspec
import pytest
from litestar.testing import TestClient
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from switchyard.app import create_app
from switchyard.plugins import PluginHost
from switchyard.settings import ServeSettings
from switchyard.telemetry import Tracing
from switchyard.telemetry.tracing import traces_url
from switchyard_spec import DeviceInfo, EngineConfig, EngineSpec, hookimpl

from tests.support.waiting import eventually

XEON_OPTIONS = {"num_threads": "1"}
"""As tests/support/xeon_options.py: the tiny model gains nothing from more threads."""


class _OneThreadXeon:
    """The Xeon engine, declared with the test's engine options."""

    @hookimpl
    def switchyard_engines(self) -> list[EngineSpec]:
        def factory(config: EngineConfig):  # noqa: ANN202 - an Engine
            from switchyard_xeon.engine import XeonEngine

            return XeonEngine(msgspec.structs.replace(config, options=XEON_OPTIONS))

        return [EngineSpec(name="xeon", description="xeon, one thread", factory=factory,
                           probe=lambda: DeviceInfo(available=True, name="cpu"))]


@pytest.fixture(scope="module")
def traced(default_model_path) -> Iterator[tuple[TestClient, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    host = PluginHost()
    host.register(_OneThreadXeon(), "xeon-test")
    settings = ServeSettings(model_id=str(default_model_path), served_model_name="tiny",
                             dtype="float32", max_total_tokens=512, max_input_tokens=400)
    app = create_app(settings, plugins=host, tracing=Tracing(provider.get_tracer("test")))
    with TestClient(app, timeout=60) as client:
        eventually(lambda: client.get("/health").status_code == 200, timeout=120, interval=0.1,
                   what="the app ready")
        yield client, exporter
    provider.shutdown()


def _request_spans(exporter: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    """The spans of the next `count` requests (waiting for them), then forget them."""
    eventually(lambda: sum(s.parent is None or s.kind is SpanKind.SERVER
                           for s in exporter.get_finished_spans()) >= count,
               timeout=30, interval=0.02, what="the request spans")
    spans = list(exporter.get_finished_spans())
    exporter.clear()
    return spans


def _stream(client: TestClient, headers: dict[str, str] | None = None) -> dict:
    r = client.post("/generate_stream", headers=headers or {}, json={
        "inputs": "hello there", "parameters": {"max_new_tokens": 4, "details": True}})
    assert r.status_code == 200
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    return events[-1]


def test_a_streamed_request_is_one_span_tree(traced):
    client, exporter = traced
    exporter.clear()
    last = _stream(client)
    spans = _request_spans(exporter, 1)
    (root,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert root.name == "POST /generate_stream"
    assert root.parent is None
    attrs = root.attributes
    assert attrs["http.route"] == "/generate_stream"
    assert attrs["http.response.status_code"] == 200
    assert attrs["gen_ai.request.model"] == "tiny"
    assert attrs["switchyard.engine"] == "xeon"
    assert attrs["gen_ai.usage.input_tokens"] == last["details"]["input_length"]
    assert attrs["gen_ai.usage.output_tokens"] == last["details"]["generated_tokens"]
    assert attrs["gen_ai.request.max_tokens"] == 4
    assert list(attrs["gen_ai.response.finish_reasons"]) == [last["details"]["finish_reason"]]
    assert root.status.status_code is StatusCode.UNSET

    children = {s.name: s for s in spans if s is not root}
    assert sorted(children) == ["decode", "prefill", "queue", "validation"]
    for child in children.values():
        assert child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
    # validation, queue, prefill and decode follow one another.
    order = [children[n] for n in ("validation", "queue", "prefill", "decode")]
    for before, after in zip(order, order[1:]):
        assert before.end_time <= after.start_time + 1_000  # ns: rounding of perf_counter
    assert children["prefill"].attributes["gen_ai.usage.input_tokens"] == attrs[
        "gen_ai.usage.input_tokens"]
    assert children["decode"].attributes["gen_ai.usage.output_tokens"] == attrs[
        "gen_ai.usage.output_tokens"]


def test_traceparent_from_the_client_is_the_parent(traced):
    client, exporter = traced
    exporter.clear()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    _stream(client, {"traceparent": f"00-{trace_id}-{parent_id}-01"})
    spans = _request_spans(exporter, 1)
    (root,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert format(root.context.trace_id, "032x") == trace_id
    assert root.parent is not None and format(root.parent.span_id, "016x") == parent_id
    assert root.parent.is_remote
    assert all(format(s.context.trace_id, "032x") == trace_id for s in spans)


def test_a_failed_request_is_an_error_span(traced):
    client, exporter = traced
    exporter.clear()
    r = client.post("/generate", json={"inputs": "", "parameters": {}})
    assert r.status_code == 422
    (root,) = _request_spans(exporter, 1)
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes["error.type"] == "validation"
    assert root.attributes["http.response.status_code"] == 422


def test_other_routes_are_not_traced(traced):
    client, exporter = traced
    exporter.clear()
    assert client.get("/metrics").status_code == 200
    assert client.post("/tokenize", json={"inputs": "hi"}).status_code == 200
    # A traced request after them marks the end: once its span is in, a span of either
    # request before it would be too. Its span is the only one.
    assert client.post("/generate", json={"inputs": "", "parameters": {}}).status_code == 422
    (marker,) = _request_spans(exporter, 1)
    assert marker.attributes["http.response.status_code"] == 422


def test_tracing_is_off_without_an_endpoint():
    off = Tracing.otlp(None, "switchyard")
    assert not off.enabled and off.tracer is None
    assert off.extract({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
                       ) is None


def test_otlp_endpoint_gets_the_traces_path():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/custom/path") == "http://collector:4318/custom/path"
