"""TGI's `best_of`, `decoder_input_details` and `watermark`, through TGI's clients and raw HTTP.

`text_generation.Client.generate` posts to the compat route `/`, and
`huggingface_hub.InferenceClient.text_generation` to `/`, so both paths are covered.
"""

from __future__ import annotations

import httpx
import pytest
from huggingface_hub import InferenceClient
from text_generation import Client
from text_generation.errors import ValidationError

PROMPT = "def fibonacci(n):"


def _mean(tokens) -> float:
    return sum(t.logprob for t in tokens) / len(tokens)


def _stream_events(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line.startswith("data:")]


def test_best_of_winner_has_the_highest_mean_logprob(server):
    out = Client(server.url, timeout=120).generate(PROMPT, max_new_tokens=6, best_of=2,
                                                   do_sample=True)
    d = out.details
    (loser,) = d.best_of_sequences
    assert _mean(d.tokens) >= _mean(loser.tokens)
    assert d.seed is not None and loser.seed is not None and d.seed != loser.seed
    assert loser.generated_tokens == len(loser.tokens) and loser.prefill == []
    assert out.generated_text == "".join(t.text for t in d.tokens if not t.special)


def test_best_of_through_huggingface_hub(server):
    client = InferenceClient(base_url=server.url, timeout=120)
    out = client.text_generation(PROMPT, max_new_tokens=4, best_of=2, do_sample=True, details=True,
                                 return_full_text=True)
    assert out.generated_text.startswith(PROMPT)
    (loser,) = out.details.best_of_sequences
    assert loser.generated_text.startswith(PROMPT)  # return_full_text applies to every candidate
    assert _mean(out.details.tokens) >= _mean(loser.tokens)


def test_best_of_omits_details_unless_asked(server):
    r = httpx.post(f"{server.url}/generate", timeout=60, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": 3, "best_of": 2, "temperature": 0.8}})
    assert r.status_code == 200 and set(r.json()) == {"generated_text"}
    r = httpx.post(f"{server.url}/generate", timeout=60, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": 3, "details": True}})
    assert "best_of_sequences" not in r.json()["details"]


@pytest.mark.parametrize(("parameters", "message"), [
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
])
def test_best_of_checks(server, parameters, message):
    r = httpx.post(f"{server.url}/generate", timeout=30,
                   json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, **parameters}})
    assert r.status_code == 422
    assert r.json() == {"error": f"Input validation error: {message}", "error_type": "validation"}


def test_best_of_over_the_limit_through_the_client(server):
    with pytest.raises(ValidationError, match=r"`best_of` must be > 0 and <= 2\. Given: 3"):
        Client(server.url, timeout=60).generate(PROMPT, max_new_tokens=2, best_of=3, do_sample=True)


@pytest.mark.parametrize(("extra", "message"), [
    ({"best_of": 2, "do_sample": True}, "`best_of` != 1 is not supported when streaming tokens"),
    ({"decoder_input_details": True},
     "`decoder_input_details` == true is not supported when streaming tokens"),
])
def test_stream_only_checks_are_events(server, extra, message):
    parameters = {"max_new_tokens": 2, **extra}
    request = {"inputs": PROMPT, "parameters": parameters}
    for url, body in ((f"{server.url}/generate_stream", request),
                      (f"{server.url}/", {**request, "stream": True})):
        (event,) = _stream_events(url, body)
        assert httpx.Response(200, content=event[5:]).json() == {
            "error": f"Input validation error: {message}", "error_type": "validation"}


def test_decoder_input_details_prefill(server):
    """Needs the engine's prompt log-probabilities (EngineRequest.prompt_logprobs)."""
    ids = [t["id"] for t in httpx.post(f"{server.url}/tokenize", json={"inputs": PROMPT},
                                       timeout=30).json()]
    out = Client(server.url, timeout=120).generate(PROMPT, max_new_tokens=1,
                                                   decoder_input_details=True)
    prefill = out.details.prefill
    assert [p.id for p in prefill] == ids
    assert prefill[0].logprob is None
    assert all(p.logprob is not None and p.logprob <= 0.0 for p in prefill[1:])
    assert "".join(p.text for p in prefill) == PROMPT
    # The prompt's last log-probability is the one the model gave that token when it was
    # generated: extend the prompt by its greedy continuation and read it back.
    first = out.details.tokens[0]
    extended = Client(server.url, timeout=120).generate(PROMPT + first.text, max_new_tokens=1,
                                                        decoder_input_details=True)
    assert [p.id for p in extended.details.prefill] == [*ids, first.id]
    assert extended.details.prefill[-1].logprob == pytest.approx(first.logprob, abs=1e-3)


def test_watermark_is_accepted_streaming_and_not(server):
    client = Client(server.url, timeout=120)
    kw = dict(max_new_tokens=12, do_sample=True, seed=3, watermark=True)
    full = client.generate(PROMPT, **kw).generated_text
    streamed = "".join(e.token.text for e in client.generate_stream(PROMPT, **kw)
                       if not e.token.special)
    assert streamed == full
    hub = InferenceClient(base_url=server.url, timeout=120)
    assert hub.text_generation(PROMPT, max_new_tokens=12, do_sample=True, seed=3,
                               watermark=True) == full


def test_watermark_changes_sampling(server):
    """Needs the engine's watermark (SamplingParams.watermark)."""
    client = Client(server.url, timeout=120)
    kw = dict(max_new_tokens=24, do_sample=True, seed=11)
    plain = client.generate(PROMPT, **kw).generated_text
    marked = client.generate(PROMPT, watermark=True, **kw).generated_text
    assert plain == client.generate(PROMPT, **kw).generated_text
    assert marked != plain
