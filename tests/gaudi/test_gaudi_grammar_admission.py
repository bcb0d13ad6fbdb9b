"""The Gaudi engine holds a constrained request until its grammar compiles; the batch decodes on."""

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


def test_a_compiling_grammar_does_not_stall_the_static_batch(make_gaudi, default_model_path,
                                                             gated_compiles):
    from transformers import AutoTokenizer

    engine = make_gaudi(default_model_path)
    eos = engine.info.eos_token_ids
    sink = Collector()
    engine.submit(greedy_request("free", prompt_of(8), 20), sink)
    sink.wait_tokens("free", 2)
    engine.submit(EngineRequest(
        request_id="constrained", prompt_token_ids=tuple(prompt_of(5)),
        sampling=SamplingParams(), logprobs=False,
        stopping=StoppingParams(max_new_tokens=8, eos_token_ids=eos),
        constraint=Constraint(kind=ConstraintKind.REGEX, spec=PATTERN)), sink)
    assert len(token_ids(sink.wait("free"))) == 20
    assert not sink.events("constrained")
    engine.abort("nobody")  # an abort of an unknown id leaves the held request alone
    gated_compiles.set()
    events = sink.wait("constrained")
    assert events[-1].error is None, events[-1].error
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    text = tokenizer.decode([t for t in token_ids(events) if t not in eos])
    assert re.fullmatch(PATTERN, text), text
