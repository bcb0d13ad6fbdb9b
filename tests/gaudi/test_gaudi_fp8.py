"""QUANT_CONFIG: FP8 through Intel Neural Compressor, measured then served, on the CPU device.

The shipped example configs (``plugins/gaudi/examples/maxabs_measure.json``
and ``maxabs_quant.json``) run unchanged: their ``dump_stats_path``
(``./hqt_output/measure``) is relative, so each test runs in a temporary
working directory. On the CPU the engine rewrites what only a Gaudi honours
(``use_qdq`` -> true, ``maxabs_hw`` -> ``maxabs_pow2``) and logs each.

References are independent of the engine: the statistics against the model's
own weights and embeddings, and the served tokens and log-probabilities
against the same checkpoint converted by INC's public API (``FP8Config``,
``convert``) and run through plain transformers (``generate``, a forward pass).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("neural_compressor.torch.quantization")

from switchyard_gaudi import assembly  # noqa: E402
from switchyard_gaudi.engine import GaudiEngine  # noqa: E402
from switchyard_spec import (  # noqa: E402
    EngineRequest,
    EngineStartError,
    SamplingParams,
    StoppingParams,
)

from tests.support.engine_requests import (  # noqa: E402
    Collector,
    greedy_request,
    prompt_of,
    token_ids,
)
from tests.support.gaudi_config import SMALL_ENV, cpu_config  # noqa: E402
from tests.support.greedy import generate_greedy  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "plugins" / "gaudi" / "examples"
MEASURE_JSON, QUANT_JSON = EXAMPLES / "maxabs_measure.json", EXAMPLES / "maxabs_quant.json"
LIMITS = {"max_total_tokens": 64, "max_input_tokens": 32, "max_batch_size": 4,
          "max_batch_prefill_tokens": 64}
"""A small grid: prompt buckets 16 and 32, prefill rows 2 and 4, decode rows 4 (4 shapes)."""
CALIBRATION = [prompt_of(n, start=s) for n, s in ((9, 1), (23, 2), (30, 3), (5, 4), (17, 5))]
NEW = 6
LAYERS = 4
LINEARS_PER_LAYER = 7


def _generate(engine: GaudiEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    sink = Collector()
    for i, prompt in enumerate(prompts):
        engine.submit(greedy_request(f"r{i}", prompt, new), sink)
    return [token_ids(sink.wait(f"r{i}")) for i in range(len(prompts))]


def _engine(model: Path, config: Path, **env: str) -> GaudiEngine:
    return GaudiEngine(cpu_config(model, **LIMITS),
                       env={**SMALL_ENV, "QUANT_CONFIG": str(config), **env})


@pytest.fixture(scope="module")
def measured(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[Path, list[list[int]]]]:
    """The shipped measure config run unchanged in a fresh working directory, as the seed does.

    Yields the working directory (holding ``hqt_output/``) and the tokens the
    calibration prompts generated.
    """
    work = tmp_path_factory.mktemp("fp8-work")
    before = os.getcwd()
    os.chdir(work)
    try:
        engine = _engine(default_model_path, MEASURE_JSON)
        engine.start()
        engine.warmup()
        assert engine.compiles == 0  # measuring runs eagerly
        generated = _generate(engine, CALIBRATION, NEW)
        engine.shutdown()  # writes the statistics
    finally:
        os.chdir(before)
    yield work, generated


def _stats(work: Path) -> dict[str, dict]:
    data = json.loads((work / "hqt_output" / "measure_hooks_maxabs.json").read_text())
    return data["Nodes"]


def test_measure_writes_maxabs_statistics_of_what_ran(measured, default_model_path,
                                                      reference_llama):
    work, generated = measured
    assert sorted(p.name for p in (work / "hqt_output").iterdir()) == [
        "measure_hooks_maxabs.json", "measure_hooks_maxabs.npz",
        "measure_hooks_maxabs_mod_list.json"]
    nodes = _stats(work)
    assert len(nodes) == LAYERS * LINEARS_PER_LAYER and "lm_head" not in nodes  # blocklisted
    layer0 = reference_llama.model.layers[0]
    # Weights: the max |w| of each linear's own checkpoint weight.
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        weight = layer0.get_submodule(name).weight
        measured_w = nodes[f"model.layers.0.{name}"]["params"]["weight"][0][0]
        assert measured_w == pytest.approx(float(weight.detach().abs().max()), rel=1e-6)
    # Inputs of layer 0's q_proj are the normed embeddings of every token the engine ran:
    # the prompts, the fed-back generated tokens (not each last one) and padding's token 0.
    ran = {0, *(t for p in CALIBRATION for t in p), *(t for g in generated for t in g[:-1])}
    with torch.inference_mode():
        normed = layer0.input_layernorm(
            reference_llama.model.embed_tokens(torch.tensor(sorted(ran))))
    measured_x = nodes["model.layers.0.self_attn.q_proj"]["inputs"][0][0][0]
    assert measured_x == pytest.approx(float(normed.abs().max()), rel=1e-5)


def _inc_reference(model_path: Path, stats_prefix: Path, folder: Path) -> torch.nn.Module:
    """The checkpoint converted by INC's own API with the statistics: no engine code involved."""
    from neural_compressor.torch.quantization import FP8Config, convert
    from transformers import AutoModelForCausalLM

    config_file = folder / "reference_quant.json"
    config_file.write_text(json.dumps({
        "mode": "QUANTIZE", "observer": "maxabs", "scale_method": "maxabs_pow2",
        "blocklist": {"types": [], "names": ["lm_head"]}, "dump_stats_path": str(stats_prefix),
        "use_qdq": True, "hp_dtype": "fp32"}))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return convert(model, FP8Config.from_json_file(str(config_file)))


FLIP = 0.3
"""The most one FP8 rounding flip moves a logit here (0.14 measured).

Float noise between two correct computations of one model (a padded batch
against an unpadded one: ~1e-6) can carry an activation across an FP8
rounding boundary, and that element then moves by a whole FP8 step (~6%).
So the engine and a reference agree to float precision almost everywhere,
and by less than this where a flip happened; a greedy choice can differ from
the reference's only where the reference's top two logits are this close.
"""


def _check_against_reference(reference: torch.nn.Module, prompt: list[int],
                             events: list) -> int:
    """Check one served sequence against the INC model through transformers; exact matches.

    Against ``generate``: the same tokens up to the first difference, and a
    difference only where ``generate``'s own top logit and the served token's
    are within :data:`FLIP`. Teacher-forced on the served tokens (one forward
    pass): each is the reference's argmax or within :data:`FLIP` of it, with
    the served log-probability within :data:`FLIP` of the reference's.
    """
    served = token_ids(events)
    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=len(served), eos_token_id=None, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True)
        full = reference(torch.tensor([prompt + served])).logits[0].float()
    generated = out.sequences[0, len(prompt):].tolist()
    for step, (mine, theirs) in enumerate(zip(served, generated)):
        if mine != theirs:
            row = out.logits[step][0].float()
            assert float(row.max() - row[mine]) < FLIP, (step, served, generated)
            break
    exact = 0
    scores = torch.log_softmax(full, -1)
    for step, (token, event) in enumerate(zip(served, events)):
        row = scores[len(prompt) - 1 + step]
        assert float(row.max() - row[token]) < FLIP, (step, served)
        assert abs(event.logprob - float(row[token])) < FLIP
        exact += int(int(row.argmax()) == token and abs(event.logprob - float(row[token])) < 1e-3)
    return exact


def test_quantize_serves_the_inc_model_with_warmed_graphs(measured, default_model_path,
                                                          reference_llama, caplog,
                                                          monkeypatch):
    work, _ = measured
    monkeypatch.chdir(work)
    with caplog.at_level("INFO", logger="switchyard.gaudi"):
        engine = _engine(default_model_path, QUANT_JSON)
        engine.start()
        engine.warmup()
    try:
        # The CPU's rewrites of the shipped (Gaudi) config, each logged.
        assert "use_qdq=False is not applicable on cpu" in caplog.text
        assert "scale_method='maxabs_hw' is not applicable on cpu" in caplog.text
        assert "'maxabs_pow2' (power-of-two scales) instead" in caplog.text
        assert "method='HOOKS' is not applied" in caplog.text
        assert f"{LAYERS * LINEARS_PER_LAYER} layers converted" in caplog.text
        shapes = len(engine.plan.shapes)
        assert engine.compiles == shapes == 4  # INC's FP8 layers trace into fullgraph graphs

        prompts = [prompt_of(n, start=s) for n, s in ((12, 7), (27, 8), (3, 9), (20, 10))]
        sink = Collector()
        for i, prompt in enumerate(prompts):
            engine.submit(greedy_request(f"r{i}", prompt, 8), sink)
        events = [sink.wait(f"r{i}") for i in range(len(prompts))]
        served = [token_ids(e) for e in events]
        reference = _inc_reference(default_model_path, work / "hqt_output" / "measure",
                                   work)
        exact = sum(_check_against_reference(reference, p, e) for p, e in zip(prompts, events))
        assert exact >= 0.9 * 8 * len(prompts)
        unquantized = [generate_greedy(reference_llama, p, 8) for p in prompts]
        assert served != unquantized  # FP8 did change something on this random model

        # Log-probabilities of a prompt: the INC model's, and near the float model's.
        prompt = prompt_of(25, start=11)
        sink = Collector()
        engine.submit(EngineRequest(request_id="lp", prompt_token_ids=tuple(prompt),
                                    prompt_logprobs=True, sampling=SamplingParams(),
                                    stopping=StoppingParams(max_new_tokens=1, ignore_eos=True)),
                      sink)
        served_lp = torch.tensor(sink.wait("lp")[0].prompt_logprobs, dtype=torch.float32)
        assert engine.compiles == shapes  # serving met only warmed shapes
    finally:
        engine.shutdown()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        fp8_logits = reference(ids).logits[0].float()
        float_logits = reference_llama(ids).logits[0].float()
    targets = torch.tensor(prompt[1:])[:, None]
    fp8_lp = torch.log_softmax(fp8_logits, -1)[:-1].gather(1, targets)[:, 0]
    diff = (served_lp - fp8_lp).abs()
    assert float((diff < 2e-4).float().mean()) >= 0.9 and float(diff.max()) < FLIP
    # FP8 against float32 on this random model (4 layers, weights of std 0.1): measured
    # relative L2 error 0.15-0.25 and argmax agreement 60-75%; the bounds leave room.
    rel = float((fp8_logits - float_logits).norm() / float_logits.norm())
    agree = float((fp8_logits.argmax(-1) == float_logits.argmax(-1)).float().mean())
    assert 0.01 < rel < 0.4
    assert agree > 0.4


def test_quant_weights_count_one_byte_in_the_memory_plan(measured, default_model_path,
                                                         monkeypatch):
    from switchyard_quant.fp8_inc import fp8_bytes

    work, _ = measured
    monkeypatch.chdir(work)
    engine = _engine(default_model_path, QUANT_JSON, WARMUP_ENABLED="false")
    engine.start()
    try:
        plain = assembly.prepare(cpu_config(default_model_path, **LIMITS), dict(SMALL_ENV))
        runner = engine._runner
        model_fp8 = fp8_bytes(runner.base) + fp8_bytes(runner.head)
        saved = plain.plan.memory.weights - engine.plan.memory.weights
        # Each FP8 weight saves 3 of its 4 float32 bytes, and the estimate is exact.
        assert model_fp8 > 0 and saved == 3 * model_fp8
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ refusals
def _start(model: Path, config: Path | str) -> None:
    GaudiEngine(cpu_config(model, **LIMITS),
                env={**SMALL_ENV, "QUANT_CONFIG": str(config)}).start()


def test_a_config_that_cannot_run_stops_start_up_before_loading(default_model_path, tmp_path,
                                                                monkeypatch):
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights loaded before the config was checked")

    monkeypatch.setattr(assembly, "load_causal_lm", no_loading)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EngineStartError, match=r"QUANT_CONFIG='.*absent\.json' is not a file"):
        _start(default_model_path, tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"mode": "MEASURE",')
    with pytest.raises(EngineStartError, match=rf"QUANT_CONFIG={bad}: {bad} is not valid JSON"):
        _start(default_model_path, bad)
    # The shipped quant config with no measure run before it in this directory.
    with pytest.raises(EngineStartError,
                       match=rf"QUANT_CONFIG={QUANT_JSON}: mode QUANTIZE reads the statistics of "
                             rf"a MEASURE run, and there are none at {tmp_path}/hqt_output/"
                             r"measure_hooks_maxabs\.npz"):
        _start(default_model_path, QUANT_JSON)
    cases = {
        '{"observer": "maxabs"}': r'"mode" must be "MEASURE" .* or "QUANTIZE"',
        '["MEASURE"]': "must hold a JSON object, not list",
        '{"mode": "QUANTIZE", "scale_method": "maxabs_hw_opt_weight"}':
            "scale_method 'maxabs_hw_opt_weight' needs a Gaudi; on the CPU use one of "
            "unit_scale, maxabs_pow2, maxabs_arbitrary",
        '{"mode": "MEASURE", "hp_dtype": "bf16"}':
            "\"hp_dtype\": 'bf16' is not the serving dtype float32",
    }
    for text, message in cases.items():
        config = tmp_path / "case.json"
        config.write_text(text)
        with pytest.raises(EngineStartError, match=rf"QUANT_CONFIG={config}: .*{message}"):
            _start(default_model_path, config)


def test_without_neural_compressor_the_error_names_the_install(default_model_path, tmp_path,
                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "neural_compressor", None)  # import fails, find_spec None
    with pytest.raises(EngineStartError, match=r"Intel Neural Compressor is not installed: pip "
                                               r"install 'switchyard-quant\[fp8\]'"):
        _start(default_model_path, MEASURE_JSON)
    monkeypatch.setitem(sys.modules, "switchyard_quant.fp8_inc", None)
    with pytest.raises(EngineStartError, match=r"FP8 needs the quant plugin with Intel Neural "
                                               r"Compressor: pip install 'switchyard-quant\[fp8\]'"):
        _start(default_model_path, MEASURE_JSON)


def test_measure_command_runs_prompts_and_writes_statistics(default_model_path, tmp_path,
                                                            monkeypatch, capsys):
    from switchyard_gaudi.__main__ import main

    monkeypatch.chdir(tmp_path)
    for name, value in {**SMALL_ENV, "QUANT_CONFIG": str(MEASURE_JSON)}.items():
        monkeypatch.setenv(name, value)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n\n    return a + b\nnaïve café\n")
    args = ["measure", "--model-id", str(default_model_path), "--prompts", str(prompts),
            "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "3",
            "--max-total-tokens", "64", "--max-input-tokens", "32", "--max-batch-size", "4",
            "--max-batch-prefill-tokens", "64", "--num-threads", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "measured 3 prompts (" in out and ", 9 generated)" in out
    assert f"{tmp_path}/hqt_output/measure_hooks_maxabs.npz" in out
    assert len(_stats(tmp_path)) == LAYERS * LINEARS_PER_LAYER
    # A quant config is refused by the measure command, with the reason.
    monkeypatch.setenv("QUANT_CONFIG", str(QUANT_JSON))
    assert main(args) == 2
    assert "is a QUANTIZE config; measuring needs" in capsys.readouterr().err
