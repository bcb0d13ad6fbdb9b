"""Paging, chunked prefill, prefix sharing and preemption on the real model: greedy output
stays token for token that of transformers, sampled output that of an undisturbed run."""

from __future__ import annotations


import pytest
import torch

from switchyard_spec import EngineRequest, SamplingParams, StoppingParams

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.waiting import eventually

TINY_BLOCKS = {"block_size": "4"}


class _Steps(list):
    """Per step, {request id: tokens fed}; and the ids of sequences that were preempted."""

    preempted: set[str]


def _idle_stats(engine):
    """The cache stats once the loop has published its state after the last step (the final
    event goes out just before the snapshot is taken)."""
    eventually(lambda: not engine.cache_stats().used_blocks, timeout=30, interval=0.01,
               what="no block in use")
    return engine.cache_stats()


def _record_steps(engine) -> _Steps:
    """Wrap the runner so each step records what it fed."""
    steps = _Steps()
    steps.preempted = set()
    runner = engine._runner
    original = runner.step

    def step(seqs):
        steps.append({s.request_id: s.num_scheduled for s in seqs})
        steps.preempted.update(s.request_id for s in seqs if s.preemptions)
        return original(seqs)

    runner.step = step
    return steps


def test_chunked_prefill_keeps_parity_and_never_stalls_decodes(make_engine, hf_greedy,
                                                               reference_model):
    engine = make_engine(max_batch_prefill_tokens=8, options=TINY_BLOCKS)
    steps = _record_steps(engine)
    sink = Collector()
    decoding, long, scored = prompt_of(5, 3), prompt_of(61, 5), prompt_of(23, 8)
    engine.submit(greedy_request("dec", decoding, 40), sink)
    sink.wait_tokens("dec", 2)
    engine.submit(greedy_request("long", long, 6), sink)
    engine.submit(EngineRequest(request_id="scored", prompt_token_ids=tuple(scored),
                                sampling=SamplingParams(), prompt_logprobs=True,
                                stopping=StoppingParams(max_new_tokens=3, ignore_eos=True)), sink)
    assert token_ids(sink.wait("long")) == hf_greedy(long, 6)
    assert token_ids(sink.wait("dec")) == hf_greedy(decoding, 40)
    events = sink.wait("scored")
    assert token_ids(events) == hf_greedy(scored, 3)

    assert all(sum(fed.values()) <= 8 for fed in steps)
    prefill = [fed for fed in steps if fed.get("long", 0) > 1]
    assert len(prefill) >= 61 // 7  # the prompt went in pieces...
    assert all(fed.get("dec") == 1 for fed in prefill)  # ...and the decode ran beside each

    with torch.inference_mode():
        logits = reference_model(torch.tensor([scored])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(scored[1:])[:, None])
    torch.testing.assert_close(torch.tensor(events[0].prompt_logprobs), expected[:, 0],
                               atol=1e-4, rtol=0)


def test_shared_prefix_is_computed_once(make_engine, hf_greedy):
    engine = make_engine(options=TINY_BLOCKS)
    steps = _record_steps(engine)
    prefix = prompt_of(40, 9)
    first, second = prefix + prompt_of(5, 100), prefix + prompt_of(7, 200)
    sink = Collector()
    engine.submit(greedy_request("first", first, 8), sink)
    assert token_ids(sink.wait("first")) == hf_greedy(first, 8)
    assert engine.cache_stats().prefix_hit_tokens == 0
    engine.submit(greedy_request("second", second, 8), sink)
    assert token_ids(sink.wait("second")) == hf_greedy(second, 8)
    assert engine.cache_stats().prefix_hit_tokens == 40
    assert next(fed["second"] for fed in steps if "second" in fed) == 7  # only the suffix
    engine.submit(greedy_request("again", first, 8), sink)  # all of it cached but a block
    assert token_ids(sink.wait("again")) == hf_greedy(first, 8)
    stats = _idle_stats(engine)
    assert stats.prefix_hit_tokens == 40 + 44 and 0 < stats.prefix_hit_rate < 1
    assert stats.used_blocks == 0 and stats.cached_blocks > 0


def test_preemption_keeps_greedy_parity(make_engine, hf_greedy):
    # 12 blocks of 4: three 38-token sequences cannot all stay.
    engine = make_engine(max_batch_total_tokens=48, max_total_tokens=48, options=TINY_BLOCKS)
    steps = _record_steps(engine)
    prompts = {f"p{i}": prompt_of(8, 17 * i) for i in range(3)}
    sink = Collector()
    for rid, prompt in prompts.items():
        engine.submit(greedy_request(rid, prompt, 30), sink)
    for rid, prompt in prompts.items():
        events = sink.wait(rid)
        assert not any(e.error for e in events)
        assert token_ids(events) == hf_greedy(prompt, 30), rid
    stats = _idle_stats(engine)
    assert stats.preemptions > 0 and {"p1", "p2"} <= steps.preempted
    assert stats.used_blocks == 0 and engine.stats().batch_tokens == 0
    assert engine.stats().max_batch_total_tokens == 48


SAMPLED = {  # the newest is preempted first: the last two are
    "greedy-penalised": SamplingParams(repetition_penalty=1.5, frequency_penalty=0.8),
    "watermarked": SamplingParams(do_sample=True, seed=12, watermark=True),
    "sampled": SamplingParams(do_sample=True, temperature=1.1, top_k=40, seed=11,
                              repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
}


@pytest.mark.parametrize("prefix_caching", ["true", "false"])
def test_a_preempted_sequence_continues_with_the_same_tokens(make_engine, prefix_caching):
    engine = make_engine(max_batch_total_tokens=48, max_total_tokens=48,
                         options={**TINY_BLOCKS, "prefix_caching": prefix_caching})
    steps = _record_steps(engine)
    sink = Collector()

    def request(rid: str, params: SamplingParams, index: int) -> EngineRequest:
        return EngineRequest(request_id=rid, prompt_token_ids=tuple(prompt_of(8, 31 * index)),
                             sampling=params,
                             stopping=StoppingParams(max_new_tokens=30, ignore_eos=True))

    alone = {}
    for index, (name, params) in enumerate(SAMPLED.items()):
        engine.submit(request(f"alone-{name}", params, index), sink)
        alone[name] = token_ids(sink.wait(f"alone-{name}"))
    assert engine.cache_stats().preemptions == 0
    for index, (name, params) in enumerate(SAMPLED.items()):
        engine.submit(request(f"crowded-{name}", params, index), sink)
    for name in SAMPLED:
        assert token_ids(sink.wait(f"crowded-{name}")) == alone[name], name
    assert {"crowded-watermarked", "crowded-sampled"} <= steps.preempted
