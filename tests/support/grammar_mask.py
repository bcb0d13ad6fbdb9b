"""Grammar bitmasks for the mask tests: random ones of every kind, and the bit-by-bit reference
that applies one to logits (one row and one token at a time, in plain PyTorch)."""

from __future__ import annotations

import torch


def reference_mask(logits: torch.Tensor, words: torch.Tensor, index: list[int]) -> torch.Tensor:
    """A copy of ``logits`` with row ``index[j]``'s token ``t`` set to -inf wherever bit
    ``t % 32`` of ``words[j, t // 32]`` is 0, one row and one token at a time; rows
    that allow nothing are left alone (the caller fails them)."""
    out = logits.clone()
    vocab = logits.shape[-1]
    for j, r in enumerate(index):
        row_words = [w & 0xFFFFFFFF for w in words[j].tolist()]
        if not any(row_words):
            continue
        for t in range(vocab):
            if not (row_words[t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def random_words(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Bitmask rows of every kind: few allowed tokens, few disallowed, random, none, all."""
    width = (vocab + 31) // 32
    words = torch.randint(-2**31, 2**31 - 1, (rows, width), generator=gen,
                          dtype=torch.int64).to(torch.int32)
    for j in range(rows):
        kind = j % 5
        if kind == 0:  # a few allowed tokens (JSON punctuation, keys)
            keep = torch.rand(width, generator=gen) < 0.02
            words[j] = torch.where(keep, words[j], torch.zeros_like(words[j]))
            words[j, 0] |= 1 << (j % 31)  # at least one
        elif kind == 1:  # a few disallowed tokens (the inside of a string)
            full = torch.rand(width, generator=gen) < 0.9
            words[j] = torch.where(full, torch.full_like(words[j], -1), words[j])
        elif kind == 3 and j % 2:
            words[j] = -1
    return words
