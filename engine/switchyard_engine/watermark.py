"""The green-list watermark of Kirchenbauer et al. (2023), with TGI's parameters.

Before each token is chosen, the vocabulary is split by a pseudo-random
permutation seeded from the previous token: the first ``gamma`` share of the
permutation is the "green list", and ``delta`` is added to those logits. Text
sampled this way holds clearly more than ``gamma`` green tokens, which a
detector that knows the scheme can test for without the model.

To stay detectable by tools written for TGI, the green list is drawn exactly as
TGI draws it: a ``torch.Generator`` seeded with ``HASH_KEY * previous_token``
yields ``torch.randperm(vocab_size)`` and the first ``int(vocab_size * gamma)``
entries are green. The permutation always comes from a CPU generator, because
other devices' generators produce different permutations for the same seed;
a watermark must not depend on the hardware that wrote it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

HASH_KEY = 15485863
"""A large prime, so that ``HASH_KEY * token`` gives distinct wide seeds."""
GAMMA_ENV = "WATERMARK_GAMMA"
DELTA_ENV = "WATERMARK_DELTA"
DEFAULT_GAMMA = 0.5
DEFAULT_DELTA = 2.0


@dataclass(frozen=True, slots=True)
class WatermarkConfig:
    """Share of the vocabulary that is green (``gamma``) and the bias added to it (``delta``)."""

    gamma: float = DEFAULT_GAMMA
    delta: float = DEFAULT_DELTA

    @classmethod
    def from_env(cls) -> WatermarkConfig:
        """Read ``WATERMARK_GAMMA`` and ``WATERMARK_DELTA`` (TGI's names and defaults)."""
        return cls(
            gamma=_env_float(GAMMA_ENV, DEFAULT_GAMMA),
            delta=_env_float(DELTA_ENV, DEFAULT_DELTA),
        )


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, not {raw!r}") from None


def greenlist(
    previous_token: int,
    vocab_size: int,
    gamma: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Ids of the green list that follows ``previous_token`` (int64, on the CPU).

    ``generator`` is reused when given (it is reseeded here), which saves
    building one per call on hot paths.
    """
    gen = generator if generator is not None else torch.Generator()
    gen.manual_seed(HASH_KEY * previous_token)
    order = torch.randperm(vocab_size, generator=gen)
    return order[: int(vocab_size * gamma)]


def apply_watermark(
    scores: torch.Tensor,
    previous_tokens: Sequence[int],
    configs: Sequence[WatermarkConfig],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Add each row's ``delta`` to its green list; row ``i`` follows ``previous_tokens[i]``.

    ``scores`` is [rows, vocab]; a new tensor is returned. Filtered (-inf)
    entries stay -inf.
    """
    rows, vocab = scores.shape
    gen = generator if generator is not None else torch.Generator()
    bias = torch.zeros(rows, vocab, dtype=scores.dtype)
    for i, (token, cfg) in enumerate(zip(previous_tokens, configs, strict=True)):
        bias[i, greenlist(token, vocab, cfg.gamma, gen)] = cfg.delta
    return scores + bias.to(scores.device, non_blocking=True)
