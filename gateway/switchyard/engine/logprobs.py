"""Log-probabilities of given tokens under raw logits (prompt log-probs, TGI's prefill details).

The value for row ``i`` is ``log_softmax(logits[i])[targets[i]]`` over the full
vocabulary, with no sampling parameter applied: it scores the text as the model
sees it. It is computed as ``logit - logsumexp(logits)`` in float32, a row chunk
at a time, so a long prompt never needs a second [tokens, vocab] float32 tensor
beside the logits themselves.
"""

from __future__ import annotations

import torch

CHUNK_ROWS = 256
"""Rows converted to float32 at once; bounds the scratch memory per call."""


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
    if rows is None:
        rows = torch.arange(logits.shape[0], device=logits.device)
    if logits.dim() != 2 or targets.dim() != 1 or rows.shape != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)}, rows {tuple(rows.shape)} and targets "
            f"{tuple(targets.shape)} do not match"
        )
    out = torch.empty(targets.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, targets.shape[0], chunk_rows):
        part = logits[rows[start : start + chunk_rows]].float()
        picked = part.gather(1, targets[start : start + chunk_rows, None]).squeeze(1)
        out[start : start + chunk_rows] = picked - torch.logsumexp(part, dim=-1)
    return out
