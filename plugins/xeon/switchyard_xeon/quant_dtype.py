"""Which dtype a quantization method runs in on this machine, or why it cannot run.

The start-up side of :mod:`switchyard_xeon.quantized`: it asks the native
kernels (:func:`~switchyard_xeon.kernels.load_kernels`) which panels loaded
and passed their checks, so it sits above both (the kernels' own checks use
the packers in ``quantized``).
"""

from __future__ import annotations

import torch
from switchyard_spec import EngineConfig, EngineStartError, Packing, QuantizationMethod

from switchyard_xeon.kernels import load_kernels


def w8a8_dtype(config: EngineConfig, method: QuantizationMethod, dtype: torch.dtype) -> torch.dtype:
    """The dtype a W8A8 method runs in, or a start-up error when its kernels are missing.

    The linears take fp32 activations whatever the dtype; bf16 (``--dtype
    auto`` on a CPU with native bf16, or ``bfloat16``) keeps the bf16 KV
    cache of the bf16 mode, ``float32`` an fp32 one. Any x86-64 build of the
    kernels has a W8A8 path, so only a machine without them refuses.
    """
    status = load_kernels()
    if not status.w8a8:
        why = status.reason if status.fn is None else "the W8A8 panels failed their check"
        raise EngineStartError(f"xeon engine: --quantize {method.name} runs on the native W8A8 "
                               f"kernels, which are not available ({why})")
    return dtype


def quantized_dtype(config: EngineConfig, method: QuantizationMethod, dtype: torch.dtype,
                    bf16_dot: bool, linears: str) -> torch.dtype:
    """The dtype ``method`` runs in, or a start-up error saying why it cannot run here.

    bf16 on the bf16 dot-product kernels over the integers where they are
    (AVX512_BF16 and the native kernels, ``bf16_dot``; the uint4 panels too
    for uint4 formats) and ``--dtype`` is, or resolves to, bfloat16
    (``dtype``); otherwise fp32 on the AVX2 + FMA panels
    (:func:`runs_on_fma`) for ``--dtype auto`` or ``float32``.
    """
    name = method.name
    status = load_kernels()
    uint4 = any(f.packing is Packing.UINT4_K_INT32 for f in method.formats)
    if dtype == torch.bfloat16 and bf16_dot and (status.uint4_dot or not uint4):
        return torch.bfloat16
    if status.quant_fma and linears in ("packed", "panel") and config.dtype in ("auto", "float32"):
        return torch.float32
    if status.fn is None:
        why = status.reason
    elif linears not in ("packed", "panel"):
        why = f"linears={linears}"
    elif config.dtype not in ("auto", "bfloat16", "float32"):
        why = f"--dtype {config.dtype}; use auto, bfloat16 or float32"
    elif uint4 and status.bf16_dot and not status.uint4_dot:
        why = "the uint4 panels failed their check"
    elif not status.quant_fma and not status.bf16_dot:
        why = "this CPU has neither AVX512_BF16 nor AVX2 + FMA"
    elif config.dtype == "bfloat16":
        why = ("--dtype bfloat16 needs AVX512_BF16 dot products, which this CPU or its "
               "kernels lack; --dtype auto runs fp32 math over the quantized weights")
    else:
        why = "the AVX2 + FMA panels failed their check"
    raise EngineStartError(
        f"xeon engine: --quantize {name} runs on the native quantized panels, which cannot "
        f"run it here ({why})")
