"""Bad input gets a 4xx in the API's own format, never a 5xx, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

TGI_CASES = [
    (b"{not json", {400, 422}),
    (b'{"inputs": 5}', {422}),
    (b'{"inputs": "hi", "parameters": {"max_new_tokens": "ten"}}', {422}),
    (b'{"parameters": {}}', {422}),
    (b'{"inputs": ""}', {422}),
    (b'{"inputs": "hi", "parameters": {"max_new_tokens": -1}}', {422}),
    (b'{"inputs": "hi", "parameters": {"max_new_tokens": 0}}', {422}),
    (b'{"inputs": "hi", "parameters": {"top_p": 1.0}}', {422}),
    (b'{"inputs": "hi", "parameters": {"top_k": 0}}', {422}),
    (b'{"inputs": "hi", "parameters": {"stop": ["a","b","c","d","e"]}}', {422}),
    (b'{"inputs": "hi", "parameters": {"top_n_tokens": 50}}', {422}),
    (b'{"inputs": "hi", "parameters": {"truncate": 0}}', {422}),
    (b"[]", {400, 422}),
]


@pytest.mark.parametrize(("body", "statuses"), TGI_CASES)
def test_tgi_bad_input(server, body, statuses):
    r = httpx.post(f"{server.url}/generate", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code in statuses, r.text
    payload = r.json()
    assert set(payload) == {"error", "error_type"}
    assert payload["error_type"] == "validation"


def test_too_many_input_tokens(server):
    text = "word " * 2000
    r = httpx.post(f"{server.url}/generate",
                   json={"inputs": text, "parameters": {"max_new_tokens": 5}}, timeout=30)
    assert r.status_code == 422
    assert r.json()["error"].startswith("Input validation error: `inputs` ")
    r = httpx.post(f"{server.url}/generate",
                   json={"inputs": "hi", "parameters": {"max_new_tokens": 600}}, timeout=30)
    assert r.status_code == 422
    assert "`inputs` tokens + `max_new_tokens` must be <= 512" in r.json()["error"]


def test_stream_validation_error_is_in_stream(server):
    with httpx.stream("POST", f"{server.url}/generate_stream",
                      json={"inputs": "hi", "parameters": {"temperature": 0}}, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200  # TGI's behaviour: the error is an event
    assert lines[0].startswith('data: {"error":')


OPENAI_CASES = [
    b"{oops",
    b'{"messages": "hello"}',
    b'{"messages": []}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}',
    b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}',
]


@pytest.mark.parametrize("body", OPENAI_CASES)
def test_openai_bad_input(server, body):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]


def test_server_still_serves_after_bad_input(server):
    for body, _ in TGI_CASES:
        httpx.post(f"{server.url}/generate", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    r = httpx.post(f"{server.url}/generate",
                   json={"inputs": "hello", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
