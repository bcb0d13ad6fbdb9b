"""``--quantize int8`` and ``int4``: the engine's greedy tokens are a dequantized reference's
(up to near ties, as bf16 allows: ``assert_greedy_near``).

For each family the engine's decoder claims (Llama, Mistral with a sliding
window, Qwen2 with biases, Phi-3 with partial rotary), the reference is the
same transformers model with every linear a bf16 matmul over the weight the
method's ``quantize`` then ``dequantize`` give, and attention over
bf16-rounded keys and values (the engine's bf16 cache). The engine runs its
decode steps in one native call, in the Python loop, and in transformers'
own forward, with 16-token prefill chunks.
"""

from __future__ import annotations

import pytest
import torch

from switchyard_spec import EngineConfig
from switchyard_xeon.engine import XeonEngine

from tests.support import kernel_paths
from tests.support.bf16_reference import with_bf16_matmuls
from tests.support.engine_requests import prompt_of
from tests.support.greedy import assert_greedy_near
from tests.support.quant_methods import method
from tests.support.quantized_reference import QuantizedMatmul
from tests.support.tiny_models import tiny_llama
from tests.support.xeon_engines import engine_tokens
from tests.support.xeon_options import TEST_OPTIONS

@pytest.mark.parametrize("name", ["int8", "int4", "int4-g32"])
def test_reference_is_the_dequantized_matmul(name):
    """The kernel-order reference is ``F.linear`` over the dequantized weight, in float64."""
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(150, 40)  # a short last group for every group size
    x = torch.randn(3, 5, 150, generator=gen)
    quantization = method(name)
    weight = quantization.dequantize(quantization.quantize(linear.weight.detach())).double()
    want = torch.nn.functional.linear(x.bfloat16().double(), weight, linear.bias.double())
    with torch.inference_mode():
        got = QuantizedMatmul(linear, quantization)(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# What each method's weights are called in the engine's start-up log.
LOGGED = {"int8": "int8 weights (per-feature scales) and bf16 dot products",
          "int4": "uint4 weights (groups of 128, scales and zero points) and bf16 dot products"}


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_weights_match_generate_with_dequantized_weights(
        family_model, name, caplog):
    """Token for token; the quantized reference also differs from the bf16 one.

    (So the engine really runs the quantized weights.) The engine reports
    bf16, the dtype its matmuls compute in.
    """
    kernel_paths.require("panel uint4" if name == "int4" else "panel int8")
    folder, model = family_model
    quantization = method(name)
    prompts = [[t % 500 + 1 for t in prompt_of(n, start=s)] for n, s in ((21, 1), (6, 2))]
    reference = with_bf16_matmuls(model, quantization)
    with torch.inference_mode():
        x = torch.tensor([prompts[0]])
        assert not torch.equal(with_bf16_matmuls(model)(x).logits, reference(x).logits)
    for forward in ("auto", "decoder", "transformers"):
        caplog.clear()
        with caplog.at_level("INFO", logger="switchyard.xeon"):
            engine = XeonEngine(EngineConfig(
                model_path=str(folder), dtype="auto", quantize=name, quantization=quantization,
                max_batch_prefill_tokens=16,
                options={**TEST_OPTIONS, "block_size": "4", "forward": forward}))
            engine.start()
        try:
            assert engine.info is not None and engine.info.dtype == "bfloat16"
            assert LOGGED[name] in caplog.text
            if forward == "auto":
                assert engine._runner._forward.native is not None  # decode_layers.cpp
            assert_greedy_near(reference, prompts, engine_tokens(engine, prompts, 10), 10)
        finally:
            engine.shutdown()


def test_int4_group_sizes_each_match_their_reference(tmp_path):
    """int4-g32 and int4-g64 on a Llama of widths 64 and 96 (a short last group of 64)."""
    kernel_paths.require("panel uint4")
    torch.manual_seed(0)
    model = tiny_llama(torch.float32)
    model.save_pretrained(tmp_path)
    prompts = [[t % 90 + 1 for t in prompt_of(n, start=s)] for n, s in ((17, 1), (5, 3))]
    for name in ("int4-g32", "int4-g64"):
        quantization = method(name)
        reference = with_bf16_matmuls(model, quantization)
        engine = XeonEngine(EngineConfig(model_path=str(tmp_path), quantize=name,
                                         quantization=quantization,
                                         options={**TEST_OPTIONS, "block_size": "4"}))
        engine.start()
        try:
            assert_greedy_near(reference, prompts, engine_tokens(engine, prompts, 8), 8)
        finally:
            engine.shutdown()
