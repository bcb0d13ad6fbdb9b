"""`switchyard serve --speculate N` end to end: the session server's greedy text, and the
draft counters on `/metrics`."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

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
