"""A batch of requests with different sampling parameters: each row behaves as if alone."""

from __future__ import annotations

import threading

from switchyard_spec import EngineRequest, SamplingParams, StoppingParams

from tests.support.engine_requests import Collector, prompt_of, token_ids

MEMBERS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(),
    "greedy-penalties": SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4,
                                       presence_penalty=0.3),
    "greedy-bias": SamplingParams(logit_bias=((77, 6.0), (78, -100.0))),
    "greedy-watermark": SamplingParams(watermark=True),
    "top-k": SamplingParams(do_sample=True, temperature=0.8, top_k=20, seed=1),
    "top-p": SamplingParams(do_sample=True, top_p=0.8, seed=2),
    "typical": SamplingParams(do_sample=True, typical_p=0.7, seed=3),
    "sampled-penalties": SamplingParams(do_sample=True, temperature=1.2, seed=4,
                                        repetition_penalty=1.2, frequency_penalty=0.5,
                                        presence_penalty=0.5),
    "sampled-bias": SamplingParams(do_sample=True, seed=5, logit_bias=((300, 2.0),)),
    "watermark": SamplingParams(do_sample=True, seed=6, watermark=True, top_n_tokens=2),
    "other-seed": SamplingParams(do_sample=True, seed=7),
}


def _request(rid: str, params: SamplingParams, index: int) -> EngineRequest:
    # Different prompt lengths and budgets, so rows join and leave at different steps.
    return EngineRequest(request_id=rid, prompt_token_ids=tuple(prompt_of(3 + 4 * index, index)),
                         sampling=params,
                         stopping=StoppingParams(max_new_tokens=6 + index % 5, ignore_eos=True))


def test_each_member_of_a_mixed_batch_matches_its_solo_run(make_engine):
    engine = make_engine()
    sink = Collector()
    alone: dict[str, list[int]] = {}
    for index, (name, params) in enumerate(MEMBERS.items()):
        engine.submit(_request(f"alone-{name}", params, index), sink)
        alone[name] = token_ids(sink.wait(f"alone-{name}"))

    # Park the loop inside a step so that every member is admitted at the same boundary.
    runner = engine._runner
    original = runner.step
    entered, gate = threading.Event(), threading.Event()
    sizes: list[int] = []

    def step(seqs):
        if not entered.is_set():
            entered.set()
            gate.wait(30)
        sizes.append(len(seqs))
        return original(seqs)

    runner.step = step
    engine.submit(_request("blocker", SamplingParams(), 0), sink)
    assert entered.wait(10)
    for index, (name, params) in enumerate(MEMBERS.items()):
        engine.submit(_request(f"batch-{name}", params, index), sink)
    gate.set()
    for name in MEMBERS:
        assert token_ids(sink.wait(f"batch-{name}")) == alone[name], name
    assert len(MEMBERS) + 1 in sizes  # they really ran together
