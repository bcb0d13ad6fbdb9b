"""The Xeon plugin's pooling engine: embedding models and cross-encoder rerankers on the CPU.

`layout` reads what a model folder says about pooling (sentence-transformers'
`modules.json`, its Pooling and Dense modules; the architecture of a
cross-encoder), `model` runs one padded forward of a batch and pools it, and
`engine` batches concurrent requests on a thread of its own. Nothing here is
shared with the generation engine: a pooling forward keeps no KV cache.
"""

from __future__ import annotations

from switchyard_spec import EngineConfig, PoolingEngine


def make_pooling_engine(config: EngineConfig) -> PoolingEngine:
    """Build a :class:`XeonPoolingEngine` for ``config`` without loading weights."""
    from switchyard_xeon.pooling.engine import XeonPoolingEngine  # imports torch

    return XeonPoolingEngine(config)
