"""A progress bar per phase (tqdm, on stderr).

A phase ends at its duration or at its request cap, whichever comes first,
so the bar shows the larger of the two fractions, and counts answers and
errors beside it.
"""

from __future__ import annotations

import asyncio
import sys
import time

from tqdm import tqdm

from switchyard.bench.client import RequestResult
from switchyard.bench.profile import Phase


class PhaseProgress:
    """Use as `async with PhaseProgress(phase, enabled) as bar:` and pass `bar.done` on.

    Off where stderr is not a terminal (CI logs would fill with redraws).
    """

    def __init__(self, phase: Phase, enabled: bool) -> None:
        self.phase = phase
        self.ok = 0
        self.failed = 0
        self._bar = tqdm(total=100, desc=f"{phase.name:<22}", unit="%", file=sys.stderr,
                         disable=None if enabled else True, leave=True,
                         bar_format="{desc} {bar} {n_fmt:>3}% {elapsed}{postfix}")
        self._start = time.perf_counter()
        self._ticker: asyncio.Task[None] | None = None

    def done(self, result: RequestResult) -> None:
        """Count one finished request."""
        if result.ok:
            self.ok += 1
        else:
            self.failed += 1

    def _refresh(self) -> None:
        elapsed = time.perf_counter() - self._start
        by_time = elapsed / self.phase.duration_s if self.phase.duration_s > 0 else 0.0
        by_count = (self.ok + self.failed) / max(self.phase.max_requests, 1)
        pct = min(int(max(by_time, by_count) * 100), 100)
        self._bar.n = pct
        self._bar.set_postfix_str(f"ok={self.ok} errors={self.failed}", refresh=False)
        self._bar.refresh()

    async def _tick(self) -> None:
        while True:
            self._refresh()
            await asyncio.sleep(0.25)

    async def __aenter__(self) -> PhaseProgress:
        self._ticker = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        # A phase that ended early (all answered) still reads as complete.
        self._bar.n = 100
        self._bar.set_postfix_str(f"ok={self.ok} errors={self.failed}", refresh=False)
        self._bar.close()
