"""Continuous batching on the real model: greedy parity with transformers, joins, load."""

from __future__ import annotations

import threading

from switchyard_spec import FinishReason

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids


def _record_batches(engine, gate: threading.Event | None = None,
                    entered: threading.Event | None = None, park_at: int = 0) -> list[tuple[int, int]]:
    """Wrap the runner so each step records (sequences, prefilling sequences).

    With ``gate``, step number ``park_at`` signals ``entered`` and waits for the
    gate: the loop is then parked mid-step while the test queues more requests,
    so they deterministically join at the next step boundary.
    """
    seen: list[tuple[int, int]] = []
    runner = engine._runner
    original = runner.step

    def step(seqs):
        if gate is not None and len(seen) == park_at:
            entered.set()
            gate.wait(30)
        seen.append((len(seqs), sum(1 for s in seqs if s.generated == 0)))
        return original(seqs)

    runner.step = step
    return seen


def test_greedy_parity_with_mixed_prompt_lengths(make_engine, hf_greedy):
    """Three prompts of different lengths, submitted together, match generate() exactly."""
    engine = make_engine()
    gate, entered = threading.Event(), threading.Event()
    batches = _record_batches(engine, gate, entered)
    prompts = {"short": prompt_of(3, 11), "medium": prompt_of(17, 23), "long": prompt_of(61, 5)}
    sink = Collector()
    # Park the loop inside a step, so the three are admitted together at the next boundary.
    engine.submit(greedy_request("blocker", prompt_of(2), 30), sink)
    assert entered.wait(10)
    for rid, prompt in prompts.items():
        engine.submit(greedy_request(rid, prompt, 24), sink)
    gate.set()
    prompts["blocker"] = prompt_of(2)
    for rid, prompt in prompts.items():
        events = sink.wait(rid)
        assert token_ids(events) == hf_greedy(prompt, len(token_ids(events))), rid
        assert events[-1].finish_reason is FinishReason.LENGTH
        assert events[0].prompt_tokens == len(prompt)
        assert events[0].seed is None
    # One step prefilled all three next to the decoding blocker.
    assert (4, 3) in batches, batches


def test_request_joins_while_another_decodes(make_engine, hf_greedy):
    """A late request is prefilled between decode steps and gets tokens before the first ends."""
    engine = make_engine()
    gate, entered = threading.Event(), threading.Event()
    batches = _record_batches(engine, gate, entered, park_at=5)
    sink = Collector()
    first, late = prompt_of(9, 3), prompt_of(26, 40)
    engine.submit(greedy_request("first", first, 60), sink)
    assert entered.wait(30)  # parked after "first" produced 5 tokens
    engine.submit(greedy_request("late", late, 8), sink)
    gate.set()
    late_events = sink.wait("late")
    first_events = sink.wait("first")

    late_first_token = late_events[0]
    assert late_first_token.error is None
    # The late request finished while the first was still decoding.
    order = sink.order
    assert order.index(("late", 7)) < order.index(("first", 59))
    assert token_ids(late_events) == hf_greedy(late, 8)
    assert token_ids(first_events) == hf_greedy(first, 60)
    # It joined a running batch: one step held a decode and a prefill together.
    assert (2, 1) in batches, batches


def test_sixteen_concurrent_requests_complete(shared_engine):
    """16 requests at once: every one ends exactly once with the asked-for token count."""
    sink = Collector()
    wanted = {f"r{i}": 3 + (i * 5) % 17 for i in range(16)}
    for i, (rid, n) in enumerate(wanted.items()):
        shared_engine.submit(greedy_request(rid, prompt_of(4 + 3 * i, i), n), sink)
    for rid, n in wanted.items():
        events = sink.wait(rid)
        ends = [e for e in events if e.finish_reason is not None or e.error is not None]
        assert len(ends) == 1 and ends[0] is events[-1], rid
        assert len(token_ids(events)) == n, rid
        assert events[-1].finish_reason is FinishReason.LENGTH
    stats = shared_engine.stats()
    assert stats.running == 0 and stats.waiting == 0


def test_stats_do_not_block_while_busy(shared_engine, monkeypatch):
    """stats() answers at once while the loop is mid-generation."""
    # The loop is parked inside a step of the busy request's decoding, so it is mid-step
    # when stats() is called on any machine (a guessed moment could find it finished).
    runner = shared_engine._runner
    original = runner.step
    entered, gate = threading.Event(), threading.Event()

    def held(seqs):
        if any(s.request_id == "busy" and s.generated >= 2 for s in seqs):
            entered.set()
            gate.wait(30)
        return original(seqs)

    monkeypatch.setattr(runner, "step", held)
    sink = Collector()
    shared_engine.submit(greedy_request("busy", prompt_of(30), 40), sink)
    try:
        assert entered.wait(30), "the busy request took no decode step"
        done = threading.Event()
        threading.Thread(target=lambda: (shared_engine.stats(), done.set()), daemon=True).start()
        # Held for up to 30 s: an answer within 10 s did not wait for the step to end.
        assert done.wait(10), "stats() waited for the loop's step"
    finally:
        gate.set()  # the shared engine goes on serving the module's other tests
    assert len(token_ids(sink.wait("busy"))) == 40
    assert shared_engine.stats().steps > 0
