"""Units of the drain (`switchyard.drain`) and of the gauges cluster routers read.

The live behaviour (a real SIGTERM with streams in flight, gauges of a loaded engine) is in
tests/e2e/test_drain.py; here each decision is driven directly: which signal drains, when
the drain ends, and how the gauges are computed from an engine's `EngineStats`.
"""

from __future__ import annotations

import asyncio
import re
import signal
from types import SimpleNamespace

import pytest
import uvicorn

from switchyard import drain
from switchyard.telemetry.metrics import CACHE_INFO, Metrics
from switchyard_spec import EngineStats


class _Gateway(SimpleNamespace):
    draining = False
    in_flight = 0


def _server(timeout: float = 30.0) -> tuple[drain.DrainingServer, _Gateway]:
    gateway = _Gateway()
    config = uvicorn.Config(app=lambda *a: None, log_config=None)
    return drain.DrainingServer(config, gateway, timeout), gateway  # type: ignore[arg-type]


def _tick(server: drain.DrainingServer) -> bool:
    # Counter 1: not a once-per-second tick, so uvicorn's part only reads should_exit.
    return asyncio.run(server.on_tick(1))


def test_sigterm_drains_until_nothing_is_in_flight():
    server, gateway = _server()
    gateway.in_flight = 2
    server.handle_exit(signal.SIGTERM, None)
    assert gateway.draining and not server.should_exit
    assert _tick(server) is False  # two requests still running
    gateway.in_flight = 0
    assert _tick(server) is True and server.should_exit
    assert server._captured_signals == [signal.SIGTERM]  # re-raised after shutdown


def test_drain_ends_at_its_timeout(monkeypatch):
    server, gateway = _server(timeout=30)
    gateway.in_flight = 1
    clock = [1000.0]
    monkeypatch.setattr(drain.time, "monotonic", lambda: clock[0])
    server.handle_exit(signal.SIGTERM, None)
    clock[0] += 29.9
    assert _tick(server) is False
    clock[0] += 0.1
    assert _tick(server) is True and gateway.in_flight == 1


def test_second_sigterm_sigint_and_zero_timeout_stop_at_once():
    server, gateway = _server()
    gateway.in_flight = 1
    server.handle_exit(signal.SIGTERM, None)
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit
    server, gateway = _server()
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and not gateway.draining
    server, gateway = _server(timeout=0)
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and not gateway.draining


def test_in_flight_counts_requests_until_their_last_byte_not_probes():
    gateway = _Gateway()
    seen: list[int] = []

    async def app(scope, receive, send):
        seen.append(gateway.in_flight)
        await asyncio.sleep(0)

    middleware = drain.in_flight_counter(gateway)(app)  # type: ignore[arg-type]

    async def call(method: str, path: str) -> None:
        await middleware({"type": "http", "method": method, "path": path}, None, None)

    for method, path in [("POST", "/generate_stream"), ("POST", "/v1/chat/completions"),
                         ("POST", "/"), ("GET", "/health"), ("GET", "/"), ("GET", "/live"),
                         ("GET", "/metrics"), ("GET", "/ping")]:
        asyncio.run(call(method, path))
    assert seen == [1, 1, 1, 0, 0, 0, 0, 0]
    assert gateway.in_flight == 0


def _scrape(stats: EngineStats) -> dict[str, list[tuple[dict[str, str], float]]]:
    model = SimpleNamespace(name="m", engine_spec=SimpleNamespace(name="e"), warmup=None,
                            engine=SimpleNamespace(stats=lambda: stats))
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in Metrics(lambda: [model]).exposition().decode().splitlines():
        match = re.fullmatch(r"(\w+)\{(.*)\} (\S+)", line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            samples.setdefault(match.group(1), []).append((labels, float(match.group(3))))
    return samples


@pytest.mark.parametrize("used,total", [(0, 64), (5, 64), (64, 64), (3, 7)])
def test_kv_usage_is_used_over_total_blocks(used, total):
    stats = EngineStats(running=2, waiting=3, batch_tokens=used * 16,
                        max_batch_total_tokens=total * 16, kv_block_size=16,
                        kv_blocks_total=total, kv_blocks_used=used)
    samples = _scrape(stats)
    assert samples["switchyard_kv_cache_usage_ratio"] == [({"model": "m", "engine": "e"},
                                                           used / total)]
    assert samples["tgi_queue_size"][0][1] == 3
    assert samples["tgi_batch_current_size"][0][1] == 2
    assert samples[CACHE_INFO] == [({"model": "m", "engine": "e", "block_size": "16",
                                     "num_gpu_blocks": str(total)}, 1.0)]


def test_a_static_cache_counts_rows_as_blocks():
    """The gaudi engine's report: a row of max_total_tokens per batch slot, one per sequence,
    so utilisation is rows held, however few tokens each row has filled."""
    stats = EngineStats(running=3, waiting=0, batch_tokens=3 * 40, max_batch_total_tokens=8 * 512,
                        kv_block_size=512, kv_blocks_total=8, kv_blocks_used=3)
    samples = _scrape(stats)
    assert samples["switchyard_kv_cache_usage_ratio"][0][1] == 3 / 8
    assert samples[CACHE_INFO][0][0]["block_size"] == "512"


def test_an_engine_without_blocks_is_measured_in_tokens_and_has_no_cache_info():
    stats = EngineStats(running=1, waiting=0, batch_tokens=100, max_batch_total_tokens=400)
    samples = _scrape(stats)
    assert samples["switchyard_kv_cache_usage_ratio"][0][1] == 0.25
    assert CACHE_INFO not in samples

