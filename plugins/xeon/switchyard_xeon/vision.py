"""Vision-language models on the Xeon engine: Llava-Next and Llava 1.5, through transformers.

The gateway prepares each image with the model folder's processor and sends
the prompt with the image's placeholder token repeated once per image feature,
plus the pixel arrays (``switchyard_spec.ImageInput``). Here the model is
transformers' own ``LlavaNextForConditionalGeneration`` or
``LlavaForConditionalGeneration`` and runs on the fallback path
(:mod:`switchyard_xeon.fallback`), continuously batched like any fallback
model:

- **Prefill**: a chunk that holds image placeholders enters as input
  embeddings (the hook :meth:`FallbackRunner.feeds_embeds`): the text tokens'
  embeddings, with the placeholders' rows replaced by the image's features in
  order, as the model's own forward does with ``masked_scatter``. The vision
  tower and projector run once per image, when the first chunk that reaches
  it runs (``model.get_image_features``, which applies the config's feature
  layer, feature selection and, for Llava-Next, the tiling and unpadding);
  the features are kept until the chunk that holds the image's last
  placeholder has run, so a prompt split over several chunks encodes its
  images once. A sequence re-prefilled after preemption encodes them again.
- **Decode** is the language model alone, on token ids, in the fallback's
  padded batch.

Prefix caching: the fallback path has none (each sequence has its own cache),
so no cached state is ever shared between sequences, and two prompts with the
same text and different images cannot meet in a cache. (The paged path's
prefix cache keys blocks on token ids alone; a vision model must not take it
until its block hashes include ``ImageInput.content_hash``.)
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from switchyard.engine.loading import LoadedModel, dtype_name, eos_token_ids, resolve_dtype
from switchyard_spec import EngineStartError, ImageInput, ModelInfo

from switchyard_xeon.block_manager import BlockManager
from switchyard_xeon.fallback import FallbackRunner
from switchyard_xeon.sequence import Sequence

logger = logging.getLogger("switchyard.xeon")

ARCHITECTURES = {
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
}
"""Model types the engine serves with images -> the transformers class that runs them."""


@dataclass(frozen=True)
class VisionModel:
    """A folder's vision-language architecture."""

    model_type: str
    class_name: str


def vision_model(model_path: str | Path) -> VisionModel | None:
    """The vision-language architecture of the folder, or None for any other model.

    Read from ``config.json`` alone (no transformers import), so the engine
    can choose the path before loading anything.
    """
    try:
        raw = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the text path's checks say what is wrong with the folder
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    name = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    return VisionModel(model_type, name) if model_type and name else None


def load_vision_lm(model_path: str | Path, kind: VisionModel, dtype: str) -> LoadedModel:
    """Load the vision-language model in ``model_path`` with transformers' class for it.

    Raises :class:`EngineStartError` when the weights cannot be read.
    """
    import transformers

    torch_dtype = resolve_dtype(dtype)
    path = Path(model_path)
    start = time.perf_counter()
    model_class = getattr(transformers, kind.class_name)
    try:
        model = model_class.from_pretrained(path, dtype=torch_dtype, use_safetensors=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise EngineStartError(f"cannot load {kind.class_name} weights from {str(path)!r}: "
                               f"{exc}") from exc
    model = model.to("cpu").eval()
    text = model.config.get_text_config()
    head = model.get_output_embeddings()
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    info = ModelInfo(
        model_type=kind.model_type,
        dtype=dtype_name(torch_dtype),
        vocab_size=int(vocab),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 0) or 0),
        eos_token_ids=eos_token_ids(model),
        device="cpu",
        takes_images=True,
    )
    return LoadedModel(model=model, info=info, seconds=time.perf_counter() - start)


def pixel_tensor(image: ImageInput, dtype: torch.dtype) -> torch.Tensor:
    """``image.pixel_values`` as a tensor of ``image.shape``."""
    values = torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32)
    return values.reshape(image.shape).to(dtype)


class VisionRunner(FallbackRunner):
    """The fallback runner for vision-language models: image features in prefill (see module)."""

    def __init__(self, model: torch.nn.Module, blocks: BlockManager,
                 device: torch.device | str = "cpu", padded: bool | None = None) -> None:
        super().__init__(model, blocks, device, padded)
        self._features: dict[tuple[int, int], torch.Tensor] = {}
        """(seq_id, image index) -> the image's features, from its first chunk to its last."""
        self._tracked: set[int] = set()
        self.images_encoded = 0
        """Times the vision tower has run (once per image per prefill)."""

    @property
    def held_features(self) -> int:
        """Images whose features are held between chunks."""
        return len(self._features)

    def feeds_embeds(self, seq: Sequence) -> bool:
        """Whether the coming step's tokens of ``seq`` hold any image placeholder."""
        start = seq.num_cached
        end = start + seq.num_scheduled
        return any(i.offset < end and start < i.offset + i.length for i in seq.request.images)

    def input_embeds(self, seq: Sequence) -> torch.Tensor:
        """The scheduled tokens' embeddings, image placeholders replaced by image features."""
        start = seq.num_cached
        end = start + seq.num_scheduled
        ids = torch.tensor([seq.new_tokens], device=self.device)
        embeds = self.model.get_input_embeddings()(ids)
        for index, image in enumerate(seq.request.images):
            lo, hi = max(start, image.offset), min(end, image.offset + image.length)
            if lo >= hi:
                continue
            features = self._image_features(seq, index)
            embeds[0, lo - start:hi - start] = features[lo - image.offset:hi - image.offset].to(
                embeds.dtype)
            if hi == image.offset + image.length:  # its last placeholder: done with it
                self._features.pop((seq.seq_id, index), None)
        return embeds

    def _image_features(self, seq: Sequence, index: int) -> torch.Tensor:
        """The features of ``seq``'s image ``index`` ([length, hidden]), encoding it if needed."""
        key = (seq.seq_id, index)
        held = self._features.get(key)
        if held is not None:
            return held
        image = seq.request.images[index]
        kwargs: dict[str, object] = {"pixel_values": pixel_tensor(image, self.model.dtype)}
        if image.image_size:
            kwargs["image_sizes"] = torch.tensor([image.image_size], device=self.device)
        output = self.model.get_image_features(**kwargs)
        pooled = output.pooler_output if hasattr(output, "pooler_output") else output
        features = torch.cat(list(pooled), dim=0) if isinstance(pooled, (list, tuple)) else pooled
        features = features.reshape(-1, features.shape[-1])
        self.images_encoded += 1
        if features.shape[0] != image.length:
            raise RuntimeError(
                f"request {seq.request_id}: an image gave {features.shape[0]} features for "
                f"{image.length} placeholder tokens: the folder's processor and model disagree")
        self._features[key] = features
        if seq.seq_id not in self._tracked:  # drop what an aborted prefill left behind
            self._tracked.add(seq.seq_id)
            weakref.finalize(seq, self._drop, seq.seq_id)
        return features

    def _drop(self, seq_id: int) -> None:
        self._tracked.discard(seq_id)
        for key in [k for k in list(self._features) if k[0] == seq_id]:
            self._features.pop(key, None)
