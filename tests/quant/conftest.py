"""Fixtures shared by the quantization tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory) -> Path:
    """A JSON-lines calibration file of four of SmoothQuant's default texts (standard library
    sources), as ``switchyard quantize --calibration`` reads it."""
    from switchyard_quant.smoothquant import default_texts

    path = tmp_path_factory.mktemp("calibration") / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in default_texts(4)))
    return path
