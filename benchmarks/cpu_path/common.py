"""Shared helpers for the CPU forward-path microbenchmarks (timing, load, model shapes).

The machine is shared, so every number is a median over repeats and every run
prints the load average before and after; compare variants from the same run.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
for sub in ("gateway", "spec", "plugins/xeon"):
    p = str(REPO / sub)
    if p not in sys.path:
        sys.path.insert(0, p)

MODELS = Path(os.environ.get("BENCH_MODELS", "/tmp/bench-models"))
MEM_BW_GBS = 46.0
"""Measured memory read bandwidth of this machine (benchmarks/bandwidth.py)."""

# SmolLM2-135M shape: (out_features, in_features) of each linear of one layer.
SMALL = dict(hidden=576, inter=1536, layers=30, heads=9, kv_heads=3, head_dim=64, vocab=49152)


def layer_linears(cfg: dict = SMALL) -> dict[str, tuple[int, int]]:
    h, i, d = cfg["hidden"], cfg["inter"], cfg["head_dim"]
    return {
        "q": (cfg["heads"] * d, h), "k": (cfg["kv_heads"] * d, h), "v": (cfg["kv_heads"] * d, h),
        "o": (h, cfg["heads"] * d), "gate": (i, h), "up": (i, h), "down": (h, i),
    }


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def timeit(fn: Callable[[], object], repeats: int = 7, inner: int = 1, warmup: int = 2) -> dict:
    """Median / min seconds per call of ``fn`` over ``repeats`` batches of ``inner`` calls.

    ``cpu`` is the median process CPU time per call: on this shared machine it
    is the better measure for single-threaded runs (it does not count time the
    scheduler gave to other people's processes).
    """
    for _ in range(warmup):
        fn()
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
        cpu.append((time.process_time() - c0) / inner)
    return {"median": statistics.median(times), "min": min(times), "all": times,
            "cpu": statistics.median(cpu)}


def setup_threads(n: int | None = None) -> int:
    n = n or int(os.environ.get("BENCH_THREADS", "0")) or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n


def header(title: str) -> None:
    print(f"# {title}")
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load {load()}, nice {os.nice(0)}")


def cpu_idle_fraction(seconds: float = 0.5) -> float:
    """Share of all CPUs' time that was idle over ``seconds`` (from /proc/stat)."""
    def snap():
        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:]]
        return v[3] + v[4], sum(v)
    i0, t0 = snap()
    time.sleep(seconds)
    i1, t1 = snap()
    return (i1 - i0) / max(1, t1 - t0)


def wait_idle(min_idle: float = 0.9, max_wait: float = 900.0) -> float:
    """Block until the machine looks idle (others' load gone); returns the seconds waited.

    Used with ``--gate``: each timed round starts only in an idle window, so
    2-thread numbers are not dominated by other people's processes stealing a
    core from one OpenMP thread (every parallel region then waits for it).
    """
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait:
        if cpu_idle_fraction() >= min_idle:
            break
    return time.perf_counter() - t0
