"""GGUF blocks read into uint4-group32-asym: exactly the weights ``gguf.quants.dequantize`` gives.

The claim of ``switchyard_spec.GGUF_BLOCK_TYPES`` is checked here bit for bit
(float32 bits compared as integers, so signed zeros and NaN payloads count):

- Q4_0 blocks with every nibble and edge scales (zeros of both signs,
  float16 subnormals, the largest float16, infinities, quiet and signalling
  NaNs with payloads): the record's weight, by the method's ``dequantize``
  and by the contract's formula written out here, is ``gguf``'s;
- the real weights of the default model (SmolLM2-135M-Instruct), re-encoded
  as Q4_0 by ``gguf``'s own quantizer (``tests/gguf_files.py``), through the
  gateway's conversion: all 210 kept linears, against ``gguf``'s
  dequantization of the file's tensors (rows of q and k in transformers'
  order) and against the folder's float32 weights;
- why the default model's own blocks are not kept: its Q4_1 blocks'
  ``-m / d`` is an integer (what an integer zero point needs) in 0.27% of
  them, and its Q8_0 embedding has a scale per 32 weights, many per row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from safetensors import safe_open
from safetensors.torch import save_file

from switchyard_spec import GGUF_BLOCK_TYPES, GGUF_BLOCKS_FILE, uint4_group_asym
from switchyard_quant.checkpoints.gguf import load_gguf, q4_0_weight

from tests.gguf_files import default_gguf, smollm2_q4_0
from tests.quant.methods import method

Q4_0 = GGMLQuantizationType.Q4_0
EDGE_SCALES = np.concatenate([
    np.array([0.0, -0.0, 2**-24, -(2**-24), 2**-14 - 2**-24, 2**-14, 1.0, -1.0, 65504.0,
              -65504.0, np.inf, -np.inf, 0.1, -3.3e-3, 6.1e-5], dtype=np.float16),
    np.array([0x7E00, 0xFE01, 0x7C01, 0x7D55], dtype=np.uint16).view(np.float16),  # NaNs
])


def _q4_0_rows(scales: np.ndarray, rows: int, seed: int = 0) -> np.ndarray:
    """``rows`` rows of Q4_0 blocks, one per scale: row 0 every nibble twice, the rest random."""
    rng = np.random.default_rng(seed)
    out = []
    for row in range(rows):
        blocks = []
        for d in scales:
            q = np.arange(32) % 16 if row == 0 else rng.integers(0, 16, 32)
            packed = (q[:16] | (q[16:] << 4)).astype(np.uint8)  # weight j low, j + 16 high
            blocks.append(np.concatenate([np.array([d], np.float16).view(np.uint8), packed]))
        out.append(np.concatenate(blocks))
    return np.stack(out)


def _contract_weight(record) -> torch.Tensor:  # noqa: ANN001
    """The weight ``(q - z) * s`` per group, from the contract's words written out here."""
    words = record.data.to(torch.int64) & 0xFFFFFFFF
    q = ((words[..., None] >> (torch.arange(8) * 4)) & 15).reshape(record.out_features, -1)
    groups = torch.arange(record.in_features) // record.format.group_size
    return (q.float() - record.zero_points.float()[:, groups]) * record.scales[:, groups]


def _bits(values) -> np.ndarray:  # noqa: ANN001
    array = values.numpy() if isinstance(values, torch.Tensor) else values
    assert array.dtype == np.float32
    return np.ascontiguousarray(array).view(np.uint32)


def test_q4_0_with_every_nibble_and_edge_scales_is_the_format_bit_for_bit():
    raw = _q4_0_rows(EDGE_SCALES, rows=6)
    with np.errstate(invalid="ignore"):  # inf * 0 is NaN, in gguf's math as in ours
        want = gguf_dequantize(raw, Q4_0)
    record = q4_0_weight(torch.from_numpy(raw))
    assert record.format == uint4_group_asym(32)
    assert (record.out_features, record.in_features) == (6, 32 * len(EDGE_SCALES))
    assert torch.equal(record.zero_points, torch.full((6, len(EDGE_SCALES)), 8, dtype=torch.uint8))
    assert np.array_equal(_bits(record.scales[0]), _bits(EDGE_SCALES.astype(np.float32)))
    for got in (method("gguf").dequantize(record), _contract_weight(record)):
        assert np.array_equal(_bits(got), _bits(want))
    assert np.isnan(want).sum() > 0 and (_bits(want) == 0x80000000).any()  # the edges are there


def test_every_float16_scale_gives_gguf_s_weights_bit_for_bit():
    """All 65,536 float16 bit patterns as Q4_0 scales, each block with random nibbles; the
    scales widen as numpy widens them (torch's own widening of a signalling NaN does not)."""
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    rng = np.random.default_rng(2)
    nibbles = rng.integers(0, 16, (2**16, 32))
    packed = (nibbles[:, :16] | (nibbles[:, 16:] << 4)).astype(np.uint8)
    blocks = np.concatenate([every[:, None].view(np.uint8), packed], axis=1)
    raw = blocks.reshape(1024, 64 * 18)  # 1024 rows of 64 blocks (K = 2048)
    with np.errstate(invalid="ignore"):
        want = gguf_dequantize(raw, Q4_0)
    record = q4_0_weight(torch.from_numpy(raw))
    assert np.array_equal(_bits(record.scales.reshape(-1)), _bits(every.astype(np.float32)))
    assert np.array_equal(_bits(method("gguf").dequantize(record)), _bits(want))


def test_q4_0_of_random_gaussian_rows_at_several_widths_is_the_format_bit_for_bit():
    from gguf.quants import quantize

    rng = np.random.default_rng(1)
    for k in (32, 64, 576, 1536):
        values = rng.normal(0.0, 0.05, (37, k)).astype(np.float32)
        raw = quantize(values, Q4_0)
        got = method("gguf").dequantize(q4_0_weight(torch.from_numpy(raw)))
        assert np.array_equal(_bits(got), _bits(gguf_dequantize(raw, Q4_0)))


def test_the_method_is_the_contracts_q4_0_mapping():
    assert GGUF_BLOCK_TYPES == ("Q4_0",)
    gguf = method("gguf")
    assert gguf.formats == (uint4_group_asym(32),) and gguf.config_quant_method == "gguf"
    assert gguf.load is not None


@pytest.fixture(scope="module")
def q4_0_folder(model_cache: Path) -> Path:
    """The default model re-encoded as Q4_0, converted by the gateway (once per cache)."""
    from switchyard.models.gguf import ensure_gguf_model

    return ensure_gguf_model(smollm2_q4_0(model_cache), model_cache)


LLAMA_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _hf_rows(values: np.ndarray, heads: int) -> np.ndarray:
    """The rows of a GGUF q or k projection in transformers' order: llama.cpp stores each
    head's rotary halves interleaved (pairs), transformers' Llama wants them in halves."""
    n = values.shape[0]
    return values.reshape(heads, n // heads // 2, 2, -1).swapaxes(1, 2).reshape(values.shape)


def test_every_q4_0_linear_of_the_default_model_is_its_gguf_tensor_bit_for_bit(
        q4_0_folder, model_cache):
    """All 210 linears, read by ``--quantize gguf``: gguf's dequantization of the file's
    tensor (q and k rows put in transformers' order here), and the folder's float32 weight."""
    checkpoint = load_gguf(str(q4_0_folder))
    assert len(checkpoint.weights) == 210
    assert checkpoint.tensors == {f"{n}.weight" for n in checkpoint.weights}
    reader = GGUFReader(str(smollm2_q4_0(model_cache)))
    heads = {"attn_q": int(reader.fields["llama.attention.head_count"].contents()),
             "attn_k": int(reader.fields["llama.attention.head_count_kv"].contents())}
    seen = set()
    with safe_open(str(q4_0_folder / "model.safetensors"), framework="pt") as floats:
        for tensor in reader.tensors:
            if tensor.tensor_type != Q4_0:
                continue
            _, layer, kind, _ = tensor.name.split(".")
            name = f"model.layers.{layer}.{LLAMA_NAMES[kind]}"
            want = gguf_dequantize(np.asarray(tensor.data), Q4_0)
            if kind in heads:
                moved = _hf_rows(want, heads[kind])
                assert not np.array_equal(moved, want)  # the rows really are in another order
                want = moved
            got = method("gguf").dequantize(checkpoint.weights[name])
            assert np.array_equal(_bits(got), _bits(want)), name
            assert torch.equal(floats.get_tensor(f"{name}.weight").view(torch.int32),
                               got.view(torch.int32)), name
            seen.add(name)
    assert seen == set(checkpoint.weights)


def test_the_default_models_q4_1_and_q8_0_blocks_map_onto_no_format(model_cache):
    """Q4_1's ``d * q + m`` needs ``z = -m / d`` an integer in 0..15 for uint4's integer zero
    point: 0.27% of the default model's blocks have it, so no tensor maps. Q8_0 has a scale
    per 32 weights: the embedding's rows have many, where int8-per-channel holds one."""
    reader = GGUFReader(str(default_gguf(model_cache)))
    integral = blocks = 0
    for tensor in reader.tensors:
        if tensor.tensor_type == GGMLQuantizationType.Q4_1:
            raw = np.asarray(tensor.data).reshape(-1, 20)
            d = raw[:, :2].copy().view(np.float16)[:, 0].astype(np.float64)
            m = raw[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float64)
            z = -m / np.where(d == 0, 1.0, d)
            integral += int(((d != 0) & (z == np.round(z)) & (z >= 0) & (z <= 15)).sum())
            blocks += len(d)
            per_tensor = ((d != 0) & (z == np.round(z)) & (z >= 0) & (z <= 15)).all()
            assert not per_tensor, tensor.name
        elif tensor.tensor_type == GGMLQuantizationType.Q8_0:
            raw = np.asarray(tensor.data)
            scales = raw.reshape(raw.shape[0], -1, 34)[:, :, :2].copy().view(np.float16)
            distinct = [len(np.unique(row)) for row in scales[:64, :, 0]]
            assert min(distinct) > 1, tensor.name  # no row holds one scale
    assert blocks == 3_317_760 and round(100 * integral / blocks, 2) == 0.27


def test_the_reader_says_what_it_cannot_read(tmp_path):
    with pytest.raises(ValueError) as missing:
        load_gguf(str(tmp_path))
    assert f"has no {GGUF_BLOCKS_FILE}: --quantize gguf serves the linears of a GGUF file " \
           "(--model-id FILE.gguf)" in str(missing.value)
    raw = torch.from_numpy(_q4_0_rows(np.array([1.0], np.float16), rows=2))
    path = tmp_path / GGUF_BLOCKS_FILE
    path.parent.mkdir()
    save_file({"model.layers.0.mlp.up_proj.weight": raw}, str(path),
              metadata={"model.layers.0.mlp.up_proj.weight": "Q8_0"})
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.up_proj.weight' holds "
                                         r"'Q8_0' blocks; this reader maps Q4_0"):
        load_gguf(str(tmp_path))
    save_file({"model.norm": raw}, str(path), metadata={"model.norm": "Q4_0"})
    with pytest.raises(ValueError, match="'model.norm' is not a linear layer's weight"):
        load_gguf(str(tmp_path))
    save_file({"lm_head.weight": raw[:, :17].contiguous()}, str(path),
              metadata={"lm_head.weight": "Q4_0"})
    with pytest.raises(ValueError, match=r"is uint8 \[2, 17\], expected uint8 \[N, K / 32 \* 18\]"):
        load_gguf(str(tmp_path))
