"""GPTQ folders on the Xeon engine: ``switchyard quantize`` writes one, the engine serves it.

The round trip: the default model rounded by ``int4`` RTN into a GPTQ folder
(``switchyard_quant.checkpoints.writer``); the folder's tensors unpacked here
by GPTQ's documented layout, apart from the reader; the engine's greedy
tokens those of transformers with those weights (bf16 inputs, as the panels
compute; near ties allowed, ``assert_greedy_near``). A folder that does not
fit its config.json stops start-up with the tensor named.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from switchyard_spec import EngineConfig, EngineStartError
from switchyard_quant.checkpoints.writer import write_gptq
from switchyard_xeon.engine import XeonEngine
from switchyard_xeon.kernels import load_kernels

from tests.support.engine_requests import Collector, greedy_request, token_ids
from tests.support.gptq_layout import unpack_words
from tests.support.gptq_reference import NEW, PROMPTS, gptq_bf16_reference, gptq_fp32_reference
from tests.support.greedy import assert_greedy_near
from tests.support.quant_methods import method
from tests.support.xeon_options import TEST_OPTIONS


@pytest.fixture(scope="module")
def gptq_folder(tmp_path_factory, default_model_path) -> Path:
    _needs_uint4_panels()
    out = tmp_path_factory.mktemp("gptq") / "model"
    write_gptq(default_model_path, out, 64)
    return out


def _needs_uint4_panels() -> None:
    """Skip where neither the uint4 dot-product panels nor the AVX2 + FMA ones are built."""
    status = load_kernels()
    if not (status.uint4_dot or status.quant_fma):
        pytest.skip(f"no native uint4 panels here ({status.reason})")


def _engine_reference(folder: Path, tensors: dict[str, torch.Tensor]
                      ) -> tuple[torch.nn.Module, dict[str, float], str]:
    """What the engine on ``folder`` computes here, the tolerance of its greedy check, and
    what its log calls the unquantized layers: bf16 matmuls on the uint4 dot panels
    (AVX512_BF16), else fp32 math on the AVX2 + FMA panels."""
    if load_kernels().uint4_dot:
        return gptq_bf16_reference(folder, tensors), {}, "bf16 weights for the rest"
    return gptq_fp32_reference(folder), {"tol": 1e-4}, "fp32 math for the rest"


def _started(folder: Path, **options: str) -> XeonEngine:
    engine = XeonEngine(EngineConfig(model_path=str(folder), dtype="auto", quantize="gptq",
                                     quantization=method("gptq"),
                                     options={**TEST_OPTIONS, **options}))
    engine.start()
    return engine


def test_the_written_folder_is_gptq_of_the_int4_rtn(gptq_folder, default_model_path):
    """Its integers and zero points are int4-g64's; its scales those in float16; config says so."""
    config = json.loads((gptq_folder / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": False,
        "true_sequential": True, "static_groups": False, "checkpoint_format": "gptq",
        "lm_head": False}
    assert (gptq_folder / "tokenizer.json").is_file()
    tensors = load_file(str(gptq_folder / "model.safetensors"))
    source = load_file(str(Path(default_model_path) / "model.safetensors"))
    prefix = "model.layers.1.mlp.down_proj"
    rtn = method("int4-g64").quantize(source[f"{prefix}.weight"].float())
    from switchyard_xeon.quantized import uint4_integers

    assert torch.equal(unpack_words(tensors[f"{prefix}.qweight"].T.contiguous()),
                       uint4_integers(rtn))
    assert torch.equal(unpack_words(tensors[f"{prefix}.qzeros"]).T + 1, rtn.zero_points.long())
    assert torch.equal(tensors[f"{prefix}.scales"], rtn.scales.T.half())
    assert f"{prefix}.weight" not in tensors
    assert torch.equal(tensors["lm_head.weight"], source["lm_head.weight"])  # kept in float
    assert torch.equal(tensors["model.norm.weight"], source["model.norm.weight"])


def test_a_gptq_folder_serves_the_greedy_tokens_of_its_weights(gptq_folder, caplog):
    """Round trip: write, load, and the engine's tokens are those of the checkpoint's weights."""
    tensors = load_file(str(gptq_folder / "model.safetensors"))
    reference, tol, rest = _engine_reference(gptq_folder, tensors)
    caplog.set_level("INFO")
    engine = _started(gptq_folder)
    try:
        sink = Collector()
        for i, prompt in enumerate(PROMPTS):
            engine.submit(greedy_request(f"r{i}", prompt, NEW), sink)
        got = [token_ids(sink.wait(f"r{i}")) for i in range(len(PROMPTS))]
    finally:
        engine.shutdown()
    assert_greedy_near(reference, PROMPTS, got, NEW, **tol)
    assert "GPTQ (28 linears, 4 bits, group 64, checkpoint_format gptq)" in caplog.text
    assert ("uint4 weights (groups of 64, scales and zero points) from the checkpoint "
            f"(28 linears), {rest}") in caplog.text


def _copy(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    return out


def test_a_folder_that_does_not_fit_its_config_stops_start_up(gptq_folder, tmp_path):
    """A missing float tensor, and a layer whose shape config.json contradicts, are named."""
    broken = _copy(gptq_folder, tmp_path)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(EngineStartError, match=r"tensor 'model.norm.weight' is missing"):
        _started(broken)
    config = json.loads((gptq_folder / "config.json").read_text())
    config["intermediate_size"] += 8
    reshaped = tmp_path / "reshaped"
    shutil.copytree(gptq_folder, reshaped)
    (reshaped / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineStartError) as raised:
        _started(reshaped)
    assert ("--quantize gptq: the checkpoint's 'model.layers.0.mlp.down_proj' is [out 128, in "
            "352] but config.json's model has [out 128, in 360]") in str(raised.value)


def test_gptq_on_a_folder_without_quantization_config_is_refused(default_model_path):
    with pytest.raises(EngineStartError, match=r"--quantize gptq: .*config.json: "
                                               r"quantization_config.quant_method is None"):
        _started(Path(default_model_path))


# Act-order: groups formed over a permutation of the inputs, stored with g_idx.


def _pack_k(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] values 0..15 -> GPTQ's qweight int32 [K/8, N]: input 8r + i in bits 4i of row r."""
    n, k = q.shape
    words = (q.long().view(n, k // 8, 8) << (torch.arange(8) * 4)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).T.contiguous()


def _act_order_folder(gptq_folder: Path, source: Path, out: Path, shared: bool) -> Path:
    """``gptq_folder`` with every layer rounded again over a random order of its inputs.

    Each layer's weight (from the float model ``source``) is permuted, rounded
    by int4-g64 in that order, and stored as GPTQ stores act-order: integers
    in the inputs' order, ``g_idx[perm[i]] = i // 64``. With ``shared``,
    projections of one input (q|k|v, gate|up) share a permutation, as GPTQ's
    act-order gives them (one Hessian); otherwise each has its own.
    """
    from switchyard_xeon.quantized import uint4_integers

    shutil.copytree(gptq_folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    floats = load_file(str(source / "model.safetensors"))
    for prefix in sorted(k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")):
        key = prefix
        if shared:
            key = prefix.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace(
                "up_proj", "gate_proj")
        weight = floats[f"{prefix}.weight"].float()
        k = weight.shape[1]
        seed = sum(ord(c) * (i + 1) for i, c in enumerate(key))
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        rtn = method("int4-g64").quantize(weight[:, perm])
        q = torch.empty(weight.shape, dtype=torch.int64)
        q[:, perm] = uint4_integers(rtn)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // 64).to(torch.int32)
        tensors[f"{prefix}.qweight"] = _pack_k(q)
        tensors[f"{prefix}.qzeros"] = _pack_along_n(rtn.zero_points.long().T - 1)
        tensors[f"{prefix}.scales"] = rtn.scales.T.half().contiguous()
        tensors[f"{prefix}.g_idx"] = g_idx
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (out / "config.json").write_text(json.dumps(config))
    return out


def _pack_along_n(values: torch.Tensor) -> torch.Tensor:
    """int [G, N] -> GPTQ's qzeros int32 [G, N/8], eight consecutive outputs per word."""
    return _pack_k(values).T.contiguous()


@pytest.mark.parametrize("shared", [True, False], ids=["shared-order", "own-order"])
def test_an_act_order_folder_serves_the_greedy_tokens_of_its_weights(
        gptq_folder, default_model_path, tmp_path, caplog, shared):
    """desc_act folders: the engine gathers each layer's input in the stored order."""
    folder = _act_order_folder(gptq_folder, Path(default_model_path), tmp_path / "ao", shared)
    tensors = load_file(str(folder / "model.safetensors"))
    assert not torch.equal(tensors["model.layers.0.mlp.down_proj.g_idx"].long(),
                           torch.arange(352) // 64)
    reference, tol, rest = _engine_reference(folder, tensors)
    caplog.set_level("INFO")
    engine = _started(folder)
    try:
        sink = Collector()
        for i, prompt in enumerate(PROMPTS):
            engine.submit(greedy_request(f"r{i}", prompt, NEW), sink)
        got = [token_ids(sink.wait(f"r{i}")) for i in range(len(PROMPTS))]
    finally:
        engine.shutdown()
    assert_greedy_near(reference, PROMPTS, got, NEW, **tol)
    assert "GPTQ (28 linears, 4 bits, group 64, checkpoint_format gptq)" in caplog.text
    # On the uint4 panels (not the stock fallback, which would dequantize and be right anyway).
    assert ("uint4 weights (groups of 64, scales and zero points) from the checkpoint "
            f"(28 linears), {rest}") in caplog.text


def test_a_tied_embedding_model_saved_without_its_lm_head_serves(default_model_path, tmp_path):
    """Tied models (SmolLM2, Qwen2.5-0.5B) save no lm_head.weight: the head is the embedding."""
    _needs_uint4_panels()
    tied = tmp_path / "tied"
    shutil.copytree(default_model_path, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    floats = load_file(str(tied / "model.safetensors"))
    del floats["lm_head.weight"]
    save_file(floats, str(tied / "model.safetensors"))
    folder = tmp_path / "gptq"
    write_gptq(tied, folder, 64)
    tensors = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    reference, tol, _ = _engine_reference(folder, tensors)  # ties the head to the embedding
    engine = _started(folder)
    try:
        sink = Collector()
        for i, prompt in enumerate(PROMPTS):
            engine.submit(greedy_request(f"r{i}", prompt, NEW), sink)
        got = [token_ids(sink.wait(f"r{i}")) for i in range(len(PROMPTS))]
    finally:
        engine.shutdown()
    assert_greedy_near(reference, PROMPTS, got, NEW, **tol)
