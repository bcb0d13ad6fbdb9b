"""The Gaudi engine on the CPU device, warmed up: a mixed workload compiles nothing new,
and every value a client reads matches transformers.

The engine serves the default tiny Llama with prompts up to 48 tokens,
sequences up to 96, 8 rows; prompts padded to 16s, prefill batches to 2s,
decode batches to 4s (9 shapes, all warmed before any test runs).
"""

from __future__ import annotations

import random
import threading
import time

import torch
from switchyard_gaudi.warmup_plan import DECODE, Shape
from switchyard_spec import (
    EngineRequest,
    FinishReason,
    SamplingParams,
    StepReport,
    StoppingParams,
)

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.greedy import generate_greedy

MAX_TOTAL = 96


def _ended_once(events) -> None:
    """Exactly one event ends the sequence, and it is the last."""
    ends = [i for i, e in enumerate(events) if e.finish_reason is not None or e.error is not None]
    assert ends == [len(events) - 1], events


def test_a_mixed_workload_compiles_nothing_after_warmup(warm_engine, reference_llama, caplog):
    """Different prompt lengths, joins and leaves, aborts, sequences run to max_total_tokens."""
    engine = warm_engine
    compiled = engine.compiles
    assert compiled == len(engine.plan.shapes) == 9
    moves: list[tuple[int, int]] = []
    cache = engine._cache
    move = cache.move
    cache.move = lambda src, dst, n: (moves.append((src, dst)), move(src, dst, n))[1]
    shapes: list[Shape] = []
    decode = engine._runner.decode
    engine._runner.decode = lambda seqs, shape: (shapes.append(shape), decode(seqs, shape))[1]
    rng = random.Random(7)
    sink = Collector()
    prompts: dict[str, list[int]] = {}
    wanted: dict[str, int] = {}

    def submit(rid: str, length: int, new: int) -> None:
        prompts[rid], wanted[rid] = prompt_of(length, start=rng.randrange(100)), new
        engine.submit(greedy_request(rid, prompts[rid], new), sink)

    try:
        with caplog.at_level("WARNING", logger="switchyard.gaudi"):
            # A first wave of 8 fills every row; the longer prompts (prefilled last, in the
            # high rows) outlive the short ones, so the batch shrinks from 8 rows to 4 and
            # the survivors move down.
            for i, length in enumerate((3, 5, 9, 14, 30, 36, 41, 48)):
                submit(f"w{i}", length, 4 + 8 * i if i < 7 else MAX_TOTAL)  # w7 runs to 96
            sink.wait_tokens("w0", 2)
            submit("late-abort", 20, 40)  # queued behind a full batch
            engine.abort("late-abort")
            for i in range(8):
                submit(f"j{i}", rng.randint(1, 48), rng.randint(1, 30))
                if i == 3:
                    sink.wait_tokens("j3", 1)
                    engine.abort("j2")  # running (or already done): either way it ends once
                # Random gaps between arrivals are the schedule this test exercises.
                time.sleep(rng.random() * 0.05)
            engine.abort("no-such-request")
            for rid in prompts:
                _ended_once(sink.wait(rid, timeout=120))
    finally:
        cache.move = move
        engine._runner.decode = decode
    assert engine.compiles == compiled, "a shape compiled after warmup"
    assert "not warmed up" not in caplog.text and "not in the warmup plan" not in caplog.text
    assert moves, "the batch never shrank below a bucket"
    assert {s.batch for s in shapes} == {4, 8} and {s.phase for s in shapes} == {DECODE}
    for rid, prompt in prompts.items():
        events = sink.events(rid)
        if events[-1].finish_reason is FinishReason.ABORTED:
            assert rid in ("late-abort", "j2")
            continue
        ids = token_ids(events)
        assert events[-1].finish_reason is FinishReason.LENGTH
        assert len(ids) == min(wanted[rid], MAX_TOTAL - len(prompt)), rid
        assert ids == generate_greedy(reference_llama, prompt, len(ids)), rid
    assert sink.events("late-abort")[-1].finish_reason is FinishReason.ABORTED
    assert len(prompts["w7"]) + len(token_ids(sink.events("w7"))) == MAX_TOTAL
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (0, 0)
    assert stats.max_batch_total_tokens == 8 * MAX_TOTAL
    # The static cache in blocks: one row of MAX_TOTAL per batch slot, none held when idle.
    assert (stats.kv_block_size, stats.kv_blocks_total, stats.kv_blocks_used) == (MAX_TOTAL, 8, 0)


def test_logprobs_and_top_tokens_are_transformers(warm_engine, reference_llama):
    prompt = prompt_of(11, start=3)
    sink = Collector()
    warm_engine.submit(EngineRequest(
        request_id="lp", prompt_token_ids=tuple(prompt), prompt_logprobs=True,
        sampling=SamplingParams(top_n_tokens=3),
        stopping=StoppingParams(max_new_tokens=5, ignore_eos=True)), sink)
    events = sink.wait("lp")
    ids = token_ids(events)
    with torch.inference_mode():
        logits = reference_llama(torch.tensor([prompt + ids])).logits[0].float()
    scores = torch.log_softmax(logits, dim=-1)
    for step, event in enumerate(events):
        row = scores[len(prompt) - 1 + step]
        assert event.token_id == int(row.argmax())
        assert abs(event.logprob - float(row[event.token_id])) < 1e-4
        values, top = row.topk(3)
        assert [t.id for t in event.top_tokens] == top.tolist()
        torch.testing.assert_close(torch.tensor([t.logprob for t in event.top_tokens]), values,
                                   atol=1e-4, rtol=0)
    # The prompt: token i + 1 scored by position i, with its 3 best alternatives.
    first = events[0]
    expected = scores[: len(prompt) - 1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(first.prompt_logprobs), expected, atol=1e-4, rtol=0)
    assert len(first.prompt_top_tokens) == len(prompt) - 1
    for position, alternatives in enumerate(first.prompt_top_tokens):
        assert [t.id for t in alternatives] == scores[position].topk(3).indices.tolist()
    assert all(e.prompt_logprobs == () for e in events[1:])


def test_seeded_sampling_does_not_depend_on_batch_mates(warm_engine):
    def sampled(rid: str, company: int) -> list[int]:
        sink = Collector()
        for i in range(company):
            warm_engine.submit(greedy_request(f"{rid}-mate{i}", prompt_of(7 + 5 * i), 12), sink)
        warm_engine.submit(EngineRequest(
            request_id=rid, prompt_token_ids=tuple(prompt_of(9)),
            sampling=SamplingParams(do_sample=True, temperature=0.9, top_k=40, top_p=0.95,
                                    seed=1234),
            stopping=StoppingParams(max_new_tokens=12, ignore_eos=True)), sink)
        events = sink.wait(rid)
        assert {e.seed for e in events} == {1234}
        return token_ids(events)

    alone = sampled("alone", 0)
    assert sampled("crowded", 5) == alone
    other = EngineRequest(
        request_id="other-seed", prompt_token_ids=tuple(prompt_of(9)),
        sampling=SamplingParams(do_sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=99),
        stopping=StoppingParams(max_new_tokens=12, ignore_eos=True))
    sink = Collector()
    warm_engine.submit(other, sink)
    assert token_ids(sink.wait("other-seed")) != alone


def test_eos_ends_a_sequence_unless_ignored(warm_engine):
    eos = warm_engine.info.eos_token_ids[0]
    forced = SamplingParams(logit_bias=((eos, 100.0),))
    sink = Collector()
    for rid, ignore in (("stops", False), ("goes-on", True)):
        warm_engine.submit(EngineRequest(
            request_id=rid, prompt_token_ids=tuple(prompt_of(5)), sampling=forced,
            stopping=StoppingParams(max_new_tokens=4, eos_token_ids=(eos,), ignore_eos=ignore)),
            sink)
    stops, goes_on = sink.wait("stops"), sink.wait("goes-on")
    assert [e.token_id for e in stops] == [eos]
    assert stops[-1].finish_reason is FinishReason.EOS_TOKEN
    assert token_ids(goes_on) == [eos] * 4 and goes_on[-1].finish_reason is FinishReason.LENGTH


def test_requests_it_cannot_serve_fail_alone(warm_engine, reference_llama):
    sink = Collector()
    bad = {"oov": (10**6,), "too-long": tuple(prompt_of(49)), "empty": ()}
    for rid, prompt in bad.items():
        warm_engine.submit(EngineRequest(request_id=rid, prompt_token_ids=prompt,
                                         sampling=SamplingParams(),
                                         stopping=StoppingParams(max_new_tokens=3)), sink)
    warm_engine.submit(greedy_request("fine", prompt_of(6), 3), sink)
    assert "outside the vocabulary" in sink.wait("oov")[0].error
    assert "longer than max_input_tokens 48" in sink.wait("too-long")[0].error
    assert "empty" in sink.wait("empty")[0].error
    assert token_ids(sink.wait("fine")) == generate_greedy(reference_llama, prompt_of(6), 3)


def test_every_step_is_reported_with_its_real_sizes(warm_engine):
    reports: list[StepReport] = []
    warm_engine.set_step_observer(reports.append)
    try:
        sink = Collector()
        warm_engine.submit(greedy_request("a", prompt_of(10), 3), sink)
        warm_engine.submit(greedy_request("b", prompt_of(4), 3), sink)
        sink.wait("a"), sink.wait("b")
    finally:
        warm_engine.set_step_observer(None)
    prefills = [r for r in reports if r.method == "prefill"]
    decodes = [r for r in reports if r.method == "decode"]
    assert sum(r.prefill_tokens for r in prefills) == 14
    assert sum(r.batch_size for r in prefills) == 2
    assert sum(r.decode_tokens for r in decodes) == 4  # two more tokens each
    assert all(r.ok and r.kv_tokens_total == 8 * MAX_TOTAL for r in reports)
    first = sink.events("a")[0]
    assert first.queue_seconds is not None and 0 <= first.queue_seconds < 30


def test_shutdown_ends_everything_once(make_gaudi, default_model_path):
    engine = make_gaudi(default_model_path, env={"WARMUP_ENABLED": "false"})
    sink = Collector()
    started = threading.Event()
    decode = engine._runner.decode

    def slow(seqs, shape):
        started.set()
        time.sleep(0.2)  # slow decode steps, so the shutdown lands mid-generation: the scenario
        return decode(seqs, shape)

    engine._runner.decode = slow
    for i in range(3):
        engine.submit(greedy_request(f"s{i}", prompt_of(5 + i), 50), sink)
    assert started.wait(60)
    engine.shutdown()
    for i in range(3):
        events = sink.events(f"s{i}")
        _ended_once(events)
        assert events[-1].finish_reason is FinishReason.ABORTED
    late = Collector()
    engine.submit(greedy_request("late", prompt_of(5), 2), late)
    assert late.wait("late")[0].error == "engine is shut down"
