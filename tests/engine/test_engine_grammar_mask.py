"""Masking logits with grammar bitmasks (switchyard_engine.grammar.mask_logits and
GrammarSupport.apply) against a reference built independently: xgrammar's own
bitmask, read bit by bit and applied by a plain PyTorch loop
(``tests/support/grammar_mask.py``).

Tiny tokenizer: the default model's byte-level BPE (2,048 tokens).
"""

from __future__ import annotations

import json

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from switchyard_engine import grammar
from switchyard_engine.grammar import GrammarSupport, compile_grammar, mask_logits
from switchyard_engine.sampling import RowSampler
from switchyard_spec import (
    Constraint,
    ConstraintKind,
    EngineRequest,
    SamplingParams,
    StoppingParams,
)

from tests.support.grammar_mask import random_words, reference_mask


@pytest.mark.parametrize("sparse_words", [0, 4, 64, 10**6])
@pytest.mark.parametrize("min_rows", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [31, 100, 2048 + 61])
def test_mask_logits_equals_the_bit_by_bit_reference(vocab, dtype, sparse_words, min_rows,
                                                     monkeypatch):
    """Both paths (sparse and additive) and any mix of them mask exactly as the reference,
    over random bitmasks whose last word has spare bits set past the logits' width,
    with unconstrained rows in the same batch left untouched."""
    monkeypatch.setattr(grammar, "SPARSE_WORDS", sparse_words)
    monkeypatch.setattr(grammar, "SPARSE_MIN_ROWS", min_rows)
    gen = torch.Generator().manual_seed(vocab + sparse_words)
    batch = 12
    index = [0, 2, 3, 5, 6, 7, 9, 11]  # rows 1, 4, 8, 10 are free text
    words = random_words(gen, len(index), vocab)
    if vocab == 100:  # a bitmask wider than the logits by whole words: their bits ignored
        words = torch.cat([words, torch.full((len(index), 2), -1, dtype=torch.int32)], dim=1)
    words[2] = 0  # allows nothing: reported, left alone
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    logits[5, 3] = float("-inf")  # already -inf stays -inf, allowed or not
    expected = reference_mask(logits, words, index)
    dead = mask_logits(logits, words, torch.tensor(index))
    assert dead == [2]
    assert torch.equal(logits, expected)
    for free in (1, 4, 8, 10):
        assert torch.isfinite(logits[free]).all()


def test_mask_logits_on_a_non_contiguous_row_view():
    """The rows the sampler keeps may be a view of a wider batch; only its rows change."""
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(6, 80, generator=gen)
    view = full[::2]
    words = random_words(gen, 2, 80)
    expected = reference_mask(view, words, [0, 2])
    mask_logits(view, words, torch.tensor([0, 2]))
    assert torch.equal(view, expected)


SCHEMA = {"type": "object", "properties": {"s": {"type": "string"},
                                           "n": {"type": "integer"}},
          "required": ["s", "n"], "additionalProperties": False}


@pytest.mark.parametrize("pad", [0, 45])
def test_apply_masks_a_mixed_batch_as_xgrammar(default_model_path, pad):
    """A batch mixing free rows and constrained rows in different grammar states (inside
    a string: most tokens allowed; at a key or a number: few), on a padded vocabulary:
    every row equals xgrammar's own mask applied bit by bit."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(default_model_path))
    vocab = len(tokenizer) + pad
    constraint = Constraint(kind=ConstraintKind.JSON_SCHEMA,
                            spec=json.dumps(SCHEMA, sort_keys=True, separators=(",", ":")))
    support = GrammarSupport(tokenizer, vocab)
    request = EngineRequest(request_id="r", prompt_token_ids=(1,), sampling=SamplingParams(),
                            stopping=StoppingParams(max_new_tokens=64, eos_token_ids=(2,)),
                            constraint=constraint)
    prefixes = ['{"n":', '{"n":12,"s":"ab', "", '{"n":7,"s":"x y', '{"n":3']
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = compile_grammar(xgr.GrammarCompiler(info), constraint)
    rows: list[RowSampler] = []
    index: list[int] = []
    reference_words = []
    for k, prefix in enumerate(prefixes):
        rows.append(RowSampler(SamplingParams(), (1,), vocab))  # a free row before each
        row = RowSampler(SamplingParams(), (1,), vocab)
        row.grammar = support.start(request)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[2])
        for token in tokenizer.encode(prefix, add_special_tokens=False):
            row.record(token)
            assert matcher.accept_token(token)
        words = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(words)
        reference_words.append(words[0])
        index.append(len(rows))
        rows.append(row)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(pad))
    expected = reference_mask(logits, torch.stack(reference_words), index)
    assert support.apply(logits, rows) == [None] * len(rows)
    assert torch.equal(logits, expected)
    allowed = torch.isfinite(logits[index]).sum(dim=1).tolist()
    assert max(allowed) > vocab // 2 and min(allowed) < 20  # both kinds of state were hit
    assert not torch.isfinite(logits[index, len(tokenizer):]).any()  # padding never allowed
