"""Benchmark profiles: which phases to run, with what request shapes, for how long.

A profile is warmup, then a max-throughput run (closed loop: N users, each
sending its next request when the previous one ends), then a sweep of
constant request rates (open loop). Every phase is bounded both by a duration
and by a request count, and every request by its own timeout, so a run always
stops by itself.
"""

from __future__ import annotations

import random
from typing import Literal

import msgspec

Arrival = Literal["poisson", "uniform"]
PhaseKind = Literal["warmup", "throughput", "constant"]


class LengthSpec(msgspec.Struct, frozen=True):
    """A token count: fixed when `low == high`, otherwise sampled uniformly in [low, high]."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        """Read `"200"` (fixed) or `"100:300"` (uniform range, inclusive)."""
        parts = text.split(":")
        if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"expected N or LOW:HIGH token counts, got {text!r}")
        low, high = int(parts[0]), int(parts[-1])
        if low < 1 or high < low:
            raise ValueError(f"token counts must satisfy 1 <= LOW <= HIGH, got {text!r}")
        return cls(low, high)

    def sample(self, rng: random.Random) -> int:
        """One count; a fixed spec consumes no randomness, so fixed runs stay comparable."""
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def describe(self) -> str:
        """`200` or `100:300`, as it is written on the command line."""
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    """Everything that decides the load a run sends."""

    name: str
    input_tokens: LengthSpec
    output_tokens: LengthSpec
    warmup_requests: int
    """Sent one at a time before anything is measured (compiles, caches, page-ins)."""
    throughput: bool = True
    """Run the closed-loop max-throughput phase."""
    concurrency: int
    """Users in the max-throughput phase."""
    duration_s: float
    """Length of the max-throughput phase and of each constant-rate phase."""
    max_requests: int
    """Cap on requests sent in each phase, whichever of the two limits comes first."""
    rates: tuple[float, ...] | None = None
    """Constant request rates (req/s); None: derive them from the max-throughput result."""
    rate_steps: int = 10
    """How many rates an automatic sweep has."""
    rate_factor: float = 1.2
    """An automatic sweep reaches this multiple of the measured max QPS (past saturation)."""
    arrival: Arrival = "poisson"
    request_timeout_s: float = 120.0
    """A request still running after this long fails; a phase thus ends by
    `duration_s + request_timeout_s`."""


class Phase(msgspec.Struct, frozen=True, kw_only=True):
    """One measured stretch of a run, as the runner executes it."""

    name: str
    kind: PhaseKind
    duration_s: float
    max_requests: int
    concurrency: int | None = None
    """Closed loop: this many users. None for open-loop phases."""
    rate: float | None = None
    """Open loop: offered requests per second. None for closed-loop phases."""


PROFILES: dict[str, Profile] = {
    # CI and smoke checks: seconds, tiny requests.
    "smoke": Profile(name="smoke", input_tokens=LengthSpec(16, 16), output_tokens=LengthSpec(8, 8),
                     warmup_requests=1, concurrency=4, duration_s=3.0, max_requests=24,
                     rate_steps=2, request_timeout_s=30.0),
    # A first look in about a minute.
    "quick": Profile(name="quick", input_tokens=LengthSpec(64, 64),
                     output_tokens=LengthSpec(32, 32), warmup_requests=2, concurrency=8,
                     duration_s=10.0, max_requests=200, rate_steps=4,
                     request_timeout_s=60.0),
    # A full sweep on a small model (about 12 minutes).
    "default": Profile(name="default", input_tokens=LengthSpec(200, 200),
                       output_tokens=LengthSpec(200, 200), warmup_requests=3, concurrency=32,
                       duration_s=60.0, max_requests=2000),
    # inference-benchmarker's fixed-length shape (200 in, 800 out, 2-minute phases).
    "fixed-length": Profile(name="fixed-length", input_tokens=LengthSpec(200, 200),
                            output_tokens=LengthSpec(800, 800), warmup_requests=3,
                            concurrency=128, duration_s=120.0, max_requests=5000,
                            request_timeout_s=300.0),
    # Chat-like: varied prompt and answer lengths.
    "chat": Profile(name="chat", input_tokens=LengthSpec(50, 500),
                    output_tokens=LengthSpec(50, 400), warmup_requests=3, concurrency=32,
                    duration_s=60.0, max_requests=2000),
}


def auto_rates(max_qps: float, steps: int, factor: float) -> tuple[float, ...]:
    """Evenly spaced rates from `factor * max_qps / steps` up to `factor * max_qps`."""
    if max_qps <= 0 or steps < 1:
        return ()
    top = max_qps * factor
    return tuple(round(top * k / steps, 3) for k in range(1, steps + 1))


def warmup_phase(profile: Profile) -> Phase:
    """One user, `warmup_requests` requests; the time cap only guards against a hung server."""
    cap = profile.request_timeout_s * max(profile.warmup_requests, 1)
    return Phase(name="warmup", kind="warmup", duration_s=cap, concurrency=1,
                 max_requests=profile.warmup_requests)


def throughput_phase(profile: Profile) -> Phase:
    """The closed-loop phase that finds the server's max throughput."""
    return Phase(name="throughput", kind="throughput", duration_s=profile.duration_s,
                 concurrency=profile.concurrency, max_requests=profile.max_requests)


def rate_phases(rates: tuple[float, ...], profile: Profile) -> list[Phase]:
    """One open-loop phase per rate; zero or negative rates are dropped."""
    return [Phase(name=f"constant@{r:.2f}req/s", kind="constant", duration_s=profile.duration_s,
                  rate=r, max_requests=profile.max_requests) for r in rates if r > 0]


def worst_case_seconds(profile: Profile) -> float:
    """An upper bound on the run's length, printed before it starts."""
    per_phase = profile.duration_s + profile.request_timeout_s
    sweeps = len(profile.rates) if profile.rates is not None else profile.rate_steps
    return (profile.request_timeout_s * profile.warmup_requests
            + per_phase * (sweeps + (1 if profile.throughput else 0)))


def parse_rates(text: str) -> tuple[float, ...]:
    """`"0.5,1,2"` into request rates; each must be positive."""
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated req/s values, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"request rates must be positive, got {text!r}")
    return rates


def resolve_profile(name: str, *, input_tokens: str | None = None,
                    output_tokens: str | None = None, rates: str | None = None,
                    **overrides: object) -> Profile:
    """A built-in profile with command-line overrides; None values leave a field as it is.

    `overrides` are Profile field names (duration_s, max_requests, concurrency, ...).
    """
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}")
    changes: dict[str, object] = {k: v for k, v in overrides.items() if v is not None}
    if input_tokens is not None:
        changes["input_tokens"] = LengthSpec.parse(input_tokens)
    if output_tokens is not None:
        changes["output_tokens"] = LengthSpec.parse(output_tokens)
    if rates is not None:
        changes["rates"] = parse_rates(rates)
    return msgspec.structs.replace(PROFILES[name], **changes)
