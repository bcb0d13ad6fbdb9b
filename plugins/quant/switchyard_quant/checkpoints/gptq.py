"""GPTQ folders as transformers (optimum, AutoGPTQ, GPTQModel) write them.

config.json's ``quantization_config``: ``quant_method`` "gptq", ``bits``,
``group_size`` (-1: one group per row), ``desc_act`` (act-order),
``checkpoint_format`` ("gptq", the default, or "gptq_v2"). Per quantized
linear ``P`` (e.g. ``model.layers.0.mlp.down_proj``) with N outputs, K inputs
and G groups:

- ``P.qweight`` int32 ``[K/8, N]``: eight 4-bit integers per word along K,
  input ``8r + i`` of output ``n`` in bits ``4i``.. of ``qweight[r, n]``;
  transposed, exactly the contract's ``Packing.UINT4_K_INT32``;
- ``P.qzeros`` int32 ``[G, N/8]``: the zero points, packed along N the same way;
  the "gptq" format stores each minus one (``gptq_v2`` stores it as is);
- ``P.scales`` float16 ``[G, N]``;
- ``P.g_idx`` int32 ``[K]``: the group of each input;
- ``P.bias`` (optional).

The weight is ``(q - z) * s`` per group. ``g_idx`` must be ``k // group_size``:
act-order checkpoints (``desc_act``: groups in another order than the inputs)
would need every layer's input permuted, which the engines' kernels do not
do, so they are refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from switchyard_spec import QuantizedCheckpoint, QuantizedWeight

from switchyard_quant.checkpoints.folder import (
    CheckpointError,
    FolderTensors,
    bits_of,
    expect_shape,
    quantization_config,
    read_qweight_layers,
    to_record,
    unpack_nibbles,
)

FORMATS = ("gptq", "gptq_v2")
"""``checkpoint_format`` values read: v1 stores zero points minus one, v2 as they are."""


def load_gptq(folder: str, options: Mapping[str, str] | None = None) -> QuantizedCheckpoint:
    """Every quantized linear of a GPTQ folder, as ``uint4_group_asym`` records."""
    config = quantization_config(folder)
    where = f"{folder}/config.json"
    method = str(config.get("quant_method", "")).lower()
    if method != "gptq":
        raise CheckpointError(f"{where}: quantization_config.quant_method is "
                              f"{config.get('quant_method')!r}, not 'gptq'")
    bits_of(config, where, "bits")
    group_size = int(config.get("group_size", 128))
    fmt = str(config.get("checkpoint_format", "gptq")).lower()
    if fmt not in FORMATS:
        raise CheckpointError(f"{where}: checkpoint_format {fmt!r} is not read; "
                              f"the readable ones are {', '.join(FORMATS)}")
    desc_act = bool(config.get("desc_act", False))
    return read_qweight_layers(
        folder, "GPTQ",
        lambda tensors, prefix: read_linear(tensors, prefix, group_size, fmt == "gptq", desc_act),
        ("qweight", "qzeros", "scales", "g_idx"),
        f"4 bits, group {group_size}, checkpoint_format {fmt}")


def read_linear(tensors: FolderTensors, prefix: str, group_size: int, v1: bool,
                desc_act: bool = False) -> QuantizedWeight:
    """One linear's ``qweight``, ``qzeros``, ``scales`` (and ``g_idx``) as a record."""
    qweight = tensors.get(f"{prefix}.qweight")
    where = f"{tensors.file_of(prefix + '.qweight')}: {prefix}"
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise CheckpointError(f"{where}.qweight is {str(qweight.dtype).removeprefix('torch.')} "
                              f"{list(qweight.shape)}, expected int32 [K/8, N]")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = 1 if group_size == -1 else -(-k // group_size)
    qzeros = tensors.get(f"{prefix}.qzeros")
    expect_shape(tensors, f"{prefix}.qzeros", qzeros, (groups, -(-n // 8)), torch.int32)
    scales = tensors.get(f"{prefix}.scales")
    expect_shape(tensors, f"{prefix}.scales", scales, (groups, n))
    if f"{prefix}.g_idx" in tensors:
        g_idx = tensors.get(f"{prefix}.g_idx")
        expect_shape(tensors, f"{prefix}.g_idx", g_idx, (k,))
        size = k if group_size == -1 else group_size
        if not torch.equal(g_idx.long(), torch.arange(k) // size):
            raise CheckpointError(
                f"{tensors.file_of(prefix + '.g_idx')}: tensor '{prefix}.g_idx' orders the "
                f"groups differently from the inputs (act-order, desc_act="
                f"{str(desc_act).lower()}): the engines' kernels would need this layer's input "
                "permuted, which they do not do; quantize without act-order")
    elif desc_act:
        raise CheckpointError(f"{where}: desc_act is true but there is no {prefix}.g_idx")
    q = unpack_nibbles(qweight.T.contiguous())  # [N, K]: words along K, as the contract packs
    zeros = unpack_nibbles(qzeros)[:, :n].T  # [N, G]
    if v1:  # stored minus one; a stored 15 is a zero point of 16, outside uint4
        zeros = zeros + 1
        if int(zeros.max()) > 15:
            raise CheckpointError(
                f"{tensors.file_of(prefix + '.qzeros')}: tensor '{prefix}.qzeros' holds a "
                "zero point of 16 (stored 15 in checkpoint_format gptq, which stores zero "
                "points minus one), outside uint4's 0..15")
    return to_record(q, scales.T.float(), zeros, group_size, where)
