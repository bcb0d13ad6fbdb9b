"""Remote models: a gateway forwards to replicas, here the session's `switchyard serve` and fakes.

One gateway serves a local model (`tiny`) and remote ones: `far` (alias
`faraway`) and `oa` (declared OpenAI-only) on the session server; `pair` on a
fake replica beside the session server, killed under load; and one each on a
fake that answers garbage, one that closes mid-stream, one that never answers
and an address nobody listens on.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import text_generation
from huggingface_hub import InferenceClient
from text_generation import Client

from tests.support.fake_upstream import FakeUpstream
from tests.support.live_server import LiveServer, free_port, start_server, stop_server
from tests.support.waiting import eventually

PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def fakes() -> Iterator[dict[str, FakeUpstream]]:
    made = {mode: FakeUpstream(mode).start() for mode in ("garbage", "cut", "slow")}
    made["pair"] = FakeUpstream("stream", events=15, gap_s=0.04).start()
    yield made
    for fake in made.values():
        fake.kill()


@pytest.fixture(scope="module")
def gateway(server: LiveServer, fakes: dict[str, FakeUpstream], default_model_path: Path,
            model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("remote")
    config = folder / "models.toml"
    config.write_text(f"""
[[models]]
name = "tiny"
model_id = "{default_model_path}"
engine_options = {{ num_threads = 1 }}

[[models]]
name = "far"
aliases = ["faraway"]
upstreams = ["{server.url}"]

[[models]]
name = "oa"
api = "openai"
upstreams = ["{server.url}/"]

[[models]]
name = "pair"
upstreams = ["{server.url}", "{fakes['pair'].url}"]
api = "openai"
max_failures = 2
cooldown_s = 0.5
metrics_interval_s = 0.05

[[models]]
name = "garbage"
upstreams = ["{fakes['garbage'].url}"]

[[models]]
name = "cut"
upstreams = ["{fakes['cut'].url}"]
max_failures = 1000  # never out: each test meets its broken stream

[[models]]
name = "slow"
upstreams = ["{fakes['slow'].url}"]
timeout_s = 10

[[models]]
name = "missing"
upstreams = ["http://127.0.0.1:{free_port()}"]
""")
    live = start_server(model_cache, folder, "--config", str(config), "--dtype", "float32")
    yield live
    stop_server(live)


def _no_address(text: str) -> None:
    assert "127.0.0.1" not in text and "http://" not in text, text


def test_models_lists_remote_models_with_their_aliases(gateway):
    ids = [m["id"] for m in httpx.get(f"{gateway.url}/v1/models", timeout=30).json()["data"]]
    assert ids == ["tiny", "far", "faraway", "oa", "pair", "garbage", "cut", "slow", "missing"]


def test_openai_clients_get_the_upstreams_tokens_by_name_and_alias(gateway, server):
    direct = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", timeout=60)
    want = direct.completions.create(model="tgi", prompt=PROMPT, max_tokens=8, temperature=0)
    want_chat = direct.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=8,
                                               temperature=0)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="-", timeout=60)
    for name in ("far", "faraway", "oa"):
        got = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        chunks = client.completions.create(model=name, prompt=PROMPT, max_tokens=8,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
        chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=8,
                                              temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        assert text == want_chat.choices[0].message.content


def test_responses_requests_reach_a_remote_models_replica(gateway, server):
    """`POST /v1/responses` for a remote model is the replica's answer, JSON and streamed
    (its typed events pass through whole), and the replica keeps it in its store."""
    direct = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", timeout=60)
    want = direct.responses.create(model="tgi", input="hello", max_output_tokens=8,
                                   temperature=0).output_text
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="-", timeout=60)
    for name in ("far", "oa"):
        got = client.responses.create(model=name, input="hello", max_output_tokens=8,
                                      temperature=0)
        assert got.output_text == want
        assert direct.responses.retrieve(got.id).output_text == want
        events = list(client.responses.create(model=name, input="hello", max_output_tokens=8,
                                              temperature=0, stream=True))
        assert events[-1].type == "response.incomplete"
        assert events[-1].response.output_text == want
        assert [e.sequence_number for e in events] == list(range(len(events)))


def test_tgi_clients_get_the_upstreams_tokens_through_the_header(gateway, server):
    want = Client(server.url, timeout=60).generate(PROMPT, max_new_tokens=8)
    for name in ("far", "faraway"):
        client = Client(gateway.url, headers={"X-Model": name}, timeout=60)
        got = client.generate(PROMPT, max_new_tokens=8)
        assert [t.id for t in got.details.tokens] == [t.id for t in want.details.tokens]
        ids = [e.token.id for e in client.generate_stream(PROMPT, max_new_tokens=8)]
        assert ids == [t.id for t in want.details.tokens]
    hub = InferenceClient(base_url=gateway.url, headers={"X-Model": "far"}, timeout=60)
    assert hub.text_generation(PROMPT, max_new_tokens=8) == want.generated_text


def test_a_stream_passes_through_with_its_headers(gateway):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}
    with httpx.stream("POST", f"{gateway.url}/generate_stream", json=body, timeout=60,
                      headers={"X-Model": "far"}) as answer:
        assert answer.headers["x-accel-buffering"] == "no"
        assert answer.headers["cache-control"] == "no-cache"
        events = [line for line in answer.iter_lines() if line.startswith("data:")]
    assert len(events) == 4 and '"generated_text":null' not in events[-1]


def test_tgi_requests_for_an_openai_only_model_are_refused_in_tgis_format(gateway):
    answer = httpx.post(f"{gateway.url}/generate", headers={"X-Model": "oa"}, timeout=30,
                        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert answer.status_code == 422 and answer.json()["error_type"] == "validation"
    assert "/v1/chat/completions" in answer.json()["error"]
    with pytest.raises(text_generation.errors.ValidationError, match="OpenAI-compatible"):
        list(Client(gateway.url, headers={"X-Model": "oa"}).generate_stream(PROMPT))


def test_tokenize_routes_are_answered_by_a_replica(gateway, server):
    body = {"inputs": PROMPT}
    want = httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()
    assert want and {"id", "text", "start", "stop"} <= set(want[0])
    for name in ("far", "faraway"):
        got = httpx.post(f"{gateway.url}/tokenize", json=body, headers={"X-Model": name},
                         timeout=30)
        assert got.status_code == 200 and got.json() == want
    chat = {"model": "tgi", "messages": MESSAGES}
    want_chat = httpx.post(f"{server.url}/chat_tokenize", json=chat, timeout=30).json()
    got_chat = httpx.post(f"{gateway.url}/chat_tokenize", json={**chat, "model": "far"},
                          timeout=30)
    assert got_chat.status_code == 200 and got_chat.json() == want_chat
    # OpenAI-only servers have neither route: TGI's 422, in TGI's format.
    for path, kw in (("/tokenize", {"json": body, "headers": {"X-Model": "oa"}}),
                     ("/chat_tokenize", {"json": {**chat, "model": "oa"}})):
        refused = httpx.post(f"{gateway.url}{path}", timeout=30, **kw)
        assert refused.status_code == 422 and refused.json()["error_type"] == "validation"


def test_health_lists_remote_models_whose_replicas_are_all_out(gateway):
    def missing_listed() -> httpx.Response | None:
        httpx.post(f"{gateway.url}/v1/completions", timeout=30,
                   json={"model": "missing", "prompt": "x", "max_tokens": 2})
        answer = httpx.get(f"{gateway.url}/health", timeout=30)
        assert answer.status_code == 200  # the other models serve
        if answer.content and "missing" in answer.json().get("unreachable", {}):
            return answer
        return None

    # `missing` is taken out after its failed requests and scrapes.
    answer = eventually(missing_listed, timeout=20, interval=0.2, what="`missing` unreachable")
    body = answer.json()
    assert body["status"] == "degraded" and "far" not in body["unreachable"]
    assert "replicas are out" in body["unreachable"]["missing"]
    _no_address(answer.text)


@pytest.mark.parametrize("model", ["garbage", "cut", "missing"])
def test_broken_upstreams_answer_a_clear_error_in_each_apis_format(gateway, model):
    t0 = time.monotonic()
    oai = httpx.post(f"{gateway.url}/v1/completions", timeout=30,
                     json={"model": model, "prompt": "x", "max_tokens": 2})
    assert oai.status_code in (502, 503), oai.text
    assert f"Model `{model}`" in oai.json()["error"]["message"]
    tgi = httpx.post(f"{gateway.url}/generate", headers={"X-Model": model}, timeout=30,
                     json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
    assert tgi.status_code in (502, 503) and tgi.json()["error_type"] in ("upstream", "unhealthy")
    with pytest.raises(openai.APIError):
        list(openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="-", max_retries=0)
             .chat.completions.create(model=model, messages=MESSAGES, stream=True))
    for text in (oai.text, tgi.text):
        _no_address(text)
    assert time.monotonic() - t0 < 15


def test_a_stream_cut_midway_ends_with_an_error_event(gateway):
    body = {"model": "cut", "prompt": "x", "max_tokens": 5, "stream": True}
    answer = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
    events = [line[5:].strip() for line in answer.text.splitlines() if line.startswith("data:")]
    assert len(events) >= 3 and events[-1] == "[DONE]"
    assert '"error"' in events[-2] and "stream broke" in events[-2]
    assert all('"error"' not in e for e in events[:-2])  # the events before came whole
    _no_address(events[-2])
    with pytest.raises(text_generation.errors.UnknownError, match="stream broke"):
        list(Client(gateway.url, headers={"X-Model": "cut"}).generate_stream("x"))


def test_a_slow_upstream_holds_up_no_other_model_and_times_out(gateway, fakes):
    result: dict[str, httpx.Response] = {}
    slow = threading.Thread(target=lambda: result.setdefault("slow", httpx.post(
        f"{gateway.url}/v1/completions", timeout=30,
        json={"model": "slow", "prompt": "x", "max_tokens": 2})))
    posts = fakes["slow"].posts
    slow.start()
    eventually(lambda: fakes["slow"].posts > posts, timeout=30,
               what="the slow request at its upstream")
    local = httpx.post(f"{gateway.url}/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": "x", "max_tokens": 4})
    # Answered while the slow request still waits on its upstream (its timeout is 10 s).
    assert local.status_code == 200 and slow.is_alive() and "slow" not in result
    slow.join(timeout=30)
    assert result["slow"].status_code == 504
    assert "timed out" in result["slow"].json()["error"]["message"]


def _stream(url: str, seen: dict[int, tuple[int, bool]], i: int) -> None:
    """One streamed completion: (events received, whether it ended without error)."""
    events, ok = 0, False
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "model": "pair", "prompt": PROMPT, "max_tokens": 12, "stream": True}) as answer:
            for line in answer.iter_lines():
                if line.startswith("data:"):
                    if '"error"' in line:
                        break
                    events += 1
                    ok = line == "data: [DONE]"
    except httpx.HTTPError:
        pass
    seen[i] = (events, ok)


def test_a_replica_killed_under_load_fails_no_request_that_had_not_begun(gateway, fakes):
    fake = fakes["pair"]
    seen: dict[int, tuple[int, bool]] = {}
    threads = [threading.Thread(target=_stream, args=(gateway.url, seen, i)) for i in range(24)]
    for i, thread in enumerate(threads):
        thread.start()
        if i == 8:  # kill it in the middle of its streams, before later requests arrive
            eventually(lambda: fake.posts >= 2, timeout=30, interval=0.02,
                       what="two streams at the replica")
            fake.kill()
    for thread in threads:
        thread.join(timeout=60)
    assert len(seen) == 24 and fake.posts > 0
    failed = [events for events, ok in seen.values() if not ok]
    assert all(events > 0 for events in failed), seen  # only streams that had begun broke
    log = gateway.log()
    assert re.search(rf"replica {re.escape(fake.url)} taken out", log)
    fake.start()  # it comes back on its port: probed after the cool-down, then used again
    eventually(lambda: f"replica {fake.url} is back" in gateway.log(), timeout=30, interval=0.1,
               what="the replica probed back")
