"""A transformers model over the weights a quantization method stands for, in fp32 math: the
reference for the Xeon engine's ``--dtype float32 --quantize`` (the AVX2 + FMA panels)."""

from __future__ import annotations

import copy

import torch

from tests.support.quant_methods import method


def with_dequantized_weights(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """A copy of fp32 ``model`` whose linears hold the weights ``--quantize name`` stands for."""
    quantization = method(name)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for module in twin.modules():
            if type(module) is torch.nn.Linear:
                module.weight.copy_(quantization.dequantize(quantization.quantize(module.weight)))
    return twin
