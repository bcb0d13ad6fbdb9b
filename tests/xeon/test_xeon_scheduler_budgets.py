"""Scheduler budgets without a model: batch size, FCFS admission, the per-step token budget,
TGI's waiting_served_ratio and max_waiting_tokens."""

from __future__ import annotations

import subprocess
import sys

from tests.support.scheduler_sim import make_scheduler, make_seq, run_to_end, step


def test_batch_size_caps_the_running_set():
    sched = make_scheduler(batch=2)
    for i in range(3):
        sched.add(make_seq(f"r{i}", 5))
    assert list(step(sched).fed) == ["r0", "r1"]
    assert [s.request_id for s in sched.waiting] == ["r2"]
    sched.finish(sched.running[0])
    assert list(step(sched).fed) == ["r1", "r2"]


def test_admission_is_first_come_first_served_and_stops_at_a_misfit():
    sched = make_scheduler(blocks=10)  # 40 tokens
    sched.add(make_seq("big", 30, max_new=2))
    sched.add(make_seq("next", 20, max_new=2))
    sched.add(make_seq("small", 2, max_new=2))
    # "next" does not fit; "small" would, but does not jump the queue.
    assert list(step(sched).fed) == ["big"]
    assert list(step(sched).fed) == ["big"]  # big's last token; it finishes
    assert list(step(sched).fed) == ["next", "small"]
    assert sched.find("big") is None


def test_the_step_budget_counts_decodes_and_chunks_prompts():
    sched = make_scheduler(prefill=10, max_total=100)
    sched.add(make_seq("a", 4, max_new=8))
    assert step(sched).fed == {"a": 4}
    sched.add(make_seq("b", 20))
    logs = [step(sched) for _ in range(3)]
    assert [log.fed for log in logs] == [{"a": 1, "b": 9}, {"a": 1, "b": 9}, {"a": 1, "b": 2}]
    assert [log.sampled for log in logs] == [["a"], ["a"], ["a", "b"]]


def test_a_decode_batch_larger_than_the_budget_still_decodes():
    sched = make_scheduler(prefill=3, batch=8)
    for i in range(3):
        sched.add(make_seq(f"r{i}", 1, max_new=6))
    step(sched)
    sched.add(make_seq("late", 4))
    log = step(sched)
    assert log.fed == {"r0": 1, "r1": 1, "r2": 1}  # nothing left for the newcomer
    run_to_end(sched)


def test_prefix_hits_cost_nothing_from_the_budget():
    shared = list(range(500, 512))  # three blocks of 4
    sched = make_scheduler(prefill=10)
    sched.add(make_seq("first", shared + [1, 2], max_new=1))
    run_to_end(sched)
    sched.add(make_seq("second", shared + [3, 4, 5, 6, 7, 8], max_new=1))
    assert step(sched).fed == {"second": 6}  # 18 tokens, 12 of them cached
    assert sched.counters.prefix_hit_tokens == 12
    assert sched.counters.admitted_tokens == 14 + 18


def test_a_request_asking_for_prompt_logprobs_gets_no_prefix_hits():
    shared = list(range(500, 512))
    sched = make_scheduler()
    sched.add(make_seq("first", shared + [1], max_new=1))
    run_to_end(sched)
    sched.add(make_seq("scored", shared + [2], max_new=1, prompt_logprobs=True))
    assert step(sched).fed == {"scored": 13}
    assert sched.counters.prefix_hit_tokens == 0


def _decoding_batch(sched, count: int, prompt: int = 3) -> None:
    for i in range(count):
        sched.add(make_seq(f"run{i}", prompt, max_new=50))
    assert len(step(sched).fed) == count  # nothing ran before: all join at once


def test_waiting_served_ratio_holds_a_lone_newcomer_until_max_waiting_tokens():
    sched = make_scheduler(batch=16, ratio=0.5, waiting_tokens=5)
    _decoding_batch(sched, 4)  # 4 running: newcomers join 2 at a time (floor(4 * 0.5))
    sched.add(make_seq("lone", 3))
    held = 0
    while "lone" not in step(sched).fed:
        held += 1
    # TGI: the batch that just joined counts as 1, each step adds 1, and at 5 the
    # minimum is dropped: 4 steps without the newcomer.
    assert held == 4


def test_enough_newcomers_join_at_once():
    sched = make_scheduler(batch=16, ratio=0.5, waiting_tokens=5)
    _decoding_batch(sched, 4)
    sched.add(make_seq("x", 3))
    sched.add(make_seq("y", 3))
    assert {"x", "y"} <= set(step(sched).fed)


def test_newcomers_that_cannot_all_fit_count_only_as_those_that_do():
    # Two are waiting, but the free blocks (2, one kept in reserve) only take one:
    # below the minimum of 2, with budget left, so neither joins.
    sched = make_scheduler(blocks=6, batch=16, ratio=0.5, waiting_tokens=3)
    _decoding_batch(sched, 4, prompt=1)
    sched.add(make_seq("x", 3))
    sched.add(make_seq("y", 3))
    assert set(step(sched).fed) == {f"run{i}" for i in range(4)}
    assert [s.request_id for s in sched.waiting] == ["x", "y"]  # put back in order
    assert sched.blocks.num_used_blocks == 4
    step(sched)
    assert "x" in step(sched).fed  # max_waiting_tokens reached


def test_newcomers_that_fill_the_budget_join_below_the_minimum():
    # Two are waiting and only one fits the 3 tokens left after the decodes: it
    # fills the step, so it joins although the minimum is 2.
    sched = make_scheduler(batch=16, prefill=4 + 3, ratio=0.5, waiting_tokens=100)
    _decoding_batch(sched, 4, prompt=1)
    sched.add(make_seq("x", 3))
    sched.add(make_seq("y", 3))
    assert step(sched).fed == {**{f"run{i}": 1 for i in range(4)}, "x": 3}
    assert [s.request_id for s in sched.waiting] == ["y"]


def test_a_budget_smaller_than_the_queue_admits_it_chunk_by_chunk():
    """64 prompts queued behind a full budget do not wait max_waiting_tokens between steps."""
    sched = make_scheduler(blocks=1024, block_size=16, batch=64, prefill=1024, max_total=256,
                           waiting_tokens=20, ratio=0.3)
    for i in range(64):
        sched.add(make_seq(f"r{i}", 128, max_new=128))
    first: dict[str, int] = {}
    steps = 0
    while sched.running or sched.waiting:
        steps += 1
        for rid in step(sched).sampled:
            first.setdefault(rid, steps)
    # 8,192 prompt tokens at ~1,024 a step: every prompt done within 10 steps.
    assert max(first.values()) <= 10
    assert steps <= 128 + 10


def test_ratio_zero_admits_at_every_step():
    sched = make_scheduler(batch=16, ratio=0.0)
    _decoding_batch(sched, 10)
    sched.add(make_seq("lone", 3))
    assert "lone" in step(sched).fed


def test_the_minimum_never_exceeds_a_full_batch():
    sched = make_scheduler(batch=5, ratio=1.0, waiting_tokens=100)
    _decoding_batch(sched, 4)  # minimum would be 4, but only 1 slot is left
    sched.add(make_seq("last", 3))
    assert "last" in step(sched).fed


def test_scheduling_modules_import_no_torch():
    code = ("import sys, switchyard_xeon.block_manager, switchyard_xeon.scheduler; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
