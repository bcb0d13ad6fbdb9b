"""`switchyard.engine_process` without a server: its settings, its frames, its start-up errors.

The behaviour under load (tokens, streaming, aborts, a killed process, no
orphans) is tested end to end in tests/e2e/test_engine_process.py.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from switchyard.engine_process import EngineProcess, parse_cpus
from switchyard.engine_process.wire import Connection, Events, Submit, ToChild, ToParent
from switchyard.models.config import ConfigError, entries_from_settings
from switchyard.settings import ServeSettings
from switchyard_spec import (
    EngineConfig,
    EngineNotFoundError,
    EngineRequest,
    EngineStats,
    FinishReason,
    SamplingParams,
    StepReport,
    StoppingParams,
    TokenEvent,
    TopToken,
)


def test_cpu_lists():
    assert parse_cpus("0-3,8, 10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpus("5") == (5,)
    for bad in ("", "a", "3-1", "1-", "-2", "0-3;5"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_the_flags_and_the_file_take_engine_process_and_cpus(tmp_path: Path):
    [entry] = entries_from_settings(ServeSettings(engine_process=True, cpus="0-1"))
    assert entry.engine_process and entry.cpus == "0-1"
    [entry] = entries_from_settings(ServeSettings())
    assert not entry.engine_process and entry.cpus is None
    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nname = "a"\nengine_process = true\ncpus = "2-3"\n'
                    '[[models]]\nname = "b"\n')
    a, b = entries_from_settings(ServeSettings(config=str(path)))
    assert (a.engine_process, a.cpus, b.engine_process, b.cpus) == (True, "2-3", False, None)
    # The flag is every entry's default.
    a, b = entries_from_settings(ServeSettings(config=str(path), engine_process=True))
    assert a.engine_process and b.engine_process


@pytest.mark.parametrize(("table", "message"), [
    ('cpus = "0-1"', "models[0] ('a'): field `cpus` pins an engine process: it needs "
                     "`engine_process = true`"),
    ('engine_process = true\ncpus = "x"', "models[0] ('a'): field `cpus`: 'x' is not a CPU "
                                          "list such as 0-3,8"),
    ("engine_process = 1", "models[0] ('a'): field `engine_process`"),
])
def test_config_mistakes_name_the_field(tmp_path: Path, table: str, message: str):
    path = tmp_path / "models.toml"
    path.write_text(f'[[models]]\nname = "a"\n{table}\n')
    with pytest.raises(ConfigError) as caught:
        entries_from_settings(ServeSettings(config=str(path)))
    assert message in str(caught.value)


def test_cpus_without_an_engine_process_is_refused_for_the_flags_too():
    with pytest.raises(ConfigError, match="--cpus pins an engine process: it needs "
                                          "--engine-process"):
        entries_from_settings(ServeSettings(cpus="0"))


def test_frames_carry_the_contract_types_unchanged():
    ours, theirs = socket.socketpair()
    parent, child = Connection(ours, ToParent), Connection(theirs, ToChild)
    try:
        request = EngineRequest(request_id="r1", prompt_token_ids=(1, 2, 3),
                                sampling=SamplingParams(do_sample=True, seed=3,
                                                        logit_bias=((5, -100.0),)),
                                stopping=StoppingParams(max_new_tokens=4, eos_token_ids=(2,)))
        parent.send(Submit(request=request))
        assert child.recv() == Submit(request=request)
        events = [TokenEvent(request_id="r1", token_id=7, logprob=-0.5,
                             top_tokens=(TopToken(7, -0.5), TopToken(9, -1.5)), seed=3,
                             prompt_tokens=3, prompt_logprobs=(-1.0, -2.0),
                             queue_seconds=0.01),
                  TokenEvent(request_id="r1", token_id=2, finish_reason=FinishReason.EOS_TOKEN),
                  TokenEvent(request_id="r2", token_id=-1, error="boom")]
        frame = Events(events=events, steps=[StepReport(method="decode", batch_size=2,
                                                        prefill_tokens=0, decode_tokens=2,
                                                        seconds=0.01)],
                       stats=EngineStats(running=1, waiting=0, kv_blocks_total=8))
        child.send(frame)
        got = parent.recv()
        assert got == frame and got.events[1].finish_reason is FinishReason.EOS_TOKEN
        child.close()
        assert parent.recv() is None  # end of file: the other process is gone
    finally:
        parent.close()
        child.close()


def test_a_start_error_in_the_process_is_raised_as_the_contract_error(tmp_path: Path):
    engine = EngineProcess("no-such-engine", EngineConfig(model_path=str(tmp_path)), model="m")
    with pytest.raises(EngineNotFoundError, match="no engine named 'no-such-engine'; "
                                                  "installed engines: .*xeon"):
        engine.start()
    child = engine._child
    assert child is not None and child.proc.wait(30) == 1
    assert engine.unavailable() is not None and not engine.healthy()
    events: list[TokenEvent] = []
    engine.submit(EngineRequest(request_id="x", prompt_token_ids=(1,),
                                sampling=SamplingParams(),
                                stopping=StoppingParams(max_new_tokens=1)), events.append)
    assert len(events) == 1 and events[0].error and "model `m` is not available" in \
        events[0].error
    engine.shutdown()  # nothing left to stop; returns at once
