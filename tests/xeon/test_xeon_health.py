"""Health of the Xeon engine: cheap liveness normally, a real probe after a failed step."""

from __future__ import annotations

import threading
import time

from tests.support.engine_requests import Collector, greedy_request, prompt_of
from tests.support.waiting import eventually


def _break_forward(engine) -> dict[str, bool]:
    """Make every forward step raise while ``state["broken"]`` is true."""
    runner = engine._runner
    original = runner.forward
    state = {"broken": True}

    def forward(*args, **kwargs):
        if state["broken"]:
            raise RuntimeError("injected device fault")
        return original(*args, **kwargs)

    runner.forward = forward
    return state


def test_probe_is_free_while_steps_succeed(make_engine):
    engine = make_engine()
    steps = engine.stats().steps
    assert engine.healthy() and engine.probe_liveness(1.0)
    # What is checked is an absence (no probe generation ran), which has no event to wait
    # on: the sleep gives a probe, had one started, time to take a step.
    time.sleep(0.1)
    assert engine.stats().steps == steps  # no generation ran
    assert engine.probe_liveness(10.0, force=True)  # force runs one
    eventually(lambda: engine.stats().steps > steps, what="the forced probe's step counted")


def test_failed_step_is_probed_and_recovers(make_engine):
    engine = make_engine()
    state = _break_forward(engine)
    sink = Collector()
    engine.submit(greedy_request("victim", prompt_of(6), 4), sink)
    assert "injected" in sink.wait("victim")[0].error

    # The fault persists: a real generation fails, and healthy() says so from then on.
    assert not engine.probe_liveness(10.0)
    assert not engine.healthy()

    state["broken"] = False
    # healthy() never blocks; it starts a probe in the background whose success shows next.
    # With every step held at a gate the probe cannot finish, yet the call returns: had it
    # waited for the probe, it would still be waiting (the probe's deadline is 30 s).
    runner = engine._runner
    original = runner.step
    entered, gate, answered = threading.Event(), threading.Event(), threading.Event()

    def held(seqs):
        entered.set()
        gate.wait(30)
        return original(seqs)

    runner.step = held
    threading.Thread(target=lambda: (engine.healthy(), answered.set()), daemon=True).start()
    assert entered.wait(10), "healthy() started no probe"
    assert answered.wait(10), "healthy() waited for the probe it started"
    assert not gate.is_set()
    runner.step = original
    gate.set()
    eventually(engine.healthy, what="healthy() after the probe succeeded")
    assert engine.probe_liveness(1.0)


def test_successful_step_clears_a_failure_without_a_probe(make_engine):
    engine = make_engine()
    state = _break_forward(engine)
    sink = Collector()
    engine.submit(greedy_request("victim", prompt_of(6), 4), sink)
    sink.wait("victim")
    state["broken"] = False
    engine.submit(greedy_request("next", prompt_of(6), 2), sink)
    sink.wait("next")
    runner = engine._runner
    original = runner.step
    stepped: list[str] = []

    def step(seqs):
        stepped.extend(s.request_id for s in seqs)
        return original(seqs)

    runner.step = step
    assert engine.probe_liveness(10.0) and engine.healthy()
    assert not stepped  # answered from the step's success: no probe ran


def test_probe_times_out_when_the_loop_is_stuck(make_engine):
    engine = make_engine()
    runner = engine._runner
    original = runner.step
    entered, gate = threading.Event(), threading.Event()

    def stuck(seqs):
        entered.set()
        gate.wait(30)
        return original(seqs)

    runner.step = stuck
    sink = Collector()
    engine.submit(greedy_request("slow", prompt_of(4), 2), sink)
    assert entered.wait(10)
    begin = time.monotonic()
    assert not engine.probe_liveness(0.3, force=True)
    # It returned at its 0.3 s deadline, not when the stuck step let go (30 s from now).
    assert time.monotonic() - begin < 10.0
    assert not engine.healthy()  # the unfinished probe counts as failed
    runner.step = original
    gate.set()
    sink.wait("slow")
    # The probe got its token once the loop moved on.
    eventually(engine.healthy, what="healthy() once the loop moved on")


def test_probe_jumps_the_queue(make_engine):
    """With the one batch slot taken and requests waiting, the probe runs next, not last."""
    engine = make_engine(max_batch_size=1)
    runner = engine._runner
    original = runner.step
    batches: list[list[str]] = []

    def step(seqs):
        batches.append([s.request_id for s in seqs])
        return original(seqs)

    runner.step = step
    sink = Collector()
    engine.submit(greedy_request("long", prompt_of(5), 12), sink)
    for i in range(3):
        engine.submit(greedy_request(f"queued{i}", prompt_of(5, i), 8), sink)
    sink.wait_tokens("long", 1)
    assert engine.probe_liveness(30.0, force=True)
    for rid in ("long", "queued0", "queued1", "queued2"):
        sink.wait(rid)
    first = {rid: next(i for i, b in enumerate(batches) if any(r.startswith(rid) for r in b))
             for rid in ("__probe__", "queued0")}
    assert first["__probe__"] < first["queued0"], batches


def test_after_shutdown(make_engine):
    engine = make_engine()
    engine.shutdown()
    assert not engine.healthy()
    assert not engine.probe_liveness(1.0, force=True)
