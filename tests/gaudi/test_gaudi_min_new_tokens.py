"""``StoppingParams.min_new_tokens`` and ``TokenEvent.cached_tokens`` on the Gaudi engine
(CPU device): greedy tokens and log-probabilities equal transformers'
``generate(min_new_tokens=...)``, several held rows in one padded batch; no prefix cache,
so ``cached_tokens`` stays 0 on a repeated prompt."""

from __future__ import annotations

import pytest
from switchyard_spec import EngineRequest, FinishReason, SamplingParams, StoppingParams

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.greedy import hf_min_new_tokens

EOS_BIAS = 5.0
PROMPT = prompt_of(11, 3)


@pytest.fixture
def engine(make_gaudi, default_model_path):
    return make_gaudi(default_model_path, env={"WARMUP_ENABLED": "false"})


def test_min_new_tokens_greedy_equals_transformers(engine, reference_llama):
    eos = reference_llama.config.eos_token_id
    assert eos in engine.info.eos_token_ids
    cases = (0, 4, 6)
    # The references first: transformers' eager forward must not run while the engine's
    # thread compiles its first graph. With the `kernels` package (transformers needs it),
    # an eager attention layer switches to a process-wide variable while any thread is
    # tracing, and dynamo's guards on that variable then fail (docs/testing.md, the lock).
    want = {n: hf_min_new_tokens(reference_llama, PROMPT, 16, n, eos, EOS_BIAS) for n in cases}
    sink = Collector()
    for min_new in cases:  # submitted together: they share prefill and decode batches
        engine.submit(EngineRequest(
            request_id=f"min{min_new}", prompt_token_ids=tuple(PROMPT),
            sampling=SamplingParams(logit_bias=((eos, EOS_BIAS),)),
            stopping=StoppingParams(max_new_tokens=16, min_new_tokens=min_new,
                                    eos_token_ids=(eos,))), sink)
    for min_new in cases:
        expected, logprobs = want[min_new]
        events = sink.wait(f"min{min_new}")
        assert not any(e.error for e in events), events[-1].error
        assert token_ids(events) == expected and expected[-1] == eos
        assert events[-1].finish_reason is FinishReason.EOS_TOKEN
        assert [e.logprob for e in events] == pytest.approx(logprobs, abs=1e-4)
        if min_new:
            assert len(expected) > min_new and eos not in expected[:min_new]
        else:
            assert len(expected) <= 3  # without the hold the bias ends it early


def test_cached_tokens_is_zero_without_a_prefix_cache(engine):
    sink = Collector()
    prompt = prompt_of(23, 3)
    for rid in ("cold", "again"):
        engine.submit(greedy_request(rid, prompt, 3), sink)
        events = sink.wait(rid)
        assert events[0].prompt_tokens == 23 and events[0].cached_tokens == 0
