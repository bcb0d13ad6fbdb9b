"""Preemption by recompute without a model: who goes, where it goes, and that it carries on."""

from __future__ import annotations

import random

from tests.support.scheduler_sim import expected_tokens, make_scheduler, make_seq, run_to_end, step


def _step_until_preemption(sched, limit: int = 200) -> None:
    for _ in range(limit):
        before = sched.counters.preemptions
        step(sched)
        if sched.counters.preemptions > before:
            return
    raise AssertionError("no preemption happened")


def test_the_newest_sequence_is_preempted_first():
    sched = make_scheduler(blocks=9, batch=8)  # 36 tokens
    seqs = {rid: make_seq(rid, 4, max_new=30) for rid in ("a", "b", "c")}
    for seq in seqs.values():
        sched.add(seq)
    _step_until_preemption(sched)
    assert [s.request_id for s in sched.running] == ["a", "b"]
    assert [s.request_id for s in sched.waiting] == ["c"]
    c = seqs["c"]
    assert c.preemptions == 1 and c.num_cached == 0 and sched.blocks.table(c.seq_id) == []
    assert c.generated > 0 and c.tokens[: c.prompt_len] == list(c.request.prompt_token_ids)
    _step_until_preemption(sched)
    assert [s.request_id for s in sched.running] == ["a"]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]  # older first
    run_to_end(sched)
    assert seqs["a"].preemptions == 0  # the oldest always makes progress
    for seq in seqs.values():
        assert seq.tokens[seq.prompt_len :] == expected_tokens(seq)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_a_resumed_sequence_recomputes_only_what_was_evicted():
    sched = make_scheduler(blocks=12, batch=8)  # 48 tokens
    a, b = make_seq("a", 8, max_new=30), make_seq("b", 8, max_new=24)
    sched.add(a)
    sched.add(b)
    _step_until_preemption(sched)
    assert sched.waiting[0] is b and b.generated > 0
    length = len(b.tokens)
    while sched.waiting:
        log = step(sched)
    # Resumed with its own full blocks still in the prefix cache.
    assert log.fed["b"] < length and sched.counters.prefix_hit_tokens >= 4
    run_to_end(sched)
    assert b.tokens[b.prompt_len :] == expected_tokens(b)


def test_a_preempted_sequence_is_not_held_back_by_the_waiting_ratio():
    sched = make_scheduler(blocks=12, batch=8, ratio=1.0, waiting_tokens=1000)
    for rid in ("a", "b", "c"):
        sched.add(make_seq(rid, 4, max_new=14))
    _step_until_preemption(sched)
    run_to_end(sched, max_steps=200)  # a gate of 1000 steps would show here


def test_no_one_is_admitted_in_a_step_that_preempted():
    sched = make_scheduler(blocks=8, batch=8)
    for rid in ("a", "b", "c"):
        sched.add(make_seq(rid, 4, max_new=16))
    preempting_steps = 0
    while len(sched):
        before = {s.request_id for s in sched.running}
        count = sched.counters.preemptions
        log = step(sched)
        if sched.counters.preemptions > count:
            preempting_steps += 1
            assert set(log.fed) <= before
    assert preempting_steps > 0


def test_a_sequence_alone_never_preempts_itself_for_prefix_blocks():
    sched = make_scheduler(blocks=5, batch=4)  # 20 tokens
    seq = make_seq("alone", 4, max_new=15)  # 19 tokens: the whole cache
    sched.add(seq)
    run_to_end(sched)
    assert seq.preemptions == 0


def test_random_traffic_on_a_tiny_cache_finishes_everything_correctly():
    rng = random.Random(7)
    sched = make_scheduler(blocks=16, block_size=4, batch=6, prefill=9)
    shared = [rng.randrange(50_000) for _ in range(10)]
    seqs = []
    for i in range(24):
        prompt = (shared[: rng.randrange(11)] if i % 2 else []) + [
            rng.randrange(50_000) for _ in range(rng.randrange(1, 20))]
        seqs.append(make_seq(f"r{i}", prompt, max_new=rng.randrange(1, 40)))
    pending = list(seqs)
    steps = 0
    while pending or len(sched):
        for _ in range(rng.randrange(3)):
            if pending:
                sched.add(pending.pop(0))
        if len(sched):
            step(sched)
        steps += 1
        assert steps < 5000
        blocks = sched.blocks
        assert 0 <= blocks.num_used_blocks <= blocks.num_blocks
        assert all(len(blocks.table(s.seq_id)) * 4 >= s.num_cached for s in sched.running)
    for seq in seqs:
        assert seq.tokens[seq.prompt_len :] == expected_tokens(seq), seq.request_id
    assert sched.counters.preemptions > 0 and sched.counters.prefix_hit_tokens > 0
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_a_sequence_preempted_while_scoring_its_prompt_scores_it_again():
    sched = make_scheduler(prefill=4)
    seq = make_seq("scored", 10, prompt_logprobs=True)
    sched.add(seq)
    step(sched)
    seq.prompt_logprobs.extend([-1.0] * 4)  # what the runner would have scored
    sched.preempt(seq)
    assert seq.prompt_logprobs == [] and seq.wants_prompt_logprobs
    assert step(sched).fed == {"scored": 4}  # from the start, no prefix hit
