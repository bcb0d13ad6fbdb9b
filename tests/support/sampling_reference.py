"""transformers' own logits warpers, the independent reference for switchyard_engine.sampling:
temperature, top-k, top-p, min-p and typical-p applied as ``generate`` applies them to one
row."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from switchyard_spec import SamplingParams


def transformers_typical(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """``scores`` through transformers' ``TypicalLogitsWarper(mass)`` (locally typical
    sampling: the tokens whose surprisal is nearest the entropy, up to ``mass``)."""
    return TypicalLogitsWarper(mass)(None, scores)


def transformers_warp(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``scores`` warped by transformers' warpers for ``p``, in ``generate``'s order."""
    if p.temperature != 1.0:
        scores = TemperatureLogitsWarper(p.temperature)(None, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(None, scores)
    if p.typical_p < 1.0:
        scores = transformers_typical(scores, p.typical_p)
    return scores
