"""`switchyard serve --speculate N` end to end, with n-gram drafts and with a draft model
(`--speculative-model`): the session server's greedy text and logprobs, TGI's `details`,
stop strings, and the draft counters on `/metrics`."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from text_generation import Client

from tests.support.family_models import ensure_family
from tests.support.live_server import start_server, stop_server

PROMPTS = ["one two three one two three one two", "def add(a, b):\n    return a + b\n\ndef",
           "The capital of France is"]


@pytest.fixture(scope="module")
def speculating(default_model_path, model_cache, tmp_path_factory):
    live = start_server(model_cache, tmp_path_factory.mktemp("spec-logs"), "--dtype", "float32",
                        "--max-total-tokens", "512", "--max-input-tokens", "400",
                        "--speculate", "4", "--engine-option", "speculate_ngram_min=1")
    yield live
    stop_server(live)


def test_greedy_text_is_the_servers_without_speculation(speculating, server):
    plain = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", timeout=120)
    spec = openai.OpenAI(base_url=f"{speculating.url}/v1", api_key="-", timeout=120)
    for prompt in PROMPTS:
        kw = dict(model="tgi", prompt=prompt, max_tokens=40, temperature=0, logprobs=1)
        want, got = plain.completions.create(**kw), spec.completions.create(**kw)
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(
            want.choices[0].logprobs.token_logprobs, abs=1e-4)
    text = httpx.get(f"{speculating.url}/metrics", timeout=30).text
    found = {m[1]: float(m[2]) for m in re.finditer(
        r'^switchyard_spec_decode_num_(\w+)\{[^}]*method="ngram"\} (\S+)$', text, re.M)}
    assert set(found) == {"drafts", "draft_tokens", "accepted_tokens"}
    assert found["draft_tokens"] >= found["accepted_tokens"] > 0


@pytest.fixture(scope="module")
def drafting(default_model_path, model_cache, tmp_path_factory):
    """A server whose drafts come from another random model with the same tokenizer: it
    disagrees with the target often, so both kept and rejected drafts occur."""
    draft = ensure_family("qwen2", default_model_path, model_cache)
    live = start_server(model_cache, tmp_path_factory.mktemp("draft-logs"), "--dtype", "float32",
                        "--max-total-tokens", "512", "--max-input-tokens", "400",
                        "--speculate", "3", "--speculative-model", str(draft))
    yield live
    stop_server(live)


def _counters(url: str, method: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(
        rf'^switchyard_spec_decode_num_(\w+)\{{[^}}]*method="{method}"\}} (\S+)$', text, re.M)}


def _gauge(url: str, method: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(rf'^switchyard_spec_decode_acceptance_rate\{{[^}}]*method="{method}"\}} '
                      rf'(\S+)$', text, re.M)
    assert found, "no acceptance rate on /metrics"
    return float(found[1])


def test_a_draft_model_keeps_the_servers_text_details_and_stops(drafting, server):
    plain, spec = Client(server.url, timeout=120), Client(drafting.url, timeout=120)
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=30, decoder_input_details=False)
        got = spec.generate(prompt, max_new_tokens=30)
        assert got.generated_text == want.generated_text
        assert got.details.finish_reason == want.details.finish_reason
        assert got.details.generated_tokens == want.details.generated_tokens
        assert [t.id for t in got.details.tokens] == [t.id for t in want.details.tokens]
        assert [t.logprob for t in got.details.tokens] == pytest.approx(
            [t.logprob for t in want.details.tokens], abs=1e-4)
    # A stop string that falls inside a step of kept drafts ends the text where it falls.
    full = plain.generate(PROMPTS[0], max_new_tokens=30).generated_text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    want = plain.generate(PROMPTS[0], max_new_tokens=30, stop_sequences=[stop])
    got = spec.generate(PROMPTS[0], max_new_tokens=30, stop_sequences=[stop])
    assert got.generated_text == want.generated_text
    assert got.details.finish_reason == want.details.finish_reason == "stop_sequence"
    found = _counters(drafting.url, "draft_model")
    assert set(found) == {"drafts", "draft_tokens", "accepted_tokens"}
    rate = _gauge(drafting.url, "draft_model")
    assert rate == pytest.approx(found["accepted_tokens"] / found["draft_tokens"])
    assert found["draft_tokens"] > found["accepted_tokens"]
    assert found["drafts"] > 0
