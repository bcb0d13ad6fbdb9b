"""TGI's watermark and a detector for it, stated independently of switchyard's code.

What TGI does (``server/text_generation_server/utils/watermark.py``,
``WatermarkLogitsProcessor``), in our words:

- ``hash_key`` is the prime 15485863; ``gamma`` is read from ``WATERMARK_GAMMA``
  (0.5 when unset) and ``delta`` from ``WATERMARK_DELTA`` (2.0 when unset);
- before each token is chosen, a ``torch.Generator`` on the logits' device is seeded
  with ``hash_key * previous_token``, where the previous token is the last id of the
  sequence so far (the prompt's last for the first generated token);
- ``torch.randperm(vocab_size)`` drawn from that generator, with ``vocab_size`` the
  width of the logits row, and its first ``int(vocab_size * gamma)`` ids are the
  green list;
- ``delta`` is added to the logits of the green list; nothing else changes.

The detector is the one-proportion z-test of Kirchenbauer et al. (2023, "A Watermark
for Large Language Models", section 3): with ``T`` scored tokens of which ``green``
are on the green list of their predecessor, ``z = (green - gamma * T) / sqrt(T *
gamma * (1 - gamma))``; text written without the watermark has ``z`` about
standard normal, and the paper calls text watermarked above ``z = 4``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

TGI_HASH_KEY = 15485863
TGI_GAMMA_ENV, TGI_DEFAULT_GAMMA = "WATERMARK_GAMMA", 0.5
TGI_DELTA_ENV, TGI_DEFAULT_DELTA = "WATERMARK_DELTA", 2.0
Z_THRESHOLD = 4.0
"""Kirchenbauer et al.'s threshold: above it, text is called watermarked."""


class TgiWatermark:
    """TGI's watermark as a transformers logits processor (``input_ids`` [1, seq], scores [1, V])."""

    def __init__(self, gamma: float = TGI_DEFAULT_GAMMA, delta: float = TGI_DEFAULT_DELTA,
                 device: str | torch.device = "cpu") -> None:
        self.gamma = gamma
        self.delta = delta
        self.rng = torch.Generator(device=device)

    @classmethod
    def from_env(cls) -> TgiWatermark:
        """With ``gamma`` and ``delta`` read from the environment as TGI reads them."""
        return cls(gamma=float(os.environ.get(TGI_GAMMA_ENV, TGI_DEFAULT_GAMMA)),
                   delta=float(os.environ.get(TGI_DELTA_ENV, TGI_DEFAULT_DELTA)))

    def green_ids(self, previous_token: int, vocab_size: int,
                  device: str | torch.device = "cpu") -> torch.Tensor:
        self.rng.manual_seed(TGI_HASH_KEY * previous_token)
        permutation = torch.randperm(vocab_size, device=device, generator=self.rng)
        return permutation[: int(vocab_size * self.gamma)]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        assert input_ids.shape[0] == 1 and scores.shape[0] == 1, "TGI's processor is per sequence"
        green = self.green_ids(int(input_ids[0, -1]), scores.shape[-1], scores.device)
        mask = torch.zeros_like(scores, dtype=torch.bool)
        mask[-1, green] = True
        out = scores.clone()
        out[mask] = out[mask] + self.delta
        return out


def z_score(context_last: int, tokens: Sequence[int], vocab_size: int,
            gamma: float = TGI_DEFAULT_GAMMA) -> float:
    """Kirchenbauer et al.'s z for ``tokens`` generated after a context ending in ``context_last``."""
    marker = TgiWatermark(gamma=gamma)
    previous, green = context_last, 0
    for token in tokens:
        green += token in set(marker.green_ids(previous, vocab_size).tolist())
        previous = token
    count = len(tokens)
    return (green - gamma * count) / math.sqrt(count * gamma * (1 - gamma))
