"""`--api-key` guards the generation routes only (bare 401); `--payload-limit` answers 413.

One extra server with both flags set, and a gateway in front of it that sends
the key from `api_key_env`.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from text_generation import Client

from tests.support.live_server import start_server, stop_server

KEY = "s3cret-key"
LIMIT = 4096
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

GUARDED = [
    ("/", {"inputs": "hi", "parameters": {"max_new_tokens": 1}}),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 1}}),
    ("/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 1}}),
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    ("/v1/responses/input_tokens", {"input": "hi"}),
    ("/invocations", {"inputs": "hi", "parameters": {"max_new_tokens": 1}}),
    ("/tokenize", {"inputs": "hi"}),
    ("/chat_tokenize", CHAT),
]


@pytest.fixture(scope="module")
def guarded(model_cache, default_model_path, tmp_path_factory):
    live = start_server(model_cache, tmp_path_factory.mktemp("logs"), "--dtype", "float32",
                        "--max-total-tokens", "512", "--api-key", KEY,
                        "--payload-limit", str(LIMIT))
    yield live
    stop_server(live)


@pytest.mark.parametrize(("path", "body"), GUARDED)
def test_generation_routes_need_the_key(guarded, path, body):
    url = f"{guarded.url}{path}"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": KEY}):
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.content == b"", (headers, r.text)
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = httpx.post(url, json=body, headers={"Authorization": f"{scheme} {KEY}"}, timeout=60)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/health", "/ping", "/live", "/info", "/v1/models", "/"])
def test_other_routes_stay_open(guarded, path):
    assert httpx.get(f"{guarded.url}{path}", timeout=30).status_code == 200


def test_real_clients_send_the_key(guarded):
    good = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, timeout=60)
    assert good.chat.completions.create(model="tgi", **CHAT).choices[0].message.role == "assistant"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="nope", timeout=60).completions.create(
            model="tgi", prompt="hi", max_tokens=1)
    done = good.responses.create(model="tgi", input="hi", max_output_tokens=1)
    assert good.responses.retrieve(done.id).id == done.id
    with pytest.raises(openai.AuthenticationError):  # a stored response needs the key too
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="nope").responses.retrieve(done.id)
    tgi = Client(guarded.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert tgi.generate("hi", max_new_tokens=2).details.generated_tokens <= 2
    hub = InferenceClient(base_url=guarded.url, api_key=KEY, timeout=60)
    assert isinstance(hub.text_generation("hi", max_new_tokens=2), str)


def test_payload_limit_is_413_in_each_api_format(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    big = "word " * LIMIT
    r = httpx.post(f"{guarded.url}/generate", json={"inputs": big}, headers=auth, timeout=30)
    assert r.status_code == 413
    assert r.json()["error_type"] == "payload_too_large" and str(LIMIT) in r.json()["error"]
    r = httpx.post(f"{guarded.url}/generate_stream", json={"inputs": big}, headers=auth, timeout=30)
    assert r.status_code == 413 and set(r.json()) == {"error", "error_type"}
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}),
                       ("/v1/completions", {"prompt": big})):
        r = httpx.post(f"{guarded.url}{path}", json=body, headers=auth, timeout=30)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "payload_too_large"
        assert r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.APIStatusError) as err:
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, timeout=60).completions.create(
            model="tgi", prompt=big, max_tokens=1)
    assert err.value.status_code == 413
    # Under the limit, the same server serves.
    r = httpx.post(f"{guarded.url}/generate", headers=auth, timeout=60,
                   json={"inputs": "word " * 10, "parameters": {"max_new_tokens": 1}})
    assert r.status_code == 200


@pytest.fixture(scope="module")
def fronting(guarded, model_cache, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fronting")
    config = folder / "models.toml"
    config.write_text(f"""
[[models]]
name = "keyed"
upstreams = ["{guarded.url}"]
api_key_env = "UPSTREAM_KEY"

[[models]]
name = "keyless"
upstreams = ["{guarded.url}"]
""")
    live = start_server(model_cache, folder, "--config", str(config),
                        env={"UPSTREAM_KEY": KEY})
    yield live
    stop_server(live)


def test_a_gateway_sends_the_upstreams_key_from_its_environment(fronting):
    client = openai.OpenAI(base_url=f"{fronting.url}/v1", api_key="-", timeout=60)
    chat = client.chat.completions.create(model="keyed", **CHAT)
    assert chat.choices[0].message.role == "assistant"
    tgi = Client(fronting.url, headers={"X-Model": "keyed"}, timeout=60)
    assert tgi.generate("hi", max_new_tokens=2).details.generated_tokens <= 2
    # The same upstream without the key refuses the gateway, not the client: a 502 that
    # says so (a 401 would tell the client its own key is wrong).
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="keyless", **CHAT)
    assert err.value.status_code == 502
    assert "refused the gateway's credentials (401)" in err.value.message
    assert "api_key_env" in err.value.message
