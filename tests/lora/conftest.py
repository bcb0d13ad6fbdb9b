"""Fixtures for the LoRA tests: PEFT adapters of several shapes on the default model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.lora_adapters import ADAPTERS, PeftReference, make_adapter


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
