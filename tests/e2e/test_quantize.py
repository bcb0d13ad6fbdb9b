"""``switchyard serve --quantize``, end to end, with the real clients.

int8 and int4 serve the greedy tokens of a transformers reference over the
same quantized weights: in bf16 matmuls (``tests/support/quantized_reference.py``)
where the CPU has AVX512_BF16, in fp32 over the dequantized weights where the
AVX2 + FMA panels run them instead; a name no
plugin declares stops start-up with what the engine can run; a GPTQ folder
written by ``switchyard quantize`` serves, detected, the tokens of its weights.
"""

from __future__ import annotations

import openai
import pytest
import torch
from text_generation import Client
from transformers import AutoModelForCausalLM, AutoTokenizer

from switchyard_xeon.kernels import load_kernels
from tests.support.bf16_reference import with_bf16_matmuls
from tests.support.calibration import calibration_prompts
from tests.support.dequantized_reference import with_dequantized_weights
from tests.support.gptq_reference import gptq_bf16_reference, gptq_fp32_reference
from tests.support.greedy import assert_greedy_near
from tests.support.live_server import start_server, stop_server
from tests.support.quant_methods import method
from tests.support.w8a8_reference import smoothquant_twin

PROMPT = "The quick brown fox"
NEW_TOKENS = 8


def test_an_unknown_method_stops_start_up_with_what_the_engine_can_run(
        model_cache, default_model_path, tmp_path):
    with pytest.raises(RuntimeError) as failed:
        start_server(model_cache, tmp_path, "--quantize", "bitnet", timeout=120)
    log = str(failed.value)
    assert "--quantize 'bitnet': no installed plugin declares that quantization method" in log
    uint4 = "uint4-group128-asym/uint4-group64-asym/uint4-group32-asym"
    assert (f"engine 'xeon' can run: awq ({uint4}), fp8 (fp8-e4m3-per-tensor), gguf "
            f"(uint4-group32-asym/uint4-group32-min), gptq ({uint4}), "
            "int4 (uint4-group128-asym), "
            "int4-g32 (uint4-group32-asym), int4-g64 (uint4-group64-asym), int8 "
            f"(int8-per-channel), ipex-lowp ({uint4}), smoothquant "
            "(w8a8-smoothquant/w8a8-smoothquant-static)") in log


def _reference_tokens(path, name: str) -> list[int]:
    """Greedy tokens of transformers with every linear over ``name``'s quantized weights, in
    the math the server computes here (:func:`_needs_kernels`)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = (with_bf16_matmuls(model, method(name)) if _bf16_dot(name)
                 else with_dequantized_weights(model, name))
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def _bf16_dot(name: str) -> bool:
    """Whether ``--quantize name`` runs on the bf16 dot-product panels here (else fp32, fma)."""
    status = load_kernels()
    return status.uint4_dot if name == "int4" else status.bf16_dot


def _needs_kernels(name: str) -> None:
    status = load_kernels()
    if not (_bf16_dot(name) or status.quant_fma):
        pytest.skip(f"no native quantized panels here ({status.reason}): "
                    f"--quantize {name} needs them")


def test_int8_server_gives_the_int8_reference_greedy_tokens(model_cache, default_model_path,
                                                           tmp_path):
    """TGI client, greedy: the tokens of transformers with the same int8 matmuls."""
    _needs_kernels("int8")
    want = _reference_tokens(default_model_path, "int8")
    live = start_server(model_cache, tmp_path, "--quantize", "int8",
                        env={"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
    try:
        response = Client(live.url, timeout=120).generate(PROMPT, max_new_tokens=NEW_TOKENS,
                                                          decoder_input_details=False)
        assert [t.id for t in response.details.tokens] == want
        assert "int8 weights (per-feature scales)" in live.log()
    finally:
        stop_server(live)


def test_int4_server_gives_the_int4_reference_to_both_clients(model_cache, default_model_path,
                                                             tmp_path):
    """TGI client (tokens, streamed too) and OpenAI SDK (text): the int4 reference's output."""
    _needs_kernels("int4")
    want = _reference_tokens(default_model_path, "int4")
    assert want != _reference_tokens(default_model_path, "int8")  # int4 really is int4 here
    text = AutoTokenizer.from_pretrained(default_model_path).decode(want)
    live = start_server(model_cache, tmp_path, "--quantize", "int4",
                        env={"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
    try:
        tgi = Client(live.url, timeout=120)
        response = tgi.generate(PROMPT, max_new_tokens=NEW_TOKENS)
        assert [t.id for t in response.details.tokens] == want
        assert response.generated_text == text
        streamed = [e.token.id for e in tgi.generate_stream(PROMPT, max_new_tokens=NEW_TOKENS)]
        assert streamed == want
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", timeout=120)
        completion = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=NEW_TOKENS,
                                               temperature=0)
        assert completion.choices[0].text == text
        assert completion.usage.completion_tokens == NEW_TOKENS
        assert "uint4 weights (groups of 128, scales and zero points)" in live.log()
    finally:
        stop_server(live)


def test_smoothquant_server_serves_the_w8a8_reference_to_both_clients(model_cache,
                                                                      default_model_path,
                                                                      tmp_path):
    """TGI client (tokens) and OpenAI SDK (text) on ``--quantize smoothquant``.

    The reference is transformers with every linear W8A8 in PyTorch, smoothed
    from statistics the tests record (``tests/support/w8a8_reference.py``);
    the tokens are checked teacher-forced, near ties allowed, as bf16 needs.
    """
    if not load_kernels().w8a8:
        pytest.skip(f"no native W8A8 kernels here ({load_kernels().reason})")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    live = start_server(model_cache, tmp_path, "--quantize", "smoothquant", "--engine-option",
                        f"calibration_cache={tmp_path / 'calibration'}",
                        env={"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
    try:
        # The KV cache is bf16 where the engine says so (AVX512_BF16), fp32 elsewhere.
        bf16_cache = "a bf16 KV cache and fp32 activations" in live.log()
        prompts = calibration_prompts("smoothquant", default_model_path)
        reference = smoothquant_twin(model, prompts, 0.5, False, bf16_cache)
        response = Client(live.url, timeout=120).generate(PROMPT, max_new_tokens=NEW_TOKENS)
        tokens = [t.id for t in response.details.tokens]
        ids = tokenizer(PROMPT).input_ids
        assert_greedy_near(reference, [ids], [tokens], NEW_TOKENS)
        assert response.generated_text == tokenizer.decode(tokens)
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", timeout=120)
        completion = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=NEW_TOKENS,
                                               temperature=0)
        assert completion.choices[0].text == tokenizer.decode(tokens)
        assert completion.usage.completion_tokens == NEW_TOKENS
        assert "W8A8 int8 weights and activations (per token" in live.log()
        assert "calibrated on 16 prompts" in live.log()
    finally:
        stop_server(live)


def test_a_gptq_folder_from_switchyard_quantize_serves_both_clients(model_cache,
                                                                    default_model_path,
                                                                    tmp_path):
    """``switchyard quantize`` writes the folder; ``serve --model-id`` detects GPTQ; TGI client
    (tokens, checked against transformers over the folder's weights) and OpenAI SDK (text)."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    _needs_kernels("int4")
    folder = tmp_path / "gptq"
    done = subprocess.run([sys.executable, "-m", "switchyard.cli", "quantize",
                           str(default_model_path), str(folder), "--method", "int4-g64"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "28 linears as GPTQ 4-bit, group 64, checkpoint_format gptq (RTN)" in done.stdout
    bf16 = _bf16_dot("int4")  # bf16 dot products (the reference's near-tie tolerance), else fp32
    reference = (gptq_bf16_reference(folder, load_file(str(folder / "model.safetensors")))
                 if bf16 else gptq_fp32_reference(folder))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    live = start_server(model_cache, tmp_path, "--model-id", str(folder),
                        env={"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
    try:
        response = Client(live.url, timeout=120).generate(PROMPT, max_new_tokens=NEW_TOKENS)
        tokens = [t.id for t in response.details.tokens]
        assert_greedy_near(reference, [tokenizer(PROMPT).input_ids], [tokens], NEW_TOKENS,
                           **({} if bf16 else {"tol": 1e-4}))
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", timeout=120)
        completion = client.completions.create(model=str(folder), prompt=PROMPT,
                                               max_tokens=NEW_TOKENS, temperature=0)
        assert completion.choices[0].text == tokenizer.decode(tokens)
        log = live.log()
        assert "quantization_config.quant_method 'gptq': serving with --quantize gptq" in log
        assert "uint4 weights (groups of 64, scales and zero points) from the checkpoint" in log
    finally:
        stop_server(live)
    with pytest.raises(RuntimeError) as refused:
        start_server(model_cache, tmp_path, "--model-id", str(folder), "--quantize", "int8",
                     timeout=120)
    assert "already quantized with 'gptq'" in str(refused.value)


def test_a_q4_0_gguf_file_serves_its_blocks_as_they_are_to_both_clients(model_cache, tmp_path):
    """``serve --model-id FILE.gguf`` without ``--quantize``: the gateway finds the GGUF blocks
    the conversion kept and serves them with ``--quantize gguf`` (uint4, exactly the file's
    weights); in fp32 the TGI client's greedy tokens are transformers' on the dequantized
    weights, token for token, and the OpenAI SDK's text is theirs. The default model re-encoded
    in Q4_0 (``tests/support/gguf_files.py``)."""
    from switchyard.models.gguf import ensure_gguf_model

    from tests.support.gguf_files import smollm2_q4_0

    if not load_kernels().quant_fma:
        pytest.skip(f"no AVX2 + FMA quantized panels here ({load_kernels().reason})")
    gguf = smollm2_q4_0(model_cache)
    folder = ensure_gguf_model(gguf, model_cache)  # what the server finds
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    want = out[0, ids.shape[1]:].tolist()
    live = start_server(model_cache, tmp_path, "--model-id", str(gguf), "--dtype", "float32",
                        "--engine-option", "num_threads=1",
                        env={"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
    try:
        response = Client(live.url, timeout=120).generate(PROMPT, max_new_tokens=NEW_TOKENS)
        assert [t.id for t in response.details.tokens] == want
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", timeout=120)
        completion = client.completions.create(model=str(gguf), prompt=PROMPT,
                                               max_tokens=NEW_TOKENS, temperature=0)
        assert completion.choices[0].text == tokenizer.decode(want)
        log = live.log()
        assert "GGUF blocks in gguf-blocks/linears.safetensors: serving with --quantize gguf" in log
        assert "GGUF Q4_0 blocks of 210 linears as uint4-group32-asym" in log
        assert "linear weights: " in log and "uint4-group32-asym 75.9 MiB (120 matmuls)" in log
    finally:
        stop_server(live)
