"""The Gaudi engine refuses LoRA adapters at start-up, naming what it lacks; the defaults of the
engine contract refuse runtime loading clearly."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from switchyard_gaudi.engine import GaudiEngine
from switchyard_spec import AdapterError, EngineStartError

from tests.support.gaudi_config import SMALL_ENV, cpu_config


def test_gaudi_refuses_adapters_at_start(default_model_path: Path,
                                         adapter_dirs: dict[str, Path]) -> None:
    config = msgspec.structs.replace(cpu_config(default_model_path),
                                     lora_adapters={"sql": str(adapter_dirs["attn-r4"])})
    engine = GaudiEngine(config, env=dict(SMALL_ENV))
    with pytest.raises(EngineStartError, match="LoRA adapters \\(sql\\) are not served") as info:
        engine.start()
    for missing in ("adapter slots per bucket", "maximum rank", "--engine xeon"):
        assert missing in str(info.value)


def test_the_contracts_default_refuses_runtime_loading(default_model_path: Path) -> None:
    engine = GaudiEngine(cpu_config(default_model_path), env=dict(SMALL_ENV))
    with pytest.raises(AdapterError, match="does not serve LoRA adapters"):
        engine.load_adapter("x", "/nowhere")
    with pytest.raises(AdapterError, match="does not serve LoRA adapters"):
        engine.unload_adapter("x")
