"""Remote pooling models: a gateway whose config names TEI replicas (`api = "tei"`) forwards
TEI's routes and `/v1/embeddings` to them. The replica here is the suite's pooling server,
which speaks TEI's routes; every number is checked against sentence-transformers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support.embedding_reference import (
    SCORE_TOLERANCE,
    assert_same_vectors,
    cross_encoder,
    sentence_transformer,
)
from tests.support.live_server import LiveServer, start_server, stop_server

pytestmark = pytest.mark.e2e

TEXTS = ["hello world", "the dog swims in the river", "what is the capital of france"]


@pytest.fixture(scope="module")
def gateway(pooling_server: LiveServer, model_cache: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A gateway with no local model: an embedder and a reranker on one TEI replica."""
    config = tmp_path_factory.mktemp("tei-remote") / "models.toml"
    config.write_text(
        f'[[models]]\nname = "tei-embed"\nupstreams = ["{pooling_server.url}"]\napi = "tei"\n'
        'upstream_model = "bert-mean"\n\n'
        f'[[models]]\nname = "tei-rerank"\nupstreams = ["{pooling_server.url}"]\napi = "tei"\n'
        'upstream_model = "cross-encoder"\n')
    live = start_server(model_cache, tmp_path_factory.mktemp("tei-remote-logs"), "--config",
                        str(config))
    yield live
    stop_server(live)


def test_embeddings_are_forwarded(gateway, pooling_models) -> None:
    from openai import OpenAI

    model = sentence_transformer(pooling_models["bert-mean"])
    embed = httpx.post(f"{gateway.url}/embed", headers={"X-Model": "tei-embed"},
                       json={"inputs": TEXTS})
    assert embed.status_code == 200, embed.text
    assert_same_vectors(embed.json(), model.encode(TEXTS, normalize_embeddings=True))
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    got = client.embeddings.create(model="tei-embed", input=TEXTS)
    assert_same_vectors([d.embedding for d in got.data], model.encode(TEXTS))


def test_rerank_is_forwarded(gateway, pooling_models) -> None:
    want = cross_encoder(pooling_models["cross-encoder"]).predict(
        [(TEXTS[2], t) for t in TEXTS])
    ranks = httpx.post(f"{gateway.url}/rerank", headers={"X-Model": "tei-rerank"},
                       json={"query": TEXTS[2], "texts": TEXTS}).json()
    assert [r["index"] for r in ranks] == list(np.argsort(-want, kind="stable"))
    for rank in ranks:
        assert abs(rank["score"] - want[rank["index"]]) < SCORE_TOLERANCE


def test_what_a_tei_replica_does_not_serve_is_refused(gateway) -> None:
    chat = httpx.post(f"{gateway.url}/v1/chat/completions", json={
        "model": "tei-embed", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "TEI" in chat.json()["error"]["message"]
    document = httpx.post(f"{gateway.url}/v1/rerank", json={
        "model": "tei-rerank", "query": "a", "documents": ["b"]})
    assert document.status_code == 400 and "/rerank" in document.json()["error"]["message"]
    assert httpx.get(f"{gateway.url}/health").status_code == 200
