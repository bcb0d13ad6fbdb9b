"""Facts about the CPU and memory, read cheaply and without torch.

The device probe runs when the gateway merely lists plugins, so this module
only reads ``/proc`` and ``os``; it never raises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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


def read_cpu_info(path: str = "/proc/cpuinfo") -> CpuInfo:
    """Parse ``/proc/cpuinfo``, counting only the CPUs in this process's affinity mask."""
    try:
        allowed = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = set(range(os.cpu_count() or 1))
    model_name, vendor = "unknown CPU", "unknown"
    flags: frozenset[str] = frozenset()
    cores: set[tuple[str, str]] = set()
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        text = ""
    for chunk in text.split("\n\n"):
        block = {}
        for line in chunk.splitlines():
            key, _, value = line.partition(":")
            block[key.strip()] = value.strip()
        if "processor" not in block:
            continue
        model_name = block.get("model name", model_name)
        vendor = block.get("vendor_id", vendor)
        if not flags:
            flags = frozenset(block.get("flags", "").split())
        cpu = int(block["processor"]) if block["processor"].isdigit() else -1
        if cpu in allowed:
            cores.add((block.get("physical id", "0"), block.get("core id", str(cpu))))
    physical = len(cores) if cores else len(allowed)
    return CpuInfo(
        model_name=model_name,
        vendor=vendor,
        flags=flags,
        physical_cores=max(1, physical),
        logical_cpus=max(1, len(allowed)),
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
