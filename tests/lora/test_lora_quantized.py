"""An adapter over an int8, int4 or GPTQ base: the low-rank path stays fp32 over the quantized
kernels.

The reference is PEFT's ``PeftModel`` (unmerged) over a transformers model
whose linears hold the weights the method stands for (dequantized), in fp32
math: what ``--dtype float32 --quantize`` computes on the AVX2 + FMA panels.
For a GPTQ checkpoint (the default model rounded into a GPTQ folder by
``switchyard_quant.checkpoints.writer``) those weights are the folder's own,
unpacked by :mod:`tests.support.gptq_layout` from GPTQ's documented layout
(never by the engine's reader), and the adapter is one built on the default
model (same names and shapes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import kernel_paths
from tests.support.dequantized_reference import with_dequantized_weights
from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.gptq_layout import folder_weights
from tests.support.gptq_reference import model_over
from tests.support.greedy import assert_greedy_near
from tests.support.lora_adapters import lora_engine
from tests.support.quant_methods import method

NEW = 8


def _adapter_tokens(engine, prompts: list[list[int]], adapter: str) -> list[list[int]]:
    """The engine's greedy tokens for ``prompts``, each request naming ``adapter``."""
    sink = Collector()
    for i, prompt in enumerate(prompts):
        request = greedy_request(f"q{i}", prompt, NEW)
        fields = {f: getattr(request, f) for f in request.__struct_fields__}
        engine.submit(request.__class__(**{**fields, "adapter_id": adapter}), sink)
    return [token_ids(sink.wait(f"q{i}")) for i in range(len(prompts))]


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
        got = _adapter_tokens(engine, prompts, "a")
        assert_greedy_near(reference, prompts, got, NEW, tol=1e-4)
        # The adapter matters here: the quantized base alone chooses otherwise.
        with torch.inference_mode():
            plain = with_dequantized_weights(base, name)
            logits = plain(torch.tensor([prompts[0] + got[0]])).logits[0, len(prompts[0]) - 1:-1]
        assert logits.argmax(-1).tolist() != got[0]
    finally:
        engine.shutdown()


def test_adapter_over_a_gptq_checkpoint_matches_peft_over_its_weights(
        default_model_path: Path, adapter_dirs: dict[str, Path], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """The default model as a 4-bit GPTQ folder (group 64) under an adapter on every projection:
    ``--dtype float32`` runs the checkpoint's uint4 layers on the fma panels, so the reference
    is fp32 PEFT over transformers holding the folder's weights, unpacked here."""
    from peft import PeftModel
    from switchyard_quant.checkpoints.writer import write_gptq
    from switchyard_xeon.kernels import load_kernels

    load_kernels()
    kernel_paths.require("panel quant fma")
    folder = tmp_path / "gptq"
    write_gptq(default_model_path, folder, 64)
    weights, quantized = folder_weights(folder)
    assert len(quantized) == 28  # the 7 projections of each of the 4 layers
    base = model_over(folder, weights)
    reference = PeftModel.from_pretrained(model_over(folder, weights),
                                          adapter_dirs["all-r8"]).eval()
    caplog.set_level("INFO")
    engine = lora_engine(folder, {"a": adapter_dirs["all-r8"]},
                         quantize="gptq", quantization=method("gptq"))
    try:
        assert ("uint4 weights (groups of 64, scales and zero points) from the checkpoint "
                "(28 linears)") in caplog.text
        assert "in fp32 math (AVX2 + FMA)" in caplog.text
        prompts = [prompt_of(13, start=5), prompt_of(7, start=50)]
        got = _adapter_tokens(engine, prompts, "a")
        assert_greedy_near(reference, prompts, got, NEW, tol=1e-4)
        # The adapter matters here: the GPTQ base alone chooses otherwise.
        with torch.inference_mode():
            logits = base(torch.tensor([prompts[0] + got[0]])).logits[0, len(prompts[0]) - 1:-1]
        assert logits.argmax(-1).tolist() != got[0]
    finally:
        engine.shutdown()
