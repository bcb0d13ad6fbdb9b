"""GGUF blocks read into uint4 formats: exactly the weights ``gguf.quants.dequantize`` gives.

The claim of ``switchyard_spec.GGUF_BLOCK_TYPES`` is checked here bit for bit
(float32 bits compared as integers, so signed zeros and NaN payloads count),
the tolerance is zero:

- Q4_0 blocks (``uint4-group32-asym``, zero point 8) with every nibble and
  edge scales (zeros of both signs, float16 subnormals, the largest
  float16, infinities, quiet and signalling NaNs with payloads), and all
  65,536 float16 scales: the record's weight, by the method's
  ``dequantize`` and by the contract's formula written out here, is
  ``gguf``'s;
- Q4_1 blocks (``uint4-group32-min``: ``q * s + b``) the same way: every
  nibble with edge scales and mins (``d == 0`` with a negative ``m``, zeros
  of both signs, subnormals, the largest float16, infinities, NaNs), all
  65,536 float16 values as scales and as mins, and Gaussian rows quantized
  by ``gguf``'s own Q4_1 quantizer;
- the real weights of the default model (SmolLM2-135M-Instruct): its own
  Q4_1 linears, and the same re-encoded as Q4_0 by ``gguf``'s quantizer
  (``tests/support/gguf_files.py``), through the gateway's conversion: all 210
  kept linears, against ``gguf``'s dequantization of the file's tensors
  (rows of q and k in transformers' order) and against the folder's
  float32 weights;
- why Q4_1 needs a float min, and the Q8_0 embedding stays dequantized: an
  integer zero point holds ``-m / d`` in 0.27% of the default model's Q4_1
  blocks; Q8_0 has a scale per 32 weights, many per row.
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

from switchyard_spec import GGUF_BLOCK_TYPES, GGUF_BLOCKS_FILE, uint4_group_asym, uint4_group_min
from switchyard_quant.checkpoints.gguf import load_gguf, q4_0_weight, q4_1_weight

from tests.support.gguf_files import default_gguf, smollm2_q4_0
from tests.support.quant_methods import method

Q4_0 = GGMLQuantizationType.Q4_0
Q4_1 = GGMLQuantizationType.Q4_1
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


def _q4_1_rows(pairs: np.ndarray, rows: int, seed: int = 0) -> np.ndarray:
    """``rows`` rows of Q4_1 blocks, one per ``(d, m)`` float16 pair: row 0 every nibble twice,
    the rest random."""
    rng = np.random.default_rng(seed)
    out = []
    for row in range(rows):
        blocks = []
        for d, m in pairs:
            q = np.arange(32) % 16 if row == 0 else rng.integers(0, 16, 32)
            packed = (q[:16] | (q[16:] << 4)).astype(np.uint8)  # weight j low, j + 16 high
            blocks.append(np.concatenate([np.array([d, m], np.float16).view(np.uint8), packed]))
        out.append(np.concatenate(blocks))
    return np.stack(out)


def _contract_weight(record) -> torch.Tensor:  # noqa: ANN001
    """The weight per group, from the contract's words written out here: ``(q - z) * s``, or
    ``q * s + b`` for a min format (the product rounded to float32, then the sum)."""
    words = record.data.to(torch.int64) & 0xFFFFFFFF
    q = ((words[..., None] >> (torch.arange(8) * 4)) & 15).reshape(record.out_features, -1)
    groups = torch.arange(record.in_features) // record.format.group_size
    if record.format.group_min:
        return q.float() * record.scales[:, groups] + record.mins[:, groups]
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


EDGE_PAIRS = np.array(
    [(0.0, -0.75), (0.0, 0.5), (-0.0, -3.0), (0.0, 0.0), (0.0, -0.0), (-0.0, -0.0),
     (1.0, -8.0), (0.125, -1.0), (2**-24, -(2**-24)), (2**-14, -(2**-14) * 7.5),
     (2**-24, 65504.0), (65504.0, -65504.0), (65504.0, 65504.0), (4096.0, -61440.0),
     (0.0123, -0.0937), (-0.0123, 0.0937), (6.1e-5, 3.3e-3), (np.inf, -1.0), (1.0, -np.inf),
     (np.inf, -np.inf), (np.nan, 1.0), (1.0, np.nan)], dtype=np.float16)
"""(d, m) pairs: d == 0 (the weight is m) with negative, positive and signed-zero m; offsets
that are and are not integer multiples of d; subnormals; sums that overflow float16 (not
float32); infinities and NaNs."""


def test_q4_1_with_every_nibble_and_edge_blocks_is_the_format_bit_for_bit():
    pairs = np.concatenate([EDGE_PAIRS, np.array(
        [(0x7E00, 0x3C00), (0x3C00, 0xFE01), (0x7C01, 0x3C00), (0x3C00, 0x7D55),
         (0x7C01, 0x7D55)], dtype=np.uint16).view(np.float16)])  # NaNs with payloads,
    # signalling ones included; the last pair is two NaNs
    raw = _q4_1_rows(pairs, rows=6)
    with np.errstate(invalid="ignore"):  # inf * 0 and inf - inf are NaN, in gguf's math and ours
        want = gguf_dequantize(raw, Q4_1)
    record = q4_1_weight(torch.from_numpy(raw))
    assert record.format == uint4_group_min(32) and record.zero_points is None
    assert (record.out_features, record.in_features) == (6, 32 * len(pairs))
    assert np.array_equal(_bits(record.scales[0]), _bits(pairs[:, 0].astype(np.float32)))
    assert np.array_equal(_bits(record.mins[0]), _bits(pairs[:, 1].astype(np.float32)))
    # Where d and m are both NaN, d * q + m meets two NaNs: IEEE 754 leaves open whose payload
    # comes out (numpy's add keeps the first operand's, torch's the second's), so a NaN is
    # all these blocks are held to; every other weight is compared bit for bit.
    both = np.repeat(np.isnan(pairs[:, 0]) & np.isnan(pairs[:, 1]), 32)
    assert both.sum() == 32
    for got in (method("gguf").dequantize(record), _contract_weight(record)):
        assert np.array_equal(_bits(got)[:, ~both], _bits(want)[:, ~both])
        assert np.isnan(got.numpy()[:, both]).all() and np.isnan(want[:, both]).all()
    # The d == 0 blocks stand for m, whatever their nibbles: -0.75 in every weight of block 0.
    assert (want[:, :32] == -0.75).all() and (want[:, 64:96] == -3.0).all()
    assert np.isnan(want).sum() > 0 and (_bits(want) == 0x80000000).any()


def test_every_float16_as_q4_1_scale_and_as_min_gives_gguf_s_weights_bit_for_bit():
    """All 65,536 float16 bit patterns as Q4_1 scales (random mins), then as mins (random
    scales), each block with random nibbles."""
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    rng = np.random.default_rng(3)
    others = rng.normal(0.0, 0.05, 2**16).astype(np.float16)
    nibbles = rng.integers(0, 16, (2**16, 32))
    packed = (nibbles[:, :16] | (nibbles[:, 16:] << 4)).astype(np.uint8)
    for d, m in ((every, others), (others, every)):
        halves = np.stack([d, m], axis=1).view(np.uint8)
        raw = np.concatenate([halves, packed], axis=1).reshape(1024, 64 * 20)
        with np.errstate(invalid="ignore", over="ignore"):
            want = gguf_dequantize(raw, Q4_1)
        record = q4_1_weight(torch.from_numpy(raw))
        assert np.array_equal(_bits(method("gguf").dequantize(record)), _bits(want))
        assert np.array_equal(_bits(_contract_weight(record)), _bits(want))


def test_q4_1_of_random_gaussian_rows_at_several_widths_is_the_format_bit_for_bit():
    from gguf.quants import quantize

    rng = np.random.default_rng(4)
    for k in (32, 64, 576, 1536):
        values = rng.normal(0.02, 0.05, (37, k)).astype(np.float32)
        values[3] = 0.25  # a row of one value: d == 0, every weight m
        raw = quantize(values, Q4_1)
        got = method("gguf").dequantize(q4_1_weight(torch.from_numpy(raw)))
        assert np.array_equal(_bits(got), _bits(gguf_dequantize(raw, Q4_1)))
        assert (got[3] == 0.25).all()


def test_the_method_is_the_contracts_q4_0_and_q4_1_mapping():
    assert GGUF_BLOCK_TYPES == ("Q4_0", "Q4_1")
    gguf = method("gguf")
    assert gguf.formats == (uint4_group_asym(32), uint4_group_min(32))
    assert gguf.config_quant_method == "gguf" and gguf.load is not None


@pytest.fixture(scope="module")
def q4_0_folder(model_cache: Path) -> Path:
    """The default model re-encoded as Q4_0, converted by the gateway (once per cache)."""
    from switchyard.models.gguf import ensure_gguf_model

    return ensure_gguf_model(smollm2_q4_0(model_cache), model_cache)


@pytest.fixture(scope="module")
def q4_1_folder(model_cache: Path) -> Path:
    """The default model as shipped (Q4_1), converted by the gateway (once per cache)."""
    from switchyard.models.default_model import ensure_default_model

    return ensure_default_model(model_cache)


LLAMA_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _hf_rows(values: np.ndarray, heads: int) -> np.ndarray:
    """The rows of a GGUF q or k projection in transformers' order: llama.cpp stores each
    head's rotary halves interleaved (pairs), transformers' Llama wants them in halves."""
    n = values.shape[0]
    return values.reshape(heads, n // heads // 2, 2, -1).swapaxes(1, 2).reshape(values.shape)


@pytest.mark.e2e  # the default model, from PyPI: the system whole, not a unit
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_every_linear_of_the_default_model_is_its_gguf_tensor_bit_for_bit(
        kind, request, model_cache):
    """All 210 linears, read by ``--quantize gguf``: gguf's dequantization of the file's
    tensor (q and k rows put in transformers' order here), and the folder's float32 weight.
    Q4_1: the file as shipped; Q4_0: its re-encoding."""
    folder = request.getfixturevalue(f"{kind.lower()}_folder")
    qtype = GGMLQuantizationType[kind]
    fmt = uint4_group_asym(32) if kind == "Q4_0" else uint4_group_min(32)
    checkpoint = load_gguf(str(folder))
    assert len(checkpoint.weights) == 210
    assert {w.format for w in checkpoint.weights.values()} == {fmt}
    assert checkpoint.tensors == {f"{n}.weight" for n in checkpoint.weights}
    assert checkpoint.source.startswith(f"GGUF {kind} blocks of 210 linears as {fmt.name}")
    path = smollm2_q4_0(model_cache) if kind == "Q4_0" else default_gguf(model_cache)
    reader = GGUFReader(str(path))
    heads = {"attn_q": int(reader.fields["llama.attention.head_count"].contents()),
             "attn_k": int(reader.fields["llama.attention.head_count_kv"].contents())}
    seen = set()
    with safe_open(str(folder / "model.safetensors"), framework="pt") as floats:
        for tensor in reader.tensors:
            if tensor.tensor_type != qtype:
                continue
            _, layer, role, _ = tensor.name.split(".")
            name = f"model.layers.{layer}.{LLAMA_NAMES[role]}"
            want = gguf_dequantize(np.asarray(tensor.data), qtype)
            if role in heads:
                moved = _hf_rows(want, heads[role])
                assert not np.array_equal(moved, want)  # the rows really are in another order
                want = moved
            got = method("gguf").dequantize(checkpoint.weights[name])
            assert np.array_equal(_bits(got), _bits(want)), name
            assert np.array_equal(_bits(_contract_weight(checkpoint.weights[name])),
                                  _bits(want)), name
            assert torch.equal(floats.get_tensor(f"{name}.weight").view(torch.int32),
                               got.view(torch.int32)), name
            seen.add(name)
    assert seen == set(checkpoint.weights)


def test_q4_1_needs_a_float_min_and_q8_0_maps_onto_no_format(model_cache):
    """Q4_1's ``d * q + m`` as ``(q - z) * d`` needs ``z = -m / d``: an integer in 0..15 (what
    ``uint4-group32-asym`` holds) in 0.27% of the default model's blocks, so the min format.
    Q8_0 has a scale per 32 weights: the embedding's rows have many, where int8-per-channel
    holds one, and no format has int8 groups."""
    reader = GGUFReader(str(default_gguf(model_cache)))
    integral = blocks = flat = 0
    for tensor in reader.tensors:
        if tensor.tensor_type == GGMLQuantizationType.Q4_1:
            raw = np.asarray(tensor.data).reshape(-1, 20)
            d = raw[:, :2].copy().view(np.float16)[:, 0].astype(np.float64)
            m = raw[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float64)
            z = -m / np.where(d == 0, 1.0, d)
            integral += int(((d != 0) & (z == np.round(z)) & (z >= 0) & (z <= 15)).sum())
            blocks += len(d)
            flat += int((d == 0).sum())
        elif tensor.tensor_type == GGMLQuantizationType.Q8_0:
            assert tensor.name == "token_embd.weight"  # the tied LM head's too
            raw = np.asarray(tensor.data)
            scales = raw.reshape(raw.shape[0], -1, 34)[:, :, :2].copy().view(np.float16)
            distinct = [len(np.unique(row)) for row in scales[:64, :, 0]]
            assert min(distinct) > 1, tensor.name  # no row holds one scale
    assert blocks == 3_317_760 and round(100 * integral / blocks, 2) == 0.27
    assert flat == 0  # the d == 0 blocks are tested on edge blocks above


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
                                         r"'Q8_0' blocks; this reader maps Q4_0, Q4_1"):
        load_gguf(str(tmp_path))
    save_file({"model.norm": raw}, str(path), metadata={"model.norm": "Q4_0"})
    with pytest.raises(ValueError, match="'model.norm' is not a linear layer's weight"):
        load_gguf(str(tmp_path))
    save_file({"lm_head.weight": raw[:, :17].contiguous()}, str(path),
              metadata={"lm_head.weight": "Q4_0"})
    with pytest.raises(ValueError, match=r"is uint8 \[2, 17\], expected uint8 \[N, K / 32 \* 18\]"):
        load_gguf(str(tmp_path))
    save_file({"lm_head.weight": raw}, str(path), metadata={"lm_head.weight": "Q4_1"})
    with pytest.raises(ValueError, match=r"is uint8 \[2, 18\], expected uint8 \[N, K / 32 \* 20\]"):
        load_gguf(str(tmp_path))
