"""The quantized weight formats the xeon engine's kernels run.

Its own module, torch-free, so the plugin's hooks (which must import cheaply)
declare them and the engine's packing code checks against them without either
importing the other.
"""

from __future__ import annotations

from switchyard_spec import (
    FP8_E4M3_PER_TENSOR,
    INT8_PER_CHANNEL,
    UINT4_GROUP_SIZES,
    W8A8_SMOOTHQUANT,
    W8A8_SMOOTHQUANT_STATIC,
    uint4_group_asym,
    uint4_group_min,
)

WEIGHT_FORMATS = (INT8_PER_CHANNEL, *(uint4_group_asym(g) for g in UINT4_GROUP_SIZES),
                  *(uint4_group_min(g) for g in UINT4_GROUP_SIZES),
                  W8A8_SMOOTHQUANT, W8A8_SMOOTHQUANT_STATIC, FP8_E4M3_PER_TENSOR)
"""The quantized formats the engine's kernels run: weight-only int8 and uint4
(integer zero points, or float mins) on the bf16 dot-product panels (CPUs
with AVX512_BF16) or the AVX2 + FMA ones, W8A8 on the int8
panels (AMX, AVX512-VNNI, AVX2 or scalar; :mod:`switchyard_xeon.quantized`),
FP8 E4M3 in stock PyTorch (:mod:`switchyard_xeon.fp8_linears`)."""
