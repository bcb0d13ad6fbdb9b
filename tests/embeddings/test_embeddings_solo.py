"""A server started with `--model-id` on an embedding model alone (an XLM-R-shaped one,
whose position ids depend on its padding id): it is ready, embeds batches of mixed lengths as
sentence-transformers does, and generation routes say what it serves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.embedding_reference import assert_same_vectors, sentence_transformer
from tests.support.live_server import LiveServer, start_server, stop_server
from tests.support.pooling_models import ensure_pooling_model

pytestmark = pytest.mark.e2e

TEXTS = ["hello", "the cat runs fast in the city of paris and the dog swims in the river",
         "what is the capital of france", "a b c"]


@pytest.fixture(scope="module")
def roberta(model_cache: Path) -> Path:
    return ensure_pooling_model("roberta-mean", model_cache)


@pytest.fixture(scope="module")
def solo_server(roberta: Path, model_cache: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(model_cache, tmp_path_factory.mktemp("solo-logs"), "--model-id",
                        str(roberta), "--dtype", "float32")
    yield live
    stop_server(live)


def test_roberta_batch_of_mixed_lengths(solo_server, roberta: Path) -> None:
    want = sentence_transformer(roberta).encode(TEXTS)
    body = httpx.post(f"{solo_server.url}/v1/embeddings",
                      json={"input": TEXTS, "encoding_format": "float"}).json()
    assert_same_vectors([d["embedding"] for d in body["data"]], want)
    assert body["model"] == str(roberta)
    assert httpx.get(f"{solo_server.url}/health").status_code == 200


def test_generation_routes_name_what_is_served(solo_server) -> None:
    chat = httpx.post(f"{solo_server.url}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400
    assert "no text generation model" in chat.json()["error"]["message"]
    assert "/v1/embeddings" in chat.json()["error"]["message"]
    generate = httpx.post(f"{solo_server.url}/generate", json={"inputs": "hi"})
    assert generate.status_code == 422 and "/embed" in generate.json()["error"]
    rerank = httpx.post(f"{solo_server.url}/rerank", json={"query": "a", "texts": ["b"]})
    assert rerank.status_code == 422 and "no reranking model" in rerank.json()["error"]
