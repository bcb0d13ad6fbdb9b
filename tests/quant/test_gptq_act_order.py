"""Act-order GPTQ: reading ``g_idx`` folders, the solver's column order, and writing them.

The folders are packed here from GPTQ's documented layout (not by the
reader's code): random integers, zero points and scales, and a ``g_idx``
that puts group ``i // G`` on input ``perm[i]`` for a random permutation, as
GPTQ's act-order does. The record each read gives is checked against the
weight ``(q[n, k] - z[n, g_idx[k]]) * s[n, g_idx[k]]`` computed in float64
from those numbers. The solver's act-order is checked for what it is for
(a lower output error than plain GPTQ when a few inputs are much larger than
the rest), and its records for a round trip through the writer and reader.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from switchyard_spec import uint4_group_asym
from switchyard_quant.checkpoints.folder import CheckpointError
from switchyard_quant.checkpoints.gptq import load_gptq
from switchyard_quant.checkpoints.writer import gptq_tensors, main, write_gptq
from switchyard_quant.gptq_layers import GptqSettings
from switchyard_quant.gptq_solver import HessianAccumulator, gptq_quantize

from tests.support.gptq_layout import LAYER, gptq_config, pack_rows, quantized_folder
from tests.support.gptq_reference import served_with_the_tokens_of_its_weights
from tests.support.quant_methods import method


def _act_order_example(n: int = 16, k: int = 256, group: int = 64, seed: int = 0):
    """q [N, K], z and s [N, G], a scattered g_idx [K], and the float64 weight they stand for."""
    gen = torch.Generator().manual_seed(seed)
    size = k if group == -1 else group
    groups = -(-k // size)
    q = torch.randint(0, 16, (n, k), generator=gen)
    z = torch.randint(1, 16, (n, groups), generator=gen)
    s = (torch.rand(n, groups, generator=gen) * 0.05 + 0.001).half()
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // size).to(torch.int32)
    g = g_idx.long()
    weight = (q.double() - z[:, g].double()) * s.double()[:, g]
    return q, z, s, g_idx, weight


def _tensors(q, z, s, g_idx) -> dict[str, torch.Tensor]:
    """GPTQ v1: qweight [K/8, N] along K (the inputs' order), qzeros [G, N/8] minus one, g_idx."""
    return {f"{LAYER}.qweight": pack_rows(q).T.contiguous(),
            f"{LAYER}.qzeros": pack_rows((z - 1).T.contiguous()),
            f"{LAYER}.scales": s.T.contiguous(),
            f"{LAYER}.g_idx": g_idx}


@pytest.mark.parametrize(("k", "group", "ours"), [(256, 64, 64), (256, 128, 128),
                                                  (512, 256, 128), (384, 96, 32),
                                                  (352, 128, 128)])
def test_an_act_order_folder_reads_as_the_weight_it_packs(tmp_path, k, group, ours):
    """Groups of G map onto the format's largest group dividing G; a short last group too."""
    q, z, s, g_idx, weight = _act_order_example(k=k, group=group)
    folder = quantized_folder(tmp_path, "f", gptq_config(group=group, desc_act=True),
                              _tensors(q, z, s, g_idx))
    record = load_gptq(str(folder)).weights[LAYER]
    assert record.format == uint4_group_asym(ours)
    assert record.input_order is not None
    assert torch.equal(g_idx[record.input_order].long(), torch.sort(g_idx.long()).values)
    assert torch.equal(method("gptq").dequantize(record).double(), weight.float().double())


def test_a_g_idx_in_the_inputs_order_needs_no_permutation(tmp_path):
    """desc_act true but g_idx ``k // G`` (no input was moved): no input order."""
    q, z, s, _, _ = _act_order_example()
    folder = quantized_folder(tmp_path, "f", gptq_config(desc_act=True),
                              _tensors(q, z, s, (torch.arange(256) // 64).to(torch.int32)))
    assert load_gptq(str(folder)).weights[LAYER].input_order is None


def test_g_idx_is_honoured_even_when_desc_act_is_false(tmp_path):
    """g_idx is what a reader dequantizes by (transformers does): desc_act is only a label."""
    q, z, s, g_idx, weight = _act_order_example(seed=4)
    folder = quantized_folder(tmp_path, "f", gptq_config(desc_act=False), _tensors(q, z, s, g_idx))
    record = load_gptq(str(folder)).weights[LAYER]
    assert torch.equal(method("gptq").dequantize(record).double(), weight.float().double())


def _message(tmp_path, g_idx: torch.Tensor) -> str:
    q, z, s, _, _ = _act_order_example()
    folder = quantized_folder(tmp_path, "bad", gptq_config(desc_act=True), _tensors(q, z, s, g_idx))
    with pytest.raises(CheckpointError) as raised:
        load_gptq(str(folder))
    return str(raised.value)


@pytest.mark.parametrize(("g_idx", "why"), [
    (torch.arange(255, dtype=torch.int32) // 64, "has shape [255], expected [256]"),
    (torch.arange(256, dtype=torch.int32) // 32, "names group 7, outside the 4 groups 0..3"),
    (torch.arange(256, dtype=torch.int32) // 64 - 1, "names group -1, outside the 4 groups"),
    (torch.cat([torch.zeros(65), torch.arange(65, 256) // 64]).to(torch.int32),
     "assigns 65 inputs to group 0, which must hold 64 (group_size 64)"),
    ((torch.arange(256) // 64).float(), "is float32, expected an integer type"),
])
def test_a_g_idx_that_is_no_act_order_assignment_is_refused_naming_file_and_tensor(
        tmp_path, g_idx, why):
    message = _message(tmp_path, g_idx)
    assert message.startswith(f"model.safetensors: tensor '{LAYER}.g_idx' (desc_act=true) ")
    assert why in message


def test_desc_act_without_g_idx_is_refused(tmp_path):
    q, z, s, g_idx, _ = _act_order_example()
    tensors = {k: v for k, v in _tensors(q, z, s, g_idx).items() if not k.endswith("g_idx")}
    folder = quantized_folder(tmp_path, "f", gptq_config(desc_act=True), tensors)
    with pytest.raises(CheckpointError, match=rf"desc_act is true but there is no {LAYER}.g_idx"):
        load_gptq(str(folder))


# The solver: act-order on a layer with a few large-activation inputs.

N, K, TOKENS = 48, 256, 2048


def _inputs(outliers: int, seed: int = 0) -> torch.Tensor:
    """Correlated ``[TOKENS, K]`` activations, ``outliers`` of the K inputs 20 times the rest."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, K, generator=gen)
    x = x @ (torch.randn(K, K, generator=gen) / K ** 0.5) + 0.1 * torch.randn(
        TOKENS, K, generator=gen)
    x[:, torch.randperm(K, generator=gen)[:outliers]] *= 20.0
    return x


def _hessian(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[1])
    acc.add(x)
    return acc.hessian


def _output_error(x: torch.Tensor, w: torch.Tensor, record) -> float:
    """``||X W^T - X Q^T||^2`` with Q in the inputs' order."""
    q = method("gptq").dequantize(record).double()  # the plugin's: columns back in place
    x = x.double()
    return float(((x @ w.double().T - x @ q.T) ** 2).sum())


W = torch.randn(N, K, generator=torch.Generator().manual_seed(1)) * 0.05


@pytest.mark.parametrize("group", [32, 128])
def test_act_order_lowers_the_output_error_when_a_few_inputs_are_large(group):
    x = _inputs(outliers=8)
    h = _hessian(x)
    ordered = gptq_quantize(W, h, group, act_order=True)
    plain = gptq_quantize(W, h, group)
    ratio = _output_error(x, W, ordered) / _output_error(x, W, plain)
    assert ratio < 0.6, ratio  # measured: 0.37 (group 32), 0.42 (group 128)


def test_act_order_is_no_worse_without_large_inputs():
    x = _inputs(outliers=0)
    h = _hessian(x)
    ratio = (_output_error(x, W, gptq_quantize(W, h, 64, act_order=True))
             / _output_error(x, W, gptq_quantize(W, h, 64)))
    assert ratio < 1.05, ratio  # measured: 0.93 to 1.00 over groups 32-128


def test_act_order_rounds_the_largest_inputs_first_and_is_deterministic():
    x = _inputs(outliers=8)
    h = _hessian(x)
    record = gptq_quantize(W, h, 64, act_order=True)
    order = record.input_order
    assert sorted(order.tolist()) == list(range(K))
    diagonal = torch.diagonal(h)[order]
    assert bool((diagonal[:-1] >= diagonal[1:]).all())
    again = gptq_quantize(W, h.clone(), 64, act_order=True)
    assert torch.equal(again.data, record.data) and torch.equal(again.input_order, order)
    assert torch.equal(again.scales, record.scales)


def test_the_act_order_records_round_trip_through_the_writer_and_reader(tmp_path):
    """g_idx each input's group, qweight in the inputs' order; read back, the same weight."""
    x = _inputs(outliers=8)
    record = gptq_quantize(W, _hessian(x), 64, act_order=True)
    stored = gptq_tensors(record, v1=int(record.zero_points.min()) > 0)
    g_idx = stored["g_idx"].long()
    assert torch.equal(g_idx[record.input_order], torch.arange(K) // 64)
    tensors = {f"{LAYER}.{name}": t for name, t in stored.items()}
    config = gptq_config(desc_act=True, fmt="gptq" if int(record.zero_points.min()) > 0
                         else "gptq_v2")
    loaded = load_gptq(str(quantized_folder(tmp_path, "f", config, tensors))).weights[LAYER]
    gptq = method("gptq")
    assert torch.equal(gptq.dequantize(loaded), gptq.dequantize(record))


# switchyard quantize --gptq --act-order on the gateway's tiny Llama.


@pytest.fixture(scope="module")
def act_order_folder(tmp_path_factory, default_model_path, calibration_file) -> Path:
    out = tmp_path_factory.mktemp("gptq-act-order") / "model"
    assert main([str(default_model_path), str(out), "--gptq", "--act-order", "--calibration",
                 str(calibration_file), "--group-size", "64", "--calibration-tokens", "128"]) == 0
    return out


def test_the_cli_writes_an_act_order_folder(act_order_folder):
    """desc_act true; every layer's g_idx an act-order assignment, most of them scattered."""
    config = json.loads((act_order_folder / "config.json").read_text())
    assert config["quantization_config"]["desc_act"] is True
    tensors = load_file(str(act_order_folder / "model.safetensors"))
    scattered = 0
    for name, g_idx in tensors.items():
        if name.endswith(".g_idx"):
            k = g_idx.shape[0]
            sizes = [64] * (k // 64) + ([k % 64] if k % 64 else [])  # down_proj: K 352
            assert torch.bincount(g_idx.long()).tolist() == sizes
            scattered += not torch.equal(g_idx.long(), torch.arange(k) // 64)
    assert scattered == 28
    # q|k|v read one input, so GPTQ gives them one Hessian, one order, one g_idx.
    layer = "model.layers.0.self_attn"
    assert torch.equal(tensors[f"{layer}.q_proj.g_idx"], tensors[f"{layer}.v_proj.g_idx"])
    checkpoint = load_gptq(str(act_order_folder))
    assert all(w.input_order is not None for w in checkpoint.weights.values())


def test_act_order_is_deterministic_to_the_byte(act_order_folder, default_model_path,
                                                calibration_file, tmp_path):
    settings = GptqSettings(calibration_file=str(calibration_file), group_size=64,
                            max_tokens=128, act_order=True)
    write_gptq(default_model_path, tmp_path / "again", 64, settings)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (act_order_folder / name).read_bytes()


def test_the_act_order_folder_is_served_with_the_tokens_of_its_weights(act_order_folder):
    """Unpacked here by g_idx, transformers' greedy tokens; the engine's the same."""
    served_with_the_tokens_of_its_weights(act_order_folder)
