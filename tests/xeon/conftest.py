"""Fixtures for the Xeon engine tests: a real engine on the default model, and its reference.

Everything runs the real model (the gateway's embedded tiny Llama) in float32,
so greedy output can be compared token for token with ``transformers``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from switchyard_spec import EngineConfig
from switchyard_xeon.engine import XeonEngine

from tests.support.tiny_models import DECODER_FAMILIES
from tests.support.xeon_options import TEST_OPTIONS


@pytest.fixture(scope="session")
def reference_model(default_model_path: Path) -> torch.nn.Module:
    """The same model through plain transformers (its own attention), float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy(reference_model: torch.nn.Module) -> Callable[[list[int], int], list[int]]:
    """``model.generate(do_sample=False)`` continuation of a prompt, EOS ignored."""

    def run(prompt: list[int], max_new: int) -> list[int]:
        with torch.inference_mode():
            out = reference_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=None,  # never stop at EOS: the engine requests ignore it
                pad_token_id=0,
            )
        ids = out[0, len(prompt) :].tolist()
        assert len(ids) == max_new
        return ids

    return run


@pytest.fixture
def make_engine(default_model_path: Path) -> Iterator[Callable[..., XeonEngine]]:
    """Build and start engines on the default model (float32); all are shut down after."""
    engines: list[XeonEngine] = []

    def build(options: dict[str, str] | None = None, **limits: int) -> XeonEngine:
        engine = XeonEngine(EngineConfig(model_path=str(default_model_path), dtype="float32",
                                         options={**TEST_OPTIONS, **(options or {})},
                                         **limits))  # type: ignore[arg-type]
        engine.start()
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="module")
def shared_engine(default_model_path: Path) -> Iterator[XeonEngine]:
    """One started, warmed engine for tests that do not change its limits."""
    engine = XeonEngine(EngineConfig(model_path=str(default_model_path), dtype="float32",
                                     options=TEST_OPTIONS))
    engine.start()
    engine.warmup()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module", params=sorted(DECODER_FAMILIES))
def family_model(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny random model of one family the hand-written decoder claims
    (:data:`~tests.support.tiny_models.DECODER_FAMILIES`), saved as a model folder, and its
    fp32 reference."""
    torch.manual_seed(0)
    model = DECODER_FAMILIES[request.param]().eval()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return folder, model
