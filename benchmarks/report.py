"""The run's outputs: `results.json`, `results.md` (tables) and `results.png` (plots)."""

from __future__ import annotations

from pathlib import Path

import msgspec
from bandwidth import Bandwidth, DecodeBound
from results import Point


class RunReport(msgspec.Struct, kw_only=True):
    """Everything one run measured, as written to results.json."""

    command: str
    machine: str
    settings: dict[str, object]
    bandwidth: Bandwidth | None = None
    bounds: dict[str, DecodeBound] = {}
    """Batch-1 decode bound per shape."""
    points: list[Point] = []


BYTES_DIVISOR = {"int8": 2, "smoothquant": 2, "int4": 4, "gguf": 4}
"""bf16 bytes per weight over a quantized peer's, by the peer name's last part."""


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return lines


def markdown(report: RunReport) -> str:
    """The comparison table, then batch 1 against the bandwidth bound, then notes."""
    out = ["# Switchyard vs peers", "", f"`{report.command}`", "", report.machine, ""]
    settings = ", ".join(f"{k}={v}" for k, v in report.settings.items())
    out += [f"Dtype: **{report.settings.get('dtype', '?')}** (every peer); checkpoint saved in "
            f"{report.settings.get('checkpoint_dtype', 'float32')}.", "",
            f"Settings: {settings}.", ""]
    rows = [[p.shape, p.peer, str(p.streams), p.status, _num(p.output_tokens_per_s),
             _ms(p.ttft_p50_s), _ms(p.ttft_p90_s), _ms(p.itl_p50_s), _ms(p.itl_p90_s),
             p.reason] for p in report.points]
    out += _table(["shape", "peer", "streams", "status", "output tok/s", "TTFT p50 ms",
                   "TTFT p90 ms", "ITL p50 ms", "ITL p90 ms", "skipped because / errors"], rows)
    if report.bandwidth is not None:
        bw = report.bandwidth
        dtype = report.settings.get("dtype", "bfloat16")
        stored = report.settings.get("checkpoint_dtype", dtype)
        if stored == "bfloat16":  # the least a peer reads without quantizing
            dtype = "bfloat16"
        out += ["", "## Batch 1 against the memory-bandwidth bound", "",
                (f"Read bandwidth {bw.read_gbs:.1f} GB/s (sum of a {bw.size_mib} MiB float32 "
                 f"tensor, {bw.threads} threads, best of {bw.repeats}); copy "
                 f"{bw.copy_gbs:.1f} GB/s. Bound = read bandwidth / ({dtype} weights + KV "
                 "cache read per step at the mean context; int8 and smoothquant peers: "
                 "one byte per weight, int4 and gguf (Q4 blocks) peers half a byte, scales "
                 "not counted). Decode tok/s = 1 / ITL p50."), ""]
        rows = []
        for shape, bound in report.bounds.items():
            for p in report.points:
                if p.shape != shape or p.streams != 1 or p.itl_p50_s is None:
                    continue
                decode = 1 / p.itl_p50_s
                # A quantized peer reads fewer bytes per weight: its bound is its own.
                weights = bound.weight_bytes / BYTES_DIVISOR.get(p.peer.rsplit("-", 1)[-1], 1)
                tokens_s = bw.read_gbs * 1e9 / (weights + bound.kv_bytes)
                rows.append([shape, p.peer, f"{weights / 1e6:.0f}",
                             f"{bound.kv_bytes / 1e6:.1f}", _num(tokens_s),
                             _num(decode), f"{100 * decode / tokens_s:.0f}%"])
        out += _table(["shape", "peer", "weights MB", "KV MB", "bound tok/s",
                       "decode tok/s", "of bound"], rows)
    notes = sorted({(p.peer, p.note) for p in report.points if p.note})
    if notes:
        out += ["", "## How each peer ran", ""] + [f"- {peer}: {note}" for peer, note in notes]
    return "\n".join(out) + "\n"


def plot(report: RunReport, path: Path) -> None:
    """Per shape: output tok/s, TTFT p50 and ITL p50 against concurrent streams."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(p.shape for p in report.points))
    peers = list(dict.fromkeys(p.peer for p in report.points))
    if not shapes:
        return
    streams = sorted({p.streams for p in report.points})
    panels = [("output_tokens_per_s", "output tokens/s", 1.0),
              ("ttft_p50_s", "TTFT p50 (ms)", 1000.0), ("itl_p50_s", "ITL p50 (ms)", 1000.0)]
    fig, axes = plt.subplots(len(shapes), len(panels), figsize=(15, 4.2 * len(shapes)),
                             squeeze=False)
    for row, shape in enumerate(shapes):
        for col, (field, label, scale) in enumerate(panels):
            ax = axes[row][col]
            for peer in peers:
                pts = [p for p in report.points if p.shape == shape and p.peer == peer
                       and getattr(p, field) is not None]
                if pts:
                    ax.plot([p.streams for p in pts], [getattr(p, field) * scale for p in pts],
                            marker="o", label=peer)
            bound = report.bounds.get(shape)
            if col == 0 and bound is not None:
                ax.plot([1], [bound.tokens_per_s], marker="*", markersize=14, color="black",
                        linestyle="none", label="bandwidth bound (batch 1)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(streams, [str(n) for n in streams])  # 1, 8, 32 rather than 2^k
            ax.minorticks_off()
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel(label)
            ax.set_title(f"{shape}: {label}")
            ax.grid(True, alpha=0.3)
            if col == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: RunReport, out_dir: Path) -> None:
    """Write all three files (called after every peer, so an interrupted run keeps its rows)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    (out_dir / "results.md").write_text(markdown(report))
    plot(report, out_dir / "results.png")
