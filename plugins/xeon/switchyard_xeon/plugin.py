"""The Xeon plugin's hooks: declares the "xeon" engine.

Registered under the ``switchyard.plugins`` entry-point group. Importing this
module is cheap: torch and the engine are imported only when the factory runs.
"""

from __future__ import annotations

from switchyard_spec import (
    DeviceInfo,
    Engine,
    EngineConfig,
    EngineSpec,
    hookimpl,
)

from switchyard_xeon.pooling import make_pooling_engine
from switchyard_xeon.weight_formats import WEIGHT_FORMATS

ENGINE_NAME = "xeon"
PRIORITY = 10
"""Any CPU can serve, so accelerator engines should outrank this one."""


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
            pooling_factory=make_pooling_engine,
        )
    ]
