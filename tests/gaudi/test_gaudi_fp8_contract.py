"""``--quantize fp8`` on the Gaudi engine (CPU device): the contract's FP8 format, calibrated once.

The reference is independent of the engine's code: the float model through
plain transformers with every linear replaced by a float64 quantize-
dequantize of the format (``tests/support/fp8_reference.py``: PyTorch's
``float8_e4m3fn`` cast for the rounding, statistics recorded by a hook of
the tests, not by the toolkit). The engine runs float32 on the CPU device,
where its FP8 layer sums exact E4M3 products in fp32: only the order of fp32
sums differs from the reference, so a layer agrees within 1e-5 of its largest
output and greedy tokens are checked teacher-forced with near ties allowed
(a last-bit fp32 difference can move the next layer's E4M3 rounding by one
step now and then).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import msgspec
import pytest
import torch
from switchyard_engine.calibration import cache_key, model_content_hash
from switchyard_gaudi import assembly
from switchyard_gaudi.device import Device
from switchyard_gaudi.engine import GaudiEngine
from switchyard_gaudi.fp8_linears import Fp8Linear
from switchyard_spec import ActivationStatistics, EngineConfig, EngineStartError

from tests.support.calibration import calibration_prompts
from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.fp8_reference import Fp8Reference, fp8_twin
from tests.support.gaudi_config import SMALL_ENV, cpu_config
from tests.support.greedy import assert_greedy_near, generate_greedy
from tests.support.quant_methods import method

FP8 = method("fp8")
LIMITS = {"max_total_tokens": 64, "max_input_tokens": 32, "max_batch_size": 4,
          "max_batch_prefill_tokens": 64}
"""A small grid: prompt buckets 16 and 32, prefill rows 2 and 4, decode rows 4."""
PROMPTS = [prompt_of(n, start=s) for n, s in ((9, 1), (23, 2), (30, 3), (5, 4))]
NEW = 8
FP32_TIE = 1e-3
"""Largest logit margin a teacher-forced greedy token may lose by (see the module docstring)."""


def _config(path: Path | str, cache: Path, quantization=FP8, **options: str) -> EngineConfig:
    config = cpu_config(path, {"calibration_cache": str(cache), **options}, **LIMITS)
    return msgspec.structs.replace(config, quantize=quantization.name if quantization else "fp8",
                                   quantization=quantization)


def _engine(path: Path | str, cache: Path, env: dict[str, str] | None = None,
            quantization=FP8, **options: str) -> GaudiEngine:
    engine = GaudiEngine(_config(path, cache, quantization, **options),
                         env={**SMALL_ENV, **(env or {})})
    engine.start()
    return engine


def _generate(engine: GaudiEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    sink = Collector()
    for i, prompt in enumerate(prompts):
        engine.submit(greedy_request(f"r{i}", prompt, new), sink)
    return [token_ids(sink.wait(f"r{i}")) for i in range(len(prompts))]


# ------------------------------------------------------------------ the layer


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("out_features,in_features", [(1, 9), (33, 130)])
def test_fp8_linear_on_the_cpu_device_is_the_format_in_float64(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 100 + out_features + in_features)
    linear = torch.nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) / 20)
        linear.weight[0, 0] = 1e-6  # a subnormal for this weight scale
        linear.bias.copy_(torch.randn(out_features, generator=gen))
    x = torch.randn(rows, in_features, generator=gen) * 3
    x[0, -1] = 50.0  # beyond the calibrated range: saturates at 448 * a
    absmax = 20.0
    stats = ActivationStatistics(absmax=torch.full((in_features,), absmax), tokens=rows)
    layer = Fp8Linear(FP8.calibration.quantize(linear.weight.detach(), stats, {}), linear.bias,
                      Device("cpu", graphs=False))
    want = Fp8Reference(linear, absmax)(x.double())
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.float32 and layer.fp8_weight.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    with pytest.raises(ValueError, match="Fp8Linear runs fp8-e4m3-per-tensor"):
        Fp8Linear(method("int8").quantize(linear.weight.detach()), None, Device("cpu"))


# ------------------------------------------------------------------ the engine


def test_greedy_tokens_match_the_fp8_reference_and_warmup_covers_serving(
        default_model_path, reference_llama, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="switchyard.gaudi"):
        engine = _engine(default_model_path, tmp_path)
    try:
        assert "calibrated on 16 prompts" in caplog.text
        assert "29 linears as FP8 E4M3" in caplog.text and "unit input" not in caplog.text
        runner = engine._runner
        assert type(runner.head) is Fp8Linear
        assert not any(type(m) is torch.nn.Linear for m in runner.base.modules())
        engine.warmup()
        warmed = engine.compiles
        assert warmed > 0
        got = _generate(engine, PROMPTS, NEW)
        assert engine.compiles == warmed, "a shape compiled after warmup"
    finally:
        engine.shutdown()
    reference = fp8_twin(reference_llama, calibration_prompts("fp8", default_model_path))
    assert_greedy_near(reference, PROMPTS, got, NEW, tol=FP32_TIE)
    # The check tells FP8 from float: the float model's own tokens fail it (its margins
    # against the FP8 reference measured 0.11-0.62 here; the engine's were all 0).
    plain = [generate_greedy(reference_llama, p, NEW) for p in PROMPTS]
    with pytest.raises(AssertionError):
        assert_greedy_near(reference, PROMPTS, plain, NEW, tol=FP32_TIE)


def test_calibration_runs_once_through_the_toolkit_cache(default_model_path, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="switchyard.gaudi"):
        _engine(default_model_path, tmp_path).shutdown()
        assert "calibrated on 16 prompts" in caplog.text
        caplog.clear()
        _engine(default_model_path, tmp_path).shutdown()
    assert "calibration statistics from" in caplog.text and "calibrated on" not in caplog.text
    # The toolkit's file, keyed by model, texts and token limit: the Xeon engine reads it too.
    key = cache_key(model_content_hash(default_model_path),
                    tuple(FP8.calibration.prompts({})), FP8.calibration.max_tokens)
    assert [p.name for p in tmp_path.glob("*.safetensors")] == [f"{key}.safetensors"]
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    with pytest.raises(EngineStartError,
                       match=f"--quantize fp8: calibration file {bad}: line 2 is not JSON"):
        _engine(default_model_path, tmp_path, calibration_file=str(bad))


def test_the_memory_plan_counts_the_fp8_weights_at_one_byte(default_model_path, reference_llama,
                                                             tmp_path):
    prepared = assembly.prepare(_config(default_model_path, tmp_path), dict(SMALL_ENV))
    linear = sum(m.weight.numel() for m in reference_llama.modules()
                 if type(m) is torch.nn.Linear)
    ids = {id(m.weight) for m in reference_llama.modules() if type(m) is torch.nn.Linear}
    rest = sum(p.numel() for p in reference_llama.parameters() if id(p) not in ids)
    if reference_llama.config.tie_word_embeddings:  # the embedding stays float beside the head
        rest += reference_llama.get_input_embeddings().weight.numel()
    assert prepared.dims.fp8_parameters == linear
    assert prepared.dims.weight_bytes(4) == rest * 4 + linear


@pytest.mark.e2e
def test_switchyard_serve_gaudi_quantize_fp8_with_the_tgi_client(model_cache, default_model_path,
                                                                 reference_llama, tmp_path):
    from text_generation import Client
    from transformers import AutoTokenizer

    from tests.support.live_server import start_server, stop_server

    prompt = "The quick brown fox"
    live = start_server(
        model_cache, tmp_path, "--engine", "gaudi", "--quantize", "fp8", "--dtype", "float32",
        "--engine-option", "device=cpu", "--engine-option", "num_threads=1",
        "--engine-option", f"calibration_cache={tmp_path / 'calibration'}",
        "--max-input-tokens", "32", "--max-total-tokens", "64", "--max-batch-size", "4",
        env={**SMALL_ENV, "TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"}, timeout=300)
    try:
        response = Client(live.url, timeout=120).generate(prompt, max_new_tokens=NEW)
        log = live.log()
    finally:
        stop_server(live)
    tokens = [t.id for t in response.details.tokens]
    reference = fp8_twin(reference_llama, calibration_prompts("fp8", default_model_path))
    ids = AutoTokenizer.from_pretrained(default_model_path)(prompt).input_ids
    assert_greedy_near(reference, [ids], [tokens], NEW, tol=FP32_TIE)
    assert "calibrated on 16 prompts" in log and "29 linears as FP8 E4M3" in log
    assert "gaudi warmup:" in log


# ------------------------------------------------------------------ refusals


def test_fp8_with_quant_config_is_refused_before_loading(default_model_path, tmp_path):
    config = tmp_path / "maxabs_quant.json"
    config.write_text(json.dumps({"mode": "QUANTIZE", "observer": "maxabs"}))
    with pytest.raises(EngineStartError, match=r"--quantize fp8 and QUANT_CONFIG=.* both ask "
                                               r"for FP8: use one"):
        assembly.prepare(_config(default_model_path, tmp_path),
                         {**SMALL_ENV, "QUANT_CONFIG": str(config)})


def test_fp8_sharded_is_refused(default_model_path, tmp_path):
    with pytest.raises(EngineStartError, match="--quantize fp8 with --num-shard above 1 is "
                                               "not implemented"):
        assembly.prepare(msgspec.structs.replace(_config(default_model_path, tmp_path),
                                                 num_shard=2), dict(SMALL_ENV))


def test_fp8_with_a_vision_model_is_refused(default_model_path, model_cache, tmp_path):
    from tests.support.vlm_model import ensure_vlm

    folder = ensure_vlm("llava_next", default_model_path, model_cache)
    with pytest.raises(EngineStartError, match="--quantize fp8 is not supported for .*vision"):
        assembly.prepare(_config(folder, tmp_path), dict(SMALL_ENV))


def test_a_method_of_another_format_is_refused_naming_fp8(default_model_path, tmp_path):
    with pytest.raises(EngineStartError, match="--quantize int8 produces int8-per-channel "
                                               "weights, which the engine has no kernels for; "
                                               "it runs fp8-e4m3-per-tensor"):
        assembly.prepare(_config(default_model_path, tmp_path, method("int8")), dict(SMALL_ENV))
