"""Chunked prefill without a model: long prompts in pieces, decodes in every step."""

from __future__ import annotations

from tests.support.scheduler_sim import expected_tokens, make_scheduler, make_seq, run_to_end, step


def test_a_long_prompt_is_chunked_while_decodes_run_every_step():
    sched = make_scheduler(prefill=8, max_total=200)
    for rid in ("d1", "d2"):
        sched.add(make_seq(rid, 2, max_new=40))
    step(sched)
    long = make_seq("long", 30, max_new=3)
    sched.add(long)
    logs = []
    while long.generated == 0:
        logs.append(step(sched))
    assert [log.fed.get("long") for log in logs] == [6, 6, 6, 6, 6]
    for log in logs:
        assert log.fed["d1"] == 1 and log.fed["d2"] == 1  # no decode waited for the prompt
        assert log.total <= 8
    assert [("long" in log.sampled) for log in logs] == [False] * 4 + [True]
    run_to_end(sched)


def test_blocks_are_taken_chunk_by_chunk():
    sched = make_scheduler(prefill=6, blocks=64)
    seq = make_seq("p", 20, max_new=2)
    sched.add(seq)
    tables = []
    while seq.generated == 0:
        step(sched)
        tables.append(len(sched.blocks.table(seq.seq_id)))
    assert tables == [2, 3, 5, 5]  # ceil(6 / 4), ceil(12 / 4), ceil(18 / 4), ceil(20 / 4)


def test_two_prompts_share_the_budget_first_come_first_served():
    sched = make_scheduler(prefill=10)
    sched.add(make_seq("a", 7, max_new=3))
    sched.add(make_seq("b", 7, max_new=3))
    assert step(sched).fed == {"a": 7, "b": 3}
    assert step(sched).fed == {"a": 1, "b": 4}
    assert step(sched).fed == {"a": 1, "b": 1}


def test_chunked_sequences_generate_what_they_would_alone():
    sched = make_scheduler(prefill=5, blocks=200)
    seqs = [make_seq(f"s{i}", 3 + 7 * i, max_new=5 + i) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    logs = run_to_end(sched)
    assert all(log.total <= 5 for log in logs)
    for seq in seqs:
        assert seq.tokens[seq.prompt_len :] == expected_tokens(seq)
    assert sched.blocks.num_used_blocks == 0


def test_a_prompt_fully_cached_but_one_token_feeds_one_token():
    shared = list(range(40, 48))
    sched = make_scheduler(prefill=8)
    sched.add(make_seq("first", shared + [1], max_new=1))
    run_to_end(sched)
    sched.add(make_seq("again", shared + [1], max_new=2))
    log = step(sched)
    assert log.fed == {"again": 1} and log.sampled == ["again"]
