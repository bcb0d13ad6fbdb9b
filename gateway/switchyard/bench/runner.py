"""Run one phase: closed loop (N users back to back) or open loop (constant rate).

Open loop sends on a schedule whatever the server's state, as real traffic
does, so queueing shows up as latency; closed loop finds max throughput.
Both stop sending at the phase's duration or request cap and wait for what
is in flight; each request fails at its own timeout, so a phase always ends.
Under overload, slow requests therefore show up as latency (up to the
timeout), not as a cliff in the error rate at an arbitrary cut-off.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import httpx
import msgspec

from switchyard.bench.client import Endpoint, RequestResult, RequestSpec, send
from switchyard.bench.profile import Arrival, Phase

CANCELLED = "cancelled: still running after its timeout"
GRACE_S = 2.0
"""Past the last timeout, a safety net: whatever still runs is cancelled."""


class PhaseRun(msgspec.Struct):
    """The raw results of one phase and its wall time.

    Wall time runs from the first send to the last end, and for open loop at least
    to the end of the sending window: a Poisson draw that leaves the window's tail
    empty must not raise the measured rate.
    """

    results: list[RequestResult]
    elapsed_s: float


def arrival_gaps(rate: float, arrival: Arrival, rng: random.Random) -> Callable[[], float]:
    """Seconds between consecutive sends: exponential (Poisson process) or fixed."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if arrival == "poisson":
        return lambda: rng.expovariate(rate)
    return lambda: 1.0 / rate


class _Recorder:
    """Sends requests as tasks and records each outcome exactly once."""

    def __init__(self, client: httpx.AsyncClient, endpoint: Endpoint, timeout_s: float,
                 on_done: Callable[[RequestResult], None] | None) -> None:
        self.client, self.endpoint, self.timeout_s = client, endpoint, timeout_s
        self.on_done = on_done
        self.results: list[RequestResult] = []
        self.start = time.perf_counter()

    def _record(self, result: RequestResult) -> None:
        self.results.append(result)
        if self.on_done is not None:
            self.on_done(result)

    async def one(self, spec: RequestSpec) -> None:
        sent = time.perf_counter()
        sent_at = sent - self.start
        try:
            result = await asyncio.wait_for(send(self.client, self.endpoint, spec, sent_at),
                                            self.timeout_s)
        except TimeoutError:
            result = RequestResult(sent_at=sent_at, e2e_s=time.perf_counter() - sent,
                                   error=f"timeout after {self.timeout_s:g}s")
        except asyncio.CancelledError:
            self._record(RequestResult(sent_at=sent_at, e2e_s=time.perf_counter() - sent,
                                       error=CANCELLED))
            raise
        self._record(result)

    async def finish(self, tasks: set[asyncio.Task[None]], drain_until: float,
                     window_s: float = 0.0) -> PhaseRun:
        """Wait for `tasks` until `drain_until` (perf_counter time), cancel the rest."""
        if tasks:
            left = max(drain_until - time.perf_counter(), 0)
            _, pending = await asyncio.wait(tasks, timeout=left)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        elapsed = max(time.perf_counter() - self.start, window_s)
        return PhaseRun(results=self.results, elapsed_s=elapsed)


async def run_closed_loop(phase: Phase, client: httpx.AsyncClient, endpoint: Endpoint,
                          make_request: Callable[[], RequestSpec], *, timeout_s: float,
                          on_done: Callable[[RequestResult], None] | None = None) -> PhaseRun:
    """`phase.concurrency` users, each sending its next request when its last one ends."""
    rec = _Recorder(client, endpoint, timeout_s, on_done)
    deadline = rec.start + phase.duration_s
    issued = 0

    async def user() -> None:
        nonlocal issued
        while time.perf_counter() < deadline and issued < phase.max_requests:
            issued += 1  # counted before awaiting, so users never overshoot the cap together
            await rec.one(make_request())

    users = {asyncio.create_task(user()) for _ in range(max(phase.concurrency or 1, 1))}
    return await rec.finish(users, deadline + timeout_s + GRACE_S)


async def run_open_loop(phase: Phase, client: httpx.AsyncClient, endpoint: Endpoint,
                        make_request: Callable[[], RequestSpec], *, arrival: Arrival,
                        rng: random.Random, timeout_s: float,
                        on_done: Callable[[RequestResult], None] | None = None) -> PhaseRun:
    """Send at `phase.rate` req/s on a schedule, not waiting for answers."""
    assert phase.rate is not None, "an open-loop phase needs a rate"
    rec = _Recorder(client, endpoint, timeout_s, on_done)
    gap = arrival_gaps(phase.rate, arrival, rng)
    tasks: set[asyncio.Task[None]] = set()
    due = 0.0  # the first request goes at once; later ones follow the arrival process
    last_sent = 0.0
    while len(tasks) < phase.max_requests and due < phase.duration_s:
        # Sleep to the absolute due time, so slow loop turns do not stretch the schedule.
        await asyncio.sleep(max(rec.start + due - time.perf_counter(), 0))
        tasks.add(asyncio.create_task(rec.one(make_request())))
        last_sent = due
        due += gap()
    # Stopped by the clock: the window is the whole duration; by the cap: up to the last send.
    window = phase.duration_s if due >= phase.duration_s else last_sent
    return await rec.finish(tasks, rec.start + phase.duration_s + timeout_s + GRACE_S, window)
