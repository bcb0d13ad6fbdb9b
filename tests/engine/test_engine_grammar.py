"""The grammar toolkit (switchyard_engine.grammar) against xgrammar's own matcher.

Tiny tokenizer: the default model's byte-level BPE (2,048 tokens).
"""

from __future__ import annotations

import json

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from switchyard_engine.grammar import (  # noqa: E402
    GrammarSupport,
    compile_grammar,
    token_penalties,
)
from switchyard_engine.lifecycle import finish_reason  # noqa: E402
from switchyard_engine.sampling import RowSampler, sample  # noqa: E402
from switchyard_engine.sequence import BaseSequence  # noqa: E402
from switchyard_spec import (  # noqa: E402
    Constraint,
    ConstraintKind,
    EngineRequest,
    FinishReason,
    SamplingParams,
    StoppingParams,
)

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                  "maximum": 99},
                                           "b": {"type": "boolean"}},
          "required": ["n", "b"], "additionalProperties": False}


def _request(constraint: Constraint, eos: tuple[int, ...] = (2,), do_sample=False,
             seed=None) -> EngineRequest:
    return EngineRequest(request_id="r", prompt_token_ids=(1, 5, 6),
                         sampling=SamplingParams(do_sample=do_sample, seed=seed),
                         stopping=StoppingParams(max_new_tokens=64, eos_token_ids=eos),
                         constraint=constraint)


def _schema() -> Constraint:
    return Constraint(kind=ConstraintKind.JSON_SCHEMA,
                      spec=json.dumps(SCHEMA, sort_keys=True, separators=(",", ":")))


def _reference_allowed(tokenizer, vocab: int, constraint: Constraint, prefix: list[int]):
    """Allowed next tokens per xgrammar's own matcher, built independently."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = compile_grammar(xgr.GrammarCompiler(info), constraint)
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[2])
    for t in prefix:
        assert matcher.accept_token(t)
    mask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(mask)
    logits = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(logits, mask)
    return set(torch.isfinite(logits[0]).nonzero()[:, 0].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [32, 100, 2048 + 61])
def test_token_penalties_mask_as_xgrammar_does(vocab, dtype):
    """Adding the penalties equals xgrammar's own in-place mask, bit for bit, over
    random bitmasks (every bit pattern in every byte position) and ragged widths."""
    gen = torch.Generator().manual_seed(vocab)
    words = torch.randint(-2**31, 2**31 - 1, (5, (vocab + 31) // 32), generator=gen,
                          dtype=torch.int64).to(torch.int32)
    words[1] = -1  # everything allowed
    words[2] = 0  # nothing allowed
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, words, vocab_size=vocab)
    masked = logits + token_penalties(words, vocab, dtype)
    assert torch.equal(masked, expected)
    assert torch.isinf(masked[2]).all() and torch.equal(masked[1], logits[1])


@pytest.mark.parametrize("pad", [0, 61])
def test_mask_matches_xgrammar_along_a_generation(tokenizer, pad):
    vocab = len(tokenizer) + pad  # a padded vocabulary: the logits are wider than the tokens
    support = GrammarSupport(tokenizer, vocab)
    constraint = _schema()
    row = RowSampler(SamplingParams(do_sample=True, seed=7), (1, 5, 6), vocab, seed=7)
    row.grammar = support.start(_request(constraint))
    generated: list[int] = []
    torch.manual_seed(0)
    for _ in range(40):
        logits = torch.randn(1, vocab)
        errors = support.apply(logits, [row])
        assert errors == [None]
        allowed = set(torch.isfinite(logits[0]).nonzero()[:, 0].tolist())
        assert allowed == _reference_allowed(tokenizer, vocab, constraint, generated)
        assert all(t < len(tokenizer) for t in allowed)  # padded columns never allowed
        (tok,) = sample(logits, [row])
        assert tok.token_id in allowed
        row.record(tok.token_id)
        generated.append(tok.token_id)
        if row.grammar.terminated:
            break
    assert row.grammar.terminated and generated[-1] == 2
    value = json.loads(tokenizer.decode(generated[:-1]))
    assert set(value) == {"n", "b"} and 0 <= value["n"] <= 99 and isinstance(value["b"], bool)


def test_cache_hits_on_equal_specs_and_rows_without_grammar_untouched(tokenizer):
    vocab = len(tokenizer)
    support = GrammarSupport(tokenizer, vocab)
    regex = Constraint(kind=ConstraintKind.REGEX, spec="[ab]{2}x")
    first = support.start(_request(regex))
    second = support.start(_request(Constraint(kind=ConstraintKind.REGEX, spec="[ab]{2}x")))
    assert support.compiles == 1 and support.hits == 1
    assert second.future is first.future
    support.start(_request(_schema()))
    assert support.compiles == 2
    free = RowSampler(SamplingParams(), (1,), vocab)
    con = RowSampler(SamplingParams(), (1,), vocab)
    con.grammar = first
    logits = torch.randn(2, vocab)
    before = logits.clone()
    assert support.apply(logits, [free, con]) == [None, None]
    assert torch.equal(logits[0], before[0])
    allowed = torch.isfinite(logits[1]).nonzero()[:, 0].tolist()
    assert allowed and all(tokenizer.decode([t]) and tokenizer.decode([t])[0] in "ab"
                           for t in allowed)


def test_grammar_end_finishes_with_eos_and_failed_compile_is_an_error(tokenizer):
    vocab = len(tokenizer)
    support = GrammarSupport(tokenizer, vocab)
    req = _request(Constraint(kind=ConstraintKind.REGEX, spec="a"))
    row = RowSampler(SamplingParams(), (1,), vocab)
    row.grammar = support.start(req)
    seq = BaseSequence(request=req, sink=lambda e: None, sampler=row, max_length=100,
                       ignore_eos=True)  # even with ignore_eos, the grammar's end ends it
    for _ in range(3):
        logits = torch.randn(1, vocab)
        support.apply(logits, [row])
        (tok,) = sample(logits, [row])
        seq.tokens.append(tok.token_id)
        row.record(tok.token_id)
        reason = finish_reason(seq, tok.token_id)
        if reason is not None:
            break
    assert reason is FinishReason.EOS_TOKEN
    assert tokenizer.decode(seq.tokens[3:-1]) == "a" and seq.tokens[-1] == 2
    bad = RowSampler(SamplingParams(), (1,), vocab)
    bad.grammar = support.start(_request(Constraint(kind=ConstraintKind.REGEX, spec="a(b")))
    logits = torch.randn(1, vocab)
    before = logits.clone()
    (error,) = support.apply(logits, [bad])
    assert error is not None and "compile" in error
    assert torch.equal(logits, before)


def test_json_schema_strings_never_take_raw_control_characters(tokenizer):
    """xgrammar 0.2.8 lets a length-bounded string take raw control characters (a tab, ESC),
    which JSON forbids, and writes untyped arrays with ", "; the compiled schema refuses both."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8},
                                               "x": {"type": "array"}},
              "required": ["s", "x"], "additionalProperties": False}
    constraint = Constraint(kind=ConstraintKind.JSON_SCHEMA,
                            spec=json.dumps(schema, sort_keys=True, separators=(",", ":")))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = compile_grammar(xgr.GrammarCompiler(info), constraint)

    for raw in ("\t", "\x1b", "\n"):
        assert not xgr.GrammarMatcher(compiled).accept_string('{"s":"a' + raw)
    assert xgr.GrammarMatcher(compiled).accept_string('{"s":"a b","x":[1,"2"]}')
    assert not xgr.GrammarMatcher(compiled).accept_string('{"s":"ab","x":[1, ')
