"""Prompt-lookup drafts: the tokens that followed the last occurrence of the sequence's tail.

A sequence's tokens (prompt, then output) are indexed by their n-grams as
they grow; the draft for the next step is what followed the most recent
earlier occurrence of the sequence's last `n` tokens, for the longest `n`
from `max_n` down to `min_n` that occurred before. Editing, summarizing and
code completion over a given text repeat long runs of it, which is where
these drafts are accepted. No second model is involved.

The index costs one dict update per n per token and one lookup per n per
draft, so drafting stays negligible next to a forward pass whatever the
sequence's length.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One sequence's n-gram index and its drafts.

    Call `draft(tokens, k)` with the sequence's whole token list each step;
    the index catches up on the tokens added since the last call (the list
    must only grow: a preempted sequence keeps its tokens).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n} "
                             f"and {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._last: dict[tuple[int, ...], int] = {}
        """n-gram -> where its most recent indexed occurrence ends (its continuation starts)."""
        self._indexed = 0
        """Occurrence ends indexed so far: every end e < _indexed."""

    def _catch_up(self, tokens: Sequence[int], upto: int) -> None:
        """Index every occurrence ending before `upto` (none of them is the tail itself)."""
        for end in range(max(self._indexed, self.min_n), upto):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._last[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, upto)

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the last earlier occurrence of the tail, longest
        n-gram first; empty when the tail occurred nowhere before."""
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        self._catch_up(tokens, length)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._last.get(tuple(tokens[length - n:]))
            if start is not None and start < length:
                return list(tokens[start:min(start + k, length)])
        return []
