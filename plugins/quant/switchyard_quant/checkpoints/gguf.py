"""GGUF blocks, as a converted GGUF folder keeps them, read into the uint4 formats they are exactly.

A folder the gateway converted from a GGUF file (``--model-id FILE.gguf``)
holds every weight in float32, and, in ``switchyard_spec.GGUF_BLOCKS_FILE``,
the GGUF blocks of the linears whose block type a contract format holds
exactly (``switchyard_spec.GGUF_BLOCK_TYPES``). This reader turns those into
``QuantizedWeight`` records, so the engine packs the file's integers and
scales as they are instead of widening them to bf16 (or rounding them
again). Both types store 32 weights of a row per block, the nibbles in 16
bytes whose byte ``j`` holds weight ``j`` in its low nibble and weight
``j + 16`` in its high one (``gguf.quants``' order):

- ``Q4_0`` (18 bytes: a little-endian float16 scale ``d``, then the
  nibbles; the weight is ``d * (q - 8)``) is ``uint4_group_asym(32)``: the
  nibbles as they are, packed eight to an int32 along K, the scale
  ``float32(d)`` and the zero point 8. The format's weight
  ``(q - 8) * float32(d)`` is the product ``gguf.quants.dequantize``
  computes, with no rounding in either (``GGUF_BLOCK_TYPES`` says why).
- ``Q4_1`` (20 bytes: float16 ``d``, float16 ``m``, then the nibbles; the
  weight is ``d * q + m``) is ``uint4_group_min(32)``: the nibbles, the
  scale ``float32(d)`` and the min ``float32(m)``. ``q * d`` is exact, so
  the format's ``q * s + b`` rounds once, in the sum, as gguf's does.

So the records stand for the folder's float32 weights bit for bit. Other
block types (Q8_0, the K-quants) are not in the file: their layers come
from the folder's float32 weights, as without this reader. The method is
``--quantize gguf``, which the gateway picks by itself for such a folder
when the engine runs its formats.
"""

from __future__ import annotations

from pathlib import Path

import torch

from switchyard_spec import (
    GGUF_BLOCKS_FILE,
    QuantizedCheckpoint,
    QuantizedWeight,
    uint4_group_asym,
    uint4_group_min,
)

from switchyard_quant.checkpoints.folder import CheckpointError
from switchyard_quant.int4 import pack_uint4_along_k

Q4_0_BLOCK_BYTES = 18
"""A Q4_0 block: a float16 scale and 32 nibbles."""
Q4_1_BLOCK_BYTES = 20
"""A Q4_1 block: a float16 scale, a float16 min and 32 nibbles."""
BLOCK_WEIGHTS = 32
"""Weights per block along K (every type GGUF_BLOCK_TYPES lists)."""
Q4_0_ZERO = 8
"""Q4_0's offset: the weight is ``d * (q - 8)``."""
READS = ("Q4_0", "Q4_1")
"""The block types this reader maps (``switchyard_spec.GGUF_BLOCK_TYPES``, all of them)."""


def _blocks(blocks: torch.Tensor, size: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint8[N, K / 32 * size]`` blocks as ``uint8[N, K / 32, size]``, and their integers
    ``q`` as ``uint8[N, K]`` (each block's last 16 bytes: weight j low, j + 16 high)."""
    if blocks.dim() != 2 or blocks.dtype != torch.uint8 or blocks.shape[1] % size:
        raise CheckpointError(f"{where} is {str(blocks.dtype).removeprefix('torch.')} "
                              f"{list(blocks.shape)}, expected uint8 [N, K / 32 * {size}]")
    n, groups = blocks.shape[0], blocks.shape[1] // size
    grouped = blocks.contiguous().view(n, groups, size)
    nibbles = grouped[..., size - BLOCK_WEIGHTS // 2:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).view(n, groups * BLOCK_WEIGHTS)
    return grouped, q


def _half(grouped: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of every block, widened to float32 ``[N, K / 32]``."""
    n, groups = grouped.shape[:2]
    return widen_float16(grouped[..., at:at + 2].contiguous().view(torch.float16).view(n, groups))


def q4_0_weight(blocks: torch.Tensor, where: str = "Q4_0 blocks") -> QuantizedWeight:
    """``uint8[N, K / 32 * 18]`` Q4_0 blocks (a row per output feature) as uint4-group32-asym."""
    grouped, q = _blocks(blocks, Q4_0_BLOCK_BYTES, where)
    n, groups = grouped.shape[:2]
    return QuantizedWeight(format=uint4_group_asym(BLOCK_WEIGHTS), out_features=n,
                           in_features=groups * BLOCK_WEIGHTS, data=pack_uint4_along_k(q),
                           scales=_half(grouped, 0).contiguous(),
                           zero_points=torch.full((n, groups), Q4_0_ZERO, dtype=torch.uint8))


def q4_1_weight(blocks: torch.Tensor, where: str = "Q4_1 blocks") -> QuantizedWeight:
    """``uint8[N, K / 32 * 20]`` Q4_1 blocks (a row per output feature) as uint4-group32-min."""
    grouped, q = _blocks(blocks, Q4_1_BLOCK_BYTES, where)
    n, groups = grouped.shape[:2]
    return QuantizedWeight(format=uint4_group_min(BLOCK_WEIGHTS), out_features=n,
                           in_features=groups * BLOCK_WEIGHTS, data=pack_uint4_along_k(q),
                           scales=_half(grouped, 0).contiguous(),
                           mins=_half(grouped, 2).contiguous())


READERS = {"Q4_0": q4_0_weight, "Q4_1": q4_1_weight}
"""Block type -> the function that reads its blocks into a record."""


def widen_float16(halves: torch.Tensor) -> torch.Tensor:
    """float16 values as float32, exactly and bit for bit, as numpy (and so gguf) widens them.

    By bits, not ``.float()``: torch's widening of a signalling NaN depends on
    the code path (quieted with its payload in vector code, another NaN in
    the scalar tail), and a scale must stand for the same weights wherever
    it sits in the tensor.
    """
    bits = halves.view(torch.int16).to(torch.int32) & 0xFFFF
    sign = (bits >> 15) << 31
    exponent = (bits >> 10) & 0x1F
    mantissa = bits & 0x3FF
    normal = sign | ((exponent + 112) << 23) | (mantissa << 13)  # rebias 15 -> 127
    special = sign | (0xFF << 23) | (mantissa << 13)  # infinities and NaNs, payload kept
    wide = torch.where(exponent == 0x1F, special, normal).view(torch.float32)
    # Zeros and subnormals: mantissa * 2**-24, exact in float32, with the sign (so -0.0 too).
    small = torch.where(sign != 0, -1.0, 1.0) * mantissa.float() * 2.0**-24
    return torch.where(exponent == 0, small, wide)


def load_gguf(folder: str, options: object = None) -> QuantizedCheckpoint:
    """The linears of a converted GGUF folder's ``GGUF_BLOCKS_FILE``: ``Q4_0`` blocks as
    ``uint4-group32-asym``, ``Q4_1`` blocks as ``uint4-group32-min``.

    ``CheckpointError`` (a ValueError) when the folder has no such file (it was
    not converted from a GGUF file, or none of the file's linears is in a block
    type a format holds exactly), or the file holds a tensor that is no
    weight, of a type this reader does not map, or of the wrong shape.
    """
    from safetensors import safe_open

    path = Path(folder) / GGUF_BLOCKS_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{folder} has no {GGUF_BLOCKS_FILE}: --quantize gguf serves the linears of a GGUF "
            f"file (--model-id FILE.gguf) in the block types a weight format holds exactly "
            f"({', '.join(READS)}); this model has none (a GGUF file's other block types are "
            "served dequantized, without --quantize)")
    weights: dict[str, QuantizedWeight] = {}
    kinds: dict[str, int] = {}
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors' own error types for a bad header
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    with handle as fh:
        types = fh.metadata() or {}
        for name in fh.keys():  # noqa: SIM118 (safe_open is no mapping)
            kind = types.get(name)
            where = f"{path.name}: tensor {name!r}"
            if not name.endswith(".weight"):
                raise CheckpointError(f"{where} is not a linear layer's weight")
            if kind not in READS:
                raise CheckpointError(f"{where} holds {kind!r} blocks; this reader maps "
                                      f"{', '.join(READS)}")
            weights[name.removesuffix(".weight")] = READERS[kind](fh.get_tensor(name), where)
            kinds[kind] = kinds.get(kind, 0) + 1
    read = "; ".join(f"{kind} blocks of {count} linear{'s' if count != 1 else ''} as "
                     + ("uint4-group32-asym (zero point 8" if kind == "Q4_0" else
                        "uint4-group32-min (float16 mins widened to float32")
                     + ", float16 scales widened to float32)"
                     for kind, count in sorted(kinds.items()))
    return QuantizedCheckpoint(
        weights=weights, tensors=frozenset(f"{name}.weight" for name in weights),
        source=f"GGUF {read}, from {GGUF_BLOCKS_FILE}; the other layers from the dequantized "
               "float32 weights")
