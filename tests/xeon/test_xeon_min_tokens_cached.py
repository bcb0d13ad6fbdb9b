"""``StoppingParams.min_new_tokens`` and ``TokenEvent.cached_tokens`` through the real engine.

min_new_tokens is checked against ``transformers``' ``generate(min_new_tokens=...)``
on the same model, with a bias on EOS (``SequenceBiasLogitsProcessor`` there,
``logit_bias`` here) so that EOS would end the text early without it.
cached_tokens is checked against the prefix cache's rule, restated here: whole
blocks of ``block_size`` tokens, leading blocks equal to ones computed before,
never the prompt's last token.
"""

from __future__ import annotations

import math
import re

import pytest
from switchyard_spec import (
    Constraint,
    ConstraintKind,
    EngineRequest,
    FinishReason,
    SamplingParams,
    StoppingParams,
    TokenEvent,
)

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.greedy import hf_min_new_tokens

EOS_BIAS = 5.0
"""Enough for greedy decoding of ``PROMPT`` to choose EOS within a few tokens, not at once
for every step (checked in the tests, not assumed)."""
PROMPT = prompt_of(11, 3)


def _run(engine, request: EngineRequest) -> list[TokenEvent]:
    sink = Collector()
    engine.submit(request, sink)
    events = sink.wait(request.request_id)
    assert not any(e.error for e in events), events[-1].error
    return events


def _request(rid: str, prompt: list[int], eos: int, max_new: int, min_new: int,
             bias: float = EOS_BIAS, constraint: Constraint | None = None,
             **sampling: object) -> EngineRequest:
    return EngineRequest(
        request_id=rid, prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(logit_bias=((eos, bias),), **sampling),  # type: ignore[arg-type]
        stopping=StoppingParams(max_new_tokens=max_new, min_new_tokens=min_new,
                                eos_token_ids=(eos,)),
        constraint=constraint)


@pytest.fixture(scope="module")
def eos(shared_engine, reference_model) -> int:
    eos = reference_model.config.eos_token_id
    assert eos in shared_engine.info.eos_token_ids
    return eos


# ------------------------------------------------------------------ min_new_tokens
def test_without_min_new_tokens_the_biased_eos_ends_the_text_early(shared_engine,
                                                                   reference_model, eos):
    expected, _ = hf_min_new_tokens(reference_model, PROMPT, 16, 0, eos, EOS_BIAS)
    assert expected[-1] == eos and len(expected) <= 3  # the precondition of the tests below
    events = _run(shared_engine, _request("early", PROMPT, eos, 16, 0))
    assert token_ids(events) == expected
    assert events[-1].finish_reason is FinishReason.EOS_TOKEN


@pytest.mark.parametrize("min_new", [4, 6])
def test_min_new_tokens_greedy_equals_transformers(shared_engine, reference_model, eos,
                                                   min_new):
    expected, hf_logprobs = hf_min_new_tokens(reference_model, PROMPT, 16, min_new, eos,
                                              EOS_BIAS)
    assert expected[-1] == eos and len(expected) > min_new  # EOS came, and only after the hold
    events = _run(shared_engine, _request(f"min{min_new}", PROMPT, eos, 16, min_new,
                                          top_n_tokens=3))
    ids = token_ids(events)
    assert ids == expected
    assert eos not in ids[:min_new]
    assert events[-1].finish_reason is FinishReason.EOS_TOKEN
    # The reported log-probabilities are those of the distribution the token was chosen
    # from: the bias and the EOS mask applied, as transformers' processed scores.
    assert [e.logprob for e in events] == pytest.approx(hf_logprobs, abs=1e-4)
    for event in events[:min_new]:
        assert eos not in [t.id for t in event.top_tokens]  # held at -inf
        assert math.isfinite(event.logprob)


def test_min_new_tokens_holds_eos_for_sampled_rows_and_max_new_tokens_still_ends(
        shared_engine, eos):
    # A bias of 100 makes EOS all but certain the moment it is allowed.
    events = _run(shared_engine, _request("sampled", PROMPT, eos, 20, 5, bias=100.0,
                                          do_sample=True, seed=11, temperature=0.9))
    ids = token_ids(events)
    assert len(ids) == 6 and eos not in ids[:5] and ids[5] == eos
    assert events[-1].finish_reason is FinishReason.EOS_TOKEN
    assert all(math.isfinite(e.logprob) for e in events)
    # max_new_tokens below min_new_tokens: the length limit ends it, never on EOS.
    events = _run(shared_engine, _request("short", PROMPT, eos, 4, 10, bias=100.0))
    assert len(token_ids(events)) == 4 and eos not in token_ids(events)
    assert events[-1].finish_reason is FinishReason.LENGTH


def test_a_grammar_that_allows_only_eos_wins_over_min_new_tokens(shared_engine, eos,
                                                                 default_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    pattern = "[a-c]{3}"
    events = _run(shared_engine, _request(
        "done", PROMPT, eos, 12, 10, bias=0.0,
        constraint=Constraint(kind=ConstraintKind.REGEX, spec=pattern)))
    ids = token_ids(events)
    # The text is complete before min_new_tokens: the grammar's EOS ends it, no NaN, no error.
    assert ids[-1] == eos and len(ids) < 10
    assert events[-1].finish_reason is FinishReason.EOS_TOKEN
    assert re.fullmatch(pattern, tokenizer.decode(ids[:-1]))
    assert all(math.isfinite(e.logprob) for e in events)
    # Where the grammar allows EOS among other tokens, EOS is held: the text goes on.
    open_pattern = "[a-c]{1,40}"
    constraint = Constraint(kind=ConstraintKind.REGEX, spec=open_pattern)
    early = token_ids(_run(shared_engine, _request("open0", PROMPT, eos, 12, 0, bias=100.0,
                                                   constraint=constraint)))
    assert len(early) == 2 and early[-1] == eos
    held = token_ids(_run(shared_engine, _request("open4", PROMPT, eos, 12, 4, bias=100.0,
                                                  constraint=constraint)))
    assert len(held) == 5 and held[-1] == eos and eos not in held[:4]
    assert re.fullmatch(open_pattern, tokenizer.decode(held[:-1]))


# -------------------------------------------------------------------- cached_tokens
def _reusable(prompt: list[int], computed: list[list[int]], block_size: int) -> int:
    """Tokens of ``prompt`` a prefix cache may reuse: its leading full blocks equal to those
    of a token run computed before, never the block holding its last token."""
    blocks = 0
    for i in range((len(prompt) - 1) // block_size):
        block = prompt[i * block_size:(i + 1) * block_size]
        if not any(run[i * block_size:(i + 1) * block_size] == block for run in computed):
            break
        blocks += 1
    return blocks * block_size


def _first_cached(engine, rid: str, prompt: list[int], new: int = 6) -> tuple[int, list[int]]:
    events = _run(engine, greedy_request(rid, prompt, new))
    assert all(e.prompt_tokens == len(prompt) for e in events[:1])
    return events[0].cached_tokens, token_ids(events)


def test_cached_tokens_count_the_reused_prefix_blocks(make_engine):
    bs = 4
    engine = make_engine({"block_size": str(bs)})
    long = prompt_of(23, 3)
    cold, cold_ids = _first_cached(engine, "cold", long)
    assert cold == 0
    assert engine.stats().kv_block_size == bs
    warm, warm_ids = _first_cached(engine, "warm", long)
    assert warm == _reusable(long, [long], bs) == 20
    assert warm_ids == cold_ids
    # A prompt that shares its first 10 tokens: the two whole blocks inside them.
    shared = long[:10] + prompt_of(13, 777)
    assert shared[10] != long[10]
    hit, _ = _first_cached(engine, "shared", shared)
    assert hit == _reusable(shared, [long], bs) == 8
    # A prompt of whole blocks, seen before: all but its last block (its last token is
    # always computed).
    whole = prompt_of(24, 50)
    assert _first_cached(engine, "whole-cold", whole)[0] == 0
    hit, _ = _first_cached(engine, "whole-warm", whole)
    assert hit == _reusable(whole, [whole], bs) == 20


def test_cached_tokens_is_zero_without_prefix_caching(make_engine):
    engine = make_engine({"block_size": "4", "prefix_caching": "false"})
    long = prompt_of(23, 3)
    cold, cold_ids = _first_cached(engine, "cold", long)
    warm, warm_ids = _first_cached(engine, "warm", long)
    assert (cold, warm) == (0, 0) and warm_ids == cold_ids


def test_cached_tokens_is_zero_for_prompt_logprobs(make_engine):
    engine = make_engine({"block_size": "4"})
    long = prompt_of(23, 3)
    _first_cached(engine, "cold", long)
    events = _run(engine, EngineRequest(
        request_id="scored", prompt_token_ids=tuple(long), sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=2, ignore_eos=True), prompt_logprobs=True))
    assert events[0].cached_tokens == 0 and len(events[0].prompt_logprobs) == 22


@pytest.mark.e2e  # an engine process: the engine spread over processes, not a unit
def test_both_fields_cross_the_engine_process(default_model_path, eos):
    """The engine in a child process (``--engine-process``): the request's min_new_tokens
    reaches it and the events' cached_tokens come back."""
    from switchyard.engine_process import EngineProcess
    from switchyard_spec import EngineConfig

    from tests.support.xeon_options import TEST_OPTIONS

    engine = EngineProcess("xeon", EngineConfig(
        model_path=str(default_model_path), dtype="float32",
        options={**TEST_OPTIONS, "block_size": "4"}), model="tiny", restart=False)
    try:
        engine.start()
        engine.warmup()  # it serves once warm
        prompt = prompt_of(23, 3)
        assert _first_cached(engine, "cold", prompt)[0] == 0
        assert _first_cached(engine, "warm", prompt)[0] == 20
        ids = token_ids(_run(engine, _request("held", PROMPT, eos, 12, 4, bias=100.0)))
        assert len(ids) == 5 and ids[-1] == eos and eos not in ids[:4]
    finally:
        engine.shutdown()
