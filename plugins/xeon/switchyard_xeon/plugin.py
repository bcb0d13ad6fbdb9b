"""The Xeon plugin's hooks: declares the "xeon" engine.

Registered under the ``switchyard.plugins`` entry-point group. Importing this
module is cheap: torch and the engine are imported only when the factory runs.
"""

from __future__ import annotations

from switchyard_spec import (
    FP8_E4M3_PER_TENSOR,
    INT8_PER_CHANNEL,
    UINT4_GROUP_SIZES,
    W8A8_SMOOTHQUANT,
    W8A8_SMOOTHQUANT_STATIC,
    DeviceInfo,
    Engine,
    EngineConfig,
    EngineSpec,
    hookimpl,
    uint4_group_asym,
    uint4_group_min,
)

ENGINE_NAME = "xeon"
PRIORITY = 10
"""Any CPU can serve, so accelerator engines should outrank this one."""
WEIGHT_FORMATS = (INT8_PER_CHANNEL, *(uint4_group_asym(g) for g in UINT4_GROUP_SIZES),
                  *(uint4_group_min(g) for g in UINT4_GROUP_SIZES),
                  W8A8_SMOOTHQUANT, W8A8_SMOOTHQUANT_STATIC, FP8_E4M3_PER_TENSOR)
"""The quantized formats the engine's kernels run: weight-only int8 and uint4
(integer zero points, or float mins) on the bf16 dot-product panels (CPUs
with AVX512_BF16) or the AVX2 + FMA ones, W8A8 on the int8
panels (AMX, AVX512-VNNI, AVX2 or scalar; :mod:`switchyard_xeon.quantized`),
FP8 E4M3 in stock PyTorch (:mod:`switchyard_xeon.fp8_linears`)."""


def make_engine(config: EngineConfig) -> Engine:
    """Build a :class:`XeonEngine` for ``config`` without loading weights."""
    from switchyard_xeon.engine import XeonEngine  # imports torch

    return XeonEngine(config)


def probe() -> DeviceInfo:
    """Report the CPU; it is always available where /proc or os says it has cores."""
    try:
        from switchyard_xeon.machine import read_cpu_info

        from pathlib import Path

        from switchyard_xeon import isa  # the standard library only: no torch here

        cpu = read_cpu_info()
        bf16 = "bfloat16" if cpu.has_bf16 else "float32 (no native bf16)"
        kernels = isa.describe(Path(isa.__file__).resolve().parent / "kernels")
        detail = f"{cpu.logical_cpus} logical CPUs, auto dtype {bf16}, kernels {kernels}"
        return DeviceInfo(available=True, name=cpu.describe(), detail=detail)
    except Exception as exc:  # a probe must never raise
        return DeviceInfo(available=False, name="CPU", detail=f"probe failed: {exc}")


@hookimpl
def switchyard_engines() -> list[EngineSpec]:
    """Declare the Xeon continuous-batching engine."""
    return [
        EngineSpec(
            name=ENGINE_NAME,
            description="CPU continuous batching with stock PyTorch (bf16 where the CPU has it)",
            factory=make_engine,
            probe=probe,
            priority=PRIORITY,
            weight_formats=WEIGHT_FORMATS,
            constrained_decoding=True,
        )
    ]
