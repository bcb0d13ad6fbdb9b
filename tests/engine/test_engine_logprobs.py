"""switchyard_engine.logprobs: scoring given tokens under raw logits."""

from __future__ import annotations

import torch

from switchyard_engine.logprobs import token_logprobs


def test_matches_log_softmax_in_chunks_and_dtypes():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 300, generator=gen) * 4
    targets = torch.randint(0, 300, (37,), generator=gen)
    expected = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(token_logprobs(logits, targets, chunk_rows=8), expected)
    half = token_logprobs(logits.bfloat16(), targets)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, expected, atol=0.1, rtol=0)


def test_selected_rows():
    logits = torch.randn(6, 20)
    rows = torch.tensor([4, 0, 4])
    targets = torch.tensor([1, 2, 3])
    expected = torch.log_softmax(logits, -1)[rows, targets]
    torch.testing.assert_close(token_logprobs(logits, targets, rows=rows), expected)
    assert token_logprobs(logits, targets[:0], rows=rows[:0]).shape == (0,)
