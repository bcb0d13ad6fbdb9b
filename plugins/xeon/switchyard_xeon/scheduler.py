"""Who runs in the next step, and how many tokens each feeds.

Every step is one forward pass over a *mixed* batch: each running sequence
that is decoding feeds its newest token, sequences still prefilling feed a
chunk of their prompt, and waiting sequences may join with a first chunk. The
limits are TGI's:

- ``max_batch_prefill_tokens``: tokens fed in one step, decodes included.
  Decodes always run (one token each); prefill chunks share what is left, so
  a long prompt is split into chunks and running decodes never wait for more
  than one chunk. Tokens found in the prefix cache cost nothing.
- ``max_batch_total_tokens``: the size of the block pool (the block manager's
  business). Blocks are taken as sequences grow; when a running sequence needs
  one and none is free, the newest running sequence is *preempted*: its
  blocks are freed and it goes back to the front of the waiting queue, to be
  re-prefilled (prompt plus generated tokens) later. The oldest sequence
  always makes progress, so no request fails for lack of cache.
- ``max_batch_size``: running sequences.
- ``waiting_served_ratio`` and ``max_waiting_tokens``: while a batch runs,
  new requests join only when at least ``floor(running * ratio)`` of them can
  join together, or when those that can join fill the step's token budget, or once
  the batch has run ``max_waiting_tokens`` steps since requests last joined
  (preempted sequences resuming are not held back). The budget clause is
  ours: TGI holds a budget-filling group back too.

Prefix-cache lookups and commits key blocks that cover image placeholders on
the images too (:meth:`Sequence.block_keys`). A sequence's first admission
records its hit in ``Sequence.cached_tokens`` (``TokenEvent.cached_tokens``:
whole blocks, never the prompt's last token, 0 when prefix caching is off or
the request asks for prompt log-probabilities).

Admission is first-come first-served and stops at the first request that does
not fit, so a large request is never starved by smaller ones behind it. A new
sequence is only admitted when its whole prompt fits in the free blocks with
``reserve_blocks`` to spare for the running batch to grow into (it takes
blocks only for its first chunk), which keeps admission from causing
preemption at once.

With n-gram speculation on (:mod:`switchyard_xeon.speculation`), a step
that passes its load gate gives each decoding sequence its drafts after its
newest token; ``complete`` then caches the newest token and the drafts the
step kept, no more.

Pure Python: no torch, no model. See :meth:`Scheduler.schedule` and
:meth:`Scheduler.complete` for the step contract.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from switchyard_xeon import speculation
from switchyard_xeon.block_manager import BlockManager, PrefixHit
from switchyard_xeon.sequence import Sequence
from switchyard_xeon.speculation import SpeculationConfig

if TYPE_CHECKING:  # the results' type only: the scheduler stays free of torch
    from switchyard_engine.sampling import SampledToken

DEFAULT_MAX_WAITING_TOKENS = 20
DEFAULT_WAITING_SERVED_RATIO = 0.3
"""TGI launcher defaults."""


@dataclass(frozen=True)
class Limits:
    """The batch limits the scheduler enforces (all resolved, none 0)."""

    max_batch_size: int
    max_batch_prefill_tokens: int
    max_total_tokens: int
    max_waiting_tokens: int = DEFAULT_MAX_WAITING_TOKENS
    waiting_served_ratio: float = DEFAULT_WAITING_SERVED_RATIO


@dataclass
class SchedulerCounters:
    """Running totals since start, for metrics."""

    preemptions: int = 0
    admitted_tokens: int = 0
    """Tokens of sequences at admission (prompts, plus generated tokens on resumption)."""
    prefix_hit_tokens: int = 0
    """Of ``admitted_tokens``, those found in the prefix cache and not computed."""
    drafts: int = 0
    """Sequence steps that fed drafts (speculative decoding)."""
    draft_tokens: int = 0
    """Tokens drafted and fed."""
    accepted_tokens: int = 0
    """Of ``draft_tokens``, those the step kept."""


class Scheduler:
    """Waiting queue, running batch, and the choice of each step's work."""

    def __init__(self, limits: Limits, blocks: BlockManager,
                 speculate: SpeculationConfig | None = None,
                 drafter: speculation.Drafter | None = None) -> None:
        self.limits = limits
        self.blocks = blocks
        self.speculate = speculate or SpeculationConfig()
        self.drafter: speculation.Drafter = drafter or speculation.NgramDrafter(
            self.speculate.min_n, self.speculate.max_n)
        """Where drafts come from (n-gram lookups unless the engine loaded a draft model)."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        """Admission order: the newest, first to be preempted, is last."""
        self.counters = SchedulerCounters()
        self.reserve_blocks = max(1, blocks.num_blocks // 100)
        self._steps_since_join = 0
        self._by_id: dict[str, Sequence] = {}
        self.gate: Callable[[Sequence, list[Sequence]], bool] | None = None
        """Whether a waiting sequence may join the running ones now, besides the cache and
        budgets: the LoRA adapters' (:meth:`~switchyard_xeon.lora.XeonAdapters.admit`);
        None admits everything. Admission stays FCFS: a refusal stops it for this step."""

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue a sequence; it joins the batch at a later ``schedule``.

        ``front`` puts it ahead of the queue: for the engine's own liveness
        probes, which must not wait behind a backlog to tell whether the
        model still runs.
        """
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def find(self, request_id: str) -> Sequence | None:
        """The live sequence named ``request_id``, if any."""
        return self._by_id.get(request_id)

    # ---------------------------------------------------------------- step
    def schedule(self) -> list[Sequence]:
        """The sequences of the next step, each with ``num_scheduled`` set (may be empty).

        Running sequences come first, oldest first, then newly admitted ones.
        Blocks for every scheduled token are allocated before this returns.
        """
        budget = self.limits.max_batch_prefill_tokens - sum(
            1 for s in self.running if s.remaining == 1)
        batch: list[Sequence] = []
        preempted = False
        i = 0
        # Oldest first. Preemption only removes the newest, from the end of the list, so
        # the index stays right; a sequence that preempts itself ends the loop.
        while i < len(self.running):
            seq = self.running[i]
            i += 1
            decode = seq.remaining == 1
            want = 1 if decode else min(seq.remaining, budget)
            if want <= 0:
                continue
            n, gave_up = self._make_room(seq, want, partial=not decode)
            preempted |= gave_up
            if n == 0:
                continue
            seq.num_scheduled = n
            budget -= 0 if decode else n
            batch.append(seq)
        if (self.speculate.enabled and not preempted and not self.waiting and batch
                and len(batch) <= self.speculate.max_batch
                and all(s.remaining == 1 for s in batch)):
            for seq in batch:
                self._add_drafts(seq)
        if not preempted:
            batch += self._admit(max(budget, 0))
        if self.running:
            self._steps_since_join += 1
        return batch

    def _add_drafts(self, seq: Sequence) -> None:
        """Give a decoding sequence its drafts, as many as free blocks hold without
        preempting anyone."""
        room = speculation.room(seq, self.speculate)
        if not speculation.can_draft(seq) or room <= 0:
            return
        drafts = self.drafter.draft(seq, room)
        while drafts and not self.blocks.grow(seq.seq_id, seq.num_cached + 1 + len(drafts)):
            drafts.pop()
        if seq.draft_probs is not None:
            seq.draft_probs = seq.draft_probs[: len(drafts)] if drafts else None
        if drafts:
            seq.drafts = drafts
            seq.num_scheduled = 1 + len(drafts)

    def complete(self, batch: list[Sequence],
                 results: Seq[SampledToken | None] | None = None) -> None:
        """Record that a step over ``batch`` succeeded: the fed tokens are now cached.

        Call before appending the sampled tokens. Newly full blocks become
        shareable through the prefix cache. A sequence that fed drafts caches
        its newest token and the drafts its result kept (``SampledToken.more``
        holds one token per kept draft, then the step's own).
        """
        for i, seq in enumerate(batch):
            tokens: Seq[int] = seq.tokens
            fed = seq.num_scheduled
            if seq.drafts:
                result = results[i] if results is not None else None
                kept = len(result.more) if result is not None and result.error is None else 0
                self.counters.drafts += 1
                self.counters.draft_tokens += len(seq.drafts)
                self.counters.accepted_tokens += kept
                speculation.adapt(seq, self.speculate, len(seq.drafts), kept)
                fed = 1 + kept
                tokens = [*seq.tokens, *seq.drafts[:kept]]
                seq.drafts = []
                seq.draft_probs = None
                self.drafter.settle(seq, seq.num_cached + fed)
            seq.num_cached += fed
            seq.num_scheduled = 0
            self.blocks.commit(seq.seq_id, tokens, seq.num_cached,
                               seq.block_keys(self.blocks.block_size))

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence from wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self._by_id.get(seq.request_id) is seq:
            del self._by_id[seq.request_id]
        self.blocks.free(seq.seq_id)
        self.drafter.forget(seq)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and queue it first, to be recomputed later."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_cached = seq.num_scheduled = 0
        seq.drafts = []
        seq.draft_probs = None
        if seq.generated == 0:
            seq.forget_prompt_scores()  # scored again from the start
        seq.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------- helpers
    def _make_room(self, seq: Sequence, want: int, partial: bool) -> tuple[int, bool]:
        """Grow ``seq`` by up to ``want`` tokens, preempting newer sequences if need be.

        A prefill chunk (``partial``) shrinks to what fits rather than preempt,
        and waits a step rather than preempt itself. Returns the tokens granted
        (0 when none) and whether anything was preempted.
        """
        preempted = False
        while True:
            room = self.blocks.room(seq.seq_id) - seq.num_cached
            n = min(want, room) if partial else want
            if n > 0 and self.blocks.grow(seq.seq_id, seq.num_cached + n):
                return n, preempted
            victim = self.running[-1]
            if victim is seq and partial:
                return 0, preempted
            self.preempt(victim)
            preempted = True
            if victim is seq:
                return 0, preempted

    def _admit(self, budget: int) -> list[Sequence]:
        """Move waiting sequences into the running batch, FCFS, within the budgets."""
        if not self.waiting:
            return []
        room_left = self.limits.max_batch_size - len(self.running)
        min_joining = self._min_joining(len(self.running), room_left)
        admitted: list[tuple[Sequence, PrefixHit]] = []
        while self.waiting and budget > 0 and len(admitted) < room_left:
            seq = self.waiting[0]
            # Prompt log-probs need every prompt position computed: no cache hits.
            hit = (PrefixHit(block_size=self.blocks.block_size) if seq.wants_prompt_logprobs
                   else self.blocks.lookup(seq.tokens, seq.block_keys(self.blocks.block_size)))
            # Its whole prompt must fit now, although only the first chunk's blocks are taken.
            reserve = self.reserve_blocks * self.blocks.block_size if self.running else 0
            if self.blocks.room(seq.seq_id, hit) - reserve < len(seq.tokens):
                break
            if self.gate is not None and not self.gate(seq, self.running):
                break
            n = min(len(seq.tokens) - hit.tokens, budget)
            if not self.blocks.allocate(seq.seq_id, hit, hit.tokens + n):
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.num_cached, seq.num_scheduled = hit.tokens, n
            admitted.append((seq, hit))
            budget -= n
        # Newcomers that fill the step's budget join even if fewer than the minimum:
        # no group could get more of this step. (TGI holds them back; with its GPU
        # budget of 4,096 that rarely binds, but with a CPU-sized one it held 64
        # queued 128-token prompts for max_waiting_tokens steps at a time.)
        if len(admitted) < min_joining and budget > 0:
            for seq, _ in reversed(admitted):  # not worth pausing for: put them back
                self.running.remove(seq)
                self.blocks.free(seq.seq_id)
                seq.num_cached = seq.num_scheduled = 0
                self.waiting.appendleft(seq)
            return []
        for seq, hit in admitted:
            self.counters.admitted_tokens += len(seq.tokens)
            self.counters.prefix_hit_tokens += hit.tokens
            if seq.cached_tokens is None:  # its first admission: what the client is told
                seq.cached_tokens = hit.tokens
        if admitted:
            self._steps_since_join = 0
        return [seq for seq, _ in admitted]

    def _min_joining(self, running: int, room_left: int) -> int:
        """How many newcomers must join together (TGI's ``min_size``), at most a full batch.

        None are required when nothing runs, when the batch has waited
        ``max_waiting_tokens`` steps, or when the first in line is a
        preempted sequence resuming.
        """
        if (not running or self._steps_since_join >= self.limits.max_waiting_tokens
                or self.waiting[0].preemptions):
            return 0
        return min(math.floor(running * self.limits.waiting_served_ratio), room_left)
