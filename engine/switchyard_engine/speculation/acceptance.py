"""The two acceptance rules that keep speculative output exactly the target model's.

- Deterministic drafts (n-gram lookups): the target is sampled at every
  drafted position with the request's own rules, and the drafts are kept
  while each sample equals its draft (`accept_matching`). The first sample
  that differs, or the sample after the last draft, ends the step, so every
  emitted token is a sample of the target: greedy output is token for token
  what the target gives alone, sampled output has its distribution.
- Drafts sampled from a draft model with probabilities q: the rule of
  Leviathan et al. (2023) and Chen et al. (2023) (`accept_rejection`). Draft
  d at position j is kept with probability min(1, p_j(d) / q_j(d)); the first
  rejected one is replaced by a sample of the normalized residual
  max(0, p_j - q_j), and when all are kept one more token is sampled from
  p_{k}. Each emitted token then has exactly the target's distribution
  p_j, whatever q is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def accept_matching(drafts: Sequence[int], sample: Callable[[int, list[int]], int]) -> list[int]:
    """The tokens a step emits for deterministic ``drafts``.

    ``sample(j, kept)`` draws the target's token at drafted position ``j``
    (0: after the sequence's last token; j: after the j-th draft) given the
    tokens ``kept`` so far this step, so that penalties, grammar state and
    seeds see exactly the tokens emitted before it. Returns the kept drafts
    and one more sample: between 1 and ``len(drafts) + 1`` tokens.
    """
    kept: list[int] = []
    for j in range(len(drafts) + 1):
        token = sample(j, kept)
        kept.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return kept


def accept_rejection(target: torch.Tensor | Callable[[int, list[int]], torch.Tensor],
                     draft: torch.Tensor, drafts: Sequence[int],
                     generator: torch.Generator | None = None) -> list[int]:
    """The tokens a step emits for ``drafts`` sampled from a draft model.

    ``draft`` holds the draft model's probabilities the drafts were sampled
    from ([k, vocab]). ``target`` holds the target's probabilities at each
    drafted position and one more ([k + 1, vocab]), or is a function
    ``target(j, kept)`` giving row ``j`` once the tokens ``kept`` so far this
    step are known (so that penalties and seeds see what a step without
    drafts would); each row is asked for at most once, in order. Both are
    the distributions after the request's own processing (temperature,
    top-k/p, penalties, masks).
    """
    k = len(drafts)
    if draft.shape[0] != k or (isinstance(target, torch.Tensor) and target.shape[0] != k + 1):
        rows = target.shape[0] if isinstance(target, torch.Tensor) else "any"
        raise ValueError(f"{k} drafts need {k + 1} target rows and {k} draft rows, got "
                         f"{rows} and {draft.shape[0]}")
    row_at = (lambda j, kept: target[j]) if isinstance(target, torch.Tensor) else target
    kept: list[int] = []
    for j, token in enumerate(drafts):
        p_row = row_at(j, kept).double()
        p, q = float(p_row[token]), float(draft[j, token])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if q > 0.0 and u * q < p or q <= 0.0 < p:
            kept.append(token)
            continue
        residual = (p_row - draft[j].double()).clamp_min_(0.0)
        total = float(residual.sum())
        # Rejection needs p(d) < q(d), so the residual has mass unless rounding ate it.
        weights = residual / total if total > 0.0 else p_row
        kept.append(int(torch.multinomial(weights, 1, generator=generator)))
        return kept
    kept.append(int(torch.multinomial(row_at(k, kept).double(), 1, generator=generator)))
    return kept
