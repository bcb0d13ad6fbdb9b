"""A model-free driver for the scheduler: sequences, and steps that "generate" known tokens.

A fake token depends only on its sequence and position, so a sequence that is
preempted and recomputed must produce exactly the tokens it would have
produced undisturbed; tests check that from the outside.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from switchyard_spec import EngineRequest, SamplingParams, StoppingParams
from switchyard_xeon.block_manager import BlockManager
from switchyard_xeon.scheduler import Limits, Scheduler
from switchyard_xeon.sequence import Sequence


def make_scheduler(blocks: int = 64, block_size: int = 4, batch: int = 8, prefill: int = 100,
                   max_total: int = 1000, waiting_tokens: int = 20, ratio: float = 0.0,
                   prefix_caching: bool = True) -> Scheduler:
    """A scheduler over a fresh block manager; the waiting-ratio gate is off unless asked."""
    limits = Limits(batch, prefill, max_total, max_waiting_tokens=waiting_tokens,
                    waiting_served_ratio=ratio)
    return Scheduler(limits, BlockManager(blocks, block_size, prefix_caching))


def make_seq(rid: str, prompt: int | list[int], max_new: int = 10,
             prompt_logprobs: bool = False) -> Sequence:
    """A sequence with a prompt of ``prompt`` distinct ids (or the ids given)."""
    ids = [hash((rid, i)) % 50_000 for i in range(prompt)] if isinstance(prompt, int) \
        else list(prompt)
    request = EngineRequest(request_id=rid, prompt_token_ids=tuple(ids), sampling=SamplingParams(),
                            stopping=StoppingParams(max_new_tokens=max_new),
                            prompt_logprobs=prompt_logprobs)
    return Sequence(request, lambda event: None, None,  # type: ignore[arg-type]
                    max_length=len(ids) + max_new, ignore_eos=True)


def fake_token(seq: Sequence) -> int:
    """The token a sequence "generates" next: a function of its identity and length only."""
    return 100_000 + hash((seq.request_id, len(seq.tokens))) % 50_000


@dataclass
class StepLog:
    """What one step did."""

    fed: dict[str, int] = field(default_factory=dict)
    """Tokens fed per request id."""
    sampled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Tokens fed in the step."""
        return sum(self.fed.values())


def step(sched: Scheduler) -> StepLog:
    """Schedule, "run" and complete one step, finishing sequences that reach their length."""
    batch = sched.schedule()
    log = StepLog(fed={s.request_id: s.num_scheduled for s in batch})
    sampling = [s for s in batch if s.samples]
    for seq in batch:  # every fed token has a block slot
        assert len(sched.blocks.table(seq.seq_id)) * sched.blocks.block_size >= \
            seq.num_cached + seq.num_scheduled
    sched.complete(batch)
    for seq in sampling:
        seq.tokens.append(fake_token(seq))
        log.sampled.append(seq.request_id)
        if len(seq.tokens) >= seq.max_length:
            sched.finish(seq)
            log.finished.append(seq.request_id)
    return log


def run_to_end(sched: Scheduler, max_steps: int = 10_000) -> list[StepLog]:
    """Step until nothing is left; every step must do some work."""
    logs = []
    while len(sched):
        logs.append(step(sched))
        assert logs[-1].fed, "a step with live sequences scheduled nothing"
        assert len(logs) < max_steps
    return logs


def expected_tokens(seq: Sequence) -> list[int]:
    """What an undisturbed run of ``seq`` generates (its fake tokens, in order)."""
    probe = make_seq(seq.request_id, list(seq.request.prompt_token_ids))
    out = []
    while len(probe.tokens) < seq.max_length:
        token = fake_token(probe)
        probe.tokens.append(token)
        out.append(token)
    return out
