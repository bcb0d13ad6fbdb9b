"""A model's sizes, read from its folder without loading it: what the memory plan needs.

``config.json`` gives the layer and head counts; the safetensors headers (a
length and a JSON table at the start of each file) give every weight's shape,
so the weights' size in the serving dtype is exact without reading a byte of
them. This is what lets the warmup plan refuse a configuration before any
weight reaches the device.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from switchyard_spec import EngineStartError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a decoder-only transformer that decide its device memory."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    parameters: int
    """Elements of every floating-point weight in the checkpoint (tied ones once)."""

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Device bytes of the weights held in a dtype of ``dtype_bytes``."""
        return self.parameters * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Cache bytes one token takes: keys and values of every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _safetensors_elements(path: Path) -> int:
    """Elements of the floating-point tensors in one safetensors file (header only)."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    total = 0
    for name, entry in header.items():
        if name == "__metadata__" or not str(entry.get("dtype", "")).startswith(("F", "BF")):
            continue
        total += math.prod(entry["shape"])
    return total


def read_model_dims(model_path: str | Path) -> ModelDims:
    """The :class:`ModelDims` of the model folder ``model_path``; EngineStartError if unreadable."""
    folder = Path(model_path)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EngineStartError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    # Multimodal checkpoints nest the language model's sizes.
    text = config.get("text_config") or config
    try:
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        dims = ModelDims(
            model_type=str(config.get("model_type", "?")),
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(text.get("intermediate_size") or 4 * hidden),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            vocab_size=int(text["vocab_size"]),
            max_position_embeddings=int(text.get("max_position_embeddings") or 0),
            parameters=sum(_safetensors_elements(p) for p in sorted(folder.glob("*.safetensors"))),
        )
    except (KeyError, TypeError, ValueError, OSError, struct.error) as exc:
        raise EngineStartError(f"cannot read the model's sizes in {folder}: {exc!r}") from exc
    return dims
