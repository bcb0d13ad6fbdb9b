"""The memory target: in the same KV budget, paged blocks serve at least twice as many
concurrent 128 + 128 sequences as a contiguous per-sequence cache at max_total_tokens 2048.

A contiguous cache reserves ``max_total_tokens`` slots per sequence when it is
admitted; the paged cache holds ``ceil(length / block_size)`` blocks, taken as
the sequence grows. Both counts come from the real block manager.
"""

from __future__ import annotations

from switchyard_xeon.block_manager import BlockManager
from switchyard_xeon.scheduler import Limits, Scheduler

from tests.support.scheduler_sim import make_seq, step

BUDGET_TOKENS = 16_384
"""--max-batch-total-tokens"""
MAX_TOTAL_TOKENS = 2048
BLOCK_SIZE = 16
PROMPT, NEW = 128, 128


def _hold_until_full(tokens_per_sequence: int) -> int:
    """How many sequences of ``tokens_per_sequence`` cache slots the pool holds at once."""
    blocks = BlockManager(BUDGET_TOKENS // BLOCK_SIZE, BLOCK_SIZE)
    count = 0
    while blocks.grow(count, tokens_per_sequence):
        count += 1
    return count


def test_paged_cache_holds_eight_times_the_contiguous_sequences():
    contiguous = _hold_until_full(MAX_TOTAL_TOKENS)
    # The last sampled token is never fed back, so a finished sequence caches 255 tokens.
    paged = _hold_until_full(PROMPT + NEW - 1)
    assert (contiguous, paged) == (8, 64)
    assert paged >= 2 * contiguous


def test_the_scheduler_runs_the_paged_count_concurrently_without_preemption():
    limits = Limits(max_batch_size=1000, max_batch_prefill_tokens=4096,
                    max_total_tokens=MAX_TOTAL_TOKENS)  # TGI's default ratio and waiting
    sched = Scheduler(limits, BlockManager(BUDGET_TOKENS // BLOCK_SIZE, BLOCK_SIZE))
    seqs = [make_seq(f"s{i}", PROMPT, max_new=NEW) for i in range(64)]
    for seq in seqs:
        sched.add(seq)
    peak = 0
    while len(sched):
        step(sched)
        peak = max(peak, len(sched.running))
    assert peak == 64 and sched.counters.preemptions == 0
    assert all(seq.generated == NEW for seq in seqs)
