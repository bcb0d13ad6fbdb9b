"""Two real replicas of one model behind a gateway; one is killed under 50 streams.

The replicas are `switchyard serve` processes: the session server and one
started here, which is killed with SIGKILL while streams run on it and later
started again on the same port. What a client may see: a stream that had
begun on the killed replica ends with an error event; a request that had not
received a byte never fails (the gateway retries it on the other replica).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.live_server import LiveServer, start_server, stop_server
from tests.support.waiting import eventually

PROMPT = "def fibonacci(n):"
STREAMS = 50


@pytest.fixture(scope="module")
def second(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(model_cache, tmp_path_factory.mktemp("second"), "--dtype", "float32")
    yield live
    if live.process.poll() is None:
        stop_server(live)


@pytest.fixture(scope="module")
def gateway(server: LiveServer, second: LiveServer, model_cache: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("failover")
    config = folder / "models.toml"
    config.write_text(f"""
[[models]]
name = "duo"
upstreams = ["{server.url}", "{second.url}"]
max_failures = 2
cooldown_s = 0.5
metrics_interval_s = 0.05
""")
    live = start_server(model_cache, folder, "--config", str(config))
    yield live
    stop_server(live)


def _stream(url: str, seen: dict[int, tuple[int, bool]], i: int) -> None:
    """One streamed completion: (events received, whether it ended with [DONE])."""
    events, ok = 0, False
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "model": "duo", "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}) as answer:
            for line in answer.iter_lines():
                if line.startswith("data:"):
                    if '"error"' in line:
                        break
                    events += 1
                    ok = line == "data: [DONE]"
    except httpx.HTTPError:
        pass
    seen[i] = (events, ok)


def _running(replica: LiveServer) -> float:
    """The replica's running requests, from its own gauge."""
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("tgi_batch_current_size"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_killing_a_replica_under_load_fails_only_streams_that_had_begun(
        gateway: LiveServer, second: LiveServer, model_cache: Path) -> None:
    seen: dict[int, tuple[int, bool]] = {}
    threads = [threading.Thread(target=_stream, args=(gateway.url, seen, i))
               for i in range(STREAMS)]
    for thread in threads[: STREAMS // 2]:
        thread.start()
    # Kill it with streams in flight on it.
    eventually(lambda: _running(second) >= 1, timeout=60, interval=0.02,
               what="a stream on the second replica")
    second.process.send_signal(signal.SIGKILL)
    second.process.wait()
    for thread in threads[STREAMS // 2:]:  # these arrive while it is dead or already out
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert len(seen) == STREAMS
    broken = {i: events for i, (events, ok) in seen.items() if not ok}
    assert all(events > 0 for events in broken.values()), seen  # each had begun
    assert all(seen[i][1] for i in range(STREAMS // 2, STREAMS)), seen
    assert f"replica {second.url} taken out" in gateway.log()

    # Back on the same port: probed after the cool-down, then given requests again.
    port = int(second.url.rsplit(":", 1)[1])
    back = start_server(model_cache, second.log_path.parent, "--dtype", "float32", port=port)
    second.process, second.log_path = back.process, back.log_path
    eventually(lambda: f"replica {second.url} is back" in gateway.log(), timeout=30,
               interval=0.1, what="the replica probed back")
    answered = []
    for _ in range(12):
        r = httpx.post(f"{gateway.url}/v1/completions", timeout=60, json={
            "model": "duo", "prompt": PROMPT, "max_tokens": 2})
        answered.append(r.status_code)
    assert answered == [200] * 12
    served = httpx.get(f"{second.url}/metrics", timeout=10).text
    assert any(line.startswith("tgi_request_success") and "_created" not in line
               and float(line.rsplit(" ", 1)[1]) > 0
               for line in served.splitlines()), "the restarted replica got no request"
