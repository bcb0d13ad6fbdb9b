"""`POST /invocations` (SageMaker) and `POST /chat_tokenize`."""

from __future__ import annotations

import json

import httpx
import pytest

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]


def _post(server, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_invocations_dispatches_on_the_body(server):
    generate = _post(server, "/invocations",
                     {"inputs": "import os", "parameters": {"max_new_tokens": 2}})
    assert generate.status_code == 200
    assert isinstance(generate.json(), list) and "generated_text" in generate.json()[0]
    chat = _post(server, "/invocations", {"messages": MESSAGES, "max_tokens": 2, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    direct = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                                    "temperature": 0})
    assert chat.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]
    completion = _post(server, "/invocations", {"prompt": "import os", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"


def test_invocations_streams(server):
    with httpx.stream("POST", f"{server.url}/invocations", timeout=60, json={
            "inputs": "import os", "parameters": {"max_new_tokens": 2}, "stream": True}) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert [e["index"] for e in events] == [1, 2] and events[-1]["generated_text"] is not None
    with httpx.stream("POST", f"{server.url}/invocations", timeout=60, json={
            "messages": MESSAGES, "max_tokens": 2, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][5:])["object"] == "chat.completion.chunk"


@pytest.mark.parametrize(("body", "api"), [
    ({"something": "else"}, "tgi"),
    ([1, 2], "tgi"),
    ({"inputs": "x", "parameters": {"top_k": 0}}, "tgi"),
    ({"messages": [], "max_tokens": 2}, "openai"),
    ({"messages": "hi"}, "openai"),
    ({"prompt": "x", "max_tokens": -1}, "openai"),
])
def test_invocations_errors_in_the_dispatched_api_format(server, body, api):
    r = _post(server, "/invocations", body)
    assert r.status_code == (422 if api == "tgi" else 400), r.text
    if api == "tgi":
        assert set(r.json()) == {"error", "error_type"}
    else:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_chat_tokenize(server):
    r = _post(server, "/chat_tokenize", {"messages": MESSAGES, "model": "tgi"})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"tokenize_response", "templated_text"}
    text, tokens = body["templated_text"], body["tokenize_response"]
    assert "hi there" in text and "Be brief." in text
    # Offsets are byte offsets into the templated text, and the tokens are the chat prompt's.
    raw = text.encode()
    assert all(raw[t["start"]:t["stop"]].decode() == t["text"] for t in tokens)
    chat = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert len(tokens) == chat.json()["usage"]["prompt_tokens"]


def test_chat_tokenize_errors(server):
    r = _post(server, "/chat_tokenize", {"messages": []})
    assert r.status_code == 422 and set(r.json()) == {"error", "error_type"}
