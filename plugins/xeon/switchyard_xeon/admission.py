"""Turning an EngineRequest into a Sequence, and the limits that decide whether it can run.

Requests arrive validated by the gateway, but the engine checks what would
otherwise break a whole batch (an id outside the vocabulary makes the embedding
lookup fail for every batch mate) or could never be served.
"""

from __future__ import annotations

import os
import secrets

from switchyard.engine.sampling import RowSampler
from switchyard.engine.watermark import WatermarkConfig
from switchyard_spec import EngineConfig, EngineRequest, EventSink, ModelInfo

from switchyard_xeon.scheduler import Limits, Sequence

IGNORE_EOS_ENV = "TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN"

DEFAULT_MAX_BATCH_SIZE = 64
DEFAULT_MAX_BATCH_PREFILL_TOKENS = 4096
DEFAULT_MAX_TOTAL_TOKENS = 4096
"""Used when the model does not say how long its context is."""
CACHE_MEMORY_FRACTION = 0.4
"""Share of the memory available after loading that the KV cache may use."""


def ignore_eos_forced() -> bool:
    """Whether TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN asks to ignore EOS everywhere."""
    return os.environ.get(IGNORE_EOS_ENV, "").strip().lower() in ("1", "true", "yes")


def resolve_limits(
    config: EngineConfig, info: ModelInfo, bytes_per_token: int, free_memory: int
) -> tuple[Limits, int]:
    """Fill the limits left at 0 in ``config`` for this model and machine.

    Returns the limits and the cache budget in tokens.
    """
    max_total = config.max_total_tokens or info.max_position_embeddings or DEFAULT_MAX_TOTAL_TOKENS
    batch = config.max_batch_size or DEFAULT_MAX_BATCH_SIZE
    prefill = config.max_batch_prefill_tokens or max(DEFAULT_MAX_BATCH_PREFILL_TOKENS, 1)
    budget = config.max_batch_total_tokens
    if not budget:
        # Enough for every slot to reach max_total, unless memory says otherwise;
        # never less than one full-length sequence.
        budget = batch * max_total
        if free_memory and bytes_per_token:
            budget = min(budget, int(free_memory * CACHE_MEMORY_FRACTION) // bytes_per_token)
        budget = max(budget, max_total)
    return Limits(batch, prefill, max_total), budget


class Admission:
    """Validates requests and builds their :class:`Sequence` with sampling state.

    ``watermark`` is the engine's watermark setting (read from the environment
    once at start, so a bad value fails start-up rather than a request).
    """

    def __init__(self, limits: Limits, vocab_size: int, capacity_tokens: int,
                 watermark: WatermarkConfig | None = None) -> None:
        self.limits = limits
        self.vocab_size = vocab_size
        self.capacity_tokens = capacity_tokens
        self.watermark = watermark if watermark is not None else WatermarkConfig()

    def build(self, request: EngineRequest, sink: EventSink) -> tuple[Sequence | None, str]:
        """The sequence for ``request``, or None and the reason it cannot be served."""
        prompt = request.prompt_token_ids
        n = len(prompt)
        max_new = request.stopping.max_new_tokens
        if n == 0:
            return None, "the prompt is empty"
        if max_new < 1:
            return None, "max_new_tokens must be at least 1"
        if any(not 0 <= t < self.vocab_size for t in prompt):
            return None, f"prompt has token ids outside the vocabulary (size {self.vocab_size})"
        if n >= self.limits.max_total_tokens:
            return None, (
                f"prompt of {n} tokens leaves no room under max_total_tokens "
                f"{self.limits.max_total_tokens}"
            )
        max_length = min(n + max_new, self.limits.max_total_tokens)
        if max_length > self.capacity_tokens:
            return None, f"{max_length} tokens exceed the cache capacity ({self.capacity_tokens})"
        params = request.sampling
        seed = params.seed
        if params.do_sample and seed is None:
            seed = secrets.randbits(63)
        sampler = RowSampler(params, prompt, self.vocab_size, seed=seed,
                             logprobs=request.logprobs, watermark=self.watermark)
        ignore_eos = request.stopping.ignore_eos or ignore_eos_forced()
        seq = Sequence(request, sink, sampler, max_length=max_length, ignore_eos=ignore_eos)
        return seq, ""
