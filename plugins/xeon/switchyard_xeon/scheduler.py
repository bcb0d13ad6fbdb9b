"""Who runs in the next step: the waiting queue, the running batch and admission.

Every step runs all running sequences (one new token each) plus the waiting
sequences admitted at this boundary (their whole prompt). Admission is
first-come first-served and stops at the first request that does not fit, so
a large request is never starved by smaller ones behind it. A request fits when

- the running batch has fewer than ``max_batch_size`` sequences,
- the prompts admitted this step stay within ``max_batch_prefill_tokens``
  (the first one is always let in, so an over-long prompt cannot block the
  queue; chunked prefill will lift that), and
- the cache can reserve the request's worst-case length (prompt plus
  ``max_new_tokens``, capped at ``max_total_tokens``). Reserving the worst case
  means a running sequence never runs out of cache and nothing is preempted.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from switchyard.engine.sampling import RowSampler
from switchyard_spec import EngineRequest, EventSink

from switchyard_xeon.kv_cache import KVCache

_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's life in the engine: its tokens, limits and sampling state."""

    request: EngineRequest
    sink: EventSink
    sampler: RowSampler
    max_length: int
    """Prompt plus the most tokens it may generate (the cache reservation)."""
    ignore_eos: bool
    seq_id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)
    num_cached: int = 0
    """Tokens whose keys/values are in the cache."""
    prompt_logprobs: list[float] = field(default_factory=list)
    """Prompt log-probs computed so far (only when the request asks); sent on the first event."""

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.request.prompt_token_ids)

    @property
    def request_id(self) -> str:
        """The gateway's name for the sequence."""
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        """Tokens in the prompt."""
        return len(self.request.prompt_token_ids)

    @property
    def generated(self) -> int:
        """Tokens generated so far."""
        return len(self.tokens) - self.prompt_len

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt tokens still need their log-probabilities computed."""
        return self.request.prompt_logprobs and self.num_cached < self.prompt_len - 1

    @property
    def new_tokens(self) -> list[int]:
        """Tokens the next forward must feed (the prompt, then one at a time)."""
        return self.tokens[self.num_cached :]


@dataclass(frozen=True)
class Limits:
    """The batch limits the scheduler enforces (all resolved, none 0)."""

    max_batch_size: int
    max_batch_prefill_tokens: int
    max_total_tokens: int


class Scheduler:
    """FCFS admission from the waiting queue into the running batch."""

    def __init__(self, limits: Limits, cache: KVCache) -> None:
        self.limits = limits
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}

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

    def schedule(self) -> list[Sequence]:
        """Admit what fits and return the sequences of the next step (running first)."""
        prefill_tokens = 0
        admitted = 0
        while self.waiting and len(self.running) < self.limits.max_batch_size:
            seq = self.waiting[0]
            n = len(seq.new_tokens)
            if admitted and prefill_tokens + n > self.limits.max_batch_prefill_tokens:
                break
            if not self.cache.can_reserve(seq.max_length):
                break
            self.waiting.popleft()
            self.cache.reserve(seq.seq_id, seq.max_length)
            self.running.append(seq)
            prefill_tokens += n
            admitted += 1
        return list(self.running)

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence from wherever it is and free its cache."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self._by_id.get(seq.request_id) is seq:
            del self._by_id[seq.request_id]
        self.cache.release(seq.seq_id)

    def find(self, request_id: str) -> Sequence | None:
        """The live sequence named ``request_id``, if any."""
        return self._by_id.get(request_id)
