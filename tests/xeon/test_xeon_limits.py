"""How the engine sizes its cache and reads its options (no model needed)."""

from __future__ import annotations

import pytest

from switchyard_spec import EngineConfig, EngineStartError, ModelInfo
from switchyard_xeon.admission import CACHE_MEMORY_FRACTION, max_total_reason, resolve_limits

INFO = ModelInfo(model_type="llama", dtype="float32", vocab_size=100,
                 max_position_embeddings=4096, eos_token_ids=(2,), device="cpu")
MiB = 2**20


def _blocks(tokens: int) -> int:
    return -(-tokens // 16)


def _resolve(free_memory: int = 0, bytes_per_token: int = 1024, threads: int = 8,
             **config: object):
    return resolve_limits(EngineConfig(model_path="x", **config),  # type: ignore[arg-type]
                          INFO, bytes_per_token, free_memory, threads)


def test_an_explicit_budget_is_the_cache_size_rounded_up_to_blocks():
    limits, plan = _resolve(max_batch_total_tokens=1000, max_total_tokens=512)
    assert (plan.num_blocks, plan.block_size, plan.capacity_tokens) == (63, 16, 1008)
    assert "--max-batch-total-tokens" in plan.source and plan.prefix_caching
    assert limits.max_total_tokens == 512


def test_without_a_budget_memory_decides():
    _, roomy = _resolve(free_memory=64 * 1024 * MiB, max_batch_size=4)
    assert roomy.capacity_tokens == 4 * 4096 and "max_batch_size" in roomy.source
    _, tight = _resolve(free_memory=10 * MiB, max_batch_size=4)
    assert tight.capacity_tokens == _blocks(int(10 * MiB * CACHE_MEMORY_FRACTION) // 1024) * 16
    assert "free memory" in tight.source
    _, short = _resolve(free_memory=1 * MiB)
    assert short.capacity_tokens == 4096 and "short" in short.source


LONG = ModelInfo(model_type="llama", dtype="float32", vocab_size=100,
                 max_position_embeddings=32768, eos_token_ids=(2,), device="cpu")


def _resolve_long(free_memory: int, **config: object):
    engine_config = EngineConfig(model_path="x", **config)  # type: ignore[arg-type]
    limits, plan = resolve_limits(engine_config, LONG, 1024, free_memory, 8)
    return limits, plan, max_total_reason(engine_config, LONG, limits, plan)


def test_the_models_whole_context_where_the_cache_holds_one_sequence_of_it():
    limits, plan, why = _resolve_long(64 * 1024 * MiB, max_batch_size=2)
    assert limits.max_total_tokens == 32768 and plan.capacity_tokens == 2 * 32768
    assert why == "the model's context"
    # 40% of 50 MiB at 1 KiB a token: 20,480 tokens, less than one sequence of 32,768.
    limits, plan, why = _resolve_long(50 * MiB)
    budget = int(50 * MiB * CACHE_MEMORY_FRACTION) // 1024
    assert limits.max_total_tokens == plan.capacity_tokens == _blocks(budget) * 16
    assert why.startswith("less than the model's context (32768)") and "free memory" in why
    # Shorter still: never under the old default of 4,096.
    limits, plan, why = _resolve_long(1 * MiB)
    assert limits.max_total_tokens == plan.capacity_tokens == 4096 and "short" in why


def test_an_asked_for_length_is_one_sequence_whatever_the_memory():
    limits, plan, why = _resolve_long(1 * MiB, max_total_tokens=32768)
    assert limits.max_total_tokens == plan.capacity_tokens == 32768
    assert why == "--max-total-tokens"


def test_a_budget_below_the_sequence_length():
    with pytest.raises(EngineStartError, match="at least max_total_tokens"):
        _resolve(max_batch_total_tokens=100, max_total_tokens=512)
    limits, plan = _resolve(max_batch_total_tokens=100)  # the model's 4096 is only a default
    assert limits.max_total_tokens == plan.capacity_tokens == 112


def test_options():
    limits, plan = _resolve(options={"block_size": "8", "max_waiting_tokens": "3",
                                     "waiting_served_ratio": "1.2", "prefix_caching": "off"})
    assert (limits.max_waiting_tokens, limits.waiting_served_ratio) == (3, 1.2)
    assert plan.block_size == 8 and not plan.prefix_caching
    defaults, _ = _resolve()
    assert (defaults.max_waiting_tokens, defaults.waiting_served_ratio) == (20, 0.3)
    assert defaults.max_batch_prefill_tokens == 4096 and defaults.max_batch_size == 64


@pytest.mark.parametrize(("threads", "tokens"), [(1, 512), (2, 1024), (6, 3072), (8, 4096),
                                                 (64, 4096)])
def test_the_default_prefill_budget_scales_with_the_threads(threads, tokens):
    limits, _ = _resolve(threads=threads)
    assert limits.max_batch_prefill_tokens == tokens
    explicit, _ = _resolve(threads=threads, max_batch_prefill_tokens=300)
    assert explicit.max_batch_prefill_tokens == 300


@pytest.mark.parametrize("options", [{"block_size": "0"}, {"block_size": "big"},
                                     {"waiting_served_ratio": "-1"},
                                     {"prefix_caching": "maybe"}])
def test_bad_options_fail_start_up(options):
    with pytest.raises(EngineStartError, match="xeon option"):
        _resolve(options=options)
