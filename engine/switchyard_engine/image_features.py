"""Vision-language models for any engine: which folders are one, loading them, image features.

The gateway prepares each image of a prompt with the model folder's processor
and sends the prompt's token ids with the image's placeholder token repeated
once per image feature, plus the pixel arrays (``switchyard_spec.ImageInput``).
What an engine then does with them is the same on every device, and lives here:

- :func:`vision_architecture` tells, from ``config.json`` alone, whether a
  folder is one of the :data:`ARCHITECTURES` served with images;
- :func:`load_vision_lm` loads it with transformers' own class (the engine's
  attention for the text model only: the vision tower keeps its default) and
  reports its :class:`~switchyard_spec.ModelInfo` with ``takes_images``;
- :func:`encode_image` runs the vision tower and projector on one image
  (``model.get_image_features``: the config's feature layer and selection,
  Llava-Next's tiling, unpadding and newline rows) and checks that it gives
  one feature per placeholder;
- :func:`place_features` writes an image's features over the embedding rows
  of its placeholders, for rows covering all of a prompt (one padded prefill
  row) or any slice of it (a chunk of a chunked prefill), as the Llava
  forward's ``masked_scatter`` does for a whole prompt.

The language model then runs on those input embeddings in prefill, and on
token ids in decode, with whatever attention and cache the engine has.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from switchyard_spec import EngineStartError, ImageInput, ModelInfo

from switchyard_engine.loading import LoadedModel, check_loading_info, dtype_name, eos_token_ids

logger = logging.getLogger("switchyard.engine")

ARCHITECTURES = {
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
}
"""Model types served with images -> the transformers class that runs them."""


class ImageFeatureError(RuntimeError):
    """The vision tower gave a number of features other than the image's placeholder count
    (the folder's processor and model disagree): the request cannot be served."""


@dataclass(frozen=True)
class VisionArchitecture:
    """A folder's vision-language architecture, read from its ``config.json``."""

    model_type: str
    """``llava_next`` or ``llava``."""
    class_name: str
    """The transformers class that runs it (``LlavaNextForConditionalGeneration``)."""
    text_model_type: str
    """The model type of its language model (``mistral``, ``llama``, ...); "" when unstated."""


def vision_architecture(model_path: str | Path) -> VisionArchitecture | None:
    """The vision-language architecture of the folder, or None for any other model.

    Read from ``config.json`` alone (no transformers import), so an engine can
    choose its path before loading anything; an unreadable folder is None
    too (the text path's checks say what is wrong with it).
    """
    try:
        raw = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    model_type = raw.get("model_type")
    name = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if name is None:
        return None
    text = raw.get("text_config")
    # transformers' Llava configs default their text model to Llama when none is stated.
    text_type = str(text.get("model_type", "llama")) if isinstance(text, dict) else "llama"
    return VisionArchitecture(str(model_type), name, text_type)


def load_vision_lm(model_path: str | Path, arch: VisionArchitecture, dtype: torch.dtype,
                   device: str = "cpu", text_attention: str | None = None) -> LoadedModel:
    """Load the vision-language model in ``model_path`` with transformers' class for it.

    ``text_attention`` (an attention name registered with transformers'
    ``AttentionInterface``) is given to the text model only: the vision tower
    keeps its default. The model is moved to ``device`` and put in eval mode.
    Raises :class:`EngineStartError` when the weights cannot be read.
    """
    import transformers  # heavy; only engines that load a model pay for it

    path = Path(model_path)
    start = time.perf_counter()
    model_class = getattr(transformers, arch.class_name)
    extra: dict[str, object] = {}
    if text_attention is not None:
        extra["attn_implementation"] = {"text_config": text_attention}
    try:
        model, loading = model_class.from_pretrained(path, dtype=dtype, use_safetensors=True,
                                                     output_loading_info=True, **extra)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise EngineStartError(f"cannot load {arch.class_name} weights from {str(path)!r}: "
                               f"{exc}") from exc
    check_loading_info(path, arch.class_name, loading)
    model = model.to(device).eval()
    seconds = time.perf_counter() - start
    logger.info("loaded %s (%s) in %.2fs", path, arch.class_name, seconds)
    text = model.config.get_text_config()
    head = model.get_output_embeddings()
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    info = ModelInfo(
        model_type=arch.model_type,
        dtype=dtype_name(dtype),
        vocab_size=int(vocab),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 0) or 0),
        eos_token_ids=eos_token_ids(model),
        device=device,
        takes_images=True,
    )
    return LoadedModel(model=model, info=info, seconds=seconds)


def pixel_tensor(image: ImageInput, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """``image.pixel_values`` (float32 bytes) as a tensor of ``image.shape``, in ``dtype``."""
    values = torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32)
    return values.reshape(image.shape).to(device=device, dtype=dtype)


def encode_image(model: torch.nn.Module, image: ImageInput) -> torch.Tensor:
    """The features of ``image`` ([image.length, hidden]) from the model's tower and projector.

    ``model`` is a Llava-family model (it has ``get_image_features``); the
    pixels go to the device and dtype of its parameters. Raises
    :class:`ImageFeatureError` when the count differs from ``image.length``.
    """
    weight = next(model.parameters())
    kwargs: dict[str, object] = {"pixel_values": pixel_tensor(image, weight.dtype, weight.device)}
    if image.image_size:  # Llava-Next: the original size decides the unpadding
        kwargs["image_sizes"] = torch.tensor([image.image_size], device=weight.device)
    output = model.get_image_features(**kwargs)
    # transformers 5 returns a model output whose pooler_output holds the projected features
    # (Llava-Next: one tensor per image); older releases return the tensor or list itself.
    pooled = output.pooler_output if hasattr(output, "pooler_output") else output
    features = torch.cat(list(pooled), dim=0) if isinstance(pooled, (list, tuple)) else pooled
    features = features.reshape(-1, features.shape[-1])
    if features.shape[0] != image.length:
        raise ImageFeatureError(
            f"an image gave {features.shape[0]} features for {image.length} placeholder "
            "tokens: the folder's processor and model disagree")
    return features


def place_features(rows: torch.Tensor, start: int, image: ImageInput,
                   features: torch.Tensor) -> bool:
    """Write ``image``'s features over its placeholders' rows in ``rows``, in place.

    ``rows`` ([n, hidden]) are the input embeddings of prompt positions
    ``start .. start + n - 1``: a whole prompt (``start`` 0) or one chunk of
    it; only the placeholders that fall inside are written. Returns whether
    the image's last placeholder lies inside (its features are not needed
    again for this prefill).
    """
    end = start + rows.shape[0]
    lo, hi = max(start, image.offset), min(end, image.offset + image.length)
    if lo < hi:
        rows[lo - start:hi - start] = features[lo - image.offset:hi - image.offset].to(rows.dtype)
    return start < image.offset + image.length <= end


def overlaps(image: ImageInput, start: int, end: int) -> bool:
    """Whether any of ``image``'s placeholders lies in prompt positions ``start .. end - 1``."""
    return image.offset < end and start < image.offset + image.length
