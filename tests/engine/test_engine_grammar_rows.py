"""GrammarRows: both engines' constrained rows, with one failure policy."""

from __future__ import annotations

import logging

from switchyard_engine.grammar import grammar_settled
from switchyard_engine.grammar_rows import UNKNOWN_FOLDER, GrammarRows
from switchyard_engine.sampling import RowSampler
from switchyard_engine.sequence import BaseSequence
from switchyard_spec import (
    Constraint,
    ConstraintKind,
    EngineRequest,
    SamplingParams,
    StoppingParams,
)

SCHEMA = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'


def _seq(vocab: int, constraint: Constraint | None) -> BaseSequence:
    request = EngineRequest(request_id="r", prompt_token_ids=(1, 2), sampling=SamplingParams(),
                            stopping=StoppingParams(max_new_tokens=4), constraint=constraint)
    return BaseSequence(request, lambda event: None, RowSampler(SamplingParams(), (1, 2), vocab),
                        max_length=6, ignore_eos=False)


def test_an_unknown_folder_fails_the_row_and_never_serves_it_unconstrained():
    rows = GrammarRows(lambda: None)
    seq = _seq(64, Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=SCHEMA))
    rows.start(seq)
    assert seq.sampler.grammar is not None and seq.sampler.grammar.error == UNKNOWN_FOLDER
    assert rows.support is None


def test_a_free_text_row_gets_no_grammar_and_builds_nothing():
    asked: list[int] = []
    rows = GrammarRows(lambda: asked.append(1) or None)
    seq = _seq(64, None)
    rows.start(seq)
    assert seq.sampler.grammar is None and not asked


def test_rows_compile_from_the_model_folder_and_warmup_wraps_the_tokenizer(
        default_model_path, tokenizer, caplog):
    vocab = len(tokenizer)
    rows = GrammarRows(lambda: str(default_model_path))
    with caplog.at_level(logging.INFO, logger="test.grammar_rows"):
        rows.prepare(vocab, logging.getLogger("test.grammar_rows"))
    assert "tokenizer wrapped" in caplog.text and rows.support is not None
    seq = _seq(vocab, Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=SCHEMA))
    rows.start(seq)
    state = seq.sampler.grammar
    assert state is not None and state.ready(timeout=60) and state.error is None
    assert grammar_settled(state)
