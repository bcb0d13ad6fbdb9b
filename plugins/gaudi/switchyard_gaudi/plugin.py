"""The Gaudi plugin's hooks: declares the "gaudi" engine.

Registered under the ``switchyard.plugins`` entry-point group. Importing this
module is cheap: the probe looks for Habana's software without importing it
where it is absent, and torch and the engine load only when the factory runs.
Without an HPU the engine is listed as unavailable, with the reason, so it
never takes over from the CPU engine by default; ``--engine gaudi
--engine-option device=cpu`` still runs it on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

from switchyard_spec import (
    FP8_E4M3_PER_TENSOR,
    CommandSpec,
    DeviceInfo,
    Engine,
    EngineConfig,
    EngineSpec,
    hookimpl,
)

ENGINE_NAME = "gaudi"
PRIORITY = 100
"""Above the CPU engine's: where an HPU is present it serves by default."""
WEIGHT_FORMATS = (FP8_E4M3_PER_TENSOR,)
"""The quantized formats the engine runs: FP8 E4M3 (``--quantize fp8``) on the device's FP8
matmul (:mod:`switchyard_gaudi.fp8_linears`; Habana's on an HPU, the format's math in
PyTorch on the CPU device). ``QUANT_CONFIG`` is Intel Neural Compressor's own FP8 flow."""


def make_engine(config: EngineConfig) -> Engine:
    """Build a :class:`GaudiEngine` for ``config`` without loading weights."""
    from switchyard_gaudi.engine import GaudiEngine  # imports torch

    return GaudiEngine(config)


def probe() -> DeviceInfo:
    """Report whether an HPU is present (never raises)."""
    try:
        from switchyard_gaudi.device import detect_hpu  # torch: only when plugins are listed
        from switchyard_gaudi.model_code import describe_model_code

        status = detect_hpu()
        return DeviceInfo(available=status.available, name=status.name,
                          detail=f"{status.detail}; {describe_model_code()}")
    except Exception as exc:  # a probe must never raise
        return DeviceInfo(available=False, name="Intel Gaudi (HPU)", detail=f"probe failed: {exc}")


@hookimpl
def switchyard_engines() -> list[EngineSpec]:
    """Declare the Gaudi static-shape engine."""
    return [
        EngineSpec(
            name=ENGINE_NAME,
            description="Intel Gaudi: static-shape bucketed batching with warmup "
                        "(device=cpu runs it on the CPU)",
            factory=make_engine,
            probe=probe,
            priority=PRIORITY,
            weight_formats=WEIGHT_FORMATS,
            constrained_decoding=True,
        )
    ]


def _module_command(subcommand: str) -> Callable[[list[str]], int]:
    """``python -m switchyard_gaudi SUBCOMMAND`` as a ``switchyard`` subcommand's main."""

    def run(argv: list[str]) -> int:
        from switchyard_gaudi.__main__ import main  # imports torch: only when run

        return main([subcommand, *argv])

    return run


@hookimpl
def switchyard_commands() -> list[CommandSpec]:
    """``switchyard warmup-plan`` (size settings without a device) and ``switchyard fp8-measure``."""
    return [
        CommandSpec(name="warmup-plan",
                    help="gaudi: print the warmup shapes and memory estimate for a model and "
                         "limits, without a device or loading weights",
                    main=_module_command("plan")),
        CommandSpec(name="fp8-measure",
                    help="gaudi: run calibration prompts under a MEASURE QUANT_CONFIG and write "
                         "the FP8 statistics",
                    main=_module_command("measure")),
    ]
