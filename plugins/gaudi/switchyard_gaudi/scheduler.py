"""Who is prefilled next, and when: TGI's router semantics over padded, bucketed batches.

The engine alternates two kinds of step, as TGI does with static shapes: a
*prefill* step runs newcomers' prompts (their rows padded to a prefill batch
bucket, their prompts to a prompt bucket) and they join the running batch; a
*decode* step advances every running sequence by one token. Between decode
steps, newcomers are prefilled when:

- nothing runs, or
- at least ``floor(running * waiting_served_ratio)`` of them can join
  together, or the batch has decoded ``max_waiting_tokens`` steps since
  newcomers last joined (``--waiting-served-ratio``, ``--max-waiting-tokens``);

and a prefill takes at most ``max_batch_size - running`` of them, while its
padded tokens (bucketed rows x bucketed prompt length, what the device runs)
fit ``--max-batch-prefill-tokens``.

Queue order is tgi-gaudi's ``QUEUE_THRESHOLD_MS``: shorter prompts first
(fewer padded tokens, earlier first tokens), except that a request waiting
longer than the threshold is overdue and goes ahead of every request that is
not (overdue ones among themselves shorter first too). Like TGI, a prefill
stops at the first request that would break the budget rather than skip it.

Pure Python: no torch, no model; the clock is injectable for tests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from switchyard_gaudi.sequence import GaudiSequence
from switchyard_gaudi.warmup_plan import Grid, Shape

DEFAULT_MAX_WAITING_TOKENS = 20
DEFAULT_WAITING_SERVED_RATIO = 0.3
"""TGI launcher defaults."""


class WaitingQueue:
    """Requests not yet prefilled, in ``QUEUE_THRESHOLD_MS`` order (see the module docstring)."""

    def __init__(self, threshold_ms: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold_s = threshold_ms / 1000.0
        self.clock = clock
        self._items: list[GaudiSequence] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items))

    def push(self, seq: GaudiSequence) -> None:
        """Queue a sequence (its ``queued_at`` says how long it has waited)."""
        self._items.append(seq)

    def remove(self, seq: GaudiSequence) -> None:
        """Take a sequence out of the queue."""
        self._items.remove(seq)

    def ordered(self) -> list[GaudiSequence]:
        """Overdue requests first, then the others; shorter prompts first within each."""
        now = self.clock()

        def key(seq: GaudiSequence) -> tuple[bool, int, int]:
            overdue = now - seq.queued_at > self.threshold_s
            return (not overdue, seq.prompt_len, seq.arrival)

        return sorted(self._items, key=key)


@dataclass(frozen=True)
class Policy:
    """The router settings the scheduler enforces."""

    max_batch_size: int
    max_waiting_tokens: int = DEFAULT_MAX_WAITING_TOKENS
    waiting_served_ratio: float = DEFAULT_WAITING_SERVED_RATIO


@dataclass(frozen=True)
class Prefill:
    """A prefill step: the sequences it takes and the padded shape it runs."""

    seqs: list[GaudiSequence]
    shape: Shape


class Scheduler:
    """Chooses each prefill; the engine owns the running sequences and tells it what runs."""

    def __init__(self, grid: Grid, policy: Policy, queue: WaitingQueue) -> None:
        self.grid = grid
        self.policy = policy
        self.queue = queue
        self.steps_since_join = 0
        """Decode steps since newcomers last joined (TGI's ``waiting_tokens``)."""

    def min_joining(self, running: int) -> int:
        """How many newcomers must join together for a prefill to run now (TGI's ``min_size``)."""
        if not running or self.steps_since_join >= self.policy.max_waiting_tokens:
            return 0
        return math.floor(running * self.policy.waiting_served_ratio)

    def next_prefill(self, running: int) -> Prefill | None:
        """The next prefill with ``running`` sequences decoding, or None to decode instead.

        The sequences returned are out of the queue; the caller runs them.
        """
        room = self.policy.max_batch_size - running
        need = self.min_joining(running)
        if room <= 0 or not self.queue or len(self.queue) < need:
            return None
        picked: list[GaudiSequence] = []
        shape: Shape | None = None
        for seq in self.queue.ordered():
            wider = self.grid.prefill_shape([s.prompt_len for s in picked] + [seq.prompt_len])
            if wider is None:  # over the padded budget: it stays first in line
                break
            picked.append(seq)
            shape = wider
            if len(picked) == room:
                break
        if shape is None or len(picked) < max(need, 1):
            return None
        for seq in picked:
            self.queue.remove(seq)
        self.steps_since_join = 0
        return Prefill(picked, shape)

    def decoded(self) -> None:
        """Count a decode step (towards ``max_waiting_tokens``)."""
        self.steps_since_join += 1
