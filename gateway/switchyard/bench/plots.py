"""PNG charts of a run: latency, TTFT/ITL and throughput against offered load.

The x axis is the offered rate of the constant-rate phases; the closed-loop
max-throughput result is drawn as a dashed reference line. matplotlib runs on
its Agg backend, so no display is needed.
"""

from __future__ import annotations

from pathlib import Path

from switchyard.bench.report import BenchReport
from switchyard.bench.stats import LatencyStats, PhaseSummary

PLOTS = ("latency.png", "ttft_itl.png", "throughput.png")


def _series(phases: list[PhaseSummary], pick: str, field: str) -> list[float]:
    """Milliseconds of one statistic per phase (NaN where a phase had no success)."""
    values = []
    for p in phases:
        stats: LatencyStats | None = getattr(p, pick)
        values.append(getattr(stats, field) * 1000 if stats is not None else float("nan"))
    return values


def write_plots(report: BenchReport, out_dir: Path) -> list[str]:
    """Write the PNGs into `out_dir`; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot's import
    import matplotlib.pyplot as plt

    sweep = [p for p in report.phases if p.kind == "constant" and p.target_rate is not None]
    sweep.sort(key=lambda p: p.target_rate or 0.0)
    peak = next((p for p in report.phases if p.kind == "throughput"), None)
    rates = [p.target_rate or 0.0 for p in sweep]
    title = f"{report.model or report.url} ({report.api}, profile {report.profile.name})"

    def axes_for(panels: int):  # type: ignore[no-untyped-def]
        fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, 4.4), squeeze=False)
        fig.suptitle(title, fontsize=10)
        for ax in axes[0]:
            ax.set_xlabel("offered load (req/s)")
            ax.grid(True, alpha=0.3)
            if not sweep:
                ax.text(0.5, 0.5, "no constant-rate phases", ha="center",
                        transform=ax.transAxes)
        return fig, axes[0]

    def latency_panel(ax, pick: str, label: str) -> None:  # type: ignore[no-untyped-def]
        for field, style in (("avg", "o-"), ("p50", "s--"), ("p90", "^--"), ("p99", "v:")):
            ax.plot(rates, _series(sweep, pick, field), style, label=field)
        ax.set_ylabel(f"{label} (ms)")
        ax.set_title(label)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)

    written: list[str] = []

    fig, (ax,) = axes_for(1)
    latency_panel(ax, "e2e", "end-to-end latency")
    written.append(_save(fig, plt, out_dir / PLOTS[0]))

    fig, (ax_ttft, ax_itl) = axes_for(2)
    latency_panel(ax_ttft, "ttft", "time to first token")
    latency_panel(ax_itl, "itl", "inter-token latency")
    written.append(_save(fig, plt, out_dir / PLOTS[1]))

    fig, (ax_tok, ax_qps) = axes_for(2)
    ax_tok.plot(rates, [p.output_tokens_per_s for p in sweep], "o-", label="constant rate")
    ax_tok.set_ylabel("output tokens/s")
    ax_tok.set_title("output throughput")
    ax_qps.plot(rates, [p.qps for p in sweep], "o-", label="achieved")
    ax_qps.plot(rates, rates, ":", color="gray", label="offered")
    ax_qps.set_ylabel("successful req/s")
    ax_qps.set_title("achieved request rate")
    if peak is not None:
        ax_tok.axhline(peak.output_tokens_per_s, ls="--", color="red",
                       label=f"max throughput ({peak.concurrency} users)")
        ax_qps.axhline(peak.qps, ls="--", color="red",
                       label=f"max throughput ({peak.concurrency} users)")
    for a in (ax_tok, ax_qps):
        a.set_ylim(bottom=0)
        a.legend(fontsize=8)
    written.append(_save(fig, plt, out_dir / PLOTS[2]))
    return written


def _save(fig, plt, path: Path) -> str:  # type: ignore[no-untyped-def]
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path.name
