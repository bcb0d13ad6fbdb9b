"""Threads that share the machine: the engine's torch threads follow the cores left to it.

A step's parallel regions end at a barrier, so they run at the pace of the
slowest thread. When another process holds one of the engine's cores, the
thread on that core gets a fraction of it and every region waits for it,
while the others spin at the barrier: on a 2-core VM beside one busy process
a token took 2.3-8.8x as long as alone with two threads, and 1.7x with one
(``benchmarks/shared_machine.py``). So the engine watches how much of its
CPUs other processes use (``/proc/stat``'s busy time on those CPUs less this
process's own CPU time) and runs one thread fewer per core they take, back up
when they leave. Each thread computes whole outputs (panels, heads,
sequences), so the thread count changes no number the engine computes.

Idle threads do not spin: between steps libgomp's workers spin for a short
while (``GOMP_SPINCOUNT``, its default) and then sleep on a futex, and an
idle engine's compute thread blocks on its inbox.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger("switchyard.xeon")

PROC_STAT = "/proc/stat"
POLL_S = 1.0
"""How often the share is measured (a window of this length)."""
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""user, nice, system, irq, softirq, steal in a ``/proc/stat`` cpu line (guest time is
already in user; steal is time the hypervisor gave to someone else)."""


def busy_seconds(cpus: Iterable[int], path: str = PROC_STAT) -> float | None:
    """CPU-seconds the given CPUs have spent busy since boot (None when unreadable)."""
    wanted = {f"cpu{c}" for c in cpus}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                name, _, rest = line.partition(" ")
                if name in wanted:
                    fields = rest.split()
                    total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    except (OSError, ValueError):
        return None
    return total / tick


@dataclass
class CpuShare:
    """Sizes the engine's torch threads to the cores other processes leave it.

    Call :meth:`poll` on the compute thread before each step (it measures at
    most every ``interval_s``); it returns the new thread count when that
    should change. A change needs two windows in a row that agree, so one
    burst of another process does not move it.
    """

    cpus: frozenset[int]
    limit: int
    """The most threads: the configured count."""
    interval_s: float = POLL_S
    busy: Callable[[], float | None] = None  # type: ignore[assignment]
    own: Callable[[], float] = time.process_time
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if self.busy is None:
            self.busy = lambda: busy_seconds(self.cpus)
        self.threads = self.limit
        self.others = 0.0
        """Cores' worth of the engine's CPUs other processes used in the last window."""
        self._pending: int | None = None
        self._mark = self._sample()

    def _sample(self) -> tuple[float, float | None, float]:
        return self.clock(), self.busy(), self.own()

    def poll(self) -> int | None:
        """The thread count to switch to now, or None to keep the current one."""
        now = self.clock()
        if now - self._mark[0] < self.interval_s:
            return None
        then, mark = self._mark, self._sample()
        self._mark = mark
        if then[1] is None or mark[1] is None:
            return None
        wall = mark[0] - then[0]
        self.others = max(0.0, (mark[1] - then[1]) - (mark[2] - then[2])) / wall
        want = max(1, min(self.limit, int(len(self.cpus) - self.others + 0.5)))
        if want == self.threads:
            self._pending = None
            return None
        if self._pending != want:  # first window that disagrees: wait for a second
            self._pending = want
            return None
        self._pending = None
        self.threads = want
        return want
