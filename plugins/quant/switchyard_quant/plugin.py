"""The quant plugin's hooks: weight-only ``int8`` and ``int4`` (three group sizes), ``smoothquant``,
``fp8``, the checkpoint methods ``gptq``, ``awq``, ``ipex-lowp`` and ``gguf``, and
``switchyard quantize``.

Registered under the ``switchyard.plugins`` entry-point group. Importing this
module is cheap and imports no torch: each method's functions import the
arithmetic (:mod:`switchyard_quant.int8`, :mod:`switchyard_quant.int4`) when
an engine first calls them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from switchyard_spec import (
    FP8_E4M3_PER_TENSOR,
    INT8_PER_CHANNEL,
    W8A8_SMOOTHQUANT,
    W8A8_SMOOTHQUANT_STATIC,
    ActivationQuant,
    ActivationStatistics,
    Calibration,
    Packing,
    QuantizationMethod,
    QuantizedCheckpoint,
    QuantizedWeight,
    hookimpl,
    uint4_group_asym,
    uint4_group_min,
)

INT4_GROUPS = {"int4": 128, "int4-g64": 64, "int4-g32": 32}
"""``--quantize`` name -> group size of its uint4 format (plain ``int4``: 128, ipex's default)."""


def quantize_int8(weight: Any) -> QuantizedWeight:
    """See :func:`switchyard_quant.int8.quantize_int8`."""
    from switchyard_quant.int8 import quantize_int8 as quantize

    return quantize(weight)


def quantize_int4(weight: Any, group_size: int) -> QuantizedWeight:
    """See :func:`switchyard_quant.int4.quantize_uint4`."""
    from switchyard_quant.int4 import quantize_uint4

    return quantize_uint4(weight, group_size)


def quantize_smoothquant(weight: Any) -> QuantizedWeight:
    """See :func:`switchyard_quant.smoothquant.quantize_smoothquant` (no statistics)."""
    from switchyard_quant.smoothquant import quantize_smoothquant as quantize

    return quantize(weight)


def quantize_smoothquant_calibrated(weight: Any, statistics: ActivationStatistics,
                                    options: Mapping[str, str]) -> QuantizedWeight:
    """See :func:`switchyard_quant.smoothquant.quantize_calibrated`."""
    from switchyard_quant.smoothquant import quantize_calibrated

    return quantize_calibrated(weight, statistics, options)


def smoothquant_prompts(options: Mapping[str, str]) -> tuple[str, ...]:
    """See :func:`switchyard_quant.smoothquant.calibration_prompts`."""
    from switchyard_quant.smoothquant import calibration_prompts

    return calibration_prompts(options)


def quantize_fp8(weight: Any) -> QuantizedWeight:
    """See :func:`switchyard_quant.fp8_method.quantize_fp8` (no statistics: unit input scale)."""
    from switchyard_quant.fp8_method import quantize_fp8 as quantize

    return quantize(weight)


def quantize_fp8_calibrated(weight: Any, statistics: ActivationStatistics,
                            options: Mapping[str, str]) -> QuantizedWeight:
    """See :func:`switchyard_quant.fp8_method.quantize_calibrated`."""
    from switchyard_quant.fp8_method import quantize_calibrated

    return quantize_calibrated(weight, statistics, options)


def fp8_prompts(options: Mapping[str, str]) -> tuple[str, ...]:
    """See :func:`switchyard_quant.fp8_method.calibration_prompts`."""
    from switchyard_quant.fp8_method import calibration_prompts

    return calibration_prompts(options)


FP8_OPTIONS = ("calibration_file", "calibration_samples")
"""The engine options ``fp8`` reads (see :mod:`switchyard_quant.fp8_method`)."""

SMOOTHQUANT_OPTIONS = ("smoothquant_alpha", "smoothquant_activations", "calibration_file",
                       "calibration_samples")
"""The engine options ``smoothquant`` reads (see :mod:`switchyard_quant.smoothquant`)."""


def load_checkpoint(folder: str, options: Mapping[str, str], layout: str) -> QuantizedCheckpoint:
    """See :mod:`switchyard_quant.checkpoints` (``layout``: gptq, awq, lowp or gguf)."""
    if layout == "gptq":
        from switchyard_quant.checkpoints.gptq import load_gptq as load
    elif layout == "awq":
        from switchyard_quant.checkpoints.awq import load_awq as load
    elif layout == "gguf":
        from switchyard_quant.checkpoints.gguf import load_gguf as load
    else:
        from switchyard_quant.checkpoints.lowp import load_lowp as load
    return load(folder, options)


CHECKPOINTS = {
    "gptq": ("gptq", "GPTQ folders as transformers writes them (quantization_config "
                     "quant_method gptq, 4 bits, act-order too; read, not quantized at load)"),
    "awq": ("awq", "AWQ folders (AutoAWQ's GEMM layout, quant_method awq, 4 bits; read, "
                   "not quantized at load)"),
    "ipex-lowp": ("", "ipex's low-precision checkpoint (UINT4 packed along K, scales, zero "
                      "points; --engine-option low_precision_checkpoint=FILE)"),
}
"""Checkpoint methods: name -> (config.json quant_method they are detected by, description)."""


def quantize_main(argv: list[str]) -> int:
    """See :func:`switchyard_quant.checkpoints.writer.main`."""
    from switchyard_quant.checkpoints.writer import main

    return main(argv)


def dequantize(weight: QuantizedWeight) -> Any:
    """The float32 weight any of this plugin's formats stands for."""
    if weight.format.packing is Packing.FP8_E4M3_ROWS:
        from switchyard_quant.fp8_method import dequantize_fp8

        return dequantize_fp8(weight)
    if weight.format.activations is not ActivationQuant.NONE:
        from switchyard_quant.smoothquant import dequantize_w8a8

        return dequantize_w8a8(weight)
    if weight.format.packing is Packing.INT8_ROWS:
        from switchyard_quant.int8 import dequantize_int8

        return dequantize_int8(weight)
    from switchyard_quant.gptq_act_order import restore_input_order
    from switchyard_quant.int4 import dequantize_uint4

    return restore_input_order(dequantize_uint4(weight), weight.input_order)


@hookimpl
def switchyard_quantization_methods() -> list[QuantizationMethod]:
    """Declare int8, int4 (three group sizes), smoothquant, fp8 and the checkpoint methods
    (gptq, awq, ipex-lowp; gguf: the Q4_0 and Q4_1 blocks a converted GGUF folder keeps)."""
    methods = [QuantizationMethod(
        name="int8",
        description="weight-only int8, symmetric, a scale per output feature (RTN at load)",
        formats=(INT8_PER_CHANNEL,), quantize=quantize_int8, dequantize=dequantize)]
    for name, group in INT4_GROUPS.items():
        methods.append(QuantizationMethod(
            name=name,
            description=f"weight-only uint4, asymmetric, a scale and zero point per {group} "
                        "weights along K (RTN at load)",
            formats=(uint4_group_asym(group),),
            quantize=functools.partial(quantize_int4, group_size=group),
            dequantize=dequantize))
    methods.append(QuantizationMethod(
        name="smoothquant",
        description="SmoothQuant W8A8: int8 weights per output feature and int8 activations "
                    "per token (or static), smoothed by calibration (alpha 0.5)",
        formats=(W8A8_SMOOTHQUANT, W8A8_SMOOTHQUANT_STATIC),
        quantize=quantize_smoothquant, dequantize=dequantize,
        calibration=Calibration(prompts=smoothquant_prompts,
                                quantize=quantize_smoothquant_calibrated, max_tokens=128,
                                options=SMOOTHQUANT_OPTIONS)))
    methods.append(QuantizationMethod(
        name="fp8",
        description="FP8 E4M3 weights and activations, a scale per tensor each; activation "
                    "scales measured by calibration (measure, then quantize)",
        formats=(FP8_E4M3_PER_TENSOR,), quantize=quantize_fp8, dequantize=dequantize,
        calibration=Calibration(prompts=fp8_prompts, quantize=quantize_fp8_calibrated,
                                max_tokens=128, options=FP8_OPTIONS)))
    uint4 = tuple(uint4_group_asym(g) for g in (128, 64, 32))
    for name, (detected, description) in CHECKPOINTS.items():
        layout = "lowp" if name == "ipex-lowp" else name
        methods.append(QuantizationMethod(
            name=name, description=description, formats=uint4,
            quantize=functools.partial(quantize_int4, group_size=128), dequantize=dequantize,
            load=functools.partial(load_checkpoint, layout=layout),
            config_quant_method=detected))
    methods.append(QuantizationMethod(
        name="gguf",
        description="a GGUF file's Q4_0 and Q4_1 linears as they are (uint4 with a scale and "
                    "a zero point 8 or a float min per 32 weights: exact), the rest "
                    "dequantized; chosen by itself for a GGUF model whose engine runs the "
                    "formats",
        formats=(uint4_group_asym(32), uint4_group_min(32)),
        quantize=functools.partial(quantize_int4, group_size=32), dequantize=dequantize,
        load=functools.partial(load_checkpoint, layout="gguf"), config_quant_method="gguf"))
    return methods


@hookimpl
def switchyard_commands() -> list[Any]:
    """``switchyard quantize MODEL OUT --method int4 [--gptq --calibration FILE]``."""
    from switchyard_spec import CommandSpec

    return [CommandSpec(name="quantize",
                        help="quant: round a model to 4 bits (RTN, or GPTQ with --gptq "
                             "--calibration FILE) and write a GPTQ folder (--method int4, "
                             "int4-g64, int4-g32)",
                        main=quantize_main)]
