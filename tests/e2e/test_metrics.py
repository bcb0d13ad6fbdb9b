"""`GET /metrics`, JSON request logs and OTLP export, against one live server of our own.

The server is started for this module alone (the session `server` is shared,
so its counters are cumulative), with `--json-output` and `--otlp-endpoint`
pointing at a small OTLP/HTTP collector run by the test, and EOS ignored so
every request generates exactly `max_new_tokens`. A fixed set of requests is
sent once; the tests then check the exposition (names, `# TYPE`s, labels,
bucket bounds, counts by outcome), the log lines and the exported spans.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from switchyard.telemetry.exposition import format_number, render
from tests.support.live_server import LiveServer, start_server, stop_server
from tests.support.prometheus import Scrape
from tests.support.waiting import eventually

MODEL = "switchyard/tiny-llama-random"
LABELS = {"model": MODEL, "engine": "xeon"}
MAX_INPUT, MAX_TOTAL = 400, 512

# ----------------------------------------------------------------- exposition units


def test_numbers_are_written_as_tgi_writes_them():
    assert format_number(4.0) == "4"
    assert format_number(5.12) == "5.12"
    assert format_number(0.00015000000000000001) == "0.00015000000000000001"
    assert format_number(1e-05) == "0.00001"
    assert format_number(float("inf")) == "+Inf"
    assert format_number(3) == "3"


def test_counters_render_without_total_or_created():
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    Counter("tgi_request_count", "doc", ["model"], registry=registry).labels("m").inc(2)
    text = render([registry]).decode()
    assert text == ('# HELP tgi_request_count doc\n# TYPE tgi_request_count counter\n'
                    'tgi_request_count{model="m"} 2\n')


# ----------------------------------------------------------------- a collector


class _Collector(BaseHTTPRequestHandler):
    spans: list[tuple[str, object, object]] = []  # (service name, resource span, span)

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        for rs in request.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes
                           if a.key == "service.name")
            for ss in rs.scope_spans:
                for span in ss.spans:
                    type(self).spans.append((service, rs, span))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def collector() -> Iterator[str]:
    _Collector.spans = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


# ----------------------------------------------------------------- the traffic


@dataclass
class Sent:
    """What the module sent and what the server answered."""

    server: LiveServer
    successes: int = 0
    generated: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    total: int = 0


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(scope="module")
def sent(model_cache, default_model_path, tmp_path_factory, collector) -> Iterator[Sent]:
    live = start_server(
        model_cache, tmp_path_factory.mktemp("logs"), "--dtype", "float32",
        "--max-total-tokens", str(MAX_TOTAL), "--max-input-tokens", str(MAX_INPUT),
        "--json-output", "--otlp-endpoint", collector, "--otlp-service-name", "switchyard-test",
        env={"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
    out = Sent(server=live)
    url = live.url

    def ok(r: httpx.Response, tokens: int) -> None:
        assert r.status_code == 200, r.text
        out.successes += 1
        out.generated += tokens
        out.total += 1

    def failed(err: str) -> None:
        out.failures[err] = out.failures.get(err, 0) + 1
        out.total += 1

    try:
        for n in (3, 5):
            r = httpx.post(f"{url}/generate", timeout=60, headers={"traceparent": TRACEPARENT}
                           if n == 3 else {},
                           json={"inputs": "def fib(n):", "parameters": {"max_new_tokens": n}})
            ok(r, n)
        r = httpx.post(f"{url}/generate_stream", timeout=60,
                       json={"inputs": "hello", "parameters": {"max_new_tokens": 4}})
        ok(r, 4)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2})
        ok(r, 4)
        r = httpx.post(f"{url}/generate", json={"inputs": "", "parameters": {}}, timeout=60)
        assert r.status_code == 422
        failed("validation")
        # An in-stream error: the status is 200, the request still failed.
        r = httpx.post(f"{url}/generate_stream", timeout=60,
                       json={"inputs": "hi", "parameters": {"best_of": 2, "do_sample": True}})
        assert r.status_code == 200 and '"error_type":"validation"' in r.text
        failed("validation")
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "nope", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404
        failed("model_not_found")
        # A client that goes away mid-stream: TGI's "dropped".
        long = {"inputs": "go on", "parameters": {"max_new_tokens": 400}}
        with httpx.stream("POST", f"{url}/generate_stream", json=long, timeout=60) as stream:
            next(line for line in stream.iter_lines() if line.startswith("data:"))
        failed("dropped")
        eventually(lambda: Scrape.parse(httpx.get(f"{url}/metrics").text).value(
                       "tgi_request_failure", err="dropped") >= 1,
                   timeout=30, interval=0.1, what="the dropped stream counted")
        yield out
    finally:
        stop_server(live)


@pytest.fixture(scope="module")
def scrape(sent: Sent) -> Scrape:
    r = httpx.get(f"{sent.server.url}/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return Scrape.parse(r.text)


# ----------------------------------------------------------------- metrics


TYPES = {
    "tgi_request_count": "counter", "tgi_request_success": "counter",
    "tgi_request_failure": "counter", "tgi_batch_inference_count": "counter",
    "tgi_batch_inference_success": "counter", "tgi_batch_inference_failure": "counter",
    "tgi_request_duration": "histogram", "tgi_request_validation_duration": "histogram",
    "tgi_request_queue_duration": "histogram", "tgi_request_inference_duration": "histogram",
    "tgi_request_mean_time_per_token_duration": "histogram",
    "tgi_request_input_length": "histogram", "tgi_request_generated_tokens": "histogram",
    "tgi_request_max_new_tokens": "histogram", "tgi_batch_forward_duration": "histogram",
    "tgi_queue_size": "gauge", "tgi_batch_current_size": "gauge",
    "tgi_batch_current_max_tokens": "gauge", "tgi_batch_max_total_tokens": "gauge",
    "switchyard_kv_cache_usage_ratio": "gauge", "switchyard_kv_cache_used_tokens": "gauge",
    "switchyard_kv_cache_capacity_tokens": "gauge", "switchyard_warmup_duration_seconds": "gauge",
    "switchyard_cache_config_info": "gauge",
}


def test_names_and_types_are_tgis(scrape):
    for name, kind in TYPES.items():
        assert scrape.types.get(name) == kind, name
    # TGI's exporter adds no suffix to counters and no *_created series.
    assert "tgi_request_count_total" not in scrape.text and "_created" not in scrape.text
    for name, _, _ in scrape.samples:
        assert not name.endswith("_total"), name
        assert name in scrape.types or name.rsplit("_", 1)[0] in scrape.types, name


def test_every_series_names_model_and_engine(scrape):
    for name, labels, _ in scrape.samples:
        if labels.get("model"):  # a request refused before a model was chosen has none
            assert labels["model"] == MODEL and labels["engine"] == "xeon", (name, labels)
    assert scrape.value("tgi_request_count", **LABELS) > 0


def test_request_counts_match_what_was_sent(scrape, sent):
    assert scrape.value("tgi_request_count") == sent.total
    assert scrape.value("tgi_request_success", **LABELS) == sent.successes
    for err, count in sent.failures.items():
        assert scrape.value("tgi_request_failure", err=err) == count, err
    assert scrape.value("tgi_request_failure") == sum(sent.failures.values())
    # Durations and generated tokens are recorded for successful requests only.
    assert scrape.value("tgi_request_duration_count", **LABELS) == sent.successes
    assert scrape.value("tgi_request_generated_tokens_sum", **LABELS) == sent.generated
    assert scrape.value("tgi_request_mean_time_per_token_duration_count") == sent.successes


# TGI's duration buckets, as its router defines them (router/src/server.rs): 35 bounds; a
# value starts at 0.0001 and is multiplied by 1.5 before each bound is pushed, so the first
# bound is 0.0001 * 1.5 and the last 0.0001 * 1.5**35 (about 146 s), each the float64 that
# the repeated multiplication rounds to. Its exporter (metrics-exporter-prometheus) writes an
# f64 as Rust's `Display` does: the shortest decimal that reads back as the same double, never
# in exponent form. These are the `le` labels that gives, pinned here.
TGI_DURATION_LE = [
    "0.00015000000000000001", "0.00022500000000000002", "0.0003375", "0.00050625",
    "0.000759375", "0.0011390624999999999", "0.0017085937499999998", "0.0025628906249999996",
    "0.0038443359374999994", "0.00576650390625", "0.008649755859375", "0.0129746337890625",
    "0.01946195068359375", "0.029192926025390625", "0.043789389038085935", "0.0656840835571289",
    "0.09852612533569335", "0.14778918800354002", "0.22168378200531003", "0.33252567300796504",
    "0.49878850951194753", "0.7481827642679213", "1.122274146401882", "1.683411219602823",
    "2.5251168294042348", "3.787675244106352", "5.681512866159528", "8.52226929923929",
    "12.783403948858936", "19.175105923288406", "28.76265888493261", "43.143988327398915",
    "64.71598249109837", "97.07397373664756", "145.61096060497135", "+Inf",
]


def test_pinned_labels_follow_tgis_definition():
    """The pinned labels are TGI's recipe: repeated multiplication, shortest round-trip text."""
    from decimal import Decimal

    value, labels = 0.0001, []
    for _ in range(35):
        value *= 1.5
        labels.append(format(Decimal(repr(value)), "f"))  # shortest digits, positional
    assert labels + ["+Inf"] == TGI_DURATION_LE
    assert float(TGI_DURATION_LE[-2]) == pytest.approx(0.0001 * 1.5**35)


def test_bucket_bounds_are_tgis(scrape):
    expected = TGI_DURATION_LE
    for name in ("tgi_request_duration", "tgi_request_queue_duration",
                 "tgi_request_inference_duration", "tgi_request_validation_duration",
                 "tgi_request_mean_time_per_token_duration", "tgi_batch_forward_duration"):
        assert scrape.bounds(name) == expected, name
    assert scrape.bounds("tgi_request_input_length") == [
        str(4 * (i + 1)) for i in range(100)] + ["+Inf"]
    generated = scrape.bounds("tgi_request_generated_tokens")
    assert generated[:3] == ["5.12", "10.24", "15.36"] and generated[-2:] == ["512", "+Inf"]
    assert scrape.bounds("tgi_request_max_new_tokens") == generated


def test_batch_metrics_come_from_engine_steps(scrape, sent):
    prefill = scrape.value("tgi_batch_inference_count", method="prefill", **LABELS)
    decode = scrape.value("tgi_batch_inference_count", method="decode", **LABELS)
    assert prefill >= 1 and decode >= 1
    assert scrape.value("tgi_batch_inference_success", **LABELS) == prefill + decode
    assert scrape.value("tgi_batch_inference_failure", **LABELS) == 0
    assert scrape.value("tgi_batch_forward_duration_count", **LABELS) == prefill + decode


def test_gauges(scrape):
    capacity = scrape.value("tgi_batch_max_total_tokens", **LABELS)
    assert capacity > 0
    assert scrape.value("switchyard_kv_cache_capacity_tokens", **LABELS) == capacity
    assert 0 <= scrape.value("switchyard_kv_cache_usage_ratio", **LABELS) <= 1
    assert scrape.value("switchyard_warmup_duration_seconds", **LABELS) > 0
    assert scrape.value("tgi_queue_size", **LABELS) >= 0


# ----------------------------------------------------------------- logs


def test_json_logs_one_line_per_request(sent):
    lines = [json.loads(line) for line in sent.server.log().splitlines() if line.strip()]
    assert {"timestamp", "level", "target", "message"} <= set(lines[0])
    targets = [line["target"] for line in lines]
    # Start-up explains itself, in the same format, step by step.
    for step in ("switchyard.plugins", "switchyard.models", "switchyard.xeon"):
        assert step in targets, step
    requests = [line["request"] for line in lines if line["target"] == "switchyard.request"]
    assert len(requests) == sent.total  # one line per request, none per token
    ok = [r for r in requests if r["error"] is None]
    assert len(ok) == sent.successes
    first = ok[0]
    assert first["route"] == "/generate" and first["status"] == 200
    assert first["model"] == MODEL and first["engine"] == "xeon"
    assert first["generated_tokens"] == 3 and first["finish_reasons"] == ["length"]
    for key in ("validation_seconds", "queue_seconds", "inference_seconds",
                "time_per_token_seconds"):
        assert first[key] >= 0, key
    errors = sorted(r["error"] for r in requests if r["error"] is not None)
    assert errors == sorted(e for e, n in sent.failures.items() for _ in range(n))


# ----------------------------------------------------------------- traces


def test_spans_are_exported_over_otlp_http(sent):
    def request_spans() -> list:
        return [s for _, _, s in _Collector.spans if s.name.startswith("POST ")]

    # The batch processor exports every few seconds.
    eventually(lambda: len(request_spans()) >= sent.total, timeout=20, interval=0.2,
               what="a span exported for every request")
    roots = request_spans()
    assert {service for service, _, _ in _Collector.spans} == {"switchyard-test"}
    assert len(roots) == sent.total
    traced = [s for s in roots if s.trace_id.hex() == TRACEPARENT.split("-")[1]]
    assert len(traced) == 1 and traced[0].parent_span_id.hex() == TRACEPARENT.split("-")[2]
    children = [s.name for _, _, s in _Collector.spans if s.parent_span_id == traced[0].span_id]
    assert sorted(children) == ["decode", "prefill", "queue", "validation"]
