"""The pooling engine interface: embedding models and rerankers, one forward and no cache.

A pooling model (a sentence-transformers folder, an encoder with a pooling
rule, a decoder used as an embedder, a cross-encoder) turns token ids into one
vector or one score per input. There is no generation, no sampling and no KV
cache kept after the forward, so its engine has its own small interface beside
``Engine``: ``start``, ``warmup``, then ``submit`` from the HTTP side, then
``shutdown``. An engine plugin offers one through ``EngineSpec.pooling_factory``.

The gateway owns text (prompts, tokenization, truncation, normalization,
Matryoshka truncation, the reranker's activation); the engine owns tensors
(the backbone, the pooling, the folder's Dense layers, batching).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable

import msgspec

from switchyard_spec.types import EngineStats, WarmupReport


class PoolingTask(str, enum.Enum):
    """What a pooling model computes for each input."""

    EMBED = "embed"
    """One vector per text (sentence-transformers' `encode`)."""
    RERANK = "rerank"
    """One relevance score per (query, text) pair (a cross-encoder)."""


class PoolingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One input to pool: token ids as the gateway tokenized them, special tokens included."""

    request_id: str
    token_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...] = ()
    """Segment ids of a (query, text) pair for a cross-encoder; empty means all zeros."""
    all_tokens: bool = False
    """Return the backbone's hidden state of every token (TEI's `/embed_all`) instead of
    the pooled vector."""


class PoolingResult(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine hands back for one ``PoolingRequest``.

    ``values`` are little-endian float32 bytes of shape ``shape``: ``(dimensions,)``
    for an embedding (before any normalization: the gateway normalizes), ``(1,)``
    for a reranker's raw score (before its activation), ``(tokens, hidden)`` with
    ``all_tokens``. ``error`` is set instead when the forward failed.
    """

    request_id: str
    values: bytes = b""
    shape: tuple[int, ...] = ()
    error: str | None = None
    queue_seconds: float = 0.0
    """From submit to the start of the forward that ran it."""
    inference_seconds: float = 0.0
    """The duration of that forward (shared by the batch it ran in)."""


class PoolingInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What ``PoolingEngine.start`` reports about the loaded model."""

    task: PoolingTask
    model_type: str
    dtype: str
    device: str
    vocab_size: int
    max_position_embeddings: int
    """The longest input, special tokens included, the backbone takes."""
    dimensions: int
    """Length of the pooled vector (after the folder's Dense layers); 1 for a reranker."""
    hidden_size: int
    """Length of each per-token vector of ``all_tokens``."""
    pooling: str
    """The pooling rule in use, e.g. "mean", "cls", "lasttoken", "classifier"."""


PoolingDone = Callable[[PoolingResult], None]
"""Called once per submitted request, from the engine's thread."""


class PoolingEngine(abc.ABC):
    """A batching engine for one pooling model on one device.

    Thread contract as ``Engine``: ``start``, ``warmup`` and ``shutdown`` may block and
    are called from a worker thread; ``submit`` and ``stats`` are called from the
    event loop and return at once. Requests submitted close together run in one
    padded forward; nothing is kept after it.
    """

    @abc.abstractmethod
    def start(self) -> PoolingInfo:
        """Load the weights and start the batching loop; ``EngineStartError`` if it cannot."""

    @abc.abstractmethod
    def warmup(self) -> WarmupReport:
        """Run representative batch shapes once, after ``start``."""

    @abc.abstractmethod
    def submit(self, request: PoolingRequest, done: PoolingDone) -> None:
        """Queue one input; ``done`` receives exactly one ``PoolingResult`` for it."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """The current load (waiting and running inputs), without waiting for the loop."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the loop; requests still queued get a ``PoolingResult`` with ``error``."""

    def healthy(self) -> bool:
        """Whether the loop is alive, answered at once."""
        return True
