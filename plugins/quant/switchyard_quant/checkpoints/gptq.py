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

The weight is ``(q - z) * s`` per group ``g_idx[k]``. Without act-order
``g_idx`` is ``k // group_size``; act-order checkpoints (``desc_act``: groups
formed in another order than the inputs) have any ``g_idx`` in which every
group but the last holds ``group_size`` inputs. Their columns are stored
sorted by group, with the order in the record's ``input_order``
(:mod:`switchyard_quant.gptq_act_order`), so the engine gathers each input
row in that order; a ``g_idx`` that is no such assignment is refused, naming
the file and tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
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
from switchyard_quant.gptq_act_order import order_from_g_idx

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
    order = None
    if f"{prefix}.g_idx" in tensors:
        try:
            order = order_from_g_idx(tensors.get(f"{prefix}.g_idx"), group_size, k, groups)
        except ValueError as exc:
            raise CheckpointError(f"{tensors.file_of(prefix + '.g_idx')}: tensor "
                                  f"'{prefix}.g_idx' (desc_act={str(desc_act).lower()}) "
                                  f"{exc}") from None
    elif desc_act:
        raise CheckpointError(f"{where}: desc_act is true but there is no {prefix}.g_idx")
    q = unpack_nibbles(qweight.T.contiguous())  # [N, K]: words along K, as the contract packs
    if order is not None:  # act-order: each group's inputs together, in the stored order
        q = q[:, order]
    zeros = unpack_nibbles(qzeros)[:, :n].T  # [N, G]
    if v1:  # stored minus one; a stored 15 is a zero point of 16, outside uint4
        zeros = zeros + 1
        if int(zeros.max()) > 15:
            raise CheckpointError(
                f"{tensors.file_of(prefix + '.qzeros')}: tensor '{prefix}.qzeros' holds a "
                "zero point of 16 (stored 15 in checkpoint_format gptq, which stores zero "
                "points minus one), outside uint4's 0..15")
    record = to_record(q, scales.T.float(), zeros, group_size, where)
    return record if order is None else msgspec.structs.replace(record, input_order=order)
