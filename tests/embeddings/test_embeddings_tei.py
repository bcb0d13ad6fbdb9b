"""TEI's routes (`/embed`, `/embed_all`, `/similarity`) against sentence-transformers and
transformers on the same folders, through huggingface_hub's InferenceClient and raw HTTP."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from tests.support.embedding_reference import (
    assert_same_vectors,
    normalized,
    sentence_transformer,
)

pytestmark = pytest.mark.e2e

TEXTS = ["hello world", "the dog swims in the river and the cat runs", "what is paris"]
LONG = " ".join(["the big red car runs fast on the road of the city"] * 8)
"""Over the 64-token limit of the BERT embedders."""


def _post(server, path: str, body: dict, model: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"X-Model": model}, timeout=60)


def test_inference_client_feature_extraction(pooling_server, pooling_models) -> None:
    """huggingface_hub's client, unchanged, pointed at the route; the server's default
    embedding model (the first) answers; TEI normalizes by default."""
    from huggingface_hub import InferenceClient

    client = InferenceClient(model=f"{pooling_server.url}/embed")
    model = sentence_transformer(pooling_models["bert-mean"])
    got = client.feature_extraction(TEXTS[1])
    assert got.dtype == np.float32
    assert_same_vectors(got, model.encode([TEXTS[1]], normalize_embeddings=True))
    got = client.feature_extraction(TEXTS[0], normalize=True, truncate=True)
    assert_same_vectors(got, model.encode([TEXTS[0]], normalize_embeddings=True))


@pytest.mark.parametrize("kind", ["bert-cls", "decoder-last"])
def test_embed_normalizes_unless_told_not_to(kind: str, pooling_server, pooling_models) -> None:
    model = sentence_transformer(pooling_models[kind])
    raw = model.encode(TEXTS)
    unit = _post(pooling_server, "/embed", {"inputs": TEXTS}, kind)
    assert unit.status_code == 200, unit.text
    assert_same_vectors(unit.json(), normalized(raw))
    plain = _post(pooling_server, "/embed", {"inputs": TEXTS, "normalize": False}, kind)
    if kind == "decoder-last":
        # The folder ends in Normalize, which `normalize: false` leaves out, as TEI does:
        # the reference is then transformers' last hidden state of the last token.
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(pooling_models[kind])
        with torch.no_grad():
            raw = np.stack([backbone(**model.tokenizer(t, return_tensors="pt"))
                            .last_hidden_state[0, -1].numpy() for t in TEXTS])
    assert_same_vectors(plain.json(), raw)


def test_prompt_name_prefixes_the_prompt(pooling_server, pooling_models) -> None:
    want = sentence_transformer(pooling_models["bert-cls"]).encode(
        TEXTS, prompt_name="query", normalize_embeddings=True)
    got = _post(pooling_server, "/embed", {"inputs": TEXTS, "prompt_name": "query"}, "bert-cls")
    assert_same_vectors(got.json(), want)
    bad = _post(pooling_server, "/embed", {"inputs": TEXTS, "prompt_name": "nope"}, "bert-cls")
    assert bad.status_code == 422
    assert "query" in bad.json()["error"] and bad.json()["error_type"] == "validation"


def test_truncate_right_and_left(pooling_server, pooling_models) -> None:
    """Too long: refused; with `truncate`, cut as sentence-transformers cuts (right), or
    from the left with `truncation_direction`."""
    model = sentence_transformer(pooling_models["bert-mean"])
    refused = _post(pooling_server, "/embed", {"inputs": LONG}, "bert-mean")
    assert refused.status_code == 422 and "64" in refused.json()["error"]
    right = _post(pooling_server, "/embed", {"inputs": LONG, "truncate": True}, "bert-mean")
    assert_same_vectors(right.json(), model.encode([LONG], normalize_embeddings=True))
    ids = model.tokenizer(LONG, add_special_tokens=False)["input_ids"][-62:]
    cls, sep = model.tokenizer.cls_token_id, model.tokenizer.sep_token_id
    features = {"input_ids": torch.tensor([[cls, *ids, sep]]),
                "attention_mask": torch.ones(1, 64, dtype=torch.long),
                "token_type_ids": torch.zeros(1, 64, dtype=torch.long)}
    with torch.no_grad():
        want = model(features)["sentence_embedding"].numpy()
    left = _post(pooling_server, "/embed", {"inputs": LONG, "truncate": True,
                                            "truncation_direction": "Left"}, "bert-mean")
    assert_same_vectors(left.json(), want)


def test_embed_all_is_every_tokens_hidden_state(pooling_server, pooling_models) -> None:
    from transformers import AutoModel, AutoTokenizer

    folder = pooling_models["bert-cls"]
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder)
    got = _post(pooling_server, "/embed_all", {"inputs": TEXTS}, "bert-cls").json()
    assert len(got) == len(TEXTS)
    for text, rows in zip(TEXTS, got, strict=True):
        with torch.no_grad():
            want = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].numpy()
        assert_same_vectors(rows, want)


def test_similarity(pooling_server, pooling_models) -> None:
    vectors = sentence_transformer(pooling_models["decoder-last"]).encode(
        TEXTS, normalize_embeddings=True)
    got = _post(pooling_server, "/similarity", {"inputs": {
        "source_sentence": TEXTS[0], "sentences": TEXTS[1:]}}, "decoder-last").json()
    np.testing.assert_allclose(got, vectors[1:] @ vectors[0], atol=1e-5)
