"""Bad inputs on the embedding and rerank routes: a 4xx in the route's own format, never a
5xx; generation routes on a pooling model and pooling routes on a chat model name what the
model serves."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.e2e

OPENAI_CASES = [
    ("empty string", {"model": "bert-mean", "input": ""}, "input"),
    ("empty list", {"model": "bert-mean", "input": []}, "input"),
    ("empty string in a list", {"model": "bert-mean", "input": ["a", ""]}, "input"),
    ("empty token list", {"model": "bert-mean", "input": [[]]}, "input"),
    ("too many inputs", {"model": "small-batch", "input": ["a"] * 5}, "input"),
    ("id over the vocabulary", {"model": "bert-mean", "input": [[2, 5, 10**6]]}, "input"),
    ("negative id", {"model": "bert-mean", "input": [2, -1, 3]}, "input"),
    ("mixed input", {"model": "bert-mean", "input": [1, "a"]}, "input"),
    ("too long", {"model": "bert-mean", "input": "cat " * 100}, "input"),
    ("dimensions, not Matryoshka", {"model": "bert-cls", "input": "a", "dimensions": 8},
     "dimensions"),
    ("dimensions not offered", {"model": "bert-mean", "input": "a", "dimensions": 7},
     "dimensions"),
    ("unknown encoding_format", {"model": "bert-mean", "input": "a", "encoding_format": "int8"},
     "encoding_format"),
    ("chat model", {"model": "chat", "input": "a"}, "model"),
    ("reranker", {"model": "cross-encoder", "input": "a"}, "model"),
    ("unknown field", {"model": "bert-mean", "input": "a", "pooling": "cls"}, "pooling"),
]

TEI_CASES = [
    ("/embed", "bert-mean", {"inputs": ""}),
    ("/embed", "bert-mean", {"inputs": []}),
    ("/embed", "small-batch", {"inputs": ["a"] * 5}),
    ("/embed", "bert-mean", {"inputs": [[2, 10**6, 3]]}),
    ("/embed", "bert-cls", {"inputs": "a", "dimensions": 8}),
    ("/embed", "bert-mean", {"inputs": "a", "truncation_direction": "up"}),
    ("/embed", "chat", {"inputs": "a"}),
    ("/embed_all", "bert-mean", {"inputs": [""]}),
    ("/similarity", "bert-mean", {"inputs": {"source_sentence": "a", "sentences": []}}),
    ("/rerank", "cross-encoder", {"query": "a", "texts": []}),
    ("/rerank", "cross-encoder", {"query": "", "texts": ["a"]}),
    ("/rerank", "cross-encoder", {"query": "a", "texts": ["b", ""]}),
    ("/rerank", "bert-mean", {"query": "a", "texts": ["b"]}),
    ("/rerank", "chat", {"query": "a", "texts": ["b"]}),
]


@pytest.mark.parametrize(("body", "param"), [c[1:] for c in OPENAI_CASES],
                         ids=[c[0] for c in OPENAI_CASES])
def test_openai_embeddings_bad_input(body: dict, param: str, pooling_server) -> None:
    response = httpx.post(f"{pooling_server.url}/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


def test_openai_embeddings_unknown_model_is_404(pooling_server) -> None:
    response = httpx.post(f"{pooling_server.url}/v1/embeddings",
                          json={"model": "nope", "input": "a"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_messages_name_what_the_model_serves(pooling_server) -> None:
    url = pooling_server.url
    chat = httpx.post(f"{url}/v1/embeddings", json={"model": "chat", "input": "a"}).json()
    assert "text generation" in chat["error"]["message"]
    on_embedder = httpx.post(f"{url}/v1/chat/completions", json={
        "model": "bert-mean", "messages": [{"role": "user", "content": "hi"}]})
    assert on_embedder.status_code == 400
    assert "/v1/embeddings" in on_embedder.json()["error"]["message"]
    completion = httpx.post(f"{url}/v1/completions", json={"model": "cross-encoder",
                                                           "prompt": "hi"})
    assert completion.status_code == 400 and "/rerank" in completion.json()["error"]["message"]
    generate = httpx.post(f"{url}/generate", headers={"X-Model": "bert-cls"},
                          json={"inputs": "hi"})
    assert generate.status_code == 422 and "embeddings" in generate.json()["error"]


@pytest.mark.parametrize(("path", "model", "body"), TEI_CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(TEI_CASES)])
def test_tei_routes_bad_input(path: str, model: str, body: dict, pooling_server) -> None:
    response = httpx.post(f"{pooling_server.url}{path}", json=body, headers={"X-Model": model})
    assert response.status_code == 422, response.text
    assert set(response.json()) == {"error", "error_type"}
    assert response.json()["error_type"] == "validation"


@pytest.mark.parametrize("body", [{"query": "a", "documents": []},
                                  {"query": "a", "documents": ["b"], "top_n": 0},
                                  {"query": "a", "documents": ["b"], "model": "bert-mean"}])
def test_document_rerank_bad_input(body: dict, pooling_server) -> None:
    response = httpx.post(f"{pooling_server.url}/v1/rerank", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
