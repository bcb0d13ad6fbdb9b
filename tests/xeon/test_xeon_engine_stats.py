"""The xeon engine's `EngineStats`: its KV cache in blocks, as the block manager counts them
(the gateway's KV-cache utilisation gauge is `kv_blocks_used / kv_blocks_total`)."""

from __future__ import annotations

from types import SimpleNamespace


def test_xeon_engine_stats_count_the_block_managers_blocks():
    from switchyard_xeon.block_manager import BlockManager, PrefixHit
    from switchyard_xeon.stats import engine_stats

    blocks = BlockManager(num_blocks=32, block_size=16)
    assert blocks.allocate(1, PrefixHit(block_size=16), 40)  # 3 blocks
    assert blocks.allocate(2, PrefixHit(block_size=16), 17)  # 2 blocks
    from switchyard_xeon.scheduler import SchedulerCounters
    from switchyard_xeon.speculation import SpeculationConfig

    sched = SimpleNamespace(blocks=blocks, running=[1, 2], waiting=[3],
                            speculate=SpeculationConfig(), counters=SchedulerCounters())
    stats = engine_stats(sched, steps=7)  # type: ignore[arg-type]
    assert (stats.kv_block_size, stats.kv_blocks_total, stats.kv_blocks_used) == (16, 32, 5)
    assert stats.kv_blocks_used == blocks.num_used_blocks
    assert stats.batch_tokens == 5 * 16 and stats.max_batch_total_tokens == 32 * 16
    assert (stats.running, stats.waiting, stats.steps) == (2, 1, 7)
    assert stats.spec_method == "" and stats.spec_draft_tokens == 0  # speculation off
    blocks.free(1)
    assert engine_stats(sched, 7).kv_blocks_used == 2  # type: ignore[arg-type]
