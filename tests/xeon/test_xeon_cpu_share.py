"""Threads that share the machine: the thread budget (cores, cgroup quota) and the share
other processes leave, measured and followed by the engine between steps."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import pytest

from switchyard_spec import EngineConfig
from switchyard_xeon import machine
from switchyard_xeon.cpu_share import CpuShare, busy_seconds
from switchyard_xeon.engine import XeonEngine

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.xeon_options import TEST_OPTIONS


class Counters:
    """A fake machine: wall clock, busy CPU-seconds of the engine's CPUs, own CPU time."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = 0.0

    def advance(self, seconds: float, others: float, own: float) -> None:
        """``seconds`` pass while other processes use ``others`` cores and we use ``own``."""
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds


def share_of(counters: Counters, cpus: int = 2, limit: int = 2) -> CpuShare:
    return CpuShare(frozenset(range(cpus)), limit, interval_s=1.0, busy=lambda: counters.busy,
                    own=lambda: counters.own, clock=lambda: counters.now)


def test_a_thread_fewer_per_core_others_take_after_two_windows_and_back():
    c = Counters()
    share = share_of(c)
    c.advance(1.0, others=0.0, own=2.0)
    assert share.poll() is None and share.threads == 2
    c.advance(1.0, others=1.0, own=1.0)  # a neighbour takes a core: one window is not enough
    assert share.poll() is None and share.others == pytest.approx(1.0)
    c.advance(1.0, others=1.0, own=1.0)
    assert share.poll() == 1 and share.threads == 1
    c.advance(0.5, others=0.0, own=1.0)
    assert share.poll() is None  # within the interval: not measured
    c.advance(1.0, others=0.1, own=1.0)
    assert share.poll() is None
    c.advance(1.0, others=0.1, own=1.0)
    assert share.poll() == 2


def test_a_burst_in_one_window_changes_nothing():
    c = Counters()
    share = share_of(c)
    for others in (0.0, 1.0, 0.0, 1.0, 0.2):
        c.advance(1.0, others=others, own=1.5)
        assert share.poll() is None
    assert share.threads == 2


def test_never_below_one_thread_nor_above_the_limit():
    c = Counters()
    share = share_of(c, cpus=4, limit=3)
    for _ in range(2):
        c.advance(1.0, others=4.0, own=0.0)
        share.poll()
    assert share.threads == 1
    for _ in range(2):
        c.advance(1.0, others=0.0, own=1.0)
        share.poll()
    assert share.threads == 3


def test_busy_seconds_reads_only_the_given_cpus(tmp_path: Path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  1000 0 1000 5000 0 0 0 0 0 0\n"
                    "cpu0 100 10 50 4000 7 3 2 5 0 0\n"
                    "cpu1 900 0 950 1000 0 0 0 0 0 0\n"
                    "intr 12345\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert busy_seconds({0}, str(stat)) == pytest.approx((100 + 10 + 50 + 3 + 2 + 5) / tick)
    assert busy_seconds({7}, str(stat)) == 0
    assert busy_seconds({0}, str(tmp_path / "missing")) is None


def test_cgroup_quota_caps_the_thread_budget(tmp_path: Path):
    placement = machine.CpuPlacement(cpus=frozenset(range(8)), node=None, physical_cores=8,
                                     allowed=frozenset(range(8)))
    limit = tmp_path / "cpu.max"
    limit.write_text("max 100000\n")
    assert machine.cgroup_cpu_limit(str(limit)) is None
    limit.write_text("250000 100000\n")
    assert machine.cgroup_cpu_limit(str(limit)) == 2.5
    assert machine.thread_budget(placement, 2.5) == (
        3, "cgroup CPU quota of 2.5 CPUs over 8 physical cores")
    assert machine.thread_budget(placement, None) == (8, "8 physical cores")
    assert machine.thread_budget(placement, 0.2)[0] == 1
    assert machine.cgroup_cpu_limit(str(tmp_path / "none")) is None


def generate(engine: XeonEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    sink = Collector()
    for i, prompt in enumerate(prompts):
        engine.submit(greedy_request(f"r{i}", prompt, new), sink)
    return [token_ids(sink.wait(f"r{i}")) for i in range(len(prompts))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_thread_count_changes_no_token(default_model_path, dtype):
    """Each thread computes whole outputs, so one thread or two give the same tokens."""
    prompts = [prompt_of(n, start=s) for n, s in ((5, 1), (40, 2), (17, 3))]
    runs = []
    for threads in ("1", "2"):
        engine = XeonEngine(EngineConfig(model_path=str(default_model_path), dtype=dtype,
                                         options={**TEST_OPTIONS, "num_threads": threads}))
        engine.start()
        try:
            runs.append(generate(engine, prompts, 16))
        finally:
            engine.shutdown()
    assert runs[0] == runs[1]


def test_freed_buffers_are_kept_for_the_next_step():
    """On glibc the engine raises the mmap and trim thresholds (and says so); with another
    C library it leaves the allocator alone and says nothing."""
    said = machine.keep_freed_memory()
    if platform.libc_ver()[0] == "glibc":
        assert said == "glibc keeps freed buffers below 256 MiB for reuse (up to 1 GiB)"
    else:
        assert said == ""


def test_an_idle_engine_does_not_spin(default_model_path):
    """Between requests the compute thread blocks on its inbox and the OpenMP workers
    sleep after libgomp's short spin: two idle seconds cost well under a tenth of a core."""
    from switchyard_spec import EngineConfig
    from switchyard_xeon.engine import XeonEngine

    from tests.support.engine_requests import Collector, greedy_request, prompt_of

    engine = XeonEngine(EngineConfig(model_path=str(default_model_path), dtype="float32",
                                     options={"num_threads": "2"}))
    engine.start()
    try:
        sink = Collector()
        engine.submit(greedy_request("r", prompt_of(40, start=1), 8), sink)
        sink.wait("r")
        time.sleep(0.5)  # past libgomp's spin
        wall, cpu = time.monotonic(), time.process_time()
        time.sleep(2.0)
        used = (time.process_time() - cpu) / (time.monotonic() - wall)
    finally:
        engine.shutdown()
    assert used < 0.1, f"an idle engine used {used:.2f} of a core"
