"""The LoRA gauge the Gateway API Inference Extension's endpoint picker reads for adapter
affinity: ``switchyard_lora_requests_info``, Switchyard's name for vLLM's
``vllm:lora_requests_info`` (its model-server protocol: labels ``max_lora``,
``running_lora_adapters``, ``waiting_lora_adapters``, comma-separated names; value: the time
of the snapshot, so the picker can take the latest series).

Three levels: the gauge rendered from given ``EngineStats``; the Xeon engine's stats while
a request for one adapter runs and a request for another waits (``max_loras=1``: one
adapter at a time); and ``/metrics`` of the LoRA tests' live server (``live`` in
conftest.py, its engine in its own process) while streams for its adapters are in flight,
read with prometheus_client's own text parser. Expected names are the adapters the test
submitted, sorted and each once, as the contract's fields say.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from switchyard.telemetry.metrics import LORA_INFO, PICKER_METRICS, Metrics
from switchyard_spec import EngineStats

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.live_server import RANDOM_MODEL
from tests.support.lora_adapters import SERVER_ADAPTERS, SERVER_KEY, lora_engine
from tests.support.waiting import eventually

NAME = "switchyard_lora_requests_info"
"""The gauge's name as the task and docs/deploy.md define it (not read from the code)."""
LABEL_NAMES = {"model", "engine", "max_lora", "running_lora_adapters", "waiting_lora_adapters"}


def _lora_samples(text: str) -> list[tuple[dict[str, str], float]]:
    """The gauge's samples in a /metrics text, by prometheus_client's parser (which also
    checks the family is declared a gauge)."""
    out = []
    for family in text_string_to_metric_families(text):
        if family.name == NAME:
            assert family.type == "gauge"
            out += [(dict(s.labels), s.value) for s in family.samples]
    return out


# ----------------------------------------------------------- rendering


def _render(stats: EngineStats) -> str:
    model = SimpleNamespace(name="m", engine_spec=SimpleNamespace(name="xeon"), warmup=None,
                            engine=SimpleNamespace(stats=lambda: stats))
    return Metrics(lambda: [model]).exposition().decode()


def test_the_name_is_the_one_the_picker_is_given():
    assert LORA_INFO == NAME and PICKER_METRICS["loraSpec"] == NAME


def test_the_gauge_joins_the_names_and_carries_the_time_of_the_stats():
    stats = EngineStats(running=3, waiting=2, max_lora=4, running_lora_adapters=("chat", "sql"),
                        waiting_lora_adapters=("summaries", "sql"))
    before = time.time()
    samples = _lora_samples(_render(stats))
    after = time.time()
    [(labels, value)] = samples
    assert labels == {"model": "m", "engine": "xeon", "max_lora": "4",
                      "running_lora_adapters": "chat,sql",
                      "waiting_lora_adapters": "summaries,sql"}
    assert before <= value <= after


def test_no_adapters_in_use_are_empty_strings():
    [(labels, _)] = _lora_samples(_render(EngineStats(running=0, waiting=0, max_lora=8)))
    assert labels["max_lora"] == "8"
    assert labels["running_lora_adapters"] == "" and labels["waiting_lora_adapters"] == ""


def test_an_engine_serving_no_adapters_has_no_series():
    text = _render(EngineStats(running=1, waiting=1))
    assert _lora_samples(text) == [] and NAME not in text


# ----------------------------------------------------------- the engine

A, B = "first", "second"


@pytest.fixture(scope="module")
def engine(default_model_path: Path, adapter_dirs: dict[str, Path]):
    """Two adapters, one held ready at a time: a request for the other waits."""
    engine = lora_engine(default_model_path, {A: adapter_dirs["attn-r4"],
                                              B: adapter_dirs["mlp-regex"]}, max_loras=1)
    yield engine
    engine.shutdown()


def _request(rid: str, adapter: str, new: int, start: int):
    return msgspec.structs.replace(greedy_request(rid, prompt_of(6, start=start), new),
                                   adapter_id=adapter)


def test_engine_stats_name_the_adapters_of_running_and_waiting_sequences(engine):
    sink = Collector()
    engine.submit(_request("long", A, 1000, start=3), sink)  # aborted below
    sink.wait_tokens("long", 2)
    engine.submit(_request("short", B, 4, start=11), sink)
    # B cannot come in while A's request holds the only slot: it waits.
    stats = eventually(lambda: (s := engine.stats()).waiting_lora_adapters and s,
                       what="the second adapter's request waiting")
    assert stats.max_lora == 1
    assert stats.running_lora_adapters == (A,)
    assert stats.waiting_lora_adapters == (B,)
    assert (stats.running, stats.waiting) == (1, 1)
    assert not sink.events("short")
    engine.abort("long")
    sink.wait("long")
    events = sink.wait("short")
    assert events[-1].error is None and len(token_ids(events)) == 4
    idle = eventually(lambda: (s := engine.stats()).running == 0 and s.waiting == 0 and s,
                      what="the engine idle")
    assert idle.running_lora_adapters == () and idle.waiting_lora_adapters == ()
    assert idle.max_lora == 1  # the adapters are still loaded


def test_one_name_per_adapter_however_many_sequences_use_it(engine):
    sink = Collector()
    for i in range(3):
        engine.submit(_request(f"same{i}", A, 1000, start=20 + i), sink)
    for i in range(3):
        sink.wait_tokens(f"same{i}", 2)
    stats = eventually(lambda: (s := engine.stats()).running == 3 and s, what="three running")
    assert stats.running_lora_adapters == (A,) and stats.waiting_lora_adapters == ()
    for i in range(3):
        engine.abort(f"same{i}")
        sink.wait(f"same{i}")


def test_an_engine_with_no_adapter_loaded_serves_none(engine, adapter_dirs: dict[str, Path]):
    try:
        engine.unload_adapter(A)
        engine.unload_adapter(B)
        # An idle engine publishes its stats again when adapters are loaded or unloaded.
        eventually(lambda: engine.stats().max_lora == 0, what="max_lora 0 with no adapter")
        stats = engine.stats()
        assert stats.running_lora_adapters == () and stats.waiting_lora_adapters == ()
    finally:
        engine.load_adapter(A, str(adapter_dirs["attn-r4"]))
        engine.load_adapter(B, str(adapter_dirs["mlp-regex"]))
    eventually(lambda: engine.stats().max_lora == 1, what="max_lora back with the adapters")


# ----------------------------------------------------------- the live server


class _Stream(threading.Thread):
    """A streamed OpenAI completion for an adapter (EOS ignored), read to its end."""

    def __init__(self, url: str, model: str, tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.tokens = url, model, tokens
        self.chunks = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": self.model, "prompt": "The quick brown fox", "max_tokens": self.tokens,
                "temperature": 0, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {SERVER_KEY}"}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        self.chunks += 1
        except httpx.HTTPError as exc:  # seen by the test
            self.error = exc


def _scrape(url: str) -> tuple[list[tuple[dict[str, str], float]], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    now = time.time()
    return [s for s in _lora_samples(text) if s[0].get("model") == RANDOM_MODEL], now


@pytest.mark.e2e
def test_metrics_name_the_adapters_of_streams_in_flight(live):
    served = sorted(SERVER_ADAPTERS)  # the server's adapters, by served name
    first, second = served[0], served[1]
    # Two streams for the first adapter, one for the second: each name once, sorted.
    streams = [_Stream(live.url, first, 200), _Stream(live.url, first, 200),
               _Stream(live.url, second, 200)]
    for stream in streams:
        stream.start()

    def all_running():  # 3 sequences of 2 adapters: within max_lora, none has to wait
        samples, now = _scrape(live.url)
        return (samples and samples[0][0]["running_lora_adapters"] == f"{first},{second}"
                and samples[0][0]["waiting_lora_adapters"] == "" and (samples, now))

    samples, now = eventually(all_running, interval=0.02,
                              what=lambda: f"both adapters running; {_scrape(live.url)}")
    [(labels, value)] = samples
    assert set(labels) == LABEL_NAMES
    assert labels["engine"] == "xeon"
    assert labels["max_lora"] == "8"  # --max-loras's default (docs/lora.md)
    assert abs(value - now) < 5
    assert any(stream.is_alive() for stream in streams)  # seen while they ran
    for stream in streams:
        stream.join(timeout=120)
        assert stream.error is None and stream.chunks > 0, (stream.error, stream.chunks)

    def idle():
        samples, now = _scrape(live.url)
        return samples and samples[0][0]["running_lora_adapters"] == "" and (samples, now)

    [(labels, value)], now = eventually(
        idle, what=lambda: f"no adapter running after the streams; {_scrape(live.url)}")
    assert labels["waiting_lora_adapters"] == "" and labels["max_lora"] == "8"
    assert abs(value - now) < 5
