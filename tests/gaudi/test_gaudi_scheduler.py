"""The queue policy without a model: QUEUE_THRESHOLD_MS order, TGI's join rules, padded budget."""

from __future__ import annotations

import pytest
from switchyard_gaudi.scheduler import Policy, Scheduler, WaitingQueue
from switchyard_gaudi.sequence import GaudiSequence
from switchyard_gaudi.warmup_plan import PREFILL, BucketSettings, Limits, Shape, make_grid
from switchyard_spec import EngineRequest, SamplingParams, StoppingParams


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _seq(name: str, length: int, queued_at: float) -> GaudiSequence:
    request = EngineRequest(request_id=name, prompt_token_ids=tuple(range(1, length + 1)),
                            sampling=SamplingParams(), stopping=StoppingParams(max_new_tokens=4))
    return GaudiSequence(request, sink=lambda e: None, sampler=None,  # type: ignore[arg-type]
                         max_length=length + 4, ignore_eos=False, queued_at=queued_at)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _scheduler(clock: Clock, max_batch: int = 8, threshold_ms: int = 120,
               **policy: float) -> Scheduler:
    """Prompt buckets 16, 32, 48; prefill rows 2, 4, 6; at most 96 padded prefill tokens."""
    limits = Limits(max_input_tokens=48, max_total_tokens=64, max_batch_size=max_batch,
                    max_batch_prefill_tokens=96)
    grid = make_grid(limits, BucketSettings(batch_step=4, prefill_batch_step=2, seq_step=16))
    return Scheduler(grid, Policy(max_batch, **policy), WaitingQueue(threshold_ms, clock))


def _names(seqs: list[GaudiSequence]) -> list[str]:
    return [s.request_id for s in seqs]


def test_shorter_prompts_go_first(clock):
    queue = WaitingQueue(120, clock)
    for name, length in (("long", 40), ("short", 5), ("mid", 20), ("short2", 5)):
        queue.push(_seq(name, length, clock.now))
    assert _names(queue.ordered()) == ["short", "short2", "mid", "long"]


def test_overdue_requests_go_before_shorter_ones(clock):
    queue = WaitingQueue(120, clock)
    queue.push(_seq("old-long", 40, clock.now))
    clock.now += 0.100
    queue.push(_seq("new-short", 5, clock.now))
    assert _names(queue.ordered()) == ["new-short", "old-long"]  # 100 ms: not overdue yet
    clock.now += 0.030
    assert _names(queue.ordered()) == ["old-long", "new-short"]  # 130 ms: overdue
    queue.push(_seq("older-mid", 20, clock.now - 1.0))
    # Both overdue now: the shorter first.
    assert _names(queue.ordered()) == ["older-mid", "old-long", "new-short"]


def test_a_zero_threshold_serves_in_arrival_length_order_once_overdue(clock):
    queue = WaitingQueue(0, clock)
    queue.push(_seq("a", 30, clock.now - 0.001))
    queue.push(_seq("b", 10, clock.now))
    assert _names(queue.ordered()) == ["a", "b"]  # only "a" has waited past 0 ms


def test_the_prefill_budget_counts_padded_tokens(clock):
    sched = _scheduler(clock)
    for i in range(3):
        sched.queue.push(_seq(f"s{i}", 3, clock.now))
    sched.queue.push(_seq("long", 17, clock.now))
    step = sched.next_prefill(running=0)
    # Three prompts of 3 tokens pad to 4 rows of 16 (64 tokens); with the fourth, of 17
    # tokens, it would be 4 rows of 32 = 128 padded tokens, over 96, though only 26 are real.
    assert _names(step.seqs) == ["s0", "s1", "s2"]
    assert step.shape == Shape(PREFILL, 4, 16)
    assert _names(list(sched.queue)) == ["long"]
    step = sched.next_prefill(running=3)  # floor(3 x 0.3) = 0 newcomers needed: it may join
    assert _names(step.seqs) == ["long"] and step.shape == Shape(PREFILL, 2, 32)
    assert not sched.queue


def test_a_prefill_takes_no_more_than_the_batch_has_room_for(clock):
    sched = _scheduler(clock, max_batch=8, waiting_served_ratio=0.0)
    for i in range(5):
        sched.queue.push(_seq(f"s{i}", 2, clock.now))
    step = sched.next_prefill(running=6)
    assert _names(step.seqs) == ["s0", "s1"] and step.shape == Shape(PREFILL, 2, 16)
    assert sched.next_prefill(running=8) is None  # full: decode


def test_newcomers_wait_for_company_until_max_waiting_tokens(clock):
    sched = _scheduler(clock, max_batch=16, max_waiting_tokens=3, waiting_served_ratio=0.5)
    sched.queue.push(_seq("a", 4, clock.now))
    sched.queue.push(_seq("b", 4, clock.now))
    assert sched.min_joining(6) == 3
    assert sched.next_prefill(running=6) is None  # 2 of the 3 needed: decode instead
    for _ in range(2):
        sched.decoded()
        assert sched.next_prefill(running=6) is None
    sched.decoded()  # the batch has decoded max_waiting_tokens steps: they join now
    step = sched.next_prefill(running=6)
    assert _names(step.seqs) == ["a", "b"]
    assert sched.steps_since_join == 0
    sched.queue.push(_seq("c", 4, clock.now))
    assert sched.next_prefill(running=0).seqs[0].request_id == "c"  # nothing runs: no minimum
