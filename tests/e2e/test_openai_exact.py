"""The OpenAI routes answer as OpenAI does where clients branch on it.

Every invalid request is a 400 `invalid_request_error` that the `openai` SDK
raises as `BadRequestError`, with `param` naming the field the client sent
(TGI's routes keep TGI's 422 for the same mistakes); `seed` is a signed 64-bit
integer; unknown fields are refused by name and the fields that cannot change
the answer are accepted; a body that is not JSON is a 415; stop strings wait
for `min_tokens`; `usage.prompt_tokens_details.cached_tokens` counts the
prompt tokens the prefix cache served.
"""

from __future__ import annotations

import re
import uuid

import httpx
import openai
import pytest

MESSAGES = [{"role": "user", "content": "Write a haiku about trains."}]
PROMPT = "def fibonacci(n):"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
VOCAB = 2048
"""The default test model's vocabulary size."""
MAX_TOTAL = 512
"""The session server's `--max-total-tokens` (tests/conftest.py)."""


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", timeout=120, max_retries=0)


# (fields added to a valid chat request, the `param` OpenAI names)
BAD_CHAT = [
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"1": "x"}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": [0.5]}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {}}, "tool_choice"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": "two"}, "n"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": MAX_TOTAL}, "max_tokens"),
    ({"max_completion_tokens": MAX_TOTAL}, "max_completion_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": "hello " * 450}]}, "messages"),
    ({"stream": True, "stream_options": {"include_usage": None}},
     "stream_options.include_usage"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"top_k": -1}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    # vLLM's extensions: a bad value, or one this server does not serve, names the field.
    ({"guided_json": {"type": "bogus"}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"bad_words": ["x"]}, "bad_words"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"documents": [{"text": "x"}]}, "documents"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [1], "ignore_eos": True}, "stop_token_ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"frobnicate": 1}, "frobnicate"),
]


def _ids(cases: list[tuple[dict[str, object], str]]) -> list[str]:
    return [f"{param}-{i}" for i, (_, param) in enumerate(cases)]


@pytest.mark.parametrize(("change", "param"), BAD_CHAT, ids=_ids(BAD_CHAT))
def test_bad_chat_parameters_are_bad_request_errors(client, change, param):
    body = {"model": "tgi", "messages": MESSAGES, "max_tokens": 4, **change}
    with pytest.raises(openai.BadRequestError) as err:
        stream = client.chat.completions.create(**{"messages": body.pop("messages"),
                                                   "model": body.pop("model")},
                                                extra_body=body)
        list(stream)  # only reached if the server answered 200
    error = err.value
    assert error.status_code == 400
    assert error.body["type"] == "invalid_request_error"
    assert error.body["param"] == param, error.body
    assert not error.body["message"].startswith("Input validation error")  # TGI's words


BAD_COMPLETION = [
    ({"prompt": [[VOCAB]]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [5] * 401}, "prompt"),
    ({"max_tokens": MAX_TOTAL}, "max_tokens"),
    ({"logprobs": 6}, "logprobs"),
    ({"n": 0}, "n"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"suffix": "x"}, "suffix"),
    ({"seed": 2**63}, "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"temperature": 2.5}, "temperature"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),  # a chat field: unknown here
]


@pytest.mark.parametrize(("change", "param"), BAD_COMPLETION, ids=_ids(BAD_COMPLETION))
def test_bad_completion_parameters_are_bad_request_errors(client, change, param):
    body = {"max_tokens": 4, **change}
    prompt = body.pop("prompt", PROMPT)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tgi", prompt=prompt, extra_body=body)
    assert err.value.body["param"] == param, err.value.body
    assert err.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize(("parameters", "param"), [
    ({"top_n_tokens": 6}, "top_n_tokens"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": MAX_TOTAL}, "max_new_tokens"),
    ({"temperature": 0}, "temperature"),
    ({"seed": -1}, None),
    ({"top_p": 1.0}, "top_p"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
])
def test_the_same_mistakes_on_tgi_routes_keep_tgis_422(server, parameters, param):
    r = httpx.post(f"{server.url}/generate", timeout=30,
                   json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4, **parameters}})
    assert r.status_code == 422, r.text
    body = r.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == "validation"
    assert body["error"].startswith("Input validation error")
    if param is not None:
        assert f"`{param}`" in body["error"]  # TGI's names


def test_unknown_fields_are_refused_by_name(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": MESSAGES, "max_tokens": 2, "skip_special_token": False})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "Unrecognized request argument supplied: skip_special_token",
        "type": "invalid_request_error", "param": "skip_special_token", "code": None}


def test_fields_that_cannot_change_the_answer_are_accepted(client):
    kw = dict(model="tgi", messages=MESSAGES, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kw)
    tagged = client.chat.completions.create(
        **kw, user="u1", metadata={"k": "v"}, store=False, service_tier="auto",
        prompt_cache_key="pk", safety_identifier="s1", modalities=["text"],
        extra_body={"prompt_cache_retention": "in_memory"})
    assert tagged.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("seed", [-1, 0, 2**63 - 1, -(2**63)])
def test_signed_64_bit_seeds_reproduce_their_samples(client, seed):
    kw = dict(model="tgi", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=seed)
    first = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(**kw).choices[0].message.content == first
    text = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=12, seed=seed)
    again = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=12, seed=seed)
    assert text.choices[0].text == again.choices[0].text


def test_a_negative_seed_is_its_own(client):
    """-1 is not clamped onto another seed: it samples differently from 0 and from 1."""
    def sample(seed: int) -> str:
        return client.completions.create(model="tgi", prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, seed=seed).choices[0].text
    assert len({sample(-1), sample(0), sample(1)}) == 3


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
def test_a_body_that_is_not_declared_json_is_a_415(server, path):
    body = (b'{"prompt": "x", "max_tokens": 2}' if path == "/v1/completions" else
            b'{"inputs": "x", "parameters": {"max_new_tokens": 2}}' if path == "/generate" else
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}')
    form = httpx.post(f"{server.url}{path}", content=body, timeout=30,
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415, form.text
    if path.startswith("/v1/"):
        assert form.json()["error"]["code"] == "unsupported_content_type"
    else:
        assert form.json()["error_type"] == "validation"
    ok = httpx.post(f"{server.url}{path}", content=body, timeout=30,
                    headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_min_tokens_holds_stop_strings_back(client):
    """A stop string ends the text only once `min_tokens` tokens exist (vLLM's rule): the
    text is the plain greedy text cut at the first stop string that ends in a token
    at or after the `min_tokens`-th."""
    kw = dict(model="tgi", prompt=PROMPT, max_tokens=30, temperature=0)
    plain = client.completions.create(**kw, logprobs=0).choices[0]
    tokens = plain.logprobs.tokens
    stop = plain.text[:2]
    assert stop and client.completions.create(**kw, stop=[stop]).choices[0].text == ""
    min_tokens = 10
    armed_from = len("".join(tokens[: min_tokens - 1]))  # text before token min_tokens
    at = plain.text.find(stop, max(armed_from - len(stop) + 1, 0))
    want = plain.text if at < 0 else plain.text[:at]
    got = client.completions.create(**kw, stop=[stop], extra_body={"min_tokens": min_tokens})
    assert got.choices[0].text == want
    assert got.choices[0].finish_reason == ("length" if at < 0 else "stop")


def _block_size(server) -> int:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return int(re.search(r'switchyard_cache_config_info\{[^}]*block_size="(\d+)"', text)[1])


def test_cached_tokens_count_the_prompt_served_from_the_prefix_cache(server, client):
    """Cold: 0. The same prompt again: every whole cache block of the prompt but the one
    holding its last token (which is always computed), on chat and completions,
    streamed or not."""
    block = _block_size(server)
    story = f"{uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 6
    messages = [{"role": "user", "content": story}]
    kw = dict(model="tgi", messages=messages, max_tokens=2, temperature=0)
    cold = client.chat.completions.create(**kw).usage
    assert cold.prompt_tokens > 3 * block
    assert cold.prompt_tokens_details.cached_tokens == 0
    want = (cold.prompt_tokens - 1) // block * block
    warm = client.chat.completions.create(**kw).usage
    assert warm.prompt_tokens_details.cached_tokens == want
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == want
    first = client.completions.create(model="tgi", prompt=story + "!", max_tokens=2).usage
    assert first.prompt_tokens_details.cached_tokens == 0  # a text prompt: no template
    again = client.completions.create(model="tgi", prompt=story + "!", max_tokens=2).usage
    assert again.prompt_tokens_details.cached_tokens == (first.prompt_tokens - 1) // block * block
    assert again.completion_tokens_details.reasoning_tokens == 0
