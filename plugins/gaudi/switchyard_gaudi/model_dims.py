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
from dataclasses import dataclass, replace
from pathlib import Path

from switchyard_engine.image_features import vision_architecture
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
    fp8_parameters: int = 0
    """Of those, the elements held in FP8, one byte each (``QUANT_CONFIG`` in QUANTIZE mode)."""
    tied_embeddings: bool = False
    """The LM head shares the input embedding's weight (``tie_word_embeddings``)."""
    text_model_type: str = ""
    """A vision-language model's language model type (``mistral``); else ``model_type``."""
    takes_images: bool = False
    """A vision-language model the engine serves with images (Llava-Next, Llava 1.5); its
    vision tower's weights are counted in ``parameters``."""

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Device bytes of the weights held in a dtype of ``dtype_bytes`` (FP8 ones at one byte)."""
        return (self.parameters - self.fp8_parameters) * dtype_bytes + self.fp8_parameters

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Cache bytes one token takes: keys and values of every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def per_rank(self, ranks: int) -> ModelDims:
        """The sizes one of ``ranks`` tensor-parallel ranks holds (DeepSpeed AutoTP's split).

        Attention heads, key/value heads and the MLP's intermediate size are
        split; so are the linear weights and the LM head. The input embedding
        (and the norms, counted with the split weights here: they are tiny) is
        whole on every rank. The hidden size and the vocabulary, hence the
        residual stream and the logits, are whole too.
        """
        if ranks == 1:
            return self
        embedding = self.vocab_size * self.hidden_size
        split = self.parameters - embedding + (embedding if self.tied_embeddings else 0)
        return replace(self, num_heads=-(-self.num_heads // ranks),
                       num_kv_heads=-(-self.num_kv_heads // ranks),
                       intermediate_size=-(-self.intermediate_size // ranks),
                       parameters=embedding + -(-split // ranks),
                       fp8_parameters=-(-self.fp8_parameters // ranks))


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


def safetensors_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every floating-point tensor's name and shape in the folder's safetensors headers."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        for name, entry in header.items():
            if name != "__metadata__" and str(entry.get("dtype", "")).startswith(("F", "BF")):
                shapes[name] = tuple(int(d) for d in entry["shape"])
    return shapes


_REQUIRED = frozenset({"hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"})
"""Keys of a text config the sizes need; a nested one may leave them at its class's defaults."""


def _full_text_config(folder: Path) -> dict[str, object]:
    """The nested text config with every default filled in, through transformers.

    Published Llava-Next checkpoints state only what differs from the text
    model's defaults (llava-v1.6-mistral-7b-hf's has no ``hidden_size``), so
    transformers' config class supplies the rest; no weight is read.
    """
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(folder).get_text_config().to_dict()
    except (OSError, ValueError, KeyError) as exc:
        raise EngineStartError(f"cannot read the text model's config in {folder}: {exc}") from exc


def read_model_dims(model_path: str | Path) -> ModelDims:
    """The :class:`ModelDims` of the model folder ``model_path``; EngineStartError if unreadable."""
    folder = Path(model_path)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EngineStartError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    arch = vision_architecture(folder)
    # Multimodal checkpoints nest the language model's sizes.
    text = config.get("text_config") or config
    try:
        if text is not config and not _REQUIRED <= set(text):
            text = _full_text_config(folder)
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
            tied_embeddings=bool(text.get("tie_word_embeddings",
                                          config.get("tie_word_embeddings", False))),
            text_model_type=str(text.get("model_type") or config.get("model_type", "?")),
            takes_images=arch is not None,
        )
    except (KeyError, TypeError, ValueError, OSError, struct.error) as exc:
        raise EngineStartError(f"cannot read the model's sizes in {folder}: {exc!r}") from exc
    return dims
