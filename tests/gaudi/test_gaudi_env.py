"""Each of the seed's variables does on a running engine what the seed says (on the CPU device),
or is logged as not applicable here; bad values and plans that cannot fit stop start-up.

Engines here run the default tiny Llama with the small grid of conftest.py
(9 shapes: 7 prefill, 2 decode) unless a test changes it.
"""

from __future__ import annotations

import json
import re

import pytest
from switchyard_gaudi.engine import GaudiEngine
from switchyard_gaudi.warmup_plan import DECODE
from switchyard_spec import (
    EngineRequest,
    EngineStartError,
    FinishReason,
    SamplingParams,
    StoppingParams,
)

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.gaudi_config import cpu_config
from tests.support.greedy import generate_greedy


def _run(engine: GaudiEngine, prompt: list[int], new: int, rid: str = "r") -> list[int]:
    sink = Collector()
    engine.submit(greedy_request(rid, prompt, new), sink)
    return token_ids(sink.wait(rid))


def test_warmup_enabled_false_plans_but_compiles_on_first_use(make_gaudi, default_model_path,
                                                              reference_llama, caplog):
    with caplog.at_level("INFO", logger="switchyard.gaudi"):
        engine = make_gaudi(default_model_path, env={"WARMUP_ENABLED": "false"}, warmup=True)
        assert len(engine.plan.shapes) == 9  # enumerated and checked all the same
        assert engine.compiles == 0
        prompt = prompt_of(20)
        assert _run(engine, prompt, 3) == generate_greedy(reference_llama, prompt, 3)
    assert engine.compiles == 2  # prefill 2x32 and decode 4x96, as they were first met
    assert "warmup skipped (WARMUP_ENABLED=false): 9 shapes" in caplog.text
    assert "shape prefill 2x32 compiles on first use (WARMUP_ENABLED=false)" in caplog.text


def test_limit_hpu_graph_runs_prefill_without_a_graph(make_gaudi, default_model_path,
                                                      reference_llama):
    engine = make_gaudi(default_model_path, env={"LIMIT_HPU_GRAPH": "true"}, warmup=True)
    decodes = [s for s in engine.plan.shapes if s.phase == DECODE]
    assert engine.compiles == len(decodes) == 2  # every shape ran, only decode compiled
    prompt = prompt_of(30)
    assert _run(engine, prompt, 4) == generate_greedy(reference_llama, prompt, 4)
    assert engine.compiles == 2


def test_enable_hpu_graph_false_runs_eagerly(make_gaudi, default_model_path, reference_llama):
    engine = make_gaudi(default_model_path, env={"ENABLE_HPU_GRAPH": "false"}, warmup=True)
    prompt = prompt_of(12)
    assert _run(engine, prompt, 4) == generate_greedy(reference_llama, prompt, 4)
    assert engine.compiles == 0
    assert "no graphs (ENABLE_HPU_GRAPH=false)" in engine.device.describe()


def test_bucket_variables_shape_the_plan(make_gaudi, default_model_path):
    engine = make_gaudi(default_model_path, env={
        "PAD_SEQUENCE_TO_MULTIPLE_OF": "20", "PREFILL_BATCH_BUCKET_SIZE": "3",
        "BATCH_BUCKET_SIZE": "5"}, max_batch_prefill_tokens=180)
    grid = engine.plan.grid
    # Rows up to 8 (180 // 20 = 9, capped by the batch); any limit ends its buckets.
    assert (list(grid.prefill_seq), list(grid.prefill_batch), list(grid.decode_batch)) == \
        ([20, 40, 48], [3, 6, 8], [5, 8])
    exponential = make_gaudi(default_model_path, env={
        "BATCH_SIZE_EXPONENT_BASE": "2", "SEQ_LEN_EXPONENT_BASE": "2"})
    grid = exponential.plan.grid
    assert (list(grid.prefill_seq), list(grid.prefill_batch), list(grid.decode_batch)) == \
        ([16, 32, 48], [1, 2, 4, 8], [1, 2, 4, 8])


def test_ignore_eos_variable_runs_every_sequence_to_its_length(make_gaudi, default_model_path):
    engine = make_gaudi(default_model_path, env={"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true",
                                                 "ENABLE_HPU_GRAPH": "false"})
    eos = engine.info.eos_token_ids[0]
    sink = Collector()
    engine.submit(EngineRequest(
        request_id="eos", prompt_token_ids=tuple(prompt_of(5)),
        sampling=SamplingParams(logit_bias=((eos, 100.0),)),
        stopping=StoppingParams(max_new_tokens=3, eos_token_ids=(eos,))), sink)
    events = sink.wait("eos")
    assert token_ids(events) == [eos] * 3 and events[-1].finish_reason is FinishReason.LENGTH


def test_profiler_variables_write_a_trace_where_they_say(make_gaudi, default_model_path,
                                                         tmp_path):
    path = tmp_path / "hpu_profile"
    # Warmup on, running no shape: the profiler starts when warmup ends, and compiles are slow.
    engine = make_gaudi(default_model_path, warmup=True, env={
        "WARMUP_ENABLED": "false", "ENABLE_HPU_GRAPH": "false", "PROF_WAITSTEP": "1",
        "PROF_WARMUPSTEP": "1", "PROF_STEP": "2", "PROF_PATH": str(path),
        "PROF_RECORD_SHAPES": "true"})
    _run(engine, prompt_of(8), 6)  # one prefill and five decode steps: enough for 1 + 1 + 2
    traces = list(path.glob("*.pt.trace.json"))
    assert len(traces) == 1
    trace = json.loads(traces[0].read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("ProfilerStep#2" in n for n in names) and any("ProfilerStep#3" in n for n in names)
    assert not any("ProfilerStep#1" in n for n in names)  # waited, then warmed, not kept
    assert any("Input Dims" in e.get("args", {}) for e in trace["traceEvents"])  # shapes
    off = make_gaudi(default_model_path, env={"PROF_STEP": "2", "PROF_RANKS": "1",
                                              "WARMUP_ENABLED": "false",
                                              "ENABLE_HPU_GRAPH": "false",
                                              "PROF_PATH": str(tmp_path / "rank1")}, warmup=True)
    _run(off, prompt_of(8), 6)
    assert not (tmp_path / "rank1").exists()  # this engine is rank 0, not listed


def test_what_the_cpu_cannot_honour_is_logged_once(make_gaudi, default_model_path, caplog):
    with caplog.at_level("WARNING", logger="switchyard.gaudi"):
        make_gaudi(default_model_path, env={"USE_FLASH_ATTENTION": "true",
                                            "FLASH_ATTENTION_RECOMPUTE": "true",
                                            "SKIP_TOKENIZER_IN_TGI": "true"})
    for name in ("USE_FLASH_ATTENTION", "FLASH_ATTENTION_RECOMPUTE", "SKIP_TOKENIZER_IN_TGI"):
        assert caplog.text.count(f"{name}=true is not") == 1, name


def test_bad_values_and_unsupported_requests_stop_start_up(default_model_path, tmp_path):
    def start(env: dict[str, str], **limits: int) -> None:
        GaudiEngine(cpu_config(default_model_path, **limits), env=env).start()

    with pytest.raises(EngineStartError, match="BATCH_BUCKET_SIZE='0' must be at least 1"):
        start({"BATCH_BUCKET_SIZE": "0"})
    config = tmp_path / "maxabs_quant.json"
    config.write_text(json.dumps({"mode": "QUANTIZE", "observer": "maxabs",
                                  "dump_stats_path": str(tmp_path / "hqt_output" / "measure")}))
    with pytest.raises(EngineStartError, match="mode QUANTIZE reads the statistics of a MEASURE"):
        start({"QUANT_CONFIG": str(config)})  # none measured: tests/gaudi/test_gaudi_fp8.py
    with pytest.raises(EngineStartError, match="unknown option prefix_caching"):
        GaudiEngine(cpu_config(default_model_path, {"prefix_caching": "false"})).start()
    with pytest.raises(EngineStartError, match="speculative decoding .engine option speculate"):
        GaudiEngine(cpu_config(default_model_path, {"speculate": "4"})).start()
    with pytest.raises(EngineStartError, match="engine option speculative_model, "
                                               "--speculative-model"):
        GaudiEngine(cpu_config(default_model_path, {"speculative_model": "/x"})).start()
    with pytest.raises(EngineStartError, match="cpu_compile must be one of"):
        GaudiEngine(cpu_config(default_model_path, {"cpu_compile": "fast"})).start()
    with pytest.raises(EngineStartError, match="4 rows x 48 tokens = 192 tokens, over "
                                               "--max-batch-prefill-tokens 100"):
        start({"PREFILL_BATCH_BUCKET_SIZE": "4", "PAD_SEQUENCE_TO_MULTIPLE_OF": "16"},
              max_batch_prefill_tokens=100)


def test_a_plan_that_cannot_fit_is_refused_before_loading(default_model_path):
    """A fake 8 MiB device: the weights (4.8 MiB) fit, the cache for 8 rows does not."""
    def start(memory: str, **limits: int) -> GaudiEngine:
        engine = GaudiEngine(cpu_config(default_model_path, {"device_memory": memory}, **limits),
                             env={"PAD_SEQUENCE_TO_MULTIPLE_OF": "16",
                                  "PREFILL_BATCH_BUCKET_SIZE": "2"})
        engine.start()
        return engine

    with pytest.raises(EngineStartError, match=r"does not fit in device memory.*lower "
                                               r"--max-batch-size to (\d+)") as err:
        start("8MiB")
    assert "(8.0 MiB free)" in str(err.value)
    batch = int(re.search(r"--max-batch-size to (\d+)", str(err.value)).group(1))
    engine = start("8MiB", max_batch_size=batch)  # the value named does start
    try:
        assert engine.plan.memory.fits and engine.plan.limits.max_batch_size == batch
    finally:
        engine.shutdown()
    with pytest.raises(EngineStartError, match="no limit makes the weights smaller"):
        start("4MiB")


def test_without_a_batch_size_the_largest_that_fits_is_chosen(make_gaudi, default_model_path):
    roomy = make_gaudi(default_model_path, max_batch_size=0, max_batch_prefill_tokens=0)
    assert roomy.plan.limits.max_batch_size == 64
    assert roomy.plan.limits.max_batch_prefill_tokens == 4096
    small = make_gaudi(default_model_path, options={"device_memory": "8MiB"}, max_batch_size=0)
    assert 1 <= small.plan.limits.max_batch_size < 64
    assert small.plan.memory.fits
    by_tokens = make_gaudi(default_model_path, max_batch_size=0, max_batch_total_tokens=960)
    assert by_tokens.plan.limits.max_batch_size == 10  # 960 // 96, the seed's bs * total
