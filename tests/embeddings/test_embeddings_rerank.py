"""TEI's `/rerank` and the Jina/Cohere `/v1/rerank` against CrossEncoder.predict on the same
folder: scores within 1e-4 and the same order."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from tests.support.embedding_reference import SCORE_TOLERANCE, cross_encoder

pytestmark = pytest.mark.e2e

QUERY = "what is the capital of france"
TEXTS = [
    "paris is the capital of france",
    "the dog swims in the river",
    "london is a big city in england",
    "hello",
    "the population of the country and its language",
]


def _reference(pooling_models) -> np.ndarray:
    return np.asarray(cross_encoder(pooling_models["cross-encoder"]).predict(
        [(QUERY, t) for t in TEXTS]), dtype=np.float64)


def test_tei_rerank_scores_and_order(pooling_server, pooling_models) -> None:
    want = _reference(pooling_models)
    body = httpx.post(f"{pooling_server.url}/rerank", headers={"X-Model": "cross-encoder"},
                      json={"query": QUERY, "texts": TEXTS, "return_text": True}).json()
    assert [r["index"] for r in body] == list(np.argsort(-want, kind="stable"))
    for rank in body:
        assert abs(rank["score"] - want[rank["index"]]) < SCORE_TOLERANCE
        assert rank["text"] == TEXTS[rank["index"]]


def test_tei_raw_scores_are_the_logits(pooling_server, pooling_models) -> None:
    want = np.asarray(cross_encoder(pooling_models["cross-encoder"]).predict(
        [(QUERY, t) for t in TEXTS], activation_fn=torch.nn.Identity()), dtype=np.float64)
    body = httpx.post(f"{pooling_server.url}/rerank", headers={"X-Model": "cross-encoder"},
                      json={"query": QUERY, "texts": TEXTS, "raw_scores": True}).json()
    assert "text" not in body[0]
    for rank in body:
        assert abs(rank["score"] - want[rank["index"]]) < SCORE_TOLERANCE


def test_document_rerank_top_n(pooling_server, pooling_models) -> None:
    """The Jina/Cohere shape: `documents` as strings or `{text}`, sorted, cut to `top_n`;
    the first reranker serves it when `model` is absent."""
    want = _reference(pooling_models)
    documents = [t if i % 2 else {"text": t} for i, t in enumerate(TEXTS)]
    body = httpx.post(f"{pooling_server.url}/v1/rerank", json={
        "query": QUERY, "documents": documents, "top_n": 3}).json()
    order = list(np.argsort(-want, kind="stable"))[:3]
    assert "results" in body, body
    assert [r["index"] for r in body["results"]] == order
    for result in body["results"]:
        assert abs(result["relevance_score"] - want[result["index"]]) < SCORE_TOLERANCE
        assert result["document"] == {"text": TEXTS[result["index"]]}
    assert body["model"] == "cross-encoder" and body["usage"]["total_tokens"] > 0
