"""``switchyard serve --quantize``, end to end: int8 serves what the int8 reference computes; other names stop start-up."""

from __future__ import annotations

import pytest
import torch
from text_generation import Client
from transformers import AutoModelForCausalLM, AutoTokenizer

from switchyard_xeon.kernels import load_kernels
from tests.conftest import start_server, stop_server
from tests.xeon.test_xeon_decoder import _with_bf16_matmuls


def test_an_unknown_method_stops_start_up_with_what_the_engine_implements(
        model_cache, default_model_path, tmp_path):
    with pytest.raises(RuntimeError) as failed:
        start_server(model_cache, tmp_path, "--quantize", "gptq", timeout=120)
    assert "quantization 'gptq' is not supported (it implements: int8)" in str(failed.value)


def test_int8_server_gives_the_int8_reference_greedy_tokens(model_cache, default_model_path,
                                                           tmp_path):
    """TGI client, greedy: the tokens of transformers with the same int8 matmuls."""
    if not load_kernels().bf16_dot:
        pytest.skip("no AVX512_BF16 here: --quantize int8 needs the dot-product panels")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    reference = _with_bf16_matmuls(model, int8=True)
    prompt = "The quick brown fox"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    want = out[0, ids.shape[1]:].tolist()
    live = start_server(model_cache, tmp_path, "--quantize", "int8",
                        env={"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
    try:
        response = Client(live.url, timeout=120).generate(prompt, max_new_tokens=8,
                                                          decoder_input_details=False)
        assert [t.id for t in response.details.tokens] == want
        assert "int8 weights (per-feature scales)" in live.log()
    finally:
        stop_server(live)
