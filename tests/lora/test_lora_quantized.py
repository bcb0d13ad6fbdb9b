"""An adapter over an int8 or int4 base: the low-rank path stays fp32 over the quantized kernels.

The reference is PEFT's ``PeftModel`` (unmerged) over a transformers model
whose linears hold the weights the method stands for (dequantized), in fp32
math: what ``--dtype float32 --quantize`` computes on the AVX2 + FMA panels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import kernel_paths
from tests.support.dequantized_reference import with_dequantized_weights
from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.greedy import assert_greedy_near
from tests.support.lora_adapters import lora_engine
from tests.support.quant_methods import method

NEW = 8


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_adapter_over_a_quantized_base_matches_peft_over_its_weights(
        default_model_path: Path, adapter_dirs: dict[str, Path], name: str) -> None:
    from peft import PeftModel
    from switchyard_xeon.kernels import load_kernels
    from transformers import AutoModelForCausalLM

    load_kernels()
    kernel_paths.require("panel quant fma")
    base = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    reference = PeftModel.from_pretrained(with_dequantized_weights(base, name),
                                          adapter_dirs["all-r8"]).eval()
    engine = lora_engine(default_model_path, {"a": adapter_dirs["all-r8"]},
                         quantize=name, quantization=method(name))
    try:
        prompts = [prompt_of(13, start=5), prompt_of(7, start=50)]
        sink = Collector()
        for i, prompt in enumerate(prompts):
            request = greedy_request(f"q{i}", prompt, NEW)
            fields = {f: getattr(request, f) for f in request.__struct_fields__}
            engine.submit(request.__class__(**{**fields, "adapter_id": "a"}), sink)
        got = [token_ids(sink.wait(f"q{i}")) for i in range(len(prompts))]
        assert_greedy_near(reference, prompts, got, NEW, tol=1e-4)
        # The adapter matters here: the quantized base alone chooses otherwise.
        with torch.inference_mode():
            plain = with_dequantized_weights(base, name)
            logits = plain(torch.tensor([prompts[0] + got[0]])).logits[0, len(prompts[0]) - 1:-1]
        assert logits.argmax(-1).tolist() != got[0]
    finally:
        engine.shutdown()
