"""One request's life in the engine: its tokens, how many are cached, what the next step feeds.

A sequence's ``tokens`` are its prompt followed by what it generated. The
first ``num_cached`` of them have their keys and values in the cache; the
scheduler sets ``num_scheduled``, how many of the rest the next forward pass
feeds (the whole remaining prompt, a chunk of it, or the one newest token).
When the fed tokens reach the end of ``tokens`` the step samples a new token.

Preemption drops the cache (``num_cached`` back to 0) but keeps ``tokens``
and the sampling state, so the sequence is re-prefilled from its prompt *and*
its generated tokens and continues exactly where it stopped.

Pure Python: the sampler is held, never used, here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from switchyard_spec import EngineRequest, EventSink, TopToken

if TYPE_CHECKING:
    from switchyard.engine.sampling import RowSampler

_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """A request being served: tokens, cache progress and sampling state."""

    request: EngineRequest
    sink: EventSink
    sampler: RowSampler
    max_length: int
    """Prompt plus the most tokens it may generate."""
    ignore_eos: bool
    seq_id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)
    num_cached: int = 0
    """Tokens whose keys/values are in the cache."""
    num_scheduled: int = 0
    """Tokens the coming step feeds, from ``num_cached`` on (set by the scheduler)."""
    prompt_logprobs: list[float] = field(default_factory=list)
    """Prompt log-probs computed so far (only when the request asks); sent on the first event."""
    prompt_top_tokens: list[tuple[TopToken, ...]] = field(default_factory=list)
    """The most likely tokens at each scored prompt position (when the request asks for
    prompt log-probs and ``top_n_tokens``); sent on the first event with them."""
    preemptions: int = 0
    """Times this sequence lost its cache and went back to the waiting queue."""

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
    def remaining(self) -> int:
        """Tokens not yet in the cache: 1 while decoding, more while (re-)prefilling."""
        return len(self.tokens) - self.num_cached

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt tokens still need their log-probabilities computed.

        Only before the first generated token: a preempted sequence has
        delivered them already and does not score its prompt again.
        """
        return (self.request.prompt_logprobs and self.generated == 0
                and self.num_cached < self.prompt_len - 1)

    @property
    def prompt_top_n(self) -> int:
        """How many alternatives to report per scored prompt position (0: none)."""
        return self.request.sampling.top_n_tokens if self.request.prompt_logprobs else 0

    def forget_prompt_scores(self) -> None:
        """Drop the prompt's scores: delivered, or to be computed again after preemption."""
        self.prompt_logprobs = []
        self.prompt_top_tokens = []

    @property
    def new_tokens(self) -> list[int]:
        """Tokens the coming step feeds."""
        return self.tokens[self.num_cached : self.num_cached + self.num_scheduled]

    @property
    def samples(self) -> bool:
        """Whether the coming step ends at the last token, and so samples the next one."""
        return self.num_cached + self.num_scheduled == len(self.tokens)
