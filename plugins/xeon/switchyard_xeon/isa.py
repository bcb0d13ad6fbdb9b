"""The ISA levels the native kernels are compiled for, and which one this CPU runs.

The kernels are built once per level at install time (``setup.py`` reads
:data:`VARIANTS` from this file, which therefore imports nothing but the
standard library): every source is compiled again with the level's target flags
into a library of its own, ``_kernels_<name>``. Nothing is compiled for the
machine that builds, so a wheel runs anywhere, and a CPU loads only a library
whose every instruction it has: :func:`choose` reads the CPU's features before
any library is opened (a library is never loaded to find out).

``SWITCHYARD_XEON_ISA`` caps the choice at a lower level (``avx2``, ``avx512``,
``avx512_bf16``; ``none`` for the PyTorch path), for tests and for bug reports;
a level the CPU lacks is never taken, whatever it says.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import platform
from dataclasses import dataclass
from pathlib import Path

ISA_ENV = "SWITCHYARD_XEON_ISA"
NONE = "none"
"""The level below every variant: no native library, PyTorch ops."""

_V3 = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")
"""x86-64-v3 in /proc/cpuinfo's words (`abm` is LZCNT)."""
_V4 = (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


@dataclass(frozen=True)
class Variant:
    """One ISA level: the flags its sources are compiled with, and what the CPU must have."""

    name: str
    cflags: tuple[str, ...]
    needs: tuple[str, ...]
    """CPU flags, as /proc/cpuinfo names them, that every instruction of the build needs."""
    paths: str
    """What the level adds, for the log."""

    @property
    def library(self) -> str:
        """The extension's module name (its file is this plus the interpreter's suffix)."""
        return f"_kernels_{self.name}"


VARIANTS = (
    Variant("avx2", ("-march=x86-64-v3",), _V3,
            "AVX2 + FMA: fp32 panels, quantized-weight panels in fp32 math, W8A8 on vpmaddubsw"),
    Variant("avx512", ("-march=x86-64-v4", "-mavx512vnni"), (*_V4, "avx512_vnni"),
            "AVX-512 + VNNI: paged prefill kernel, one-pass grammar masks, W8A8 on vpdpbusd"),
    # AMX code in it runs only after the kernel grants the tile state (arch_prctl),
    # so the flags are safe on an AVX512_BF16 CPU without AMX (Zen 4, Cooper Lake).
    Variant("avx512_bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16",
                            "-mamx-tile", "-mamx-int8", "-mamx-bf16"),
            (*_V4, "avx512_vnni", "avx512_bf16"),
            "AVX512_BF16: bf16/int8/uint4 dot-product panels; W8A8 on AMX where granted"),
)
"""Lowest first; each level's CPUs can run every level before it."""
NAMES = (NONE, *(v.name for v in VARIANTS))


@dataclass(frozen=True)
class Choice:
    """The level this process loads, and why."""

    variant: Variant | None
    reason: str


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty off Linux or x86-64).

    Linux lists a feature only when the kernel also saves its register state, so a
    flag here is one a process may use.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def runnable(flags: frozenset[str]) -> tuple[Variant, ...]:
    """The variants a CPU with these flags can run, lowest first."""
    return tuple(v for v in VARIANTS if all(f in flags for f in v.needs))


def choose(flags: frozenset[str] | None = None, cap: str | None = None) -> Choice:
    """The best variant this CPU runs, at most `cap` (default: ``SWITCHYARD_XEON_ISA``)."""
    flags = cpu_flags() if flags is None else flags
    cap = (os.environ.get(ISA_ENV, "") if cap is None else cap).strip().lower()
    if cap and cap not in NAMES:
        raise ValueError(f"{ISA_ENV}={cap!r}: expected one of {', '.join(NAMES)}")
    can = runnable(flags)
    if not can:
        missing = [f for f in VARIANTS[0].needs if f not in flags]
        return Choice(None, f"this CPU lacks {VARIANTS[0].name} ({', '.join(missing) or 'x86-64'})")
    best = can[-1]
    if cap == NONE:
        return Choice(None, f"{ISA_ENV}=none")
    if cap:
        allowed = [v for v in can if NAMES.index(v.name) <= NAMES.index(cap)]
        if not allowed:
            return Choice(None, f"{ISA_ENV}={cap}")
        chosen = allowed[-1]
        why = (f"{ISA_ENV}={cap}" if chosen is not best
               else f"the best this CPU runs ({ISA_ENV}={cap})")
        return Choice(chosen, why)
    return Choice(best, "the best this CPU runs")


def source_hash(folder: Path) -> str:
    """A hash of the kernel sources in `folder` (``*.cpp`` and ``*.h``): each library is
    built with the hash of what it was compiled from, and the loader refuses a library
    whose hash is not that of the sources beside it."""
    digest = hashlib.sha256()
    for path in sorted([*folder.glob("*.cpp"), *folder.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def library_path(variant: Variant, folder: Path) -> Path | None:
    """Where `variant`'s library is in `folder` (None when it was not built)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"{variant.library}{suffix}"
        if path.is_file():
            return path
    return None


def describe(folder: Path) -> str:
    """Which library a process would open and why, without opening it (for probes)."""
    try:
        choice = choose()
    except ValueError as exc:
        return f"none ({exc})"
    if choice.variant is None:
        return f"none ({choice.reason})"
    below = VARIANTS[: VARIANTS.index(choice.variant) + 1]
    built = [v for v in reversed(below) if library_path(v, folder) is not None]
    if not built:
        return f"none (not built for {choice.variant.name} or below)"
    if built[0] is not choice.variant:
        return f"{built[0].name} ({choice.variant.name} was not built)"
    return f"{choice.variant.name} ({choice.reason})"
