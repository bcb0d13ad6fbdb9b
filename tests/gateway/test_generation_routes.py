"""Route behaviour that needs control over the engine: a scripted engine stands in for it.

Covers what a real engine cannot be made to do on demand (fail mid-stream, give
chosen log-probabilities) and what the gateway must ask of any engine (all `n`
sequences at once, seeds, logit bias, watermark, prompt log-probabilities).
"""

from __future__ import annotations

import json

import pytest

from switchyard.routes.auth import authorized
from tests.gateway.fake_engine import TOKEN_IDS, scripted_app

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def app(default_model_path):
    with scripted_app(default_model_path) as (client, engine):
        yield client, engine


@pytest.fixture()
def client(app):
    client, engine = app
    engine.requests.clear()
    engine.token_ids = TOKEN_IDS
    engine.fail_after = None
    engine.logprob = lambda k: -1.0
    return client


@pytest.fixture()
def engine(app):
    return app[1]


def _events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]


def test_health_probes_the_engine_after_a_generation_error(client, engine):
    probes = engine.probes
    assert client.get("/health").status_code == 200
    assert engine.probes == probes  # healthy: no probe
    engine.fail_after = 0
    r = client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 424 and r.json()["error_type"] == "generation"
    # Unhealthy now: /health asks the engine to prove it can generate, and it cannot.
    r = client.get("/health")
    assert r.status_code == 503 and r.json() == {"error": "unhealthy", "error_type": "healthcheck"}
    assert engine.probes == probes + 1
    engine.fail_after = None
    assert client.get("/health").status_code == 200  # the probe passed: healthy again
    assert engine.probes == probes + 2
    assert client.get("/health").status_code == 200
    assert engine.probes == probes + 2


def test_a_successful_generation_restores_health(client, engine):
    engine.fail_after = 0
    client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    engine.fail_after = None
    assert client.post("/generate", json={"inputs": "hi"}).status_code == 200
    probes = engine.probes
    assert client.get("/health").status_code == 200 and engine.probes == probes


def test_openai_chat_stream_error_after_start_then_done(client, engine):
    engine.fail_after = 1
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 2, "stream": True})
    assert r.status_code == 200
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"].startswith("Request failed during generation: scripted failure")
    assert all("error" not in json.loads(e) for e in events[:-2])


def test_openai_completion_stream_error_after_start_then_done(client, engine):
    engine.fail_after = 1
    r = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 3,
                                             "stream": True})
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "generation"
    assert len([e for e in events if '"error"' in e]) == 1  # one error ends the stream


def test_tgi_stream_error_after_start_is_an_event(client, engine):
    engine.fail_after = 1
    r = client.post("/generate_stream", json={"inputs": "hi", "parameters": {"max_new_tokens": 3}})
    events = [json.loads(e) for e in _events(r.text)]
    assert events[0]["token"]["id"] == TOKEN_IDS[0]
    assert events[-1]["error_type"] == "generation"


def test_best_of_answers_with_the_highest_mean_logprob(client, engine):
    engine.logprob = lambda k: -5.0 + k  # the last submitted sequence is the most likely
    r = client.post("/generate", json={"inputs": "hi", "parameters": {
        "max_new_tokens": 2, "best_of": 2, "do_sample": True, "details": True}})
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    assert [t["logprob"] for t in details["tokens"]] == [-4.0, -4.0]
    (loser,) = details["best_of_sequences"]
    assert [t["logprob"] for t in loser["tokens"]] == [-5.0, -5.0]
    assert set(loser) == {"generated_text", "finish_reason", "generated_tokens", "seed",
                          "prefill", "tokens"}
    first, second = engine.requests
    assert first.sampling.do_sample and second.sampling.seed == first.sampling.seed + 1
    assert details["seed"] == second.sampling.seed and loser["seed"] == first.sampling.seed


def test_best_of_without_details_is_just_the_text(client, engine):
    r = client.post("/generate", json={"inputs": "hi", "parameters": {
        "max_new_tokens": 2, "best_of": 2, "temperature": 0.5}})
    assert r.status_code == 200 and set(r.json()) == {"generated_text"}
    assert len(engine.requests) == 2


def test_decoder_input_details_fills_prefill(client, engine):
    r = client.post("/generate", json={"inputs": "hello world", "parameters": {
        "max_new_tokens": 2, "decoder_input_details": True}})
    assert r.status_code == 200
    (request,) = engine.requests
    assert request.prompt_logprobs
    prefill = r.json()["details"]["prefill"]
    assert [p["id"] for p in prefill] == list(request.prompt_token_ids)
    assert prefill[0]["logprob"] is None
    assert [p["logprob"] for p in prefill[1:]] == [-0.5 - j for j in range(len(prefill) - 1)]
    assert "".join(p["text"] for p in prefill) == "hello world"


def test_prefill_shared_by_best_of_sequences(client, engine):
    r = client.post("/generate", json={"inputs": "hello world", "parameters": {
        "max_new_tokens": 2, "best_of": 2, "do_sample": True, "decoder_input_details": True}})
    details = r.json()["details"]
    assert details["prefill"] and details["best_of_sequences"][0]["prefill"] == details["prefill"]
    assert [req.prompt_logprobs for req in engine.requests] == [True, False]


def test_watermark_and_logit_bias_reach_the_engine(client, engine):
    r = client.post("/generate", json={"inputs": "hi", "parameters": {
        "max_new_tokens": 1, "watermark": True}})
    assert r.status_code == 200
    assert engine.requests[-1].sampling.watermark
    r = client.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"7": 100, "3": -100}})
    assert r.status_code == 200
    assert engine.requests[-1].sampling.logit_bias == ((3, -100.0), (7, 100.0))


def test_n_choices_are_submitted_together_with_consecutive_seeds(client, engine):
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 11})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [req.sampling.seed for req in engine.requests] == [11, 12, 13]
    prompt = len(engine.requests[0].prompt_token_ids)
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 9,
                             "total_tokens": prompt + 9}


def test_completion_choices_are_numbered_per_prompt(client, engine):
    r = client.post("/v1/completions", json={"prompt": ["a", "b c"], "n": 2, "max_tokens": 1,
                                             "echo": True})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for choice, prompt in zip(choices, ["a", "a", "b c", "b c"], strict=True):
        assert choice["text"].startswith(prompt)
    assert len(engine.requests) == 4


@pytest.mark.parametrize(("header", "ok"), [
    ("Bearer k3y", True), ("bearer k3y", True), ("BEARER k3y", True),
    ("Bearer K3Y", False), ("Bearer k3y2", False), ("Basic k3y", False), ("k3y", False),
    (None, False), ("Bearer", False),
])
def test_api_key_header(header, ok):
    assert authorized(header, "k3y") is ok


def test_openai_penalties_keep_openai_semantics(client, engine):
    r = client.post("/v1/chat/completions", json={**CHAT, "presence_penalty": 1.5,
                                                  "frequency_penalty": -0.5, "user": "u-1"})
    assert r.status_code == 200
    sampling = engine.requests[-1].sampling
    # Additive OpenAI penalties, not TGI's `repetition_penalty = presence_penalty + 2`.
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (1.5, -0.5)
    assert sampling.repetition_penalty == 1.0


def test_token_texts_add_up_when_a_character_is_cut_off(client, engine, app):
    # The byte-level token for 0xE2 alone begins a 3-byte character that never ends.
    lead_byte = app[0].app.state["gateway"].registry.default.tokenizer.backend.token_to_id("â")
    engine.token_ids = (400, lead_byte)
    for path in ("/generate", "/"):
        r = client.post(path, json={"inputs": "hi", "parameters": {"max_new_tokens": 2,
                                                                   "details": True}})
        body = r.json() if path == "/generate" else r.json()[0]
        assert body["generated_text"].endswith("\ufffd")
        assert "".join(t["text"] for t in body["details"]["tokens"]) == body["generated_text"]
    events = _events(client.post("/generate_stream", json={
        "inputs": "hi", "parameters": {"max_new_tokens": 2}}).text)
    last = json.loads(events[-1])
    assert "".join(json.loads(e)["token"]["text"] for e in events) == last["generated_text"]
