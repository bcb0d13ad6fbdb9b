"""AWQ folders (AutoAWQ's GEMM layout) as transformers reads them.

config.json's ``quantization_config``: ``quant_method`` "awq", ``bits``
(AutoAWQ's own files say ``w_bit``), ``group_size`` (``q_group_size``),
``zero_point`` (must be true), ``version`` "gemm". Per quantized linear ``P``
with N outputs, K inputs and G groups:

- ``P.qweight`` int32 ``[K, N/8]``: eight 4-bit integers per word along N,
  interleaved: the nibble in bits ``4i``.. of word ``c`` is output
  ``8c + AWQ_ORDER[i]``, ``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``;
- ``P.qzeros`` int32 ``[G, N/8]``: zero points, packed the same way, as they are;
- ``P.scales`` float16 ``[G, N]``;
- ``P.bias`` (optional).

The weight is ``(q - z) * s`` per group of K. The GEMV layout packs
differently and is refused.
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

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""The output (within a word's eight) held by each nibble, least significant first."""


def unpack_awq_columns(words: torch.Tensor, n: int) -> torch.Tensor:
    """int32 ``[R, N/8]`` packed along N in AWQ's order -> int64 ``[R, n]`` in output order."""
    slots = unpack_nibbles(words).view(words.shape[0], -1, 8)
    out = torch.empty_like(slots)
    out[..., list(AWQ_ORDER)] = slots  # nibble i is output AWQ_ORDER[i]
    return out.reshape(words.shape[0], -1)[:, :n]


def load_awq(folder: str, options: Mapping[str, str] | None = None) -> QuantizedCheckpoint:
    """Every quantized linear of an AWQ (GEMM) folder, as ``uint4_group_asym`` records."""
    config = quantization_config(folder)
    where = f"{folder}/config.json"
    if str(config.get("quant_method", "")).lower() != "awq":
        raise CheckpointError(f"{where}: quantization_config.quant_method is "
                              f"{config.get('quant_method')!r}, not 'awq'")
    bits_of(config, where, "bits", "w_bit")
    group_size = int(config.get("group_size", config.get("q_group_size", 128)))
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise CheckpointError(f"{where}: AWQ version {version!r} is not read; only 'gemm' "
                              "(AutoAWQ's default layout) is")
    if not config.get("zero_point", True):
        raise CheckpointError(f"{where}: zero_point false (symmetric AWQ) is not read")
    return read_qweight_layers(
        folder, "AWQ", lambda tensors, prefix: read_linear(tensors, prefix, group_size),
        ("qweight", "qzeros", "scales"), f"4 bits, group {group_size}, GEMM")


def read_linear(tensors: FolderTensors, prefix: str, group_size: int) -> QuantizedWeight:
    """One linear's ``qweight``, ``qzeros`` and ``scales`` as a record."""
    qweight = tensors.get(f"{prefix}.qweight")
    where = f"{tensors.file_of(prefix + '.qweight')}: {prefix}"
    scales = tensors.get(f"{prefix}.scales")
    if qweight.dim() != 2 or qweight.dtype != torch.int32 or scales.dim() != 2:
        raise CheckpointError(f"{where}.qweight is {str(qweight.dtype).removeprefix('torch.')} "
                              f"{list(qweight.shape)}, expected int32 [K, N/8] with scales [G, N]")
    k, n = qweight.shape[0], scales.shape[1]
    expect_shape(tensors, f"{prefix}.qweight", qweight, (k, -(-n // 8)))
    groups = 1 if group_size == -1 else -(-k // group_size)
    expect_shape(tensors, f"{prefix}.scales", scales, (groups, n))
    qzeros = tensors.get(f"{prefix}.qzeros")
    expect_shape(tensors, f"{prefix}.qzeros", qzeros, (groups, -(-n // 8)), torch.int32)
    q = unpack_awq_columns(qweight, n).T  # [N, K]
    zeros = unpack_awq_columns(qzeros, n).T  # [N, G]
    return to_record(q.contiguous(), scales.T.float(), zeros, group_size, where)
