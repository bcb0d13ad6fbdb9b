"""GPTQ's tensor layout, packed and unpacked by the tests from the layout the GPTQ and AWQ
tools document (never by the readers' or the writer's code).

Packing: :func:`pack_rows` puts eight 4-bit values into each int32 word, the
first in the least significant bits (in a given order within the word, AWQ's);
:func:`quantized_folder` writes a model folder of tensors and a
``quantization_config``. Unpacking: :func:`unpack_words`, :func:`gptq_weight`
(one layer's float weight) and :func:`folder_weights` (a whole folder's).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LAYER = "model.layers.0.mlp.down_proj"
"""The layer the single-layer folders hold."""


def word(nibbles: list[int]) -> int:
    """Eight values 0..15, the first in the least significant bits, as an int32 bit pattern."""
    value = sum(int(v) << (4 * i) for i, v in enumerate(nibbles))
    return value - (1 << 32) if value >= 1 << 31 else value


def pack_rows(values: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """Pack each row's consecutive eights (in ``order`` within each word) into int32 words."""
    rows, cols = values.shape
    order = order or list(range(8))
    out = [[word([int(values[r, c * 8 + order[i]]) for i in range(8)])
            for c in range(cols // 8)] for r in range(rows)]
    return torch.tensor(out, dtype=torch.int32)


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> [R, 8 C]: value i of each word from bits 4i, least significant first."""
    nibbles = [(words.long() >> (4 * i)) & 15 for i in range(8)]
    return torch.stack(nibbles, -1).reshape(words.shape[0], -1)


def gptq_config(group=64, fmt="gptq", **extra) -> dict:
    """A ``quantization_config`` of a 4-bit asymmetric GPTQ folder."""
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
            "sym": False, "checkpoint_format": fmt, **extra}


def quantized_folder(tmp_path: Path, name: str, quant: dict,
                     tensors: dict[str, torch.Tensor]) -> Path:
    """A Llama model folder ``tmp_path / name`` of ``tensors`` and ``quant`` as its
    ``quantization_config``."""
    folder = tmp_path / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama",
                                                     "quantization_config": quant}))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def gptq_weight(tensors: dict[str, torch.Tensor], prefix: str, group: int) -> torch.Tensor:
    """A GPTQ v1 layer's float weight [N, K]: qweight [K/8, N] along K, qzeros [G, N/8] minus one,
    input k in group ``g_idx[k]`` (act-order) or ``k // group``."""
    q = unpack_words(tensors[f"{prefix}.qweight"].T.contiguous())  # [N, K]
    zeros = unpack_words(tensors[f"{prefix}.qzeros"]).T + 1  # [N, G]
    scales = tensors[f"{prefix}.scales"].float().T
    g = tensors.get(f"{prefix}.g_idx", torch.arange(q.shape[1]) // group).long()
    return (q - zeros[:, g]).float() * scales[:, g]


def folder_weights(folder: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The folder's float tensors, each quantized linear's weight unpacked from GPTQ's layout
    here (v1 or v2 zero points, ``g_idx`` groups), and the quantized linears' names."""
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    group, v1 = quant["group_size"], quant["checkpoint_format"] == "gptq"
    desc_act = quant["desc_act"]
    tensors = load_file(str(folder / "model.safetensors"))
    floats = {k: v.float() for k, v in tensors.items()
              if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    quantized = {k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")}
    for prefix in quantized:
        q = unpack_words(tensors[f"{prefix}.qweight"].T.contiguous())  # [N, K]
        zeros = unpack_words(tensors[f"{prefix}.qzeros"]).T + (1 if v1 else 0)  # [N, G]
        g = tensors[f"{prefix}.g_idx"].long()  # k // group, or act-order's groups
        assert desc_act or torch.equal(g, torch.arange(q.shape[1]) // group)
        scales = tensors[f"{prefix}.scales"].float().T
        floats[f"{prefix}.weight"] = (q - zeros[:, g]).float() * scales[:, g]
    return floats, quantized
