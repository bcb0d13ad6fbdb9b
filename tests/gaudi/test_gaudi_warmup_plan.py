"""The warmup plan: every shape serving can meet, its memory, and refusals that say what fits.

No model and no torch: sizes are those of real checkpoints (Llama-2-7B, the
SmolLM2-135M shape) written out, memory sizes are made up.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest
from switchyard_gaudi.model_dims import ModelDims
from switchyard_gaudi.warmup_plan import (
    DECODE,
    GIB,
    PREFILL,
    BucketSettings,
    Limits,
    Memory,
    PlanError,
    Shape,
    activation_bytes,
    build_plan,
    enumerate_shapes,
    largest_batch_that_fits,
    make_grid,
    plan_warmup,
)

LLAMA2_7B = ModelDims(model_type="llama", num_layers=32, hidden_size=4096,
                      intermediate_size=11008, num_heads=32, num_kv_heads=32, head_dim=128,
                      vocab_size=32000, max_position_embeddings=4096, parameters=6_738_415_616)
SMOL_135M = ModelDims(model_type="llama", num_layers=30, hidden_size=576, intermediate_size=1536,
                      num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152,
                      max_position_embeddings=8192, parameters=134_515_008)
# The seed's Llama2-7B BF16 command: PREFILL_BATCH_BUCKET_SIZE=2, BATCH_BUCKET_SIZE=32,
# PAD_SEQUENCE_TO_MULTIPLE_OF=256, --max-input-length 1024 --max-total-tokens 2048
# --max-batch-prefill-tokens 2048 --max-batch-total-tokens 65536 (a batch of 32).
SEED_LIMITS = Limits(max_input_tokens=1024, max_total_tokens=2048, max_batch_size=32,
                     max_batch_prefill_tokens=2048)
SEED_BUCKETS = BucketSettings(batch_step=32, prefill_batch_step=2, seq_step=256)
BF16 = 2


def test_the_seeds_llama2_command_gives_its_shapes():
    grid = make_grid(SEED_LIMITS, SEED_BUCKETS)
    assert list(grid.prefill_seq) == [256, 512, 768, 1024]
    assert list(grid.prefill_batch) == [2, 4, 6, 8]  # up to 2048 // 256 rows
    assert list(grid.decode_batch) == [32]
    shapes = enumerate_shapes(grid)
    prefill = {(s.batch, s.length) for s in shapes if s.phase == PREFILL}
    assert prefill == {(2, 256), (4, 256), (6, 256), (8, 256), (2, 512), (4, 512), (2, 768),
                       (2, 1024)}
    assert [s for s in shapes if s.phase == DECODE] == [Shape(DECODE, 32, 2048)]


def test_a_shape_outside_the_plan_is_told_which_setting_would_cover_it():
    plan = build_plan(SEED_LIMITS, SEED_BUCKETS, LLAMA2_7B, BF16, Memory(free=96 * GIB))
    assert "raise it to 4096" in plan.uncovered(Shape(PREFILL, 4, 1024))
    assert "--max-batch-prefill-tokens 2048" in plan.uncovered(Shape(PREFILL, 4, 1024))
    assert "PREFILL_BATCH_BUCKET_SIZE so that 3 is one" in plan.uncovered(Shape(PREFILL, 3, 256))
    assert "PAD_SEQUENCE_TO_MULTIPLE_OF" in plan.uncovered(Shape(PREFILL, 2, 300))
    assert "BATCH_BUCKET_SIZE" in plan.uncovered(Shape(DECODE, 16, 2048))
    assert "--max-batch-size to 48" in plan.uncovered(Shape(DECODE, 48, 2048))


def test_limits_need_not_be_powers_of_two_or_multiples():
    """tgi-gaudi#256: warmup failed unless the lengths were powers of two; here any limit works."""
    limits = Limits(max_input_tokens=1000, max_total_tokens=1500, max_batch_size=20,
                    max_batch_prefill_tokens=4000)
    grid = make_grid(limits, BucketSettings(batch_step=8, prefill_batch_step=4, seq_step=128))
    assert grid.prefill_seq.limit == 1000 and grid.decode_batch.sizes == (8, 16, 20)
    assert grid.prefill_batch.sizes == (4, 8, 12, 16, 20)  # up to 20 rows of the 128 bucket
    assert grid.prefill_shape([999, 3]) == Shape(PREFILL, 4, 1000)
    assert grid.decode_shape(17) == Shape(DECODE, 20, 1500)


def test_exponential_bases_grow_batches_and_prompts_by_powers():
    buckets = BucketSettings(batch_step=8, prefill_batch_step=4, seq_step=128, batch_base=2,
                             seq_base=2)
    grid = make_grid(replace(SEED_LIMITS, max_batch_prefill_tokens=4096), buckets)
    assert list(grid.prefill_seq) == [128, 256, 512, 1024]
    assert list(grid.decode_batch) == [1, 2, 4, 8, 16, 32]
    assert list(grid.prefill_batch) == [1, 2, 4, 8, 16, 32]


def test_every_batch_the_scheduler_can_form_is_a_planned_shape():
    """Whatever prompts come, a prefill that fits the budget and any decode are in the plan."""
    limits = Limits(max_input_tokens=300, max_total_tokens=512, max_batch_size=13,
                    max_batch_prefill_tokens=1000)
    for buckets in (BucketSettings(5, 3, 64), BucketSettings(4, 2, 100, 2, 3)):
        grid = make_grid(limits, buckets)
        shapes = set(enumerate_shapes(grid))
        rng = random.Random(1)
        for _ in range(2000):
            lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 13))]
            shape = grid.prefill_shape(lengths)
            if shape is not None:
                assert shape in shapes, (lengths, shape)
                assert shape.batch * shape.length <= 1000
        for rows in range(1, 14):
            assert grid.decode_shape(rows) in shapes
        assert grid.prefill_shape([300]) is not None  # the longest prompt alone always fits


def test_a_longest_prompt_that_cannot_be_prefilled_is_refused_with_values_that_work():
    limits = replace(SEED_LIMITS, max_batch_prefill_tokens=2048)
    buckets = replace(SEED_BUCKETS, prefill_batch_step=4)  # 4 rows x 1024 > 2048
    with pytest.raises(PlanError) as err:
        make_grid(limits, buckets)
    message = str(err.value)
    assert "4 rows x 1024 tokens = 4096 tokens" in message
    assert "raise --max-batch-prefill-tokens to 4096" in message
    assert "set PREFILL_BATCH_BUCKET_SIZE to 2" in message
    assert "lower --max-input-tokens to 512" in message
    make_grid(replace(limits, max_batch_prefill_tokens=4096), buckets)
    make_grid(limits, replace(buckets, prefill_batch_step=2))
    make_grid(replace(limits, max_input_tokens=512), buckets)


def test_the_memory_estimate_counts_weights_cache_and_the_largest_shape():
    plan = build_plan(SEED_LIMITS, SEED_BUCKETS, LLAMA2_7B, BF16, Memory(free=96 * GIB))
    mem = plan.memory
    assert mem.weights == LLAMA2_7B.parameters * 2
    # 32 decode rows + 1 scratch row of 2048 tokens, keys and values of 32 layers x 32 heads x 128
    assert mem.kv_cache == 33 * 2048 * (2 * 32 * 32 * 128 * 2)
    # Shapes run one at a time: the largest one's activations count, 2 x 1024 tokens here.
    assert mem.largest == Shape(PREFILL, 2, 1024)
    assert mem.activations == max(activation_bytes(s, LLAMA2_7B, BF16) for s in plan.shapes)
    tokens, scores = 2 * 1024, 2 * 32 * 1024 * 1024 * 4
    per_token = (4 * 4096 + 96 * 128 + 3 * 11008) * 2
    assert mem.activations == tokens * per_token + scores + 2 * 2 * 32000 * 4
    assert mem.fits and mem.total < 0.9 * 96 * GIB
    assert "GiB usable" in plan.describe()


def test_a_configuration_that_does_not_fit_names_a_setting_and_a_value_that_fits():
    memory = Memory(free=40 * GIB)
    with pytest.raises(PlanError) as err:
        plan_warmup(SEED_LIMITS, SEED_BUCKETS, LLAMA2_7B, BF16, memory)
    message = str(err.value)
    assert message.startswith("the configuration does not fit in device memory")
    batch = int(re.search(r"--max-batch-size to (\d+)", message).group(1))
    # The value named fits, one more does not: it is the largest that does.
    assert plan_warmup(replace(SEED_LIMITS, max_batch_size=batch), SEED_BUCKETS, LLAMA2_7B, BF16,
                       memory).memory.fits
    assert not build_plan(replace(SEED_LIMITS, max_batch_size=batch + 1), SEED_BUCKETS, LLAMA2_7B,
                          BF16, memory).memory.fits
    total = int(re.search(r"--max-total-tokens to (\d+)", message).group(1))
    assert plan_warmup(replace(SEED_LIMITS, max_total_tokens=total), SEED_BUCKETS, LLAMA2_7B,
                       BF16, memory)
    # The KV cache is the biggest part here, so the batch size comes first.
    assert message.index("--max-batch-size") < message.index("--max-total-tokens")


def test_when_prefill_activations_do_not_fit_the_prefill_budget_is_named_first():
    limits = Limits(max_input_tokens=1024, max_total_tokens=1100, max_batch_size=16,
                    max_batch_prefill_tokens=16384)
    buckets = BucketSettings(batch_step=16, prefill_batch_step=1, seq_step=1024)
    roomy = build_plan(limits, buckets, SMOL_135M, BF16, Memory(free=64 * GIB)).memory
    assert roomy.largest == Shape(PREFILL, 16, 1024)
    assert roomy.activations > roomy.kv_cache
    # Room for the weights, the cache and a prefill of 4 x 1024 tokens, not 16.
    four = activation_bytes(Shape(PREFILL, 4, 1024), SMOL_135M, BF16)
    memory = Memory(free=int((roomy.weights + roomy.kv_cache + four) / 0.9) + 1)
    with pytest.raises(PlanError, match=r"lower --max-batch-prefill-tokens to (\d+)") as err:
        plan_warmup(limits, buckets, SMOL_135M, BF16, memory)
    budget = int(re.search(r"prefill-tokens to (\d+)", str(err.value)).group(1))
    assert 4 * 1024 <= budget < 5 * 1024
    assert plan_warmup(replace(limits, max_batch_prefill_tokens=budget), buckets, SMOL_135M,
                       BF16, memory).memory.fits


def test_weights_that_do_not_fit_are_not_blamed_on_a_limit():
    with pytest.raises(PlanError, match="no limit makes the weights smaller"):
        plan_warmup(SEED_LIMITS, SEED_BUCKETS, LLAMA2_7B, BF16, Memory(free=10 * GIB))


def test_graph_memory_is_reserved_where_graphs_take_memory():
    hpu = build_plan(SEED_LIMITS, SEED_BUCKETS, LLAMA2_7B, BF16,
                     Memory(free=96 * GIB, graph_fraction=0.1)).memory
    assert hpu.graphs == int(hpu.usable * 0.1)


def test_the_default_batch_is_the_largest_that_fits():
    memory = Memory(free=40 * GIB)
    limits = replace(SEED_LIMITS, max_batch_size=64)
    best = largest_batch_that_fits(limits, SEED_BUCKETS, LLAMA2_7B, BF16, memory)
    assert best is not None and 1 <= best < 32
    for batch in (best, best + 1):
        plan = build_plan(replace(limits, max_batch_size=batch), SEED_BUCKETS, LLAMA2_7B, BF16,
                          memory)
        assert plan.memory.fits is (batch == best)
    assert largest_batch_that_fits(limits, SEED_BUCKETS, LLAMA2_7B, BF16,
                                   Memory(free=10 * GIB)) is None


def test_the_dry_run_prints_the_plan_without_a_device(default_model_path, capsys, monkeypatch):
    """`python -m switchyard_gaudi plan`: the seed's Llama2 settings sized for a 96 GiB Gaudi2."""
    from switchyard_gaudi.__main__ import main

    for name, value in (("PREFILL_BATCH_BUCKET_SIZE", "2"), ("BATCH_BUCKET_SIZE", "32"),
                        ("PAD_SEQUENCE_TO_MULTIPLE_OF", "256")):
        monkeypatch.setenv(name, value)
    args = ["plan", "--model-id", str(default_model_path), "--max-input-length", "1024",
            "--max-total-tokens", "2048", "--max-batch-prefill-tokens", "2048",
            "--max-batch-total-tokens", "65536"]
    assert main([*args, "--device-memory", "96GiB"]) == 0
    out = capsys.readouterr().out
    assert "max_batch_size 32" in out and "bfloat16 on hpu" in out
    assert "9 shapes: 8 prefill (2x256, 4x256, 2x512, 6x256, 2x768, 8x256, 4x512, 2x1024)" in out
    assert main([*args, "--device-memory", "40MiB"]) == 2
    assert "does not fit" in capsys.readouterr().err


def test_switchyard_warmup_plan_is_the_same_command(default_model_path):
    """The plugin adds `switchyard warmup-plan` (hook `switchyard_commands`); exit 2 = no fit."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "switchyard.cli", "warmup-plan", "--model-id",
            str(default_model_path), "--max-total-tokens", "512", "--max-input-tokens", "400",
            "--max-batch-size", "8"]
    ok = subprocess.run([*base, "--device-memory", "96GiB"], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "shapes:" in ok.stdout and "max_batch_size 8" in ok.stdout
    refused = subprocess.run([*base, "--device-memory", "1MiB"], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "does not fit" in refused.stderr


def test_the_reason_for_the_longest_sequence_names_the_cap():
    """What the engine reports with ModelInfo.max_total_tokens: the flag, the model's own
    context where it is at most 4,096, or that context capped (every bucket compiles)."""
    from switchyard_gaudi.limits import max_total_reason
    from switchyard_spec import EngineConfig

    assert max_total_reason(EngineConfig(model_path="x", max_total_tokens=2048),
                            SMOL_135M) == "--max-total-tokens"
    assert max_total_reason(EngineConfig(model_path="x"), LLAMA2_7B) == "the model's context"
    assert max_total_reason(EngineConfig(model_path="x"), SMOL_135M).startswith(
        "the model's context (8192) capped at 4096")
