"""Fixtures for the Gaudi engine tests: the same engine on the CPU device, small bucket grids.

Engines run the real models through transformers (the gateway's embedded tiny
Llama, or tiny random models of each family) in float32, so greedy output can
be compared token for token with ``generate``. Bucket grids are kept small
(prompt buckets of 16, prefill batches of 2, decode batches of 4) so that
warming every shape takes seconds on two cores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from switchyard_gaudi.engine import GaudiEngine

from tests.support.gaudi_config import SMALL_ENV, cpu_config


@pytest.fixture
def make_gaudi() -> Iterator[Callable[..., GaudiEngine]]:
    """Build and start Gaudi engines on the CPU device; all are shut down after the test.

    ``env`` is added to :data:`~tests.support.gaudi_config.SMALL_ENV`; ``warmup`` runs the plan
    after start.
    """
    engines: list[GaudiEngine] = []

    def build(model_path: Path | str, env: dict[str, str] | None = None,
              options: dict[str, str] | None = None, warmup: bool = False,
              **limits: int) -> GaudiEngine:
        engine = GaudiEngine(cpu_config(model_path, options, **limits),
                             env={**SMALL_ENV, **(env or {})})
        engine.start()
        engines.append(engine)
        if warmup:
            engine.warmup()
        return engine

    yield build
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="module")
def warm_engine(default_model_path: Path) -> Iterator[GaudiEngine]:
    """One started and warmed engine on the default model, for tests that keep its settings."""
    engine = GaudiEngine(cpu_config(default_model_path), env=dict(SMALL_ENV))
    engine.start()
    engine.warmup()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def reference_llama(default_model_path: Path) -> torch.nn.Module:
    """The default model through plain transformers, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()

