"""What every engine's sequence holds: the request, its tokens and its sampling state.

Engines subclass :class:`BaseSequence` with their own bookkeeping (the Xeon
engine's cache progress and scheduled chunk, the Gaudi engine's cache row and
arrival order); the shared pieces (:func:`~switchyard_engine.lifecycle.finish_reason`,
admission checks, events) read only what is here.

Pure Python: the sampler is held here, never used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from switchyard_spec import EngineRequest, EventSink, TopToken

if TYPE_CHECKING:
    from switchyard_engine.sampling import RowSampler


@dataclass(eq=False)
class BaseSequence:
    """A request being served: its tokens (prompt, then generated) and sampling state."""

    request: EngineRequest
    sink: EventSink
    sampler: RowSampler
    max_length: int
    """Prompt plus the most tokens it may generate."""
    ignore_eos: bool
    tokens: list[int] = field(default_factory=list)
    """The prompt followed by what was generated (the prompt when left empty)."""
    prompt_logprobs: list[float] = field(default_factory=list)
    """Prompt log-probs computed so far (only when the request asks); sent on the first event."""
    prompt_top_tokens: list[tuple[TopToken, ...]] = field(default_factory=list)
    """The most likely tokens at each scored prompt position (when the request asks for
    prompt log-probs and ``top_n_tokens``); sent on the first event with them."""
    queued_at: float = field(default_factory=time.monotonic)
    """When it was submitted (``time.monotonic``; the compute loop sets it from the
    command's time): the start of its queue time."""
    started_at: float | None = None
    """When the first forward step it was in began: the end of its queue time
    (``TokenEvent.queue_seconds``, on its first event)."""
    cached_tokens: int | None = None
    """Prompt tokens a prefix cache gave it when it was first admitted (None before,
    and always on engines without one): ``TokenEvent.cached_tokens``."""

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

    def queue_seconds(self) -> float:
        """Its queue time: submission to its first step (to now, if it has not run)."""
        started = self.started_at if self.started_at is not None else time.monotonic()
        return started - self.queued_at

    def forget_prompt_scores(self) -> None:
        """Drop the prompt's scores: delivered, or to be computed again after preemption."""
        self.prompt_logprobs = []
        self.prompt_top_tokens = []
