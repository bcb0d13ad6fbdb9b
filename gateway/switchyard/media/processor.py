"""The model folder's transformers processor, run on one image at a time.

The processor is the model's own definition of what an image becomes: it
resizes, normalises and tiles the image (Llava-Next picks a grid of tiles by
the image's aspect ratio), and it knows how many placeholder tokens the image
takes, which depends on the image's size for Llava-Next. Running it on the
placeholder token alone with the image gives both, exactly as
``processor(text, images)`` would for a whole prompt.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from PIL import Image

from switchyard_spec import EngineStartError

log = logging.getLogger("switchyard.media")


class PreparedImage(msgspec.Struct, frozen=True, kw_only=True):
    """One image as the processor leaves it: what an ``ImageInput`` holds, less its position."""

    length: int
    """Placeholder tokens the image takes."""
    content_hash: str
    pixel_values: bytes
    shape: tuple[int, ...]
    image_size: tuple[int, ...] = ()


def content_hash(pixels: bytes, shape: tuple[int, ...], image_size: tuple[int, ...]) -> str:
    """``ImageInput.content_hash``: SHA-256 over the pixels, their shape and the image size."""
    digest = hashlib.sha256()
    digest.update(repr((shape, image_size)).encode())
    digest.update(pixels)
    return digest.hexdigest()


class VisionProcessor:
    """A model's processor, with its image placeholder token.

    Thread-safe: calls are serialised (the processor's tokenizer may not be
    used from two threads at once).
    """

    def __init__(self, processor: Any, image_token: str, image_token_id: int) -> None:
        self._processor = processor
        self.image_token = image_token
        """The placeholder's text (``<image>``)."""
        self.image_token_id = image_token_id
        """The placeholder's token id."""
        self._lock = threading.Lock()

    def prepare(self, image: Image.Image) -> PreparedImage:
        """Pixel arrays, placeholder count and content hash of one decoded RGB image."""
        with self._lock:
            out = self._processor(text=self.image_token, images=[image], return_tensors="np")
        length = int((np.asarray(out["input_ids"]) == self.image_token_id).sum())
        pixels = np.ascontiguousarray(out["pixel_values"], dtype="<f4")
        sizes = out.get("image_sizes")
        size = tuple(int(v) for v in np.asarray(sizes)[0]) if sizes is not None else ()
        shape = tuple(int(d) for d in pixels.shape)
        data = pixels.tobytes()
        return PreparedImage(length=length, content_hash=content_hash(data, shape, size),
                             pixel_values=data, shape=shape, image_size=size)


def load_vision_processor(model_path: str | Path) -> VisionProcessor:
    """The processor of the vision-language model in ``model_path`` (local files only).

    Raises :class:`~switchyard_spec.EngineStartError` when the folder has no
    processor that takes images, or its image token is not in the vocabulary.
    """
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(model_path), local_files_only=True,
                                                  trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
        raise EngineStartError(f"cannot load the image processor of {str(model_path)!r}: "
                               f"{type(exc).__name__}: {exc}") from exc
    token = getattr(processor, "image_token", None)
    token_id = getattr(processor, "image_token_id", None)
    if getattr(processor, "image_processor", None) is None or not token or token_id is None:
        raise EngineStartError(
            f"the processor in {str(model_path)!r} ({type(processor).__name__}) has no image "
            "processor and image token; a vision-language model folder needs one "
            "(processor_config.json or preprocessor_config.json)")
    log.info("image processor: %s, placeholder %r (id %d)",
             type(processor.image_processor).__name__, token, token_id)
    return VisionProcessor(processor, str(token), int(token_id))
