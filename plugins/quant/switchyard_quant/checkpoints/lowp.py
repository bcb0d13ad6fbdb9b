"""ipex's low-precision checkpoints (the seed's ``--low-precision-checkpoint``), beside a float model.

A state dict (a ``.pt`` file, read with ``weights_only``, or ``.safetensors``)
holding, per quantized linear ``P``, under configurable key names:

- ``P.packed_weight`` int32 ``[N, K/8]``: UINT4 packed along K, least
  significant nibble first: the contract's ``Packing.UINT4_K_INT32`` as is;
- ``P.scale`` float ``[N, G]`` (extra dimensions of length 1 allowed);
- ``P.packed_zp``: the zero points, int32 ``[N, G]`` holding UINT4 values,
  or packed eight to a word along G (``[N, ceil(G/8)]``);
- ``P.bias`` (optional; otherwise the model's own).

The group size is ``K / G``. Engine options (``--engine-option``):
``low_precision_checkpoint`` (the file; required), and the key names
``lowp_weight_key``, ``lowp_scale_key``, ``lowp_zero_point_key``,
``lowp_bias_key`` (defaults ``packed_weight``, ``scale``, ``packed_zp``,
``bias``, ipex's). Every other tensor comes from the model folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from switchyard_spec import QuantizedCheckpoint, QuantizedWeight

from switchyard_quant.checkpoints.folder import CheckpointError, to_record, unpack_nibbles

OPTIONS = ("low_precision_checkpoint", "lowp_weight_key", "lowp_scale_key",
           "lowp_zero_point_key", "lowp_bias_key")
"""The engine options the reader takes."""
DEFAULT_KEYS = {"weight": "packed_weight", "scale": "scale", "zero_point": "packed_zp",
                "bias": "bias"}


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        loaded = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch and safetensors raise many types for a bad file
        raise CheckpointError(f"{path}: cannot read the low-precision checkpoint ({exc})") from exc
    if isinstance(loaded, tuple | list) and loaded and isinstance(loaded[0], dict):
        loaded = loaded[0]  # ipex's (state_dict, config) pair
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path}: not a state dict")
    return loaded


def load_lowp(folder: str, options: Mapping[str, str]) -> QuantizedCheckpoint:
    """The linears of the low-precision checkpoint ``options['low_precision_checkpoint']``."""
    file = options.get("low_precision_checkpoint")
    if not file:
        raise CheckpointError("--quantize ipex-lowp needs --engine-option "
                              "low_precision_checkpoint=FILE (a .pt or .safetensors state dict)")
    path = Path(file)
    if not path.is_absolute() and not path.exists():
        path = Path(folder) / file
    if not path.is_file():
        raise CheckpointError(f"low_precision_checkpoint {file!r}: no such file")
    keys = {k: options.get(f"lowp_{k}_key", v) for k, v in DEFAULT_KEYS.items()}
    state = _read_state_dict(path)
    suffix = "." + keys["weight"]
    prefixes = sorted(n.removesuffix(suffix) for n in state if n.endswith(suffix))
    if not prefixes:
        raise CheckpointError(f"{path.name}: no tensor is named *{suffix} "
                              "(set lowp_weight_key to the checkpoint's key)")
    weights: dict[str, QuantizedWeight] = {}
    biases: dict[str, torch.Tensor] = {}
    for prefix in prefixes:
        weights[prefix] = read_linear(state, prefix, keys, path.name)
        bias = state.get(f"{prefix}.{keys['bias']}")
        if bias is not None:
            biases[prefix] = bias.float().reshape(-1)
    return QuantizedCheckpoint(weights=weights, biases=biases,
                               source=f"ipex low-precision checkpoint ({len(weights)} linears, "
                                      f"uint4) from {path}")


def read_linear(state: Mapping[str, torch.Tensor], prefix: str, keys: Mapping[str, str],
                file: str) -> QuantizedWeight:
    """One linear's packed weight, scales and zero points as a record."""
    names = {k: f"{prefix}.{keys[k]}" for k in ("weight", "scale", "zero_point")}
    for kind, name in names.items():
        if name not in state:
            raise CheckpointError(f"{file}: tensor {name!r} is missing (lowp_{kind}_key is "
                                  f"{keys[kind]!r})")
    packed, scale, zp = (state[names[k]] for k in ("weight", "scale", "zero_point"))
    if packed.dim() != 2 or packed.dtype != torch.int32:
        raise CheckpointError(f"{file}: tensor {names['weight']!r} is "
                              f"{str(packed.dtype).removeprefix('torch.')} {list(packed.shape)}, "
                              "expected int32 [N, K/8]")
    n, k = packed.shape[0], packed.shape[1] * 8
    scale = scale.reshape(n, -1) if scale.numel() % max(n, 1) == 0 else scale
    if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
        raise CheckpointError(f"{file}: tensor {names['scale']!r} has shape {list(scale.shape)}, "
                              f"expected [{n}, groups] with groups dividing K={k}")
    groups = scale.shape[1]
    if zp.numel() == n * groups:
        zeros = zp.reshape(n, groups).long()
    elif zp.dim() == 2 and tuple(zp.shape) == (n, -(-groups // 8)) and zp.dtype == torch.int32:
        zeros = unpack_nibbles(zp)[:, :groups]
    else:
        raise CheckpointError(f"{file}: tensor {names['zero_point']!r} has shape "
                              f"{list(zp.shape)}, expected [{n}, {groups}] or packed "
                              f"[{n}, {-(-groups // 8)}]")
    q = unpack_nibbles(packed)
    return to_record(q, scale.float(), zeros, k // groups, f"{file}: {prefix}")
