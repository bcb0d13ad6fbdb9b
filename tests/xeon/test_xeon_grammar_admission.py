"""A constrained request waits for its grammar to compile; the batch keeps decoding meanwhile."""

from __future__ import annotations

import re

from switchyard_spec import (
    Constraint,
    ConstraintKind,
    EngineRequest,
    SamplingParams,
    StoppingParams,
)

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids

PATTERN = r"[a-c]{3}"


def test_a_compiling_grammar_does_not_stall_the_batch(make_engine, gated_compiles,
                                                      default_model_path):
    from transformers import AutoTokenizer

    engine = make_engine()
    eos = engine.info.eos_token_ids
    sink = Collector()
    engine.submit(greedy_request("free", prompt_of(8), 24), sink)
    sink.wait_tokens("free", 2)
    engine.submit(EngineRequest(
        request_id="constrained", prompt_token_ids=tuple(prompt_of(5)),
        sampling=SamplingParams(), logprobs=False,
        stopping=StoppingParams(max_new_tokens=8, eos_token_ids=eos),
        constraint=Constraint(kind=ConstraintKind.REGEX, spec=PATTERN)), sink)
    # The free request runs to its end while the constrained one's compile is held.
    assert len(token_ids(sink.wait("free"))) == 24
    assert not sink.events("constrained")
    assert engine.stats().running == 0  # held outside the scheduler, not a running row
    gated_compiles.set()
    events = sink.wait("constrained")
    assert events[-1].error is None, events[-1].error
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    text = tokenizer.decode([t for t in token_ids(events) if t not in eos])
    assert re.fullmatch(PATTERN, text), text


def test_a_request_aborted_while_its_grammar_compiles_ends_once(make_engine, gated_compiles):
    engine = make_engine()
    sink = Collector()
    engine.submit(EngineRequest(
        request_id="held", prompt_token_ids=tuple(prompt_of(5)), sampling=SamplingParams(),
        logprobs=False, stopping=StoppingParams(max_new_tokens=4),
        constraint=Constraint(kind=ConstraintKind.REGEX, spec=PATTERN)), sink)
    engine.abort("held")
    events = sink.wait("held")
    assert [e.finish_reason.value for e in events] == ["aborted"]


def test_warmup_wraps_the_tokenizer_before_any_constrained_request(make_engine):
    engine = make_engine()
    assert engine._runner.grammar is None  # nothing constrained has arrived
    engine.warmup()
    grammar = engine._runner.grammar
    assert grammar is not None and grammar.compiles == 0
    # The wrap runs in the grammar worker: a constrained request finds it done.
    assert grammar.prepare().result(timeout=60) is not None
    assert grammar._compiler is not None and grammar.compiles == 0
