"""One measured point (peer x shape x streams) and how raw request timings become one.

Every peer, over HTTP or in-process, ends up as a list of per-request timings
(`switchyard.bench.client.RequestResult`: TTFT, inter-token gaps, output
tokens) plus the wall time of the wave, so all rows are computed the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from switchyard.bench.client import RequestResult
from switchyard.bench.stats import percentile

Status = Literal["ok", "partial", "skipped"]


class Point(msgspec.Struct, kw_only=True):
    """One row of the comparison table."""

    peer: str
    shape: str
    streams: int
    status: Status
    reason: str = ""
    """Why a row was skipped, or what went wrong in part of it."""
    requests: int = 0
    ok_requests: int = 0
    output_tokens: int = 0
    wall_s: float | None = None
    """First request sent to last request finished."""
    output_tokens_per_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    itl_p50_s: float | None = None
    itl_p90_s: float | None = None
    note: str = ""
    """How this peer ran the point (e.g. requests served one at a time)."""


def skipped(peer: str, shape: str, streams: int, reason: str) -> Point:
    """A row for a point that was not measured."""
    return Point(peer=peer, shape=shape, streams=streams, status="skipped",
                 reason=_one_line(reason))


def _one_line(text: str, limit: int = 300) -> str:
    """Reasons end up in a markdown table cell: one short line."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def summarize(peer: str, shape: str, streams: int, results: Sequence[RequestResult],
              wall_s: float, note: str = "") -> Point:
    """Aggregate one wave of `streams` concurrent requests into a row.

    Throughput counts successful requests only; ITL percentiles pool every gap
    of every successful request, so they describe a typical token.
    """
    good = [r for r in results if r.ok]
    if not good:
        errors = sorted({r.error or "no tokens" for r in results})
        return skipped(peer, shape, streams, "all requests failed: " + "; ".join(errors[:2]))
    ttfts = [r.ttft_s for r in good if r.ttft_s is not None]
    gaps = [g for r in good for g in r.itl_s]
    tokens = sum(r.output_tokens for r in good)
    failed = len(results) - len(good)
    reason = ""
    if failed:
        first_error = next(r.error for r in results if not r.ok)
        reason = f"{failed} of {len(results)} requests failed: {first_error}"
    return Point(
        peer=peer, shape=shape, streams=streams, status="partial" if failed else "ok",
        reason=_one_line(reason), requests=len(results), ok_requests=len(good),
        output_tokens=tokens, wall_s=wall_s,
        output_tokens_per_s=tokens / max(wall_s, 1e-9),
        ttft_p50_s=percentile(ttfts, 50) if ttfts else None,
        ttft_p90_s=percentile(ttfts, 90) if ttfts else None,
        itl_p50_s=percentile(gaps, 50) if gaps else None,
        itl_p90_s=percentile(gaps, 90) if gaps else None,
        note=note,
    )


def from_worker(peer: str, shape: str, record: dict[str, Any], note: str = "") -> Point:
    """A row from one JSON record printed by a worker script (see `workers/`).

    A record is `{"streams": N, "wall_s": s, "requests": [{"ttft_s", "itl_s",
    "output_tokens", "error"}]}` or `{"streams": N, "error": "..."}`.
    """
    streams = int(record["streams"])
    if record.get("error"):
        return skipped(peer, shape, streams, str(record["error"]))
    results = [RequestResult(sent_at=0.0, e2e_s=float(r.get("e2e_s", 0.0)),
                             ttft_s=r.get("ttft_s"), itl_s=list(r.get("itl_s", [])),
                             output_tokens=int(r.get("output_tokens", 0)), error=r.get("error"))
               for r in record["requests"]]
    return summarize(peer, shape, streams, results, float(record["wall_s"]), note)
