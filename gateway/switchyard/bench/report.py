"""The run's record: the terminal table, `bench.json` and `bench.md`.

The table has the columns of the published TGI benchmark tables (QPS, E2E
latency, TTFT, ITL, throughput, error rate, successful requests, prompt and
decoded tokens per request), drawn as Markdown so the terminal output pastes
into a README as it is.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from switchyard.bench.profile import Profile
from switchyard.bench.stats import LatencyStats, PhaseSummary

COLUMNS = ("Benchmark", "QPS", "E2E Latency (avg)", "TTFT (avg)", "ITL (avg)", "Throughput",
           "Error Rate", "Successful Requests", "Prompt tokens per req (avg)",
           "Decoded tokens per req (avg)")


class BenchReport(msgspec.Struct, kw_only=True):
    """Everything one `switchyard bench` run measured, and the settings that produced it."""

    version: str
    started_at: str
    """UTC, ISO 8601."""
    url: str
    api: str
    model: str | None
    tokenizer: str
    """Where prompt token counts came from: a tokenizer path, `server` or `words`."""
    ignore_eos: bool
    temperature: float
    seed: int
    profile: Profile
    phases: list[PhaseSummary]
    plots: list[str] = []
    """PNG file names, relative to the JSON file."""


def _seconds(value: float) -> str:
    return f"{value:.2f} sec" if value >= 1 else f"{value * 1000:.2f} ms"


def _avg(stats: LatencyStats | None) -> str:
    return _seconds(stats.avg) if stats is not None else "-"


def table_rows(phases: list[PhaseSummary]) -> list[tuple[str, ...]]:
    """One row of formatted cells per phase, in COLUMNS order."""
    return [
        (p.name, f"{p.qps:.2f} req/s", _avg(p.e2e), _avg(p.ttft), _avg(p.itl),
         f"{p.output_tokens_per_s:.2f} tokens/sec", f"{p.error_rate * 100:.2f}%",
         f"{p.successful}/{p.requests}", f"{p.prompt_tokens_avg:.2f}",
         f"{p.output_tokens_avg:.2f}")
        for p in phases
    ]


def markdown_table(phases: list[PhaseSummary]) -> str:
    """The table as GitHub Markdown, columns padded to line up."""
    rows = [COLUMNS, *table_rows(phases)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(rows[0]), rule, *(line(r) for r in rows[1:])])


def write_json(report: BenchReport, path: Path) -> None:
    """`bench.json`: the whole report, indented."""
    path.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n")


def read_json(path: Path) -> BenchReport:
    """Load a `bench.json` back (to re-plot or compare runs)."""
    return msgspec.json.decode(path.read_bytes(), type=BenchReport)


def write_markdown(report: BenchReport, path: Path, command: str) -> None:
    """`bench.md`: the command that ran, the table and the plots."""
    lines = [f"# switchyard bench: {report.url} ({report.api})", "",
             f"Run {report.started_at}, profile `{report.profile.name}`, "
             f"model `{report.model or '-'}`, prompt tokens counted by `{report.tokenizer}`.", "",
             "```bash", command, "```", "", markdown_table(report.phases), ""]
    lines += [f"![{name}]({name})" for name in report.plots]
    path.write_text("\n".join(lines) + "\n")
