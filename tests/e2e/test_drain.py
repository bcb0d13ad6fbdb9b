"""A server configured only through TGI's environment variables, the load gauges cluster
routers read, and a SIGTERM drain, against one live server of this module's own.

The server is started with no flags at all (`PORT`, `HOSTNAME`, `MODEL_ID`, `MAX_BATCH_SIZE`,
`MAX_TOTAL_TOKENS`, TGI's older `MAX_INPUT_LENGTH`, ...), EOS ignored so every stream is
exactly `max_new_tokens` long, and a batch of 2 so that a third and fourth request wait in
the queue. The drain test stops it, so it comes last.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.support.live_server import LiveServer, free_port
from tests.support.prometheus import Scrape
from tests.support.waiting import eventually

NAME = "drain-test"
MAX_INPUT, MAX_TOTAL, BATCH = 400, 2048, 2
DRAIN_TIMEOUT = 300
DRAIN_TOKENS = 1500
"""Tokens of each stream the drain test sends: thousands of decode steps (a second or more
on the fastest machine) for the dozen quick requests the test makes while they run."""


@pytest.fixture(scope="module")
def live(default_model_path: Path, model_cache: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("logs") / "drain-server.log"
    env = {**os.environ, "SWITCHYARD_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1",
           "PORT": str(port), "HOSTNAME": "127.0.0.1", "MODEL_ID": str(default_model_path),
           "SERVED_MODEL_NAME": NAME, "DTYPE": "float32", "MAX_BATCH_SIZE": str(BATCH),
           "MAX_TOTAL_TOKENS": str(MAX_TOTAL), "MAX_INPUT_LENGTH": str(MAX_INPUT),
           "SWITCHYARD_DRAIN_TIMEOUT": str(DRAIN_TIMEOUT),
           "TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"}
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "switchyard.cli", "serve"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    server = LiveServer(url=f"http://127.0.0.1:{port}", process=proc, log_path=log_path)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, server.log()
            return httpx.get(f"{server.url}/health", timeout=2).status_code == 200

        eventually(healthy, timeout=180, interval=0.3, what=server.log,
                   ignoring=(httpx.HTTPError,))
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@dataclass
class Stream:
    """A `/generate_stream` request read to its end on a thread."""

    url: str
    prompt: str
    max_new_tokens: int
    tokens: int = 0
    final: dict | None = None
    error: BaseException | None = None
    first_token: threading.Event = field(default_factory=threading.Event)
    ended_at: float | None = None
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        body = {"inputs": self.prompt, "parameters": {"max_new_tokens": self.max_new_tokens}}
        try:
            with httpx.stream("POST", f"{self.url}/generate_stream", json=body,
                              timeout=DRAIN_TIMEOUT) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    event = json.loads(line[5:])
                    assert "error" not in event, event
                    self.tokens += 1
                    self.first_token.set()
                    if event.get("generated_text") is not None:
                        self.final = event
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first_token.set()

    @property
    def done(self) -> bool:
        return self.ended_at is not None

    def join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "stream still running"
        assert self.error is None, self.error


def _scrape(url: str) -> Scrape:
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200
    return Scrape.parse(r.text)


def _scrape_until(url: str, predicate, what: str, timeout: float = 60.0) -> Scrape:
    """The first scrape of ``url`` that satisfies ``predicate`` (polled by ``eventually``)."""
    seen: list[Scrape] = []

    def satisfied() -> Scrape | None:
        seen.append(_scrape(url))
        return seen[-1] if predicate(seen[-1]) else None

    return eventually(satisfied, timeout=timeout,
                      what=lambda: f"never saw {what}:\n{seen[-1].text}")


LABELS = {"model": NAME, "engine": "xeon"}


def test_tgi_environment_variables_configure_the_server(live, default_model_path):
    """No flag was given: the port, address, model, limits and name all came from the env."""
    info = httpx.get(f"{live.url}/info", timeout=10).json()
    assert info["model_id"] == str(default_model_path)
    assert info["max_input_tokens"] == MAX_INPUT  # MAX_INPUT_LENGTH, TGI's older name
    assert info["max_total_tokens"] == MAX_TOTAL
    models = httpx.get(f"{live.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [NAME]
    # MAX_BATCH_SIZE: the KV cache is sized for BATCH sequences of MAX_TOTAL tokens.
    scrape = _scrape(live.url)
    assert scrape.value("switchyard_kv_cache_capacity_tokens", **LABELS) == BATCH * MAX_TOTAL


def _cache_info(scrape: Scrape) -> tuple[int, int]:
    (labels,) = [ls for n, ls, v in scrape.samples
                 if n == "switchyard_cache_config_info" and ls.get("model") == NAME and v == 1]
    return int(labels["block_size"]), int(labels["num_gpu_blocks"])


def test_gauges_follow_queued_and_running_requests(live):
    idle = _scrape(live.url)
    block_size, num_blocks = _cache_info(idle)
    assert block_size == 16  # the xeon engine's default block_size
    assert block_size * num_blocks == idle.value("switchyard_kv_cache_capacity_tokens", **LABELS)
    assert block_size * num_blocks == idle.value("tgi_batch_max_total_tokens", **LABELS)
    assert idle.value("tgi_queue_size", **LABELS) == 0
    assert idle.value("tgi_batch_current_size", **LABELS) == 0
    assert idle.value("switchyard_kv_cache_usage_ratio", **LABELS) == 0

    prompts = [f"request number {i} says hello " * 3 for i in range(2 * BATCH)]
    prompt_tokens = [len(httpx.post(f"{live.url}/tokenize", json={"inputs": p},
                                    timeout=10).json()) for p in prompts]
    streams = [Stream(live.url, p, 200).start() for p in prompts]
    # BATCH run, the rest wait for a free slot: the engine's running batch and queue.
    busy = _scrape_until(live.url, lambda s: s.value("tgi_batch_current_size", **LABELS) == BATCH
                         and s.value("tgi_queue_size", **LABELS) == len(prompts) - BATCH,
                         "the batch full and the queue holding the rest")
    used = busy.value("switchyard_kv_cache_used_tokens", **LABELS)
    usage = busy.value("switchyard_kv_cache_usage_ratio", **LABELS)
    # Utilisation is used/total blocks: one snapshot, so the two gauges agree exactly.
    assert used % block_size == 0
    assert usage == (used / block_size) / num_blocks
    # Every running sequence holds at least its prompt's blocks, at most a full sequence's.
    least = sum(math.ceil(n / block_size) for n in sorted(prompt_tokens)[:BATCH])
    most = BATCH * math.ceil(MAX_TOTAL / block_size)
    assert least <= used / block_size <= most, (used, least, most)
    assert 0 < usage <= 1

    for stream in streams:
        stream.join(timeout=DRAIN_TIMEOUT)
        assert stream.tokens == 200 and stream.final is not None
    done = _scrape_until(live.url, lambda s: s.value("tgi_batch_current_size", **LABELS) == 0
                         and s.value("tgi_queue_size", **LABELS) == 0, "the engine idle")
    # Blocks kept only for prefix reuse are not in use: an idle cache is 0% used.
    assert done.value("switchyard_kv_cache_used_tokens", **LABELS) == 0
    assert done.value("switchyard_kv_cache_usage_ratio", **LABELS) == 0


def test_sigterm_drains_streams_then_exits(live):
    """Readiness fails and new requests get 503 at once; streams in flight (running and
    queued) still arrive whole; the process exits when the last one has finished."""
    streams = [Stream(live.url, f"drain stream {i} " * 3, DRAIN_TOKENS).start()
               for i in range(BATCH + 1)]
    # Whichever two the engine admitted first run; the other waits in its queue.
    _scrape_until(live.url, lambda s: s.value("tgi_batch_current_size", **LABELS) == BATCH
                  and s.value("tgi_queue_size", **LABELS) == 1, "two streams running, one queued")
    assert sum(stream.first_token.wait(0) for stream in streams) <= BATCH

    live.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()

    def unready() -> httpx.Response | None:
        health = httpx.get(f"{live.url}/health", timeout=5)
        return health if health.status_code == 503 else None

    health = eventually(unready, timeout=10, interval=0.02, what="readiness failed")
    assert health.json() == {"error": "unhealthy", "error_type": "healthcheck"}
    assert httpx.get(f"{live.url}/live", timeout=5).status_code == 200
    tgi = httpx.post(f"{live.url}/generate", timeout=10,
                     json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert tgi.status_code == 503 and tgi.json()["error_type"] == "unhealthy", tgi.text
    openai = httpx.post(f"{live.url}/v1/chat/completions", timeout=10, json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert openai.status_code == 503 and openai.json()["error"]["type"] == "unhealthy"
    assert _scrape(live.url).value("tgi_batch_current_size", **LABELS) >= 1  # still scraped
    # All of that happened while streams were still generating.
    assert not all(stream.done for stream in streams)

    for stream in streams:
        stream.join(timeout=DRAIN_TIMEOUT)
        assert stream.tokens == DRAIN_TOKENS, stream.tokens
        assert stream.final is not None and isinstance(stream.final["generated_text"], str)
    last_end = max(stream.ended_at for stream in streams)  # type: ignore[type-var]
    live.process.wait(timeout=DRAIN_TIMEOUT)
    exited = time.monotonic()
    # Drained, not timed out: the exit follows the last stream, well within the timeout.
    assert exited - signalled < DRAIN_TIMEOUT
    assert exited - last_end < 10, exited - last_end
    # uvicorn re-raises the SIGTERM it caught once it has shut down.
    assert live.process.returncode == -signal.SIGTERM
    log = live.log()
    assert "SIGTERM: draining" in log and "drained in" in log
    assert "drain timeout" not in log
