"""Turning an EngineRequest into a Sequence; the limits and cache size that decide what can run.

Requests arrive validated by the gateway, but the engine checks what would
otherwise break a whole batch (an id outside the vocabulary makes the embedding
lookup fail for every batch mate) or could never be served.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from switchyard_engine.admission import make_sampler, request_problem
from switchyard_engine.watermark import WatermarkConfig
from switchyard_spec import (
    AdapterError,
    EngineConfig,
    EngineRequest,
    EngineStartError,
    EventSink,
    ModelInfo,
)

from switchyard_xeon.block_manager import blocks_for
from switchyard_xeon.kv_cache import BLOCK_SIZE
from switchyard_xeon.options import flag, number
from switchyard_xeon.scheduler import (
    DEFAULT_MAX_WAITING_TOKENS,
    DEFAULT_WAITING_SERVED_RATIO,
    Limits,
)
from switchyard_xeon.sequence import Sequence

if TYPE_CHECKING:
    from switchyard_xeon.lora import XeonAdapters

IGNORE_EOS_ENV = "TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN"

DEFAULT_MAX_BATCH_SIZE = 64
PREFILL_TOKENS_PER_THREAD = 512
MAX_DEFAULT_PREFILL_TOKENS = 4096
"""TGI's default ``--max-batch-prefill-tokens``, sized for a GPU: the cap of ours."""
DEFAULT_MAX_TOTAL_TOKENS = 4096
"""Used when the model does not say how long its context is."""
CACHE_MEMORY_FRACTION = 0.4
"""Share of the memory available after loading that the KV cache may use."""


def ignore_eos_forced() -> bool:
    """Whether TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN asks to ignore EOS everywhere."""
    return os.environ.get(IGNORE_EOS_ENV, "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class CachePlan:
    """How big the paged KV cache is, and why."""

    num_blocks: int
    block_size: int
    source: str
    """What decided the size, for the start-up log."""
    prefix_caching: bool = True

    @property
    def capacity_tokens(self) -> int:
        """Tokens the cache holds."""
        return self.num_blocks * self.block_size


def _cache_tokens(config: EngineConfig, limits: Limits, bytes_per_token: int,
                  free_memory: int) -> tuple[int, str]:
    """How many tokens the cache should hold, and what decided it."""
    if config.max_batch_total_tokens:
        return config.max_batch_total_tokens, "--max-batch-total-tokens"
    max_total = limits.max_total_tokens
    tokens = limits.max_batch_size * max_total
    source = f"max_batch_size {limits.max_batch_size} x max_total_tokens {max_total}"
    budget = int(free_memory * CACHE_MEMORY_FRACTION) // bytes_per_token if bytes_per_token else 0
    if free_memory and budget < tokens:
        tokens = budget
        source = f"{CACHE_MEMORY_FRACTION:.0%} of {free_memory / 2**20:.0f} MiB free memory"
    if tokens < max_total:
        if config.max_total_tokens:  # asked for: one sequence of it, whatever the budget
            return max_total, "one sequence of --max-total-tokens (memory is short)"
        # The model's context does not fit: the longest sequence becomes what does (below),
        # but never less than the old default's (or the model's whole context, if shorter).
        floor = min(max_total, DEFAULT_MAX_TOTAL_TOKENS)
        if tokens < floor:
            return floor, f"one sequence of {floor} tokens (memory is short)"
    return tokens, source


def default_prefill_tokens(threads: int) -> int:
    """Tokens per prefill step when ``--max-batch-prefill-tokens`` is not set.

    A step's time grows with its tokens over the cores doing them, and every
    running stream waits for the whole step, so the budget scales with the
    threads: 512 per thread, between 512 and TGI's 4,096. On 2 cores a
    4,096-token step of the 135M shape took ~9 s; with 1,024-token steps the
    median time to first token of 32 concurrent prompts went from 8.9-9.2 s
    to 5.8-7.3 s at the same throughput (in process, 128+128 tokens).
    """
    return min(MAX_DEFAULT_PREFILL_TOKENS, max(PREFILL_TOKENS_PER_THREAD,
                                               PREFILL_TOKENS_PER_THREAD * threads))


def resolve_limits(
    config: EngineConfig, info: ModelInfo, bytes_per_token: int, free_memory: int,
    threads: int,
) -> tuple[Limits, CachePlan]:
    """Fill the limits left at 0 in ``config`` for this model and machine, and size the cache.

    The cache holds ``--max-batch-total-tokens`` tokens (rounded up to whole
    blocks) when that is set; otherwise enough for ``max_batch_size``
    sequences of ``max_total_tokens``, capped at ``CACHE_MEMORY_FRACTION`` of
    the free memory, and never less than one full-length sequence. The prefill
    budget defaults to :func:`default_prefill_tokens` of the engine's
    ``threads``. Options
    (``EngineConfig.options``): ``block_size`` (16), ``max_waiting_tokens``
    (20), ``waiting_served_ratio`` (0.3) and ``prefix_caching`` (true).
    """
    options = config.options
    limits = Limits(
        max_batch_size=config.max_batch_size or DEFAULT_MAX_BATCH_SIZE,
        max_batch_prefill_tokens=(config.max_batch_prefill_tokens
                                  or default_prefill_tokens(threads)),
        max_total_tokens=(config.max_total_tokens or info.max_position_embeddings
                          or DEFAULT_MAX_TOTAL_TOKENS),
        max_waiting_tokens=int(number(options, "max_waiting_tokens", int,
                                       DEFAULT_MAX_WAITING_TOKENS, 0)),
        waiting_served_ratio=number(options, "waiting_served_ratio", float,
                                     DEFAULT_WAITING_SERVED_RATIO, 0),
    )
    block_size = int(number(options, "block_size", int, BLOCK_SIZE, 1))
    tokens, source = _cache_tokens(config, limits, bytes_per_token, free_memory)
    plan = CachePlan(blocks_for(tokens, block_size), block_size, source,
                     flag(options, "prefix_caching", True))
    if plan.capacity_tokens < limits.max_total_tokens:
        if config.max_total_tokens:
            raise EngineStartError(
                f"max_batch_total_tokens ({config.max_batch_total_tokens}) must be at least "
                f"max_total_tokens ({config.max_total_tokens})")
        limits = replace(limits, max_total_tokens=plan.capacity_tokens)
    return limits, plan


def max_total_reason(config: EngineConfig, info: ModelInfo, limits: Limits,
                     plan: CachePlan) -> str:
    """Why the longest sequence is ``limits.max_total_tokens``, for the start-up log."""
    if config.max_total_tokens:
        return "--max-total-tokens"
    if not info.max_position_embeddings:
        return f"the model states no context length: the default {DEFAULT_MAX_TOTAL_TOKENS}"
    if limits.max_total_tokens >= info.max_position_embeddings:
        return "the model's context"
    return (f"less than the model's context ({info.max_position_embeddings}): the KV cache "
            f"holds {plan.capacity_tokens} tokens ({plan.source})")


class Admission:
    """Validates requests and builds their :class:`Sequence` with sampling state.

    ``watermark`` is the engine's watermark setting (read from the environment
    once at start, so a bad value fails start-up rather than a request).
    """

    def __init__(self, limits: Limits, vocab_size: int, capacity_tokens: int,
                 watermark: WatermarkConfig | None = None, takes_images: bool = False,
                 adapters: XeonAdapters | None = None) -> None:
        self.limits = limits
        self.vocab_size = vocab_size
        self.capacity_tokens = capacity_tokens
        self.watermark = watermark if watermark is not None else WatermarkConfig()
        self.takes_images = takes_images
        """Whether the model runs images (:mod:`switchyard_xeon.vision`); else they are refused."""
        self.adapters = adapters
        """The model's LoRA adapters; None: a request naming one is refused."""

    def build(self, request: EngineRequest, sink: EventSink) -> tuple[Sequence | None, str]:
        """The sequence for ``request``, or None and the reason it cannot be served."""
        problem = request_problem(request, self.vocab_size, self.takes_images)
        if problem is not None:
            return None, problem
        n = len(request.prompt_token_ids)
        max_new = request.stopping.max_new_tokens
        if n >= self.limits.max_total_tokens:
            return None, (
                f"prompt of {n} tokens leaves no room under max_total_tokens "
                f"{self.limits.max_total_tokens}"
            )
        max_length = min(n + max_new, self.limits.max_total_tokens)
        if max_length > self.capacity_tokens:
            return None, f"{max_length} tokens exceed the cache capacity ({self.capacity_tokens})"
        lora = None
        if request.adapter_id is not None:
            if self.adapters is None:
                return None, f"adapter {request.adapter_id!r}: this model serves no LoRA adapters"
            try:  # bound now: an unload later lets this sequence finish with it
                lora = self.adapters.bank.handle(request.adapter_id)
            except AdapterError as exc:
                return None, str(exc)
        ignore_eos = request.stopping.ignore_eos or ignore_eos_forced()
        seq = Sequence(request, sink, make_sampler(request, self.vocab_size, self.watermark),
                       max_length=max_length, ignore_eos=ignore_eos, lora=lora)
        return seq, ""
