"""Sampling through the engine: seeds, reproducibility across batch mates, logprobs."""

from __future__ import annotations

import math

import pytest
from switchyard_spec import EngineRequest, SamplingParams, StoppingParams

from .conftest import Collector, greedy_request, prompt_of, token_ids

SAMPLED = SamplingParams(do_sample=True, temperature=1.3, top_k=50, top_p=0.95, seed=4242,
                         repetition_penalty=1.1, top_n_tokens=3)


def _sampled(rid: str, params: SamplingParams = SAMPLED, max_new: int = 20) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=tuple(prompt_of(12, 99)),
                         sampling=params,
                         stopping=StoppingParams(max_new_tokens=max_new, ignore_eos=True))


def test_seeded_sampling_is_reproducible_with_batch_mates(shared_engine):
    sink = Collector()
    shared_engine.submit(_sampled("alone"), sink)
    alone = sink.wait("alone")

    mates = [
        greedy_request("mate-greedy", prompt_of(30, 7), 25),
        _sampled("mate-sampled", SamplingParams(do_sample=True, temperature=0.7, typical_p=0.9,
                                               seed=1, frequency_penalty=0.5), 25),
        _sampled("mate-unseeded", SamplingParams(do_sample=True), 25),
    ]
    for req in mates:
        shared_engine.submit(req, sink)
    sink.wait_tokens("mate-greedy", 3)  # the seeded one joins a busy batch
    shared_engine.submit(_sampled("crowded"), sink)
    crowded = sink.wait("crowded")
    for req in mates:
        sink.wait(req.request_id)

    assert token_ids(alone) == token_ids(crowded)
    # Batch shapes change float rounding a little, never the choice.
    assert [e.logprob for e in alone] == pytest.approx([e.logprob for e in crowded], abs=1e-4)
    assert all(e.seed == 4242 for e in alone + crowded)
    unseeded = sink.events("mate-unseeded")
    assert unseeded[0].seed is not None  # the engine picked one and reports it


def test_seed_changes_the_output(shared_engine):
    sink = Collector()
    shared_engine.submit(_sampled("a"), sink)
    other = SamplingParams(do_sample=True, temperature=1.3, top_k=50, top_p=0.95, seed=7)
    shared_engine.submit(_sampled("b", other), sink)
    assert token_ids(sink.wait("a")) != token_ids(sink.wait("b"))


def test_logprobs_and_top_tokens(shared_engine):
    sink = Collector()
    params = SamplingParams(top_n_tokens=4)
    shared_engine.submit(EngineRequest(request_id="g", prompt_token_ids=tuple(prompt_of(9)),
                                       sampling=params,
                                       stopping=StoppingParams(max_new_tokens=5)), sink)
    for event in sink.wait("g"):
        assert len(event.top_tokens) == 4
        best = event.top_tokens[0]
        # Greedy: the chosen token is the most likely one, with the same logprob.
        assert best.id == event.token_id and math.isclose(best.logprob, event.logprob)
        assert event.logprob <= 0.0
        logps = [t.logprob for t in event.top_tokens]
        assert logps == sorted(logps, reverse=True)
