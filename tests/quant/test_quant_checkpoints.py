"""Checkpoint readers: GPTQ, AWQ and ipex low-precision files into ``uint4_group_asym`` records.

Every folder here is packed by the test itself from the layouts as the GPTQ
and AWQ tools document them (not by the readers' code), from random integers,
zero points and scales, and the records are checked against the weight
``(q - z) * s`` computed in float64 from those same numbers.
"""

from __future__ import annotations


import pytest
import torch

from switchyard.plugins import PluginHost
from switchyard_spec import UnsupportedQuantizationError, uint4_group_asym
from switchyard_quant.checkpoints.awq import load_awq
from switchyard_quant.checkpoints.folder import CheckpointError
from switchyard_quant.checkpoints.gptq import load_gptq
from switchyard_quant.checkpoints.lowp import load_lowp

from tests.support.gptq_layout import LAYER, gptq_config, pack_rows, quantized_folder
from tests.support.quant_methods import method

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _example(n: int = 16, k: int = 256, group: int = 64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 16, (n, k), generator=gen)
    z = torch.randint(1, 16, (n, groups), generator=gen)  # 1..15: v1 can store z - 1
    s = (torch.rand(n, groups, generator=gen) * 0.05 + 0.001).half()
    g = torch.arange(k) // group
    weight = (q.double() - z[:, g].double()) * s.double()[:, g]
    return q, z, s, weight


def _gptq_tensors(q, z, s, group, v1=True, prefix=LAYER) -> dict[str, torch.Tensor]:
    """GPTQ: qweight [K/8, N] packed along K, qzeros [G, N/8] along N (minus one in v1)."""
    k = q.shape[1]
    return {f"{prefix}.qweight": pack_rows(q).T.contiguous(),
            f"{prefix}.qzeros": pack_rows((z - 1 if v1 else z).T.contiguous()),
            f"{prefix}.scales": s.T.contiguous(),
            f"{prefix}.g_idx": (torch.arange(k) // group).to(torch.int32)}


def _dequantized(record) -> torch.Tensor:
    return method("gptq").dequantize(record).double()


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_a_gptq_folder_reads_as_the_weight_it_packs(tmp_path, fmt):
    """v1 stores zero points minus one, v2 as they are: both read back to ``(q - z) * s``."""
    q, z, s, weight = _example()
    folder = quantized_folder(tmp_path, fmt, gptq_config(fmt=fmt),
                              _gptq_tensors(q, z, s, 64, v1=fmt == "gptq"))
    checkpoint = load_gptq(str(folder))
    record = checkpoint.weights[LAYER]
    assert record.format == uint4_group_asym(64)
    assert (record.out_features, record.in_features) == (16, 256)
    assert torch.equal(record.zero_points.long(), z)
    assert torch.equal(_dequantized(record), weight.float().double())
    assert f"{LAYER}.qweight" in checkpoint.tensors and f"{LAYER}.g_idx" in checkpoint.tensors


def test_reading_v2_zero_points_as_v1_would_be_off_by_one(tmp_path):
    """The checkpoint_format is what decides: the same tensors under the other name differ."""
    q, z, s, weight = _example()
    z = z.clamp(max=14)  # so that read as v1 (plus one) it stays in range
    folder = quantized_folder(tmp_path, "mislabelled", gptq_config(fmt="gptq"),
                              _gptq_tensors(q, z, s, 64, v1=False))
    record = load_gptq(str(folder)).weights[LAYER]
    assert torch.equal(record.zero_points.long(), z + 1)


@pytest.mark.parametrize(("group", "ours"), [(-1, 128), (256, 128), (96, 32)])
def test_group_sizes_map_exactly_onto_the_formats(tmp_path, group, ours):
    """Per-row (-1) and larger groups repeat their scale and zero point over the format's groups."""
    q, z, s, weight = _example(k=384, group=384 if group == -1 else group)
    folder = quantized_folder(tmp_path, f"g{group}", gptq_config(group=group),
                              _gptq_tensors(q, z, s, 384 if group == -1 else group))
    record = load_gptq(str(folder)).weights[LAYER]
    assert record.format == uint4_group_asym(ours)
    assert torch.equal(_dequantized(record), weight.float().double())


def test_an_awq_folder_reads_as_the_weight_it_packs(tmp_path):
    """AWQ GEMM: qweight [K, N/8] and qzeros [G, N/8] packed along N in the order 0,2,4,6,1,3,5,7."""
    q, z, s, weight = _example(n=24, k=192, group=64, seed=3)
    tensors = {f"{LAYER}.qweight": pack_rows(q.T.contiguous(), AWQ_ORDER),
               f"{LAYER}.qzeros": pack_rows(z.T.contiguous(), AWQ_ORDER),
               f"{LAYER}.scales": s.T.contiguous(),
               f"{LAYER}.bias": torch.arange(24, dtype=torch.float16)}
    awq = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
           "version": "gemm"}
    folder = quantized_folder(tmp_path, "awq", awq, tensors)
    checkpoint = load_awq(str(folder))
    record = checkpoint.weights[LAYER]
    assert record.format == uint4_group_asym(64)
    assert torch.equal(_dequantized(record), weight.float().double())
    assert torch.equal(checkpoint.biases[LAYER], torch.arange(24, dtype=torch.float32))
    # The interleaving matters: packed in plain order, the same numbers read differently.
    plain = quantized_folder(tmp_path, "awq-plain", awq,
                             {**tensors, f"{LAYER}.qweight": pack_rows(q.T.contiguous())})
    assert not torch.equal(_dequantized(load_awq(str(plain)).weights[LAYER]), weight)


def test_an_ipex_low_precision_checkpoint_reads_with_its_key_names(tmp_path):
    """[N, K/8] packed along K, scales [N, G], zero points as int32 values; custom keys."""
    q, z, s, weight = _example(n=8, k=128, group=32, seed=5)
    state = {f"{LAYER}.w": pack_rows(q), f"{LAYER}.sc": s.float(),
             f"{LAYER}.zp": z.to(torch.int32)}
    torch.save(state, tmp_path / "lowp.pt")
    options = {"low_precision_checkpoint": str(tmp_path / "lowp.pt"), "lowp_weight_key": "w",
               "lowp_scale_key": "sc", "lowp_zero_point_key": "zp"}
    record = load_lowp(str(tmp_path), options).weights[LAYER]
    assert record.format == uint4_group_asym(32)
    assert torch.equal(_dequantized(record), weight.float().double())
    with pytest.raises(CheckpointError, match=r"lowp.pt: tensor 'model.layers.0.mlp.down_proj"
                                              r".packed_zp' is missing"):
        load_lowp(str(tmp_path), {**options, "lowp_zero_point_key": "packed_zp"})


def _error(tmp_path, quant, tensors, loader=load_gptq) -> str:
    folder = quantized_folder(tmp_path, "bad", quant, tensors)
    with pytest.raises(CheckpointError) as raised:
        loader(str(folder))
    return str(raised.value)


def test_bad_gptq_folders_name_the_file_and_tensor(tmp_path):
    q, z, s, _ = _example()
    good = _gptq_tensors(q, z, s, 64)
    no_zeros = {k: v for k, v in good.items() if not k.endswith("qzeros")}
    assert f"tensor '{LAYER}.qzeros' is missing" in _error(tmp_path / "a", gptq_config(), no_zeros)
    wrong = {**good, f"{LAYER}.scales": s.T[:, :8].contiguous()}
    message = _error(tmp_path / "b", gptq_config(), wrong)
    assert f"model.safetensors: tensor '{LAYER}.scales' has shape [4, 8], expected [4, 16]" in message
    assert "bits=8" in _error(tmp_path / "c", gptq_config(bits=8), good)
    lopsided = {**good, f"{LAYER}.g_idx": torch.zeros(256, dtype=torch.int32)}
    message = _error(tmp_path / "d", gptq_config(desc_act=True), lopsided)
    assert (f"model.safetensors: tensor '{LAYER}.g_idx' (desc_act=true) assigns 256 inputs "
            "to group 0, which must hold 64") in message  # more: tests/quant/test_gptq_act_order.py
    assert "group_size 16 is not a multiple" in _error(
        tmp_path / "e", gptq_config(group=16), _gptq_tensors(q, z, s, 64) | {
            f"{LAYER}.qzeros": pack_rows(torch.ones(16, 16, dtype=torch.long).T.contiguous()),
            f"{LAYER}.scales": torch.ones(16, 16, dtype=torch.float16),
            f"{LAYER}.g_idx": (torch.arange(256) // 16).to(torch.int32)})
    # v1 cannot hold a zero point of 0: its stored 15 means 16.
    high = _gptq_tensors(q, torch.where(z == z.max(), 16, z), s, 64)
    assert "zero point of 16" in _error(tmp_path / "f", gptq_config(), high)
    assert "'marlin' is not read" in _error(tmp_path / "g", gptq_config(fmt="marlin"), good)


def test_bad_awq_folders_are_refused(tmp_path):
    q, z, s, _ = _example()
    tensors = {f"{LAYER}.qweight": pack_rows(q.T.contiguous(), AWQ_ORDER),
               f"{LAYER}.qzeros": pack_rows(z.T.contiguous(), AWQ_ORDER),
               f"{LAYER}.scales": s.T.contiguous()}
    base = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True}
    assert "version 'gemv'" in _error(tmp_path / "a", {**base, "version": "gemv"}, tensors,
                                      load_awq)
    message = _error(tmp_path / "b", base, {**tensors, f"{LAYER}.qzeros": tensors[
        f"{LAYER}.qzeros"][:2].contiguous()}, load_awq)
    assert f"tensor '{LAYER}.qzeros' has shape [2, 2], expected [4, 2]" in message
    assert "w_bit=3" in _error(tmp_path / "c", {"quant_method": "awq", "w_bit": 3}, tensors,
                               load_awq)


def _host_and_xeon():
    host = PluginHost.from_entry_points()
    return host, host.engines()["xeon"]


def test_a_quantized_folder_is_detected_and_other_methods_are_refused(tmp_path):
    q, z, s, _ = _example()
    folder = quantized_folder(tmp_path, "gptq", gptq_config(), _gptq_tensors(q, z, s, 64))
    host, xeon = _host_and_xeon()
    assert host.detect_quantization(None, folder) == "gptq"
    assert host.detect_quantization("gptq", folder) == "gptq"
    assert host.resolve_quantization("gptq", xeon).load is not None
    with pytest.raises(UnsupportedQuantizationError) as refused:
        host.detect_quantization("int8", folder)
    assert ("--quantize 'int8': " in str(refused.value)
            and "already quantized with 'gptq'" in str(refused.value)
            and "serve it with --quantize gptq or without --quantize" in str(refused.value))
    other = quantized_folder(tmp_path, "bnb", {"quant_method": "bitsandbytes"},
                             {"x": torch.zeros(1)})
    with pytest.raises(UnsupportedQuantizationError, match="no installed plugin reads that"):
        host.detect_quantization(None, other)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text('{"model_type": "llama"}')
    assert host.detect_quantization(None, plain) is None
    assert host.detect_quantization("int4", plain) == "int4"
