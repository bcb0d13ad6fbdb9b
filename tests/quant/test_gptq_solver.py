"""GPTQ with calibration: the solver on one linear, layer by layer on a model, and the CLI.

The solver (``switchyard_quant.gptq_solver``) is checked for what GPTQ is
for: a lower output error ``||X W^T - X Q^T||^2`` than RTN's at the same
group size when the inputs are correlated, and no worse when they are not;
its lazy-batch blocks against the plain column-by-column algorithm written
here; dead inputs; and its records round-tripping through the GPTQ writer and
reader bit for bit. ``switchyard quantize --gptq --calibration FILE`` writes a
folder that is deterministic to the byte, lowers the model's output error on
its calibration texts below RTN's, is detected as GPTQ and served by the xeon
engine with the greedy tokens of transformers over the folder's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from switchyard_quant.checkpoints.gptq import load_gptq
from switchyard_quant.checkpoints.writer import gptq_tensors, main, write_gptq
from switchyard_quant.gptq_layers import GptqSettings
from switchyard_quant.gptq_solver import HessianAccumulator, gptq_quantize
from switchyard_quant.int4 import dequantize_uint4, quantize_uint4, unpack_uint4_along_k

from tests.support.gptq_layout import folder_weights, quantized_folder
from tests.support.gptq_reference import model_over, served_with_the_tokens_of_its_weights

N, K, TOKENS = 48, 256, 2048


def _inputs(correlated: bool, seed: int = 0) -> torch.Tensor:
    """``[TOKENS, K]`` activations: mixed through a random matrix (correlated), or i.i.d."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, K, generator=gen)
    if correlated:
        x = x @ (torch.randn(K, K, generator=gen) / K ** 0.5) + 0.1 * torch.randn(
            TOKENS, K, generator=gen)
    return x


def _weight(seed: int = 1) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05


def _hessian(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[1])
    for chunk in x.split(300):  # the running average over uneven batches
        acc.add(chunk)
    return acc.hessian


def _output_error(x: torch.Tensor, w: torch.Tensor, record) -> float:
    x = x.double()
    return float(((x @ w.double().T - x @ dequantize_uint4(record).double().T) ** 2).sum())


def test_the_hessian_is_the_average_of_2_x_xt():
    x = _inputs(True)
    want = 2 * x.double().T @ x.double() / TOKENS
    torch.testing.assert_close(_hessian(x), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_gptq_has_a_lower_output_error_than_rtn_on_correlated_inputs(group):
    x, w = _inputs(True), _weight()
    gptq = _output_error(x, w, gptq_quantize(w, _hessian(x), group))
    rtn = _output_error(x, w, quantize_uint4(w, group))
    assert gptq < 0.7 * rtn, (gptq, rtn)  # measured: about half


@pytest.mark.parametrize("group", [32, 128])
def test_gptq_is_no_worse_than_rtn_on_isotropic_inputs(group):
    x, w = _inputs(False), _weight()
    gptq = _output_error(x, w, gptq_quantize(w, _hessian(x), group))
    rtn = _output_error(x, w, quantize_uint4(w, group))
    assert gptq <= 1.02 * rtn, (gptq, rtn)


def _plain_gptq(w: torch.Tensor, h: torch.Tensor, group: int, damp: float = 0.01):
    """The algorithm column by column, no blocks: codes [N, K]."""
    w, h = w.double().clone(), h.double().clone()
    h += damp * h.diagonal().mean() * torch.eye(K, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.zeros_like(w)
    for i in range(K):
        if i % group == 0:
            part = w[:, i:i + group]
            low, high = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
            scale = ((high - low) / 15).half().double()
            zero = torch.round(-low / scale).clamp(0, 15)
        codes[:, i] = torch.round(w[:, i] / scale + zero).clamp(0, 15)
        err = (w[:, i] - (codes[:, i] - zero) * scale) / u[i, i]
        w[:, i:] -= err[:, None] * u[i, i:][None, :]
    return codes


def test_the_lazy_blocks_give_the_plain_algorithms_codes():
    x, w = _inputs(True), _weight()
    h = _hessian(x)
    record = gptq_quantize(w, h, 32, block_size=64)
    got = unpack_uint4_along_k(record.data, K).double()
    want = _plain_gptq(w, h, 32)
    assert float((got != want).double().mean()) < 1e-3  # ties may round apart in the last bit


def test_a_dead_input_gets_weight_zero():
    x, w = _inputs(True), _weight()
    x[:, 5] = 0
    record = gptq_quantize(w, _hessian(x), 64)
    assert torch.equal(dequantize_uint4(record)[:, 5], torch.zeros(N))


def test_bad_arguments_are_refused():
    w, h = _weight(), _hessian(_inputs(False))
    with pytest.raises(ValueError, match="group size 48"):
        gptq_quantize(w, h, 48)
    with pytest.raises(ValueError, match="dampening"):
        gptq_quantize(w, h, 64, percdamp=0.0)
    with pytest.raises(ValueError, match="Hessian is"):
        gptq_quantize(w, h[:8, :8], 64)


@pytest.mark.parametrize("v1", [True, False])
def test_the_solvers_weights_round_trip_through_the_writer_and_reader_exactly(tmp_path, v1):
    """The scales are float16 values, so the folder holds exactly the weights GPTQ chose."""
    x, w = _inputs(True), _weight()
    record = gptq_quantize(w, _hessian(x), 64)
    assert torch.equal(record.scales.half().float(), record.scales)
    if v1:
        assert int(record.zero_points.min()) > 0
    layer = "model.layers.0.mlp.down_proj"
    tensors = {f"{layer}.{k}": v for k, v in gptq_tensors(record, v1).items()}
    config = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False,
              "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    loaded = load_gptq(str(quantized_folder(tmp_path, "f", config, tensors))).weights[layer]
    assert torch.equal(loaded.data, record.data)
    assert torch.equal(loaded.zero_points.long(), record.zero_points.long())
    assert torch.equal(dequantize_uint4(loaded), dequantize_uint4(record))


# The model: the gateway's tiny Llama, and a calibration file of standard library sources
# (``calibration_file``, tests/quant/conftest.py).


@pytest.fixture(scope="module")
def gptq_folder(tmp_path_factory, default_model_path, calibration_file) -> Path:
    out = tmp_path_factory.mktemp("gptq") / "model"
    assert main([str(default_model_path), str(out), "--gptq", "--calibration",
                 str(calibration_file), "--group-size", "64", "--calibration-tokens", "128"]) == 0
    return out


def test_a_layers_linears_are_quantized_in_the_order_they_run(default_model_path):
    """true_sequential: q|k|v (one input), o, gate|up (one input), down."""
    from transformers import AutoModelForCausalLM

    from switchyard_quant.gptq_layers import capture_inputs, decoder_layers, sequential_steps

    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    layers = decoder_layers(model)
    assert layers is model.model.layers
    with torch.no_grad():
        inputs = capture_inputs(model, layers[0], [[1, 17, 300, 45]])
        linears = {n: m for n, m in layers[1].named_modules() if isinstance(m, torch.nn.Linear)}
        assert sequential_steps(layers[1], linears, inputs[0]) == [
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
            ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]


def test_the_cli_writes_a_gptq_folder(gptq_folder):
    config = json.loads((gptq_folder / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": False,
        "true_sequential": True, "static_groups": False,
        "checkpoint_format": config["quantization_config"]["checkpoint_format"],
        "lm_head": False, "damp_percent": 0.01}
    assert load_gptq(str(gptq_folder)).source.startswith("GPTQ (28 linears, 4 bits, group 64")


def test_the_cli_prints_what_it_did(default_model_path, calibration_file, tmp_path, capsys):
    assert main([str(default_model_path), str(tmp_path / "out"), "--method", "int4-g32",
                 "--gptq", "--calibration", str(calibration_file),
                 "--calibration-samples", "2", "--calibration-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "28 linears as GPTQ 4-bit, group 32" in out
    assert "(GPTQ over 2 calibration prompts, 32 tokens, damp 0.01)" in out


def test_gptq_is_deterministic_to_the_byte(gptq_folder, default_model_path, calibration_file,
                                           tmp_path):
    settings = GptqSettings(calibration_file=str(calibration_file), group_size=64,
                            max_tokens=128)
    write_gptq(default_model_path, tmp_path / "again", 64, settings)
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (
        gptq_folder / "model.safetensors").read_bytes()
    assert (tmp_path / "again" / "config.json").read_bytes() == (
        gptq_folder / "config.json").read_bytes()


def test_gptq_lowers_the_models_error_on_its_calibration_texts(gptq_folder, default_model_path,
                                                               calibration_file, tmp_path):
    """Against RTN at the same group size: the logits' error on the calibration prompts."""
    from transformers import AutoTokenizer

    write_gptq(default_model_path, tmp_path / "rtn", 64)
    exact = model_over(Path(default_model_path),
                       load_file(str(Path(default_model_path) / "model.safetensors")))
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    texts = [json.loads(line)["text"] for line in calibration_file.read_text().splitlines()]
    prompts = [torch.tensor([tokenizer(t).input_ids[:128]]) for t in texts]

    def error(folder: Path) -> float:
        model = model_over(folder, folder_weights(folder)[0])
        with torch.inference_mode():
            return sum(float(((model(p).logits - exact(p).logits) ** 2).mean()) for p in prompts)

    gptq, rtn = error(gptq_folder), error(tmp_path / "rtn")
    assert gptq < 0.8 * rtn, (gptq, rtn)  # measured: about 0.6


def test_the_folder_is_detected_and_served_with_the_tokens_of_its_weights(gptq_folder):
    """Detected as GPTQ; the xeon engine's greedy tokens are transformers' over its weights."""
    served_with_the_tokens_of_its_weights(gptq_folder)


def test_gptq_without_calibration_is_an_error(default_model_path, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([str(default_model_path), str(tmp_path / "out"), "--gptq"])
    assert stopped.value.code == 2
    assert "--gptq needs --calibration FILE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(default_model_path), str(tmp_path / "out"), "--calibration", "x.jsonl"])
    assert "--calibration: only with --gptq" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(default_model_path), str(tmp_path / "out"), "--method", "int4-g32",
              "--group-size", "64"])
    assert "--group-size 64 contradicts --method int4-g32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(default_model_path), str(tmp_path / "out"), "--act-order"])
    assert "--act-order: only with --gptq" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, why", [("", "holds no texts"),
                                           ("{\"text\": \"a\"}\nnot json\n", "line 2 is not JSON")])
def test_an_empty_or_corrupt_calibration_file_is_an_error_naming_it(default_model_path, tmp_path,
                                                                   capsys, content, why):
    bad = tmp_path / "calibration.jsonl"
    bad.write_text(content)
    assert main([str(default_model_path), str(tmp_path / "out"), "--gptq", "--calibration",
                 str(bad)]) == 1
    assert f"switchyard quantize: calibration file {bad}: {why}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
