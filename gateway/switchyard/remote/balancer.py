"""Which replica of a remote model gets the next request: the power of two choices.

Two replicas drawn at random, the one with the smaller load wins (requests
this gateway has in flight there plus the queue depth its `/metrics` last
reported). Against "always the least loaded" it avoids sending a burst of
requests to the same replica between two scrapes, whose load figure lags;
against random choice it keeps the longest queue short (Mitzenmacher's
result: the maximum load drops from log n / log log n to log log n).
Prefix affinity, which comes first for models that balance on prefixes, is
`remote/affinity.py`; this is its fallback and the whole of `balancing = "load"`.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence

from switchyard.remote.upstream import Replica


def pick(replicas: Sequence[Replica], tried: Collection[Replica] = (),
         rng: random.Random | None = None) -> Replica | None:
    """The replica for the next attempt: available, not tried yet for this request; or None."""
    candidates = [r for r in replicas if r.available and r not in tried]
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    a, b = (rng or random).sample(candidates, 2)
    # Ties go to the first drawn: random, so equal replicas share the requests.
    return b if b.load < a.load else a
