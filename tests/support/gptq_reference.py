"""transformers over a GPTQ folder's weights (unpacked by :mod:`tests.support.gptq_layout`):
the references the Xeon engine's greedy tokens on such a folder are checked against.

On the uint4 dot-product panels (AVX512_BF16) the engine computes bf16 inputs
times the dequantized weight (:func:`gptq_bf16_reference`, :class:`ExactMatmul`);
on the AVX2 + FMA panels, fp32 math over it (:func:`gptq_fp32_reference`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.bf16_reference import with_bf16_matmuls
from tests.support.gptq_layout import folder_weights, gptq_weight
from tests.support.greedy import assert_greedy_near

PROMPTS = [[1, 17, 300, 45, 9, 1200, 77], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
NEW = 10


class ExactMatmul(torch.nn.Module):
    """bf16 inputs times the dequantized weight, summed in float64: the panels' products, exactly."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.bfloat16().double(), self.weight).float()


def model_over(folder: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers in fp32 on ``folder``'s config (its quantization dropped) with ``weights``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, _ = model.load_state_dict(weights, strict=False)
    assert set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    return model


def _floats(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as floats, each GPTQ v1 linear (group 64) as its dequantized weight."""
    floats = {k: v.float() for k, v in tensors.items() if not k.endswith(
        (".qweight", ".qzeros", ".scales", ".g_idx"))}
    for prefix in {k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")}:
        floats[f"{prefix}.weight"] = gptq_weight(tensors, prefix, 64)
    return floats


def gptq_bf16_reference(folder: Path, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers with bf16 matmuls, every quantized linear over the folder's GPTQ weight."""
    floats = _floats(tensors)
    twin = with_bf16_matmuls(model_over(folder, floats))
    for prefix in {k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")}:
        parent, _, child = prefix.rpartition(".")
        setattr(twin.get_submodule(parent), child, ExactMatmul(floats[f"{prefix}.weight"]))
    return twin


def gptq_fp32_reference(folder: Path) -> torch.nn.Module:
    """transformers in fp32 with every quantized linear over the GPTQ folder's dequantized
    weight (group 64, as ``write_gptq(..., 64)`` writes): what the fma panels compute."""
    return model_over(folder, _floats(load_file(str(folder / "model.safetensors"))))


def served_with_the_tokens_of_its_weights(gptq_folder: Path) -> None:
    """Assert that ``gptq_folder`` is detected as GPTQ and the xeon engine's greedy tokens are
    transformers' over its weights, unpacked here (skipped without native uint4 panels)."""
    from switchyard.plugins import PluginHost
    from switchyard_spec import EngineConfig
    from switchyard_xeon.engine import XeonEngine
    from switchyard_xeon.kernels import load_kernels

    from tests.support.quant_methods import method
    from tests.support.xeon_engines import engine_tokens
    from tests.support.xeon_options import TEST_OPTIONS

    name = PluginHost.from_entry_points().detect_quantization(None, gptq_folder)
    assert name == "gptq"
    status = load_kernels()
    if not (status.uint4_dot or status.quant_fma):
        pytest.skip(f"no native uint4 panels here ({status.reason})")
    weights, quantized = folder_weights(gptq_folder)
    assert len(quantized) == 28
    tol = {}
    if status.uint4_dot:  # bf16 matmuls on the dot-product panels
        twin = with_bf16_matmuls(model_over(gptq_folder, weights))
        for prefix in quantized:
            parent, _, child = prefix.rpartition(".")
            setattr(twin.get_submodule(parent), child, ExactMatmul(weights[f"{prefix}.weight"]))
    else:  # fp32 math on the AVX2 + FMA panels
        twin, tol = model_over(gptq_folder, weights), {"tol": 1e-4}
    engine = XeonEngine(EngineConfig(model_path=str(gptq_folder), dtype="auto", quantize=name,
                                     quantization=method(name), options=dict(TEST_OPTIONS)))
    engine.start()
    try:
        got = engine_tokens(engine, PROMPTS, NEW)
    finally:
        engine.shutdown()
    assert_greedy_near(twin, PROMPTS, got, NEW, **tol)
