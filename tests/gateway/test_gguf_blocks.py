"""A GGUF file's Q4_0 (and Q4_1) linears kept as blocks by the conversion, and who serves them.

The conversion (``switchyard.models.gguf``) keeps, beside the float32
folder, the blocks of each linear whose GGUF tensor is Q4_0, found by
content: here on a tiny Llama of mixed block types (``tests/support/gguf_files.py``:
the embedding, so the tied LM head, in Q4_0; a Q8_0 v projection and an
F32 o projection that stay float; q and k rows that transformers reorders),
and with a weight changed by one bit, whose blocks are then not kept. The
gateway serves a folder with blocks with ``--quantize gguf`` when the engine
runs its format and no other ``--quantize`` is given, dequantized otherwise.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from switchyard.models.gguf import ensure_gguf_model, find_converted, keep_blocks
from switchyard.plugins import PluginHost
from switchyard_spec import GGUF_BLOCKS_FILE

from tests.support.gguf_files import TINY, TINY_VOCAB, tiny_llama_gguf

KEPT = {"lm_head.weight", *(f"model.layers.0.{n}.weight" for n in (
    "self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
    *(f"model.layers.1.{n}.weight" for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))}
"""The tiny model's linears whose GGUF tensors are Q4_0 (its v and o of layer 0 are not)."""


@pytest.fixture(scope="module")
def tiny_folder(model_cache: Path) -> Path:
    return ensure_gguf_model(tiny_llama_gguf(model_cache), model_cache)


def _blocks(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(folder / GGUF_BLOCKS_FILE), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()  # noqa: SIM118


def test_the_q4_0_linears_are_kept_and_are_the_float_weights_bit_for_bit(tiny_folder, model_cache,
                                                                        caplog):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    blocks, types = _blocks(tiny_folder)
    assert set(blocks) == KEPT and set(types.values()) == {"Q4_0"}
    with safe_open(str(tiny_folder / "model.safetensors"), framework="pt") as floats:
        for name, raw in blocks.items():
            values = dequantize(raw.numpy(), GGMLQuantizationType.Q4_0)
            # The tied head is the embedding, saved once.
            want = floats.get_tensor("model.embed_tokens.weight" if name == "lm_head.weight"
                                     else name)
            assert np.array_equal(values.view(np.uint32), want.numpy().view(np.uint32)), name
    source = json.loads((tiny_folder / "switchyard-gguf.json").read_text())
    assert source["kept_blocks"] == {"Q4_0": 13} and source["conversion_version"] == "3"
    assert tiny_folder.name.endswith("-v3")
    # 18 bytes per 32 weights as blocks, 128 in float32: the head (2,048 x 64), and 2 layers
    # of 64 x 64 q, 32 x 64 k, three 128 x 64 MLP matrices, and layer 1's 32 x 64 v, 64 x 64 o.
    weights = TINY_VOCAB * 64 + 2 * (64 * 64 + 32 * 64 + 3 * 128 * 64) + 32 * 64 + 64 * 64
    assert source["kept_bytes"] == {"blocks": weights // 32 * 18, "float32": weights * 4}
    caplog.set_level(logging.INFO, "switchyard.models")
    ensure_gguf_model(tiny_llama_gguf(model_cache), model_cache)  # found, not converted again
    assert (f"GGUF {TINY}: dequantized Q4_0 (13 tensors), Q8_0 (1 tensor) to float32; F32 "
            "(6 tensors) kept; blocks of Q4_0 (13 linears) kept as they are too "
            "(gguf-blocks/linears.safetensors): 0.1 MiB (111,744 bytes) as blocks, 0.8 MiB "
            f"(794,624 bytes) in float32; converted before, into {tiny_folder}"
            ) in caplog.text


def test_a_weight_that_differs_by_one_bit_keeps_no_blocks(tiny_folder, model_cache, tmp_path):
    """Blocks are kept only where they are exactly the weight served without them."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    down = model.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        down[3, 5] = torch.nextafter(down[3, 5], torch.tensor(1.0))
    reader = GGUFReader(str(tiny_llama_gguf(model_cache)))
    assert keep_blocks(reader, model, tmp_path) == {"Q4_0": 12}
    blocks, _ = _blocks(tmp_path)
    assert set(blocks) == KEPT - {"model.layers.1.mlp.down_proj.weight"}


def test_an_older_folder_serves_unless_its_file_had_tensors_of_a_type_kept_since(tmp_path):
    """Version 2 kept Q4_0 blocks, version 3 Q4_1 blocks too: an older folder is what this
    version writes when its file had no tensor of a type kept since."""
    sha = "ab" * 32
    v1, v2 = tmp_path / f"{sha[:16]}-v1", tmp_path / f"{sha[:16]}-v2"

    def older(folder: Path, types: dict[str, int]) -> None:
        folder.mkdir(exist_ok=True)
        (folder / "switchyard-gguf.json").write_text(json.dumps({"block_types": types}))

    older(v1, {"F32": 61, "Q8_0": 1, "Q5_K": 210})
    assert find_converted(tmp_path, sha) == v1  # no blocks kept, then or now
    older(v1, {"F32": 61, "Q4_1": 210, "Q8_0": 1})  # the default model's types
    assert find_converted(tmp_path, sha) is None  # converted again, keeping the Q4_1 blocks
    older(v2, {"F32": 61, "Q4_1": 210, "Q8_0": 1})
    assert find_converted(tmp_path, sha) is None
    older(v2, {"F32": 6, "Q4_0": 13, "Q8_0": 1})  # version 2 kept these Q4_0 blocks already
    assert find_converted(tmp_path, sha) == v2
    older(v1, {"Q4_0": 1})
    (v2 / "switchyard-gguf.json").unlink()
    assert find_converted(tmp_path, sha) is None
    (tmp_path / f"{sha[:16]}-v3").mkdir()
    assert find_converted(tmp_path, sha) == tmp_path / f"{sha[:16]}-v3"


def _folder_with_blocks(tmp_path: Path) -> Path:
    folder = tmp_path / "converted"
    (folder / GGUF_BLOCKS_FILE).parent.mkdir(parents=True)
    (folder / GGUF_BLOCKS_FILE).write_bytes(b"")  # detection looks for the file only
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


def test_blocks_are_served_as_gguf_where_the_engine_runs_it_and_dequantized_elsewhere(
        tmp_path, caplog):
    host = PluginHost.from_entry_points()
    engines = host.engines()
    folder = _folder_with_blocks(tmp_path)
    caplog.set_level(logging.INFO, "switchyard.plugins")
    assert host.detect_quantization(None, folder, engines["xeon"]) == "gguf"
    assert (f"{folder}: GGUF blocks in gguf-blocks/linears.safetensors: serving with "
            "--quantize gguf") in caplog.text
    assert host.detect_quantization(None, folder) == "gguf"
    assert host.detect_quantization("gguf", folder, engines["xeon"]) == "gguf"
    # Every float weight is there: another method quantizes them, as for any folder.
    assert host.detect_quantization("int8", folder, engines["xeon"]) == "int8"
    assert ("--quantize int8 quantizes every linear from its dequantized GGUF weights; no "
            "--quantize or --quantize gguf keep the GGUF blocks") in caplog.text
    if "gaudi" in engines:  # no uint4 kernels: the float weights, as without blocks
        assert host.detect_quantization(None, folder, engines["gaudi"]) is None
        assert ("GGUF blocks in gguf-blocks/linears.safetensors are served dequantized: engine "
                "'gaudi' runs none of the formats of --quantize gguf") in caplog.text
    plain = tmp_path / "plain"
    plain.mkdir()
    assert host.detect_quantization(None, plain, engines["xeon"]) is None
