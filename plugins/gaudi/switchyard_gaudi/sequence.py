"""One request's life in the Gaudi engine: its tokens, its cache row, its sampling state.

A sequence waits in the queue until a prefill step takes it; from then on it
owns one row of the static KV cache (``row``) until it finishes. Its
``tokens`` are the prompt followed by what it generated; the cache holds the
keys and values of all but the newest token, which the next decode step feeds.

Pure Python: the sampler is held here, never used.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from switchyard_spec import EngineRequest, EventSink, TopToken

if TYPE_CHECKING:
    from switchyard.engine.sampling import RowSampler

_arrivals = itertools.count()


@dataclass(eq=False)
class GaudiSequence:
    """A request being served: tokens, cache row, sampling state and queue timing."""

    request: EngineRequest
    sink: EventSink
    sampler: RowSampler
    max_length: int
    """Prompt plus the most tokens it may generate."""
    ignore_eos: bool
    arrival: int = field(default_factory=lambda: next(_arrivals))
    """Submission order: ties between equal prompt lengths go to the earlier one."""
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    """When its prefill step began (ends its queue time)."""
    tokens: list[int] = field(default_factory=list)
    row: int | None = None
    """Its row of the KV cache while it runs."""
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_tokens: list[tuple[TopToken, ...]] = field(default_factory=list)

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
    def cached(self) -> int:
        """Tokens whose keys and values are in its cache row (all but the newest)."""
        return len(self.tokens) - 1 if self.generated else 0
