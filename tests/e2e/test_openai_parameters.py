"""OpenAI's `n`, `logit_bias`, completion `logprobs`, penalties and `user`, via the `openai` SDK."""

from __future__ import annotations

import httpx
import openai
import pytest

MESSAGES = [{"role": "user", "content": "Write a haiku about trains."}]
PROMPT = "def fibonacci(n):"


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)


def _greedy_first_token(server) -> tuple[int, str]:
    """The id and text of the greedy first token after PROMPT (through TGI's details)."""
    r = httpx.post(f"{server.url}/generate", timeout=60, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": 1, "details": True}})
    token = r.json()["details"]["tokens"][0]
    return token["id"], token["text"]


def test_chat_n_with_a_seed(client):
    kw = dict(model="tgi", messages=MESSAGES, max_tokens=5, temperature=1.0, seed=7, logprobs=True,
              user="alice")
    r = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # independent samples
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    single = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # counted once, not n times
    assert single.choices[0].message.content == texts[0]  # choice 0 uses the seed itself
    assert [c.message.content for c in client.chat.completions.create(n=3, **kw).choices] == texts


def test_chat_n_streams_interleaved_choices(client):
    kw = dict(model="tgi", messages=MESSAGES, max_tokens=6, temperature=0.9, seed=5, n=2)
    full = client.chat.completions.create(**kw)
    texts, finishes = ["", ""], [[], []]
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert texts == [c.message.content for c in full.choices]
    assert [len(f) for f in finishes] == [1, 1]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len({chunk.id for chunk in chunks}) == 1


def test_completions_n_per_prompt(client):
    prompts = ["import os\n", "class Foo:"]
    r = client.completions.create(model="tgi", prompt=prompts, n=2, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    single = [client.completions.create(model="tgi", prompt=p, max_tokens=4, temperature=0)
              for p in prompts]
    # Choice index = prompt index * n + j; greedy choices of one prompt are equal.
    expected = [single[0].choices[0].text] * 2 + [single[1].choices[0].text] * 2
    assert [c.text for c in r.choices] == expected
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(model="tgi", prompt=prompts, n=2, max_tokens=4,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in r.choices]


def test_completions_logprobs(client):
    r = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n
    if choice.finish_reason == "length":  # no special token: the tokens spell the text
        assert "".join(lp.tokens) == choice.text
    assert lp.text_offset[0] == 0
    for i in range(1, n):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0.0 and 1 <= len(top) <= 3 and top[token] == logprob
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy: the best one
    echoed = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=5, temperature=0,
                                       logprobs=0, echo=True).choices[0]
    # The prompt's tokens come first (tests/e2e/test_scoring.py checks their values).
    prompt_len = len(echoed.logprobs.tokens) - n
    assert "".join(echoed.logprobs.tokens[:prompt_len]) == PROMPT
    assert echoed.logprobs.tokens[prompt_len:] == lp.tokens
    assert echoed.logprobs.text_offset[prompt_len:] == [o + len(PROMPT) for o in lp.text_offset]
    assert echoed.logprobs.top_logprobs[0] is None  # the first prompt token has no context
    # Just the actual token at each position.
    assert all(len(top) == 1 for top in echoed.logprobs.top_logprobs[1:])
    streamed = []
    for chunk in client.completions.create(model="tgi", prompt=PROMPT, max_tokens=5, temperature=0,
                                           logprobs=2, stream=True):
        for c in chunk.choices:
            if c.logprobs:
                streamed += c.logprobs.tokens
    assert streamed == lp.tokens


def test_completions_logprobs_limit(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tgi", prompt=PROMPT, max_tokens=2, logprobs=6)
    assert err.value.body["param"] == "logprobs"


def test_logit_bias_plus_100_forces_a_token(client, server):
    """Needs the engine's logit bias (SamplingParams.logit_bias)."""
    token = httpx.post(f"{server.url}/tokenize", json={"inputs": "hello world"},
                       timeout=30).json()[3]  # " w"
    r = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=3, temperature=0,
                                  logprobs=0, logit_bias={str(token["id"]): 100})
    assert r.choices[0].logprobs.tokens == [token["text"]] * 3
    chat = client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=3,
                                          temperature=0, logit_bias={str(token["id"]): 100})
    assert chat.choices[0].message.content == token["text"] * 3


def test_logit_bias_minus_100_bans_the_greedy_token(client, server):
    """Needs the engine's logit bias (SamplingParams.logit_bias)."""
    greedy_id, greedy_text = _greedy_first_token(server)
    base = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=1, temperature=0,
                                     logprobs=0)
    assert base.choices[0].logprobs.tokens == [greedy_text]
    banned = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=1, temperature=0,
                                       logprobs=0, logit_bias={str(greedy_id): -100})
    assert banned.choices[0].logprobs.tokens != [greedy_text]


@pytest.mark.parametrize("bias", [{"hello": 1}, {"99999999": 1}, {"5": 100.5}, {"5": -101}])
def test_logit_bias_is_checked(client, bias):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=2,
                                       logit_bias=bias)
    assert err.value.body["param"] == "logit_bias"
    assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tgi", prompt=PROMPT, max_tokens=2, logit_bias=bias)


def test_tgi_array_form_of_logit_bias_is_rejected(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": MESSAGES, "max_tokens": 2, "logit_bias": [0.5, 1.0]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("n", [0, 129])
def test_n_is_checked(client, n):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=2, n=n)
    assert err.value.body["param"] == "n"


def test_penalties_change_a_repetitive_greedy_text(client):
    kw = dict(model="tgi", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0)
    base = client.completions.create(**kw).choices[0].logprobs.tokens
    assert base.count(base[0]) > 1  # the greedy text repeats its first token: penalties bite
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        penalized = client.completions.create(**penalty, **kw).choices[0].logprobs.tokens
        assert penalized != base
        assert penalized[0] == base[0]  # nothing to penalize before the first token


def test_tools_and_response_format_are_refused_by_name(server):
    import httpx

    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={**base, "tools": tools, "tool_choice": "g"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={**base, "response_format": {"type": "xml"}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={**base, "tools": tools, "response_format": {"type": "json_object"}},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "tool_error"
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={**base, "response_format": {"type": "text"}, "tools": tools,
                         "tool_choice": "none"}, timeout=30)
    assert r.status_code == 200
