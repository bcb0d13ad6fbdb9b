"""Vision-language models on the Gaudi engine: Llava-Next and Llava 1.5, as tgi-gaudi serves them.

The model is transformers' own ``LlavaNextForConditionalGeneration`` or
``LlavaForConditionalGeneration``, loaded by the toolkit
(:func:`switchyard_engine.image_features.load_vision_lm`) with the engine's
attention for its language model; the vision tower keeps its own.

- **Prefill** (:class:`VisionRunner`): the padded ``[P, S]`` token ids are
  embedded on the device (placeholder ids included: they are in the
  vocabulary), then each sequence's images are encoded, once per image,
  and their features written over the placeholders' rows
  (:func:`~switchyard_engine.image_features.encode_image`,
  :func:`~switchyard_engine.image_features.place_features`). The captured
  prefill takes these ``[P, S, hidden]`` input embeddings where a text
  model's takes ids, so its graph still depends on the bucket shape alone.
  The vision tower runs outside the captured graphs: Llava-Next's tile
  count varies with the image's aspect ratio.
- **Decode** is the language model on token ids, over the static cache,
  exactly as for a text model (:class:`~switchyard_gaudi.runner.StaticRunner`).
- An image the tower cannot encode (the folder's processor and model
  disagree on its feature count) ends its own sequence with the error; the
  others in the padded batch are served.

Prompt buckets and prefill rows follow ``BASE_IMAGE_TOKENS`` (see
:mod:`~switchyard_gaudi.warmup_plan`); sharding and ``QUANT_CONFIG`` are
refused at start-up (:mod:`~switchyard_gaudi.assembly`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from switchyard_engine.image_features import ImageFeatureError, encode_image, place_features

from switchyard_gaudi.device import Device
from switchyard_gaudi.kv_cache import StaticKVCache
from switchyard_gaudi.runner import StaticRunner
from switchyard_gaudi.sequence import GaudiSequence
from switchyard_gaudi.warmup_plan import PREFILL, Shape

logger = logging.getLogger("switchyard.gaudi")


class VisionRunner(StaticRunner):
    """A :class:`StaticRunner` whose prefill takes input embeddings with image features.

    ``model`` is the whole Llava model (its language model is the runner's
    ``base``, its ``lm_head`` the ``head``); unsharded only.
    """

    def __init__(self, model: torch.nn.Module, cache: StaticKVCache, device: Device,
                 shapes: int, capture_prefill: bool = True,
                 model_folder: str | None = None) -> None:
        self.model = model
        self.embed = model.get_input_embeddings()
        super().__init__(model, cache, device, shapes, capture_prefill, None, model_folder)
        self.images_encoded = 0
        """Times the vision tower has run (once per image per prefill)."""

    def _prefill_fn(self, embeds: torch.Tensor, rows: torch.Tensor,  # type: ignore[override]
                    last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._prefill_body({"inputs_embeds": embeds}, embeds.shape, rows, last)

    def run_prefill(self, seqs: Sequence[GaudiSequence], ids: torch.Tensor, rows: torch.Tensor,
                    last: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, list[str | None]]:
        """Embed ``ids``, put each sequence's image features in place, run the prefill."""
        dev = self.device.torch_device
        self.device.mark_step()
        embeds = self.embed(ids.to(dev))
        failed: list[str | None] = []
        for i, seq in enumerate(seqs):
            failed.append(self._place_images(seq, embeds[i]))
        return (*self.forward_embeds(embeds, rows, last), failed)

    def _place_images(self, seq: GaudiSequence, rows: torch.Tensor) -> str | None:
        """Write ``seq``'s image features into its embedding rows; the error, if one fails."""
        for image in seq.request.images:
            try:
                features = encode_image(self.model, image)
            except (ImageFeatureError, RuntimeError, ValueError) as exc:
                logger.warning("gaudi: request %s: image not encoded: %s", seq.request_id, exc)
                return f"image could not be encoded: {exc}"
            self.images_encoded += 1
            place_features(rows, 0, image, features)
        return None

    def forward_embeds(self, embeds: torch.Tensor, rows: torch.Tensor,
                       last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured prefill on device ``embeds`` [P, S, hidden], host ``rows`` and ``last``."""
        dev = self.device.torch_device
        self.device.mark_step()  # ends the vision tower's lazy graph on an HPU
        logits, hidden = self._prefill(embeds, rows.to(dev), last.to(dev))
        self.device.mark_step()
        return logits, hidden

    def warm(self, shape: Shape) -> None:
        """Run ``shape`` once on padding; a prefill shape on the padding's embeddings."""
        if shape.phase != PREFILL:
            super().warm(shape)
            return
        ids = torch.zeros(shape.batch, shape.length, dtype=torch.long)
        rows = torch.full((shape.batch,), self.cache.scratch_row, dtype=torch.long)
        zeros = torch.zeros(shape.batch, dtype=torch.long)
        self.forward_embeds(self.embed(ids.to(self.device.torch_device)), rows, zeros)
