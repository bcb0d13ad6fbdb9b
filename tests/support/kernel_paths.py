"""The native kernel paths of the Xeon engine that the suite exercises, and which this CPU runs.

The kernels are built with ``-march=native``, so what the suite can check depends on
the machine: an AVX2-only CPU builds no paged prefill kernel and no dot-product
panels. A test of a kernel path calls :func:`require` with the path's name: where the
build has the path, the call records that it ran; elsewhere it records the reason and
skips the test. Paths with a twin on the other ISA (the SDPA prefill for the native
prefill kernel, the fp32 panel GEMM over bf16-stored weights for the bf16 dot-product
panels) share their test, parametrised over both, so an AVX2 machine still runs the
twin. ``tests/conftest.py`` prints :func:`summary` at the end of the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class KernelPath:
    """One native code path: what it is, and what a build needs to have it."""

    name: str
    what: str
    needs: str
    twin: str = ""
    """What stands in for it where the build lacks it (and shares its test)."""


PATHS = (
    KernelPath("paged_attention", "decode attention over the paged cache "
               "(kernels/paged_attention.cpp)", "any x86-64 build"),
    KernelPath("paged_prefill", "causal prefill attention over the paged cache, head_dim 64/128 "
               "(kernels/paged_prefill.cpp)", "AVX-512F", twin="SDPA per sequence"),
    KernelPath("fused_ops", "RMSNorm, rotary + cache store, SiLU·up (kernels/fused_ops.cpp)",
               "any x86-64 build"),
    KernelPath("decode_layers", "every decoder layer of a decode step in one call "
               "(kernels/decode_layers.cpp)", "any x86-64 build"),
    KernelPath("lora", "each row's LoRA adapter, grouped shrink/expand (kernels/lora.cpp)",
               "any x86-64 build", twin="grouped PyTorch ops"),
    KernelPath("panel_gemm fp32", "fp32 panel GEMM, 6x16 micro-kernel (kernels/panel_gemm.cpp)",
               "AVX2 + FMA (scalar loop otherwise)"),
    KernelPath("panel_gemm bf16-stored", "the fp32 panel GEMM over weights stored as bf16, "
               "widened in registers", "AVX2 + FMA (scalar loop otherwise)"),
    KernelPath("panel_dot bf16", "bf16 dot-product panels, vdpbf16ps (kernels/panel_dot_bf16.cpp)",
               "AVX512_BF16", twin="panel_gemm bf16-stored"),
    KernelPath("panel_dot amx", "many-row calls of the bf16 and int8 dot panels on AMX tiles, "
               "tdpbf16ps over the same panels (kernels/panel_dot_bf16.cpp)",
               "AMX-BF16 and the kernel's tile permission", twin="panel_dot bf16"),
    KernelPath("panel int8", "int8 weights widened to bf16 dot products "
               "(kernels/panel_dot_bf16.cpp)", "AVX512_BF16"),
    KernelPath("panel uint4", "uint4 weights, bf16 dot products (kernels/panel_dot_uint4.cpp)",
               "AVX512_BF16"),
    KernelPath("panel quant fma", "int8, uint4 and FP8 weights in fp32 math, widened in "
               "registers (kernels/panel_quant_fma.cpp)", "AVX2 + FMA"),
    KernelPath("w8a8 amx", "W8A8 int8 GEMM on AMX tiles, tdpbusd (kernels/panel_w8a8.cpp)",
               "AMX-INT8 and the kernel's tile permission", twin="w8a8 vnni"),
    KernelPath("w8a8 vnni", "W8A8 int8 panels, vpdpbusd (kernels/panel_w8a8.cpp)",
               "AVX512-VNNI", twin="w8a8 avx2"),
    KernelPath("w8a8 avx2", "W8A8 int8 panels, vpmaddubsw (kernels/panel_w8a8.cpp)", "AVX2",
               twin="w8a8 scalar"),
    KernelPath("w8a8 scalar", "W8A8 int8 panels, plain loops (kernels/panel_w8a8.cpp)",
               "any x86-64 build"),
)
W8A8_PATH_NUMBERS = {"w8a8 amx": 1, "w8a8 vnni": 2, "w8a8 avx2": 3, "w8a8 scalar": 4}
"""``panel_w8a8.cpp``'s ``path`` argument for each W8A8 path."""
BY_NAME = {p.name: p for p in PATHS}

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx_ne_convert", "amx_bf16", "amx_int8")
"""The CPU flags that decide which paths a build has, in the order the summary names them."""

_ran: set[str] = set()
_missing: dict[str, str] = {}


def unavailable(name: str) -> str:
    """Why this build lacks path ``name``; empty when it has it."""
    from switchyard_xeon.kernels import load_kernels

    if name not in BY_NAME:
        raise KeyError(f"unknown kernel path {name!r}; known: {sorted(BY_NAME)}")
    status = load_kernels()
    if status.fn is None:
        return status.reason
    import torch

    ops = torch.ops.switchyard_xeon
    w8a8 = ops.w8a8_paths() if status.w8a8 else 0
    have = {
        "paged_attention": True,
        "paged_prefill": status.prefill is not None,
        "fused_ops": status.fused is not None,
        "decode_layers": status.fused is not None and hasattr(ops, "decode_layers"),
        "lora": hasattr(ops, "lora_add_"),
        "panel_gemm fp32": hasattr(ops, "panel_linear"),
        "panel_gemm bf16-stored": hasattr(ops, "panel_linear"),
        "panel_dot bf16": status.bf16_dot,
        "panel_dot amx": status.bf16_amx,
        "panel int8": status.bf16_dot,
        "panel uint4": status.uint4_dot,
        "panel quant fma": status.quant_fma,
        **{p: bool(w8a8 >> n & 1) for p, n in W8A8_PATH_NUMBERS.items()},
    }[name]
    return "" if have else f"needs {BY_NAME[name].needs}, which this build lacks"


def require(name: str) -> None:
    """Record that the calling test runs path ``name``, or skip it (recorded) where it is missing."""
    why = unavailable(name)
    if why:
        _missing[name] = why
        pytest.skip(f"kernel path {name} not available here: {why}")
    _ran.add(name)


def note(name: str) -> bool:
    """Record path ``name`` as exercised where this build has it, for a test that takes it
    when it is there and its twin otherwise (an engine run); returns whether it is there."""
    if unavailable(name):
        return False
    _ran.add(name)
    return True


def cpu_flags() -> list[str]:
    from switchyard_xeon.machine import read_cpu_info

    flags = read_cpu_info().flags
    return [f for f in ISA_FLAGS if f in flags]


def summary() -> list[str]:
    """The end-of-run lines: paths exercised, missing on this CPU, and not run (a subset run)."""
    if not _ran and not _missing:
        return []
    lines = [f"kernel paths exercised on this CPU ({' '.join(cpu_flags())}): "
             + (", ".join(p.name for p in PATHS if p.name in _ran) or "none")]
    missing = [p for p in PATHS if p.name in _missing]
    lines.append("kernel paths not available here: " + ("; ".join(
        f"{p.name} ({_missing[p.name]}{'; its twin: ' + p.twin if p.twin else ''})"
        for p in missing) or "none"))
    unrun = [p.name for p in PATHS if p.name not in _ran and p.name not in _missing]
    if unrun:
        lines.append("kernel paths this run did not reach: " + ", ".join(unrun))
    return lines
