"""Log-probabilities of given tokens under raw logits (prompt log-probs, TGI's prefill details).

The value for row ``i`` is ``log_softmax(logits[i])[targets[i]]`` over the full
vocabulary, with no sampling parameter applied: it scores the text as the model
sees it. It is computed as ``logit - logsumexp(logits)`` in float32, a row chunk
at a time, so a long prompt never needs a second [tokens, vocab] float32 tensor
beside the logits themselves.

:func:`prompt_scores` also returns each row's most likely tokens (OpenAI's
`top_logprobs` for echoed prompts). They are computed the same way, from the
same ``logsumexp``, so a target that is among them has bit for bit the same
value in both places: clients such as lm-evaluation-harness decide "greedy" by
comparing the two with ``==``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

CHUNK_ROWS = 256
"""Rows converted to float32 at once; bounds the scratch memory per call."""


class PromptScores(NamedTuple):
    """What :func:`prompt_scores` computes: one entry per target."""

    logprobs: torch.Tensor
    """[n] float32: log-probability of each target."""
    top_ids: torch.Tensor
    """[n, top_n] int64: the most likely tokens of each row, most likely first."""
    top_logprobs: torch.Tensor
    """[n, top_n] float32: their log-probabilities."""


def prompt_scores(
    logits: torch.Tensor,
    targets: torch.Tensor,
    rows: torch.Tensor | None = None,
    top_n: int = 0,
    chunk_rows: int = CHUNK_ROWS,
) -> PromptScores:
    """Float32 log-probability of ``targets[j]`` under ``logits[rows[j]]``, and that row's best.

    ``logits`` is [n, vocab]; ``rows`` (int64, default: every row in order)
    picks the rows to score without copying them all out first. Each row's
    ``top_n`` most likely tokens come too; ``top_n`` is clamped to the
    vocabulary, and 0 gives empty [n, 0] top tensors.
    """
    if rows is None:
        rows = torch.arange(logits.shape[0], device=logits.device)
    if logits.dim() != 2 or targets.dim() != 1 or rows.shape != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)}, rows {tuple(rows.shape)} and targets "
            f"{tuple(targets.shape)} do not match"
        )
    count = targets.shape[0]
    top_n = max(0, min(top_n, logits.shape[1]))
    device = logits.device
    out = torch.empty(count, dtype=torch.float32, device=device)
    top_ids = torch.empty(count, top_n, dtype=torch.long, device=device)
    top_lp = torch.empty(count, top_n, dtype=torch.float32, device=device)
    for start in range(0, count, chunk_rows):
        end = start + chunk_rows
        part = logits[rows[start:end]].float()
        lse = torch.logsumexp(part, dim=-1, keepdim=True)
        picked = part.gather(1, targets[start:end, None])
        # One subtraction per value, the same for the target and the alternatives.
        out[start:end] = (picked - lse).squeeze(1)
        if top_n:
            values, ids = part.topk(top_n, dim=-1)
            top_ids[start:end] = ids
            top_lp[start:end] = values - lse
    return PromptScores(out, top_ids, top_lp)


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    rows: torch.Tensor | None = None,
    chunk_rows: int = CHUNK_ROWS,
) -> torch.Tensor:
    """Float32 log-probability of ``targets[j]`` under ``logits[rows[j]]``.

    ``logits`` is [n, vocab]; ``rows`` (int64, default: every row in order)
    picks the rows to score without copying them all out first. Returns a
    float32 tensor shaped like ``targets``.
    """
    return prompt_scores(logits, targets, rows, 0, chunk_rows).logprobs
