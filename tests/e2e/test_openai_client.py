"""The OpenAI routes through the official `openai` SDK and huggingface_hub's chat client."""

from __future__ import annotations

import openai
import pytest
from huggingface_hub import InferenceClient

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say something about Python."}]


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["switchyard/tiny-llama-random"]


def test_chat_completion(client):
    r = client.chat.completions.create(model="switchyard/tiny-llama-random", messages=MESSAGES,
                                       max_tokens=8, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in {"stop", "length"}
    assert r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.system_fingerprint


def test_chat_stream_matches_non_stream(client):
    kw = dict(model="tgi", messages=MESSAGES, max_tokens=8, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 8
    assert len({c.id for c in chunks}) == 1


def test_chat_stop_excluded(client):
    kw = dict(model="tgi", messages=MESSAGES, max_tokens=12, temperature=0)
    base = client.chat.completions.create(**kw).choices[0].message.content
    assert len(base) >= 4
    stop = base[2:4]
    r = client.chat.completions.create(stop=stop, **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == base[: base.index(stop)]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert 1 <= len(content) <= 4
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    # greedy: the chosen token is the most likely one
    assert all(abs(c.logprob - c.top_logprobs[0].logprob) < 1e-4 for c in content)


def test_chat_seeded_sampling(client):
    kw = dict(model="tgi", messages=MESSAGES, max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b
    # Another seed samples other text: the seed is what made the two equal.
    assert client.chat.completions.create(**{**kw, "seed": 8}).choices[0].message.content != a


def test_completions(client):
    r = client.completions.create(model="tgi", prompt="import os\n", max_tokens=6, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].finish_reason in {"stop", "length"}
    echoed = client.completions.create(model="tgi", prompt="import os\n", max_tokens=6,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == "import os\n" + r.choices[0].text


def test_completions_prompt_list_stream(client):
    prompts = ["import os\n", "class Foo:", "for i in range(10):"]
    single = [client.completions.create(model="tgi", prompt=p, max_tokens=5, temperature=0)
              .choices[0].text for p in prompts]
    texts = ["", "", ""]
    for chunk in client.completions.create(model="tgi", prompt=prompts, max_tokens=5,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == single


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert err.value.body["code"] == "model_not_found"


def test_bad_parameter_is_openai_error(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=2,
                                       temperature=5.0)
    assert err.value.body["type"] == "invalid_request_error"
    assert err.value.body["param"] == "temperature"


def test_huggingface_hub_chat(server):
    client = InferenceClient(base_url=server.url, timeout=120)
    out = client.chat_completion(MESSAGES, max_tokens=6, temperature=0)
    assert out.choices[0].message.content is not None
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat_completion(MESSAGES, max_tokens=6, temperature=0,
                                                       stream=True) if c.choices)
    assert streamed == out.choices[0].message.content
