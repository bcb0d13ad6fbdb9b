"""Health of the Gaudi engine: cheap normally, a real 1-token probe after a failed step."""

from __future__ import annotations

from tests.support.engine_requests import Collector, greedy_request, prompt_of
from tests.support.waiting import eventually


def test_a_failed_step_is_probed_with_a_real_generation_and_recovers(make_gaudi,
                                                                    default_model_path):
    engine = make_gaudi(default_model_path)
    assert engine.healthy() and engine.probe_liveness(1.0)
    runner = engine._runner
    original = runner.prefill
    state = {"broken": True, "probes": 0}

    def prefill(seqs, shape):
        if any(seq.request_id.startswith("__probe__") for seq in seqs):
            state["probes"] += 1
        if state["broken"]:
            raise RuntimeError("injected device fault")
        return original(seqs, shape)

    runner.prefill = prefill
    sink = Collector()
    engine.submit(greedy_request("victim", prompt_of(6), 4), sink)
    assert "injected" in sink.wait("victim")[0].error
    # The fault persists: the probe, a real generation, fails; health says so from then on.
    assert not engine.probe_liveness(10.0)
    assert state["probes"] == 1 and not engine.healthy()
    state["broken"] = False
    # healthy() never blocks: it starts a probe in the background, whose success shows next.
    eventually(engine.healthy, what="healthy() after the background probe succeeded")
    assert state["probes"] >= 2
    engine.submit(greedy_request("after", prompt_of(6), 3), sink)
    assert len([e for e in sink.wait("after") if e.token_id >= 0]) == 3
