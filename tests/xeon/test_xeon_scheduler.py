"""Admission rules of the scheduler, without a model."""

from __future__ import annotations

import torch

from switchyard.engine.sampling import RowSampler
from switchyard_spec import EngineRequest, SamplingParams, StoppingParams
from switchyard_xeon.kv_cache import CacheShape, KVCache
from switchyard_xeon.scheduler import Limits, Scheduler, Sequence


def _scheduler(batch: int = 8, prefill: int = 100, blocks: int = 64) -> Scheduler:
    cache = KVCache(CacheShape(1, 1, 2), torch.float32, num_blocks=blocks, block_size=4)
    return Scheduler(Limits(batch, prefill, max_total_tokens=1000), cache)


def _seq(rid: str, prompt_len: int, max_length: int | None = None) -> Sequence:
    request = EngineRequest(request_id=rid, prompt_token_ids=tuple(range(prompt_len)),
                            sampling=SamplingParams(),
                            stopping=StoppingParams(max_new_tokens=10))
    sampler = RowSampler(request.sampling, request.prompt_token_ids, vocab_size=1000)
    return Sequence(request, lambda e: None, sampler,
                    max_length=max_length or prompt_len + 10, ignore_eos=False)


def test_batch_size_caps_the_running_set():
    sched = _scheduler(batch=2)
    for i in range(3):
        sched.add(_seq(f"r{i}", 5))
    assert [s.request_id for s in sched.schedule()] == ["r0", "r1"]
    assert [s.request_id for s in sched.waiting] == ["r2"]
    sched.finish(sched.running[0])
    assert [s.request_id for s in sched.schedule()] == ["r1", "r2"]


def test_prefill_budget_splits_admission_but_lets_a_long_prompt_in():
    sched = _scheduler(prefill=50)
    sched.add(_seq("a", 30))
    sched.add(_seq("b", 30))
    assert [s.request_id for s in sched.schedule()] == ["a"]
    assert [s.request_id for s in sched.schedule()] == ["a", "b"]
    sched.add(_seq("huge", 120))  # alone over budget: admitted when it is first in line
    assert "huge" in [s.request_id for s in sched.schedule()]


def test_cache_reservation_is_first_come_first_served():
    sched = _scheduler(blocks=10)  # 40 tokens
    sched.add(_seq("big", 20, max_length=32))
    sched.add(_seq("next", 20, max_length=32))
    sched.add(_seq("small", 2, max_length=4))
    # "next" does not fit; "small" would, but does not jump the queue.
    assert [s.request_id for s in sched.schedule()] == ["big"]
    assert sched.cache.free_blocks == 2
    sched.finish(sched.find("big"))
    assert [s.request_id for s in sched.schedule()] == ["next", "small"]
    assert sched.find("big") is None
