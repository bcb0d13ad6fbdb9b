"""Fixtures for the LoRA tests: PEFT adapters of several shapes on the default model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.live_server import LiveServer, start_server, stop_server
from tests.support.lora_adapters import (
    ADAPTERS,
    SERVER_ADAPTERS,
    SERVER_KEY,
    PeftReference,
    make_adapter,
)


@pytest.fixture(scope="session")
def adapter_dirs(default_model_path: Path, model_cache: Path) -> dict[str, Path]:
    """Every adapter of :data:`~tests.support.lora_adapters.ADAPTERS`, saved by PEFT (built once)."""
    root = model_cache / "lora-adapters-v1"
    root.mkdir(parents=True, exist_ok=True)
    return {name: make_adapter(default_model_path, root / name, spec)
            for name, spec in ADAPTERS.items()}


@pytest.fixture(scope="session")
def peft_reference(default_model_path: Path, adapter_dirs: dict[str, Path]) -> PeftReference:
    """The base model with every test adapter loaded through PEFT (unmerged)."""
    return PeftReference(default_model_path, adapter_dirs)


@pytest.fixture(scope="session")
def live(model_cache: Path, adapter_dirs: dict[str, Path],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server of the test model with :data:`~tests.support.lora_adapters.SERVER_ADAPTERS`
    from ``--lora-adapters``, runtime loading on behind :data:`SERVER_KEY`, its engine in a
    process of its own (``--engine-process``); one for the session (the API and the metrics
    tests share it)."""
    adapters = ",".join(f"{name}={adapter_dirs[key]}" for name, key in SERVER_ADAPTERS.items())
    server = start_server(model_cache, tmp_path_factory.mktemp("logs"), "--dtype", "float32",
                          "--max-total-tokens", "256", "--api-key", SERVER_KEY,
                          "--lora-adapters", adapters, "--allow-runtime-lora-updating",
                          "--engine-process")
    yield server
    stop_server(server)
