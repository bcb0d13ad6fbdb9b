"""The native grammar mask (kernels/token_mask.cpp) against the bit-by-bit reference
(tests/support/grammar_mask.py), and the engine's grammar support using it."""

from __future__ import annotations

import pytest
import torch

from switchyard_xeon.kernels import load_kernels, native_token_mask

from tests.support.grammar_mask import random_words, reference_mask

pytestmark = pytest.mark.skipif(load_kernels().token_mask is None,
                                reason="native kernels not built here")


@pytest.mark.parametrize("vocab", [1, 31, 32, 100, 2048 + 61, 49152])
@pytest.mark.parametrize("spare_words", [0, 2])
def test_native_mask_equals_the_bit_by_bit_reference(vocab, spare_words):
    gen = torch.Generator().manual_seed(vocab + spare_words)
    rows = 10
    logits = torch.randn(rows + 2, vocab, generator=gen)
    words = random_words(gen, rows, vocab)
    if spare_words:  # bitmasks wider than the logits: their bits past the vocabulary are unread
        words = torch.cat([words, torch.full((rows, spare_words), -1, dtype=torch.int32)], 1)
    index = torch.randperm(rows + 2, generator=gen)[:rows]
    # Only rows with an allowed token below the vocabulary are masked; the rest are dead.
    bits = (words.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> torch.arange(32) & 1
    in_vocab = bits.reshape(rows, -1)[:, :vocab]
    want_dead = [j for j in range(rows) if not bool(in_vocab[j].any())]
    want = reference_mask(logits, words, index.tolist())
    for j in want_dead:  # left alone, also when only spare bits past the vocabulary are set
        want[index[j]] = logits[index[j]]
    got = logits.clone()
    dead = native_token_mask(got, words, index)
    assert dead == want_dead
    assert torch.equal(got, want)


def test_native_mask_on_a_row_view_and_other_dtypes_falls_back_exactly():
    gen = torch.Generator().manual_seed(3)
    vocab = 300
    words = random_words(gen, 4, vocab)
    index = torch.tensor([0, 2, 4, 6])
    for logits in (torch.randn(7, vocab, generator=gen).to(torch.bfloat16),
                   torch.randn(vocab, 7, generator=gen).t()):  # a transposed view
        want = reference_mask(logits, words, index.tolist())
        got = logits.clone() if logits.is_contiguous() else logits.t().contiguous().t()
        native_token_mask(got, words, index)
        assert torch.equal(got, want)


def test_bad_arguments_are_refused_clearly():
    op = torch.ops.switchyard_xeon.mask_logits_.default
    logits = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="cover fewer than"):
        op(logits, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="outside"):
        op(logits, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5]))
