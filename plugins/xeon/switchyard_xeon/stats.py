"""Snapshots of the engine's load, taken by the loop after each step and read lock-free.

``EngineStats`` is the contract's record; :class:`CacheStats` carries what the
paged cache knows beyond it (usage, prefix-cache hits, preemptions) until the
contract has fields for them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from switchyard_spec import EngineStats

from switchyard_xeon.scheduler import Scheduler

if TYPE_CHECKING:
    from switchyard_engine.lora.bank import AdapterBank

    from switchyard_xeon.sequence import Sequence


@dataclass(frozen=True)
class CacheStats:
    """What the engine's paged cache is doing."""

    num_blocks: int = 0
    block_size: int = 0
    used_blocks: int = 0
    """Blocks held by live sequences."""
    cached_blocks: int = 0
    """Blocks held by no one that keep a reusable prefix (evicted when space runs out)."""
    preemptions: int = 0
    """Sequences that lost their cache to make room, since start."""
    admitted_tokens: int = 0
    prefix_hit_tokens: int = 0
    """Of the tokens admitted since start, those served from the prefix cache."""

    @property
    def usage(self) -> float:
        """Fraction of the cache held by live sequences."""
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted tokens whose keys/values were not computed again."""
        return self.prefix_hit_tokens / self.admitted_tokens if self.admitted_tokens else 0.0


def engine_stats(sched: Scheduler, steps: int, bank: AdapterBank | None = None) -> EngineStats:
    """The contract's snapshot: ``batch_tokens`` counts the cache slots held by live
    sequences (whole blocks, shared ones once); ``max_batch_total_tokens`` is the cache size.

    ``bank``: the engine's LoRA adapters (None where the model cannot take any). The
    adapter fields are filled while it serves one: an adapter is loaded, or a
    sequence runs or waits with one (an unloaded adapter its sequences still use).
    Taken on the compute thread, between steps, like the queues it reads."""
    blocks = sched.blocks
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    max_lora = 0
    if bank is not None:
        running, waiting = _adapter_names(sched.running), _adapter_names(sched.waiting)
        if running or waiting or bank.names():
            max_lora = bank.max_loras
    return EngineStats(
        running=len(sched.running), waiting=len(sched.waiting),
        batch_tokens=blocks.num_used_blocks * blocks.block_size,
        max_batch_total_tokens=blocks.num_blocks * blocks.block_size, steps=steps,
        kv_block_size=blocks.block_size, kv_blocks_total=blocks.num_blocks,
        kv_blocks_used=blocks.num_used_blocks,
        spec_method=sched.drafter.method if sched.speculate.enabled else "",
        spec_drafts=sched.counters.drafts, spec_draft_tokens=sched.counters.draft_tokens,
        spec_accepted_tokens=sched.counters.accepted_tokens,
        max_lora=max_lora, running_lora_adapters=running, waiting_lora_adapters=waiting,
    )


def _adapter_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The adapters' names of ``seqs``, each once, sorted (a label value that does not
    change with the order of the queue)."""
    return tuple(sorted({seq.lora.name for seq in seqs if seq.lora is not None}))


def cache_stats(sched: Scheduler) -> CacheStats:
    """The paged cache's snapshot."""
    blocks, counters = sched.blocks, sched.counters
    return CacheStats(
        num_blocks=blocks.num_blocks, block_size=blocks.block_size,
        used_blocks=blocks.num_used_blocks, cached_blocks=blocks.num_cached_blocks,
        preemptions=counters.preemptions, admitted_tokens=counters.admitted_tokens,
        prefix_hit_tokens=counters.prefix_hit_tokens,
    )
