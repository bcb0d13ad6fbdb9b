"""Facts about the CPU and memory, read cheaply and without torch.

The device probe runs when the gateway merely lists plugins, so this module
only reads ``/proc``, ``/sys`` and ``os``; it never raises.

:func:`choose_cpus` decides where the engine computes: on a multi-socket machine
the CPUs of one NUMA node (weights and KV cache stay in that node's memory, and
OpenMP barriers never cross the socket link), elsewhere every CPU the process
may use.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

NODE_ROOT = "/sys/devices/system/node"
CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class CpuInfo:
    """What the engine needs to know about the processor it runs on."""

    model_name: str
    vendor: str
    flags: frozenset[str]
    physical_cores: int
    """Physical cores this process may run on (hyper-threads counted once)."""
    logical_cpus: int

    @property
    def has_bf16(self) -> bool:
        """Native bfloat16 arithmetic (AVX512_BF16 or AMX)."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    def describe(self) -> str:
        """A short human name such as "Intel Xeon (2 cores, avx512_bf16)"."""
        isa = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in self.flags]
        extra = f", {isa[0]}" if isa else ""
        return f"{self.model_name} ({self.physical_cores} cores{extra})"


def read_cpu_info(path: str = CPUINFO) -> CpuInfo:
    """Parse ``/proc/cpuinfo``, counting only the CPUs in this process's affinity mask."""
    allowed = allowed_cpus()
    model_name, vendor = "unknown CPU", "unknown"
    flags: frozenset[str] = frozenset()
    blocks = _cpuinfo_blocks(path)
    for block in blocks:
        model_name = block.get("model name", model_name)
        vendor = block.get("vendor_id", vendor)
        if not flags:
            flags = frozenset(block.get("flags", "").split())
    return CpuInfo(
        model_name=model_name,
        vendor=vendor,
        flags=flags,
        physical_cores=_count_cores(allowed, blocks),
        logical_cpus=max(1, len(allowed)),
    )


def allowed_cpus() -> frozenset[int]:
    """The CPUs in this process's affinity mask (all CPUs where the mask cannot be read)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def _cpuinfo_blocks(path: str) -> list[dict[str, str]]:
    """One ``{key: value}`` per processor in a cpuinfo file (none when unreadable)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, ValueError):  # unreadable, or not text: describe no processors
        return []
    blocks = []
    for chunk in text.split("\n\n"):
        block = {}
        for line in chunk.splitlines():
            key, _, value = line.partition(":")
            block[key.strip()] = value.strip()
        if "processor" in block:
            blocks.append(block)
    return blocks


def count_physical_cores(cpus: Iterable[int], cpuinfo_path: str = CPUINFO) -> int:
    """Physical cores among ``cpus``: hyper-threads of one core count once (at least 1).

    A CPU that cpuinfo does not describe counts as a core of its own, so a
    missing or unreadable file gives the number of CPUs.
    """
    return _count_cores(cpus, _cpuinfo_blocks(cpuinfo_path))


def _count_cores(cpus: Iterable[int], blocks: list[dict[str, str]]) -> int:
    core_of: dict[int, tuple[str, str]] = {}
    for block in blocks:
        if block["processor"].isdigit():
            cpu = int(block["processor"])
            core_of[cpu] = (block.get("physical id", "0"), block.get("core id", f"cpu{cpu}"))
    cores = {core_of.get(cpu, ("?", f"cpu{cpu}")) for cpu in cpus}
    return max(1, len(cores))


def parse_cpulist(text: str) -> frozenset[int]:
    """The CPUs of a kernel CPU list such as ``"0-3,8-11"``; malformed parts are skipped."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None:
            continue
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The kernel's compact form of a CPU set: ``{0, 1, 2, 3, 8}`` -> ``"0-3,8"``."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def read_numa_nodes(root: str = NODE_ROOT) -> dict[int, frozenset[int]]:
    """NUMA node id -> its CPUs, from ``node*/cpulist``; empty without NUMA information.

    Nodes without CPUs (memory-only nodes, e.g. CXL or HBM) are left out.
    """
    nodes: dict[int, frozenset[int]] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return nodes
    for name in names:
        match = re.fullmatch(r"node(\d+)", name)
        if match is None:
            continue
        try:
            with open(os.path.join(root, name, "cpulist"), encoding="utf-8") as fh:
                cpus = parse_cpulist(fh.read())
        except (OSError, UnicodeDecodeError):
            continue
        if cpus:
            nodes[int(match.group(1))] = cpus
    return dict(sorted(nodes.items()))


@dataclass(frozen=True)
class CpuPlacement:
    """Where the engine computes: a set of CPUs, the NUMA node they belong to, their cores."""

    cpus: frozenset[int]
    """The CPUs the engine's compute should use (always within ``allowed``)."""
    node: int | None
    """The NUMA node of ``cpus``; None when the machine reports no NUMA information."""
    physical_cores: int
    """Physical cores among ``cpus`` (hyper-threads counted once): the default thread count."""
    allowed: frozenset[int]
    """The process's affinity mask when the choice was made."""

    @property
    def should_bind(self) -> bool:
        """True when ``cpus`` is a strict part of what the process may use (several nodes).

        Only then does pinning the compute thread change anything; on a
        single-node machine the scheduler already has exactly these CPUs.
        """
        return bool(self.cpus) and self.cpus < self.allowed

    def describe(self) -> str:
        """``"NUMA node 0 (CPUs 0-1)"``, or ``"CPUs 0-1 (no NUMA information)"``."""
        cpus = format_cpulist(self.cpus)
        if self.node is None:
            return f"CPUs {cpus} (no NUMA information)"
        return f"NUMA node {self.node} (CPUs {cpus})"


def choose_cpus(
    *,
    node_root: str = NODE_ROOT,
    cpuinfo_path: str = CPUINFO,
    allowed: Iterable[int] | None = None,
) -> CpuPlacement:
    """Pick the engine's CPUs: the first NUMA node that shares CPUs with the affinity mask.

    The chosen CPUs are that node's CPUs within ``allowed`` (default: this
    process's affinity mask), so a mask narrowed by ``taskset`` or a cgroup is
    never widened. Without NUMA information, or when no node intersects the
    mask, every allowed CPU is used. Never raises.
    """
    mask = frozenset(allowed) if allowed is not None else allowed_cpus()
    node: int | None = None
    cpus = mask
    for node_id, node_cpus in read_numa_nodes(node_root).items():
        if node_cpus & mask:
            node, cpus = node_id, node_cpus & mask
            break
    return CpuPlacement(
        cpus=cpus,
        node=node,
        physical_cores=count_physical_cores(cpus, cpuinfo_path),
        allowed=mask,
    )


def available_memory_bytes(path: str = "/proc/meminfo") -> int:
    """MemAvailable from ``/proc/meminfo`` (0 when unknown)."""
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"
"""cgroup v2's CPU quota of this process's group: "max 100000" or "<quota> <period>"."""


def cgroup_cpu_limit(path: str = CGROUP_CPU_MAX) -> float | None:
    """The CPUs' worth of time the cgroup's quota allows (``quota / period``), or None
    when there is no quota (``max``) or no cgroup v2 file to read."""
    try:
        with open(path, encoding="utf-8") as fh:
            quota, _, period = fh.read().strip().partition(" ")
        if quota == "max":
            return None
        return int(quota) / int(period or 100000)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def thread_budget(placement: CpuPlacement, quota: float | None) -> tuple[int, str]:
    """The default torch thread count, and why: the placement's physical cores, capped
    by the cgroup quota (rounded up: a quota of 1.5 CPUs still runs two threads part
    of the time, and fewer threads would leave it unused)."""
    cores = max(1, placement.physical_cores)
    if quota is None or quota >= cores:
        return cores, f"{cores} physical core{'s' if cores != 1 else ''}"
    capped = max(1, math.ceil(quota - 1e-9))
    return capped, f"cgroup CPU quota of {quota:g} CPUs over {cores} physical cores"


MMAP_THRESHOLD = 256 << 20
"""Allocations below this come from glibc's heap, not fresh ``mmap`` pages."""
TRIM_THRESHOLD = 1 << 30
"""Free heap memory glibc keeps for reuse before it returns any to the system."""


def keep_freed_memory() -> str:
    """Make glibc reuse freed activation buffers instead of mapping fresh pages each step.

    By default glibc serves a large allocation (a prefill step's activations: 12 MB
    for the 135M shape's gate|up at 1,024 rows) with a fresh ``mmap`` and unmaps it
    on free, so the next step takes a page fault and a zeroed page for every 4 KB
    it writes. Raising the mmap threshold (to 256 MiB) and the trim threshold (to
    1 GiB) keeps those buffers in the heap for the next step: a 1,024-token prefill
    step of the 135M shape took 0.32 s instead of 0.39 (2-core Sapphire Rapids VM).
    The cost: up to 1 GiB of freed memory stays with the process. Returns what was
    done, for the log ('' where the C library is not glibc).
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return ""
    # M_MMAP_THRESHOLD = -3, M_TRIM_THRESHOLD = -1 (malloc.h); mallopt returns 1 on success.
    if mallopt(-3, MMAP_THRESHOLD) != 1 or mallopt(-1, TRIM_THRESHOLD) != 1:
        return ""
    return (f"glibc keeps freed buffers below {MMAP_THRESHOLD >> 20} MiB for reuse "
            f"(up to {TRIM_THRESHOLD >> 30} GiB)")
