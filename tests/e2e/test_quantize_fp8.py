"""``switchyard serve --quantize fp8``, end to end, with the TGI and OpenAI clients.

The reference is transformers with every linear in FP8 E4M3 math (float64,
scaled by statistics the tests record: ``tests/support/fp8_reference.py``)
and attention over a bf16 cache, as the engine keeps it; tokens are checked
teacher-forced, near ties allowed, as every bf16 path is. One server serves
both clients (the server start and its calibration are most of the time).
"""

from __future__ import annotations

import openai
import torch
from text_generation import Client
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.calibration import calibration_prompts
from tests.support.fp8_reference import fp8_twin
from tests.support.greedy import assert_greedy_near
from tests.support.live_server import start_server, stop_server

PROMPT = "The quick brown fox"
NEW_TOKENS = 8


def test_fp8_server_serves_the_fp8_reference_to_both_clients(model_cache, default_model_path,
                                                            tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    reference = fp8_twin(model, calibration_prompts("fp8", default_model_path),
                         attention="bf16_kv_sdpa")
    live = start_server(model_cache, tmp_path, "--quantize", "fp8", "--engine-option",
                        f"calibration_cache={tmp_path / 'calibration'}",
                        env={"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
    try:
        response = Client(live.url, timeout=120).generate(PROMPT, max_new_tokens=NEW_TOKENS)
        tokens = [t.id for t in response.details.tokens]
        assert_greedy_near(reference, [tokenizer(PROMPT).input_ids], [tokens], NEW_TOKENS)
        assert response.generated_text == tokenizer.decode(tokens)
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", timeout=120)
        completion = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=NEW_TOKENS,
                                               temperature=0)
        assert completion.choices[0].text == tokenizer.decode(tokens)
        assert completion.usage.completion_tokens == NEW_TOKENS
        log = live.log()
        assert "calibrated on 16 prompts" in log
        assert "29 linears as FP8 E4M3 (8 fused groups)" in log
    finally:
        stop_server(live)
