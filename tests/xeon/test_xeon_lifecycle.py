"""Stopping, aborting, failures and shutdown of the Xeon engine on the real model."""

from __future__ import annotations

import logging

import pytest

from switchyard_spec import EngineConfig, EngineStartError, FinishReason
from switchyard_xeon.admission import IGNORE_EOS_ENV
from switchyard_xeon.engine import XeonEngine

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids

# Greedy decoding of this prompt on the default model emits EOS (<|im_end|>, id 2) first.
EOS_ID = 2
EOS_PROMPT = prompt_of(19, 54)


def test_start_warmup_and_report(default_model_path, caplog):
    """start() reports the model, warmup() runs the real path and logs progress."""
    caplog.set_level(logging.INFO, logger="switchyard.xeon")
    engine = XeonEngine(EngineConfig(model_path=str(default_model_path), dtype="float32",
                                     max_batch_size=8))
    info = engine.start()
    try:
        assert info.model_type == "llama" and info.dtype == "float32"
        assert info.vocab_size == 2048 and info.eos_token_ids == (EOS_ID,)
        assert engine.healthy()
        report = engine.warmup()
        assert report.max_batch_size == 8 and report.max_batch_total_tokens > 0
        assert engine.stats().steps >= 4
        assert any("threads" in r.message for r in caplog.records)
        assert any("warmup" in r.message for r in caplog.records)
        assert any(r.getMessage().startswith("kv cache: ") and "MiB" in r.getMessage()
                   for r in caplog.records)
    finally:
        engine.shutdown()
    assert not engine.healthy()


def test_missing_model_folder_fails_clearly(tmp_path):
    engine = XeonEngine(EngineConfig(model_path=str(tmp_path / "nope")))
    with pytest.raises(EngineStartError, match="does not exist"):
        engine.start()


def test_eos_stops_the_sequence(shared_engine):
    sink = Collector()
    shared_engine.submit(greedy_request("eos", EOS_PROMPT, 10, eos_token_ids=(EOS_ID,),
                                        ignore_eos=False), sink)
    events = sink.wait("eos")
    assert token_ids(events) == [EOS_ID]
    assert events[-1].finish_reason is FinishReason.EOS_TOKEN


def test_ignore_eos_env_var_is_honoured(shared_engine, monkeypatch):
    monkeypatch.setenv(IGNORE_EOS_ENV, "true")
    sink = Collector()
    shared_engine.submit(greedy_request("env", EOS_PROMPT, 6, eos_token_ids=(EOS_ID,),
                                        ignore_eos=False), sink)
    events = sink.wait("env")
    assert len(token_ids(events)) == 6 and token_ids(events)[0] == EOS_ID
    assert events[-1].finish_reason is FinishReason.LENGTH


def test_max_total_tokens_caps_the_sequence(make_engine):
    engine = make_engine(max_total_tokens=32)
    sink = Collector()
    engine.submit(greedy_request("cap", prompt_of(20), 50), sink)
    events = sink.wait("cap")
    assert len(token_ids(events)) == 12
    assert events[-1].finish_reason is FinishReason.LENGTH
    engine.submit(greedy_request("too-long", prompt_of(32), 5), sink)
    (event,) = sink.wait("too-long")
    assert event.error and "max_total_tokens" in event.error and event.token_id == -1


def test_invalid_requests_fail_alone(shared_engine, hf_greedy):
    """Bad requests get an error event; a batch mate is not affected."""
    sink = Collector()
    good = prompt_of(8)
    shared_engine.submit(greedy_request("good", good, 6), sink)
    shared_engine.submit(greedy_request("oov", [5, 999_999], 3), sink)
    shared_engine.submit(greedy_request("empty", [], 3), sink)
    duplicate = Collector()
    shared_engine.submit(greedy_request("good", good, 3), duplicate)  # id already live
    assert "vocabulary" in sink.wait("oov")[0].error
    assert "empty" in sink.wait("empty")[0].error
    assert "already live" in duplicate.wait("good")[0].error
    events = sink.wait("good")
    assert token_ids(events) == hf_greedy(good, 6)
    assert not any(e.error for e in events)


def test_abort_frees_the_slot(make_engine):
    """With one slot, aborting the running sequence lets the waiting one run."""
    engine = make_engine(max_batch_size=1)
    sink = Collector()
    engine.submit(greedy_request("long", prompt_of(10), 1000), sink)
    sink.wait_tokens("long", 2)
    engine.submit(greedy_request("next", prompt_of(5), 4), sink)
    engine.abort("unknown-id")  # ignored
    assert not sink.events("next")
    engine.abort("long")
    long_events = sink.wait("long")
    assert long_events[-1].finish_reason is FinishReason.ABORTED
    assert long_events[-1].token_id == -1
    assert len(long_events) < 1000
    assert sum(1 for e in long_events if e.finish_reason is not None) == 1
    assert len(token_ids(sink.wait("next"))) == 4
    engine.abort("long")  # already finished: ignored
    blocks = engine._scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_step_failure_fails_only_that_step(make_engine, hf_greedy):
    engine = make_engine()
    runner = engine._runner
    original = runner.forward
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return original(*args)

    runner.forward = flaky
    sink = Collector()
    engine.submit(greedy_request("victim", prompt_of(7), 5), sink)
    (event,) = sink.wait("victim")
    assert event.error and "injected" in event.error and event.finish_reason is None
    engine.submit(greedy_request("after", prompt_of(7), 5), sink)
    assert token_ids(sink.wait("after")) == hf_greedy(prompt_of(7), 5)
    assert engine.healthy()
    blocks = engine._scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_raising_sink_does_not_stop_the_loop(shared_engine):
    def bad_sink(event):
        raise ValueError("client went away badly")

    shared_engine.submit(greedy_request("bad", prompt_of(4), 3), bad_sink)
    sink = Collector()
    shared_engine.submit(greedy_request("fine", prompt_of(4), 3), sink)
    assert len(token_ids(sink.wait("fine"))) == 3
    assert shared_engine.healthy()


def test_shutdown_aborts_live_sequences(make_engine):
    engine = make_engine(max_batch_size=1)
    sink = Collector()
    engine.submit(greedy_request("running", prompt_of(6), 2000), sink)
    sink.wait_tokens("running", 1)
    engine.submit(greedy_request("queued", prompt_of(6), 5), sink)
    engine.shutdown()
    assert sink.wait("running", 5)[-1].finish_reason is FinishReason.ABORTED
    assert sink.wait("queued", 5)[-1].finish_reason is FinishReason.ABORTED
    engine.submit(greedy_request("late", prompt_of(6), 5), sink)
    assert sink.wait("late", 5)[-1].error == "engine is shut down"
    assert not engine.healthy()


def test_auto_dtype_serves(default_model_path):
    """The machine's own dtype (bfloat16 where the CPU has it) runs a mixed batch to the end."""
    engine = XeonEngine(EngineConfig(model_path=str(default_model_path)))
    info = engine.start()
    try:
        assert info.dtype in ("bfloat16", "float32")
        sink = Collector()
        for i in range(3):
            engine.submit(greedy_request(f"a{i}", prompt_of(5 + 9 * i, i), 6), sink)
        for i in range(3):
            assert len(token_ids(sink.wait(f"a{i}"))) == 6
    finally:
        engine.shutdown()


def test_the_model_loads_on_the_compute_thread(make_engine, monkeypatch):
    """Loading and packing run where the loop runs: OpenMP then keeps one pool of workers."""
    import threading

    from switchyard_xeon import assembly

    seen: list[str] = []
    real = assembly.load_causal_lm

    def recording(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(assembly, "load_causal_lm", recording)
    engine = make_engine()
    assert seen == ["switchyard-xeon"] and engine._thread.name == "switchyard-xeon"
    sink = Collector()
    engine.submit(greedy_request("r", prompt_of(5), 3), sink)
    assert len(token_ids(sink.wait("r"))) == 3


def test_a_failed_load_leaves_no_thread_behind(tmp_path):
    engine = XeonEngine(EngineConfig(model_path=str(tmp_path / "absent"), dtype="float32"))
    with pytest.raises(EngineStartError):
        engine.start()
    assert engine._thread is None and not engine.healthy()
