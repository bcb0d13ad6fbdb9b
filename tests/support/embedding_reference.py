"""Independent references for the embedding tests: sentence-transformers and transformers
on the same folders the server serves, and the comparisons the acceptance asks for."""

from __future__ import annotations

import base64
from functools import cache
from pathlib import Path

import numpy as np

COSINE_TOLERANCE = 1e-5
SCORE_TOLERANCE = 1e-4


@cache
def sentence_transformer(folder: Path):  # -> sentence_transformers.SentenceTransformer
    """The folder loaded by sentence-transformers itself, in float32 on the CPU."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


@cache
def cross_encoder(folder: Path):  # -> sentence_transformers.CrossEncoder
    """The reranker loaded by sentence-transformers' CrossEncoder."""
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folder), device="cpu")


def cosine_distance(a: np.ndarray, b: np.ndarray) -> float:
    """1 - cos(a, b), in float64."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(1 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_same_vectors(got: np.ndarray | list, want: np.ndarray) -> None:
    """Same count and length, each pair within the cosine tolerance and close in value."""
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert cosine_distance(g, w) < COSINE_TOLERANCE, (i, cosine_distance(g, w))
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4)


def decode_base64(text: str) -> np.ndarray:
    """A base64 embedding as clients decode it: little-endian float32."""
    return np.frombuffer(base64.b64decode(text), dtype="<f4")


def normalized(vectors: np.ndarray) -> np.ndarray:
    """Each row scaled to unit length."""
    return vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)
