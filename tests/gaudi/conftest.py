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
from switchyard_spec import EngineConfig

from tests.xeon.conftest import Collector, greedy_request, prompt_of, token_ids

__all__ = ["SMALL_ENV", "Collector", "cpu_config", "greedy_request", "prompt_of", "token_ids"]

SMALL_ENV = {"PAD_SEQUENCE_TO_MULTIPLE_OF": "16", "PREFILL_BATCH_BUCKET_SIZE": "2",
             "BATCH_BUCKET_SIZE": "4"}
"""The seed's bucket variables, set small: prompts padded to 16s, batches to 2s and 4s."""
CPU_OPTIONS = {"device": "cpu", "num_threads": "1"}
"""The tiny models gain nothing from more threads; on a busy 2-core machine OpenMP
threads waiting at barriers for a descheduled peer make every step slower."""


def cpu_config(model_path: Path | str, options: dict[str, str] | None = None,
               **limits: int) -> EngineConfig:
    """A float32 engine config on the CPU device (96-token sequences, 48-token prompts, 8 rows)."""
    values = {"max_total_tokens": 96, "max_input_tokens": 48, "max_batch_size": 8,
              "max_batch_prefill_tokens": 128, **limits}
    return EngineConfig(model_path=str(model_path), dtype="float32",
                        options={**CPU_OPTIONS, **(options or {})},
                        **values)  # type: ignore[arg-type]


@pytest.fixture
def make_gaudi() -> Iterator[Callable[..., GaudiEngine]]:
    """Build and start Gaudi engines on the CPU device; all are shut down after the test.

    ``env`` is added to :data:`SMALL_ENV`; ``warmup`` runs the plan after start.
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


def generate_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    """``generate``'s greedy continuation of one unpadded prompt, EOS ignored."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), do_sample=False, max_new_tokens=new,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
