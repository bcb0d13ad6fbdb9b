"""`/v1/embeddings` against sentence-transformers' own `encode` on the same folders, through
the openai SDK (its default base64 and `encoding_format="float"`) and LangChain."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support.embedding_reference import (
    assert_same_vectors,
    decode_base64,
    normalized,
    sentence_transformer,
)
from tests.support.pooling_models import MATRYOSHKA

pytestmark = pytest.mark.e2e

TEXTS = [
    "hello world",
    "the cat runs fast in the city of paris and the dog swims in the river",
    "what is the capital of france",
    "a",
    "deep neural network models read and write vectors for search and ranking of documents",
]
"""Mixed lengths, so that one batch pads most rows."""


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("kind", ["bert-mean", "bert-cls", "decoder-last"])
def test_sdk_default_base64_and_float_equal_sentence_transformers(
        kind: str, pooling_server, pooling_models: dict[str, Path]) -> None:
    want = sentence_transformer(pooling_models[kind]).encode(TEXTS)
    client = _client(pooling_server)
    default = client.embeddings.create(model=kind, input=TEXTS)
    floats = client.embeddings.create(model=kind, input=TEXTS, encoding_format="float")
    got_default = np.array([d.embedding for d in default.data], dtype=np.float32)
    got_float = np.array([d.embedding for d in floats.data], dtype=np.float32)
    assert [d.index for d in default.data] == list(range(len(TEXTS)))
    assert_same_vectors(got_default, want)
    assert_same_vectors(got_float, want)
    # The SDK decoded base64 into the same vector the float list carries.
    np.testing.assert_array_equal(got_default, got_float)
    tokens = sum(len(sentence_transformer(pooling_models[kind]).tokenizer(t)["input_ids"])
                 for t in TEXTS)
    assert default.usage.prompt_tokens == default.usage.total_tokens == tokens
    assert default.model == kind


def test_single_input_and_raw_base64_bytes(pooling_server, pooling_models) -> None:
    """A string input alone; base64 as the raw little-endian float32 bytes, full length."""
    want = sentence_transformer(pooling_models["bert-mean"]).encode([TEXTS[1]])
    body = httpx.post(f"{pooling_server.url}/v1/embeddings", json={
        "model": "bert-mean", "input": TEXTS[1], "encoding_format": "base64"}).json()
    vector = decode_base64(body["data"][0]["embedding"])
    assert vector.shape == (want.shape[1],)
    assert_same_vectors(vector[None], want)
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"


def test_token_id_inputs_equal_text_inputs(pooling_server, pooling_models) -> None:
    model = sentence_transformer(pooling_models["bert-cls"])
    ids = [model.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    want = model.encode(TEXTS[:3])
    client = _client(pooling_server)
    rows = client.embeddings.create(model="bert-cls", input=ids)
    assert_same_vectors([d.embedding for d in rows.data], want)
    one = client.embeddings.create(model="bert-cls", input=ids[0])
    assert_same_vectors([one.data[0].embedding], want[:1])


@pytest.mark.parametrize("dimensions", MATRYOSHKA[1:])
def test_matryoshka_dimensions_truncate_and_renormalize(
        dimensions: int, pooling_server, pooling_models) -> None:
    want = normalized(sentence_transformer(pooling_models["bert-mean"]).encode(
        TEXTS, truncate_dim=dimensions))
    client = _client(pooling_server)
    # The SDK's default (it asks for base64 and decodes it), then floats.
    for extra in ({}, {"encoding_format": "float"}):
        got = client.embeddings.create(model="bert-mean", input=TEXTS, dimensions=dimensions,
                                       **extra)
        vectors = np.array([d.embedding for d in got.data], dtype=np.float32)
        assert vectors.shape == (len(TEXTS), dimensions)
        assert_same_vectors(vectors, want)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)


def test_langchain_openai_embeddings(pooling_server, pooling_models) -> None:
    """LangChain's OpenAIEmbeddings, unchanged but for the switch that makes it send text
    rather than tiktoken ids (this model's tokenizer is not OpenAI's)."""
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model="decoder-last", base_url=f"{pooling_server.url}/v1",
                                  api_key="unused", check_embedding_ctx_length=False,
                                  max_retries=0)
    want = sentence_transformer(pooling_models["decoder-last"]).encode(TEXTS)
    assert_same_vectors(embeddings.embed_documents(TEXTS), want)
    assert_same_vectors([embeddings.embed_query(TEXTS[2])], want[2:3])
