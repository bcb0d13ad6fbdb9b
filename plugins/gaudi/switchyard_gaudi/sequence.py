"""One request's life in the Gaudi engine: its cache row and its arrival order.

A sequence waits in the queue until a prefill step takes it; from then on it
owns one row of the static KV cache (``row``) until it finishes. Its
``tokens`` are the prompt followed by what it generated; the cache holds the
keys and values of all but the newest token, which the next decode step feeds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from switchyard_engine.sequence import BaseSequence

_arrivals = itertools.count()


@dataclass(eq=False)
class GaudiSequence(BaseSequence):
    """A request being served: the toolkit's sequence, plus its cache row and arrival order."""

    arrival: int = field(default_factory=lambda: next(_arrivals))
    """Submission order: ties between equal prompt lengths go to the earlier one."""
    row: int | None = None
    """Its row of the KV cache while it runs."""

    @property
    def cached(self) -> int:
        """Tokens whose keys and values are in its cache row (all but the newest)."""
        return len(self.tokens) - 1 if self.generated else 0
