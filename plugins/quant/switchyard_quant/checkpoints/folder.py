"""What every checkpoint reader needs: the folder's tensors and config, nibbles, group sizes."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from switchyard_spec import (
    UINT4_GROUP_SIZES,
    QuantizedCheckpoint,
    QuantizedWeight,
    uint4_group_asym,
)

from switchyard_quant.int4 import UINT4_MAX, pack_uint4_along_k


class CheckpointError(ValueError):
    """A checkpoint the reader cannot serve exactly; the message names the file and tensor."""


class FolderTensors:
    """The tensors of every ``*.safetensors`` file in a model folder, by name, read on demand."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        self._where: dict[str, Path] = {}
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.folder}: no .safetensors files")
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as fh:
                    for name in fh.keys():  # noqa: SIM118 (safe_open is no mapping)
                        self._where[name] = path
            except Exception as exc:  # safetensors raises its own types for a bad header
                raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc

    def names(self) -> Iterator[str]:
        """Every tensor name in the folder."""
        return iter(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> str:
        """The file holding ``name`` (for messages), or the folder when no file does."""
        path = self._where.get(name)
        return path.name if path is not None else str(self.folder)

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``; ``CheckpointError`` naming it when the folder lacks it."""
        from safetensors import safe_open

        path = self._where.get(name)
        if path is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        with safe_open(str(path), framework="pt") as fh:
            return fh.get_tensor(name)


def quantization_config(folder: str | Path) -> dict:
    """config.json's ``quantization_config`` (``{}`` when it has none)."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    found = config.get("quantization_config") or {}
    if not isinstance(found, dict):
        raise CheckpointError(f"{path}: quantization_config is not an object")
    return found


def expect_shape(tensors: FolderTensors, name: str, tensor: torch.Tensor,
                 shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    """``CheckpointError`` naming file and tensor unless ``tensor`` has ``shape`` (and ``dtype``)."""
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"{tensors.file_of(name)}: tensor {name!r} has shape "
                              f"{list(tensor.shape)}, expected {list(shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise CheckpointError(f"{tensors.file_of(name)}: tensor {name!r} is "
                              f"{str(tensor.dtype).removeprefix('torch.')}, expected "
                              f"{str(dtype).removeprefix('torch.')}")


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, W]`` -> int64 ``[R, 8 W]``: nibble ``i`` of word ``w`` (bits ``4i``..) at ``8w + i``."""
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(8, dtype=torch.int64) * 4
    return ((unsigned[..., None] >> shifts) & UINT4_MAX).reshape(words.shape[0], -1)


def format_group(group_size: int, in_features: int, where: str) -> int:
    """The format's group size that represents a checkpoint's ``group_size`` exactly.

    A scale per ``G`` weights is the same as a scale per ``g`` weights repeated
    ``G / g`` times when ``g`` divides ``G``: the largest of
    ``UINT4_GROUP_SIZES`` that divides it is taken (``-1``, one group per row,
    is a group of ``in_features``).
    """
    size = in_features if group_size == -1 else group_size
    for group in sorted(UINT4_GROUP_SIZES, reverse=True):
        if size > 0 and size % group == 0:
            return group
    raise CheckpointError(
        f"{where}: group_size {group_size} is not a multiple of one of the uint4 formats' "
        f"group sizes {UINT4_GROUP_SIZES}, so it cannot be represented exactly")


def to_record(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              where: str) -> QuantizedWeight:
    """``q`` int ``[N, K]`` (0..15), ``scales`` and ``zeros`` ``[N, G]`` per checkpoint group
    of ``group_size`` (``-1``: the row) -> a ``uint4_group_asym`` record of the same weight."""
    n, k = q.shape
    if int(zeros.min()) < 0 or int(zeros.max()) > UINT4_MAX:
        raise CheckpointError(f"{where}: zero points outside 0..{UINT4_MAX} "
                              f"({int(zeros.min())}..{int(zeros.max())})")
    size = k if group_size == -1 else group_size
    group = format_group(group_size, k, where)
    repeat = size // group
    groups = -(-k // group)
    scales = scales.float().repeat_interleave(repeat, dim=1)[:, :groups].contiguous()
    zeros = zeros.to(torch.uint8).repeat_interleave(repeat, dim=1)[:, :groups].contiguous()
    return QuantizedWeight(format=uint4_group_asym(group), out_features=n, in_features=k,
                           data=pack_uint4_along_k(q.to(torch.uint8)), scales=scales,
                           zero_points=zeros)


def bits_of(config: dict, where: str, *keys: str) -> int:
    """The ``bits`` of a quantization_config (the first of ``keys`` present); only 4 is served."""
    key = next((k for k in keys if k in config), keys[0])
    bits = config.get(key)
    if bits != 4:
        raise CheckpointError(f"{where}: quantization_config {key}={bits!r}; only 4-bit "
                              "checkpoints map to the uint4 formats the engines run")
    return 4


def read_qweight_layers(folder: str | Path, method: str,
                        read: Callable[[FolderTensors, str], QuantizedWeight],
                        suffixes: tuple[str, ...], describe: str) -> QuantizedCheckpoint:
    """Every layer with a ``<prefix>.qweight`` (GPTQ's and AWQ's naming), read by ``read``.

    ``suffixes`` are the tensors ``read`` consumes per layer (a ``bias`` is taken
    here, as float); ``describe`` goes into ``QuantizedCheckpoint.source``.
    """
    tensors = FolderTensors(folder)
    prefixes = sorted(n.removesuffix(".qweight") for n in tensors.names() if n.endswith(".qweight"))
    if not prefixes:
        raise CheckpointError(f"{folder}: config.json says {method} but no tensor is named "
                              "*.qweight")
    weights: dict[str, QuantizedWeight] = {}
    biases: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for prefix in prefixes:
        weights[prefix] = read(tensors, prefix)
        used |= {f"{prefix}.{s}" for s in suffixes if f"{prefix}.{s}" in tensors}
        if f"{prefix}.bias" in tensors:
            biases[prefix] = tensors.get(f"{prefix}.bias").float()
            used.add(f"{prefix}.bias")
    files = sorted({tensors.file_of(f"{p}.qweight") for p in prefixes})
    return QuantizedCheckpoint(
        weights=weights, biases=biases, tensors=frozenset(used),
        source=f"{method} ({len(weights)} linears, {describe}) from {', '.join(files)}")
