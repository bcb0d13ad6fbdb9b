"""Vision-language models on the Xeon engine: Llava-Next and Llava 1.5, through transformers.

The gateway prepares each image with the model folder's processor and sends
the prompt with the image's placeholder token repeated once per image feature,
plus the pixel arrays (``switchyard_spec.ImageInput``). Here the model is
transformers' own ``LlavaNextForConditionalGeneration`` or
``LlavaForConditionalGeneration``. Its text model (Mistral, Llama, or any
causal LM the paged path takes) runs on the **paged path**
(:class:`PagedVisionRunner`): loaded with the engine's attention for the text
model only (the vision tower keeps its own), and seen as the causal LM it is
(:func:`text_causal_lm`: transformers' ``*ForCausalLM`` class around the
Llava's own language model and LM head, no weights copied), so the engine's
forward choice applies to it as to any text model: the hand-written
Llama-family decoder (:mod:`switchyard_xeon.decoder`) for Mistral and Llama
text models, transformers' forward otherwise.

- **Prefill**: a step whose chunks hold image placeholders runs the text
  model's transformers forward on input embeddings (the packed batch's token
  embeddings, each image's placeholder rows replaced by its features, as the
  Llava forward does with ``masked_scatter``), with the engine's attention
  and step metadata as for token ids; other sequences in the step (decodes,
  text chunks) ride along unchanged. Calling the text model directly skips
  the Llava forward's own image plumbing, which would need the whole image
  in one chunk. Steps without placeholders run the chosen forward on ids.
- **Image features** (:class:`ImageFeatures`, shared with the fallback's
  :class:`VisionRunner`): the vision tower and projector run once per image,
  when the first chunk that reaches it runs (``model.get_image_features``,
  which applies the config's feature layer, feature selection and, for
  Llava-Next, the tiling and unpadding); the features are kept until the
  chunk that holds the image's last placeholder has run, so a prompt split
  over several chunks encodes its images once. A sequence re-prefilled after
  preemption encodes them again, unless the prefix cache still holds them.
- **Decode** is the text model alone, on token ids, with the paged decode
  kernels (and, for the decoder, its one-call layer loop).
- **Prefix caching** keys every block that covers an image's placeholders on
  the image's ``content_hash`` and place in the prompt as well as the token
  ids (:meth:`Sequence.block_keys`), so the same text with different images
  shares only the blocks before the first image, and the same image and text
  shares every full block.

``--engine-option forward=fallback`` runs the whole model on the fallback
path instead (:mod:`switchyard_xeon.fallback`, :class:`VisionRunner`): the
model's own attention over per-sequence caches, image chunks fed as input
embeddings through :meth:`FallbackRunner.input_embeds`, no prefix caching.
So does a text model whose class cannot take the paged attention
(:func:`choose_vision_path`). Decode on the paged path measured faster than
on the fallback at 1 and 8 streams (docs/vision.md, "Engines").
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
from switchyard_engine import image_features
from switchyard_engine.image_features import ARCHITECTURES, VisionArchitecture, vision_architecture
from switchyard_engine.loading import LoadedModel, resolve_dtype
from switchyard_spec import EngineStartError

from switchyard_xeon.attention import STEP_KWARG
from switchyard_xeon.block_manager import BlockManager
from switchyard_xeon.decoder import PackedForward
from switchyard_xeon.fallback import FallbackRunner
from switchyard_xeon.kernels import PagedDecodeFn, PagedPrefillFn
from switchyard_xeon.kv_cache import PagedKVCache
from switchyard_xeon.model_paths import ForwardPath, class_unsupported
from switchyard_xeon.runner import ModelRunner
from switchyard_xeon.sequence import Sequence

logger = logging.getLogger("switchyard.xeon")

def vision_model(model_path: str | Path) -> VisionArchitecture | None:
    """The vision-language architecture of the folder, or None for any other model (read
    from ``config.json`` alone, so the engine can choose the path before loading)."""
    return vision_architecture(model_path)


def is_vision_lm(model: torch.nn.Module) -> bool:
    """Whether ``model`` is one of the vision-language classes of :data:`ARCHITECTURES`."""
    return type(model).__name__ in ARCHITECTURES.values()


def choose_vision_path(model_path: str | Path, kind: VisionArchitecture,
                       forced_fallback: bool = False) -> ForwardPath:
    """The path of a vision-language folder: paged when its text model's class can take it.

    Decided from the config alone, as :func:`~switchyard_xeon.model_paths.choose_path`
    decides it for text models; raises :class:`EngineStartError` for a config
    transformers cannot read.
    """
    if forced_fallback:
        return ForwardPath(False, f"{kind.class_name}, forward=fallback")
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(Path(model_path))
    except (OSError, ValueError, KeyError) as exc:
        raise EngineStartError(f"cannot read the {kind.class_name} config in "
                               f"{str(model_path)!r}: {exc}") from exc
    text = config.get_text_config()
    text_class = transformers.AutoModelForCausalLM._model_mapping.get(type(text), None)
    if text_class is None:
        return ForwardPath(False, f"{kind.class_name}: its {text.model_type} text model has no "
                                  "causal LM class in transformers")
    # (ALiBi families pass class_unsupported through their own module swap, which a
    # text model inside a Llava does not take: they stay on the fallback.)
    why = (class_unsupported(text_class, text)
           if getattr(text_class, "_supports_attention_backend", False)
           else f"{text_class.__name__} does not use transformers' attention interface")
    if why:
        return ForwardPath(False, f"{kind.class_name}'s text model: {why}")
    return ForwardPath(True, f"{kind.class_name}: its {text_class.__name__} text model; images "
                             "as input embeddings, prefix cache keyed on image hashes")


def load_vision_lm(model_path: str | Path, kind: VisionArchitecture, dtype: str,
                   attn_implementation: str | None = None) -> LoadedModel:
    """Load the vision-language model in ``model_path`` on the CPU with transformers' class
    for it; ``attn_implementation`` (the engine's attention name, for the paged path) goes to
    the text model only. Raises :class:`EngineStartError` when the weights cannot be read."""
    return image_features.load_vision_lm(model_path, kind, resolve_dtype(dtype), "cpu",
                                         text_attention=attn_implementation)


_TEXT_VIEWS: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = (
    weakref.WeakKeyDictionary())


def text_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The Llava ``model``'s text model as transformers' causal LM class for its config.

    An instance of that class (``MistralForCausalLM``, ``LlamaForCausalLM``,
    ...) built on the meta device, whose ``model`` and ``lm_head`` are the
    Llava's own modules: no weight is copied, and whatever changes the Llava's
    modules (linear packing) changes it too. The same view is returned for
    the same model; its ``lm_head`` follows the Llava's (packing replaces it).
    """
    view = _TEXT_VIEWS.get(model)
    if view is None:
        import transformers

        config = model.config.get_text_config()
        text_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
        with torch.device("meta"):
            view = text_class(config)
        view.model = model.model.language_model
        view.lm_head = model.lm_head
        # The forward's readers find the folder through its config (constrained decoding).
        if not getattr(config, "_name_or_path", ""):
            config._name_or_path = model.config._name_or_path
        meta = [name for name, t in [*view.named_parameters(), *view.named_buffers()]
                if t.is_meta]
        if meta:
            raise EngineStartError(f"{type(model).__name__}: its text model as "
                                   f"{text_class.__name__} lacks {', '.join(meta[:3])}")
        view.eval()
        _TEXT_VIEWS[model] = view
    elif view.lm_head is not model.lm_head:
        view.lm_head = model.lm_head
    return view


class ImageFeatures:
    """The image features of prompts being prefilled, put in place of their placeholders.

    Each image is encoded once per prefill (see the module): its features are
    held from the first chunk that reaches it to the chunk that holds its
    last placeholder, and dropped when its sequence is let go of before that.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._features: dict[tuple[int, int], torch.Tensor] = {}
        """(seq_id, image index) -> the image's features, from its first chunk to its last."""
        self._tracked: set[int] = set()
        self.encoded = 0
        """Times the vision tower has run (once per image per prefill)."""

    @property
    def held(self) -> int:
        """Images whose features are held between chunks."""
        return len(self._features)

    @staticmethod
    def feeds(seq: Sequence) -> bool:
        """Whether the coming step's tokens of ``seq`` hold any image placeholder."""
        start = seq.num_cached
        end = start + seq.num_scheduled
        return any(image_features.overlaps(i, start, end) for i in seq.request.images)

    def fill(self, seq: Sequence, rows: torch.Tensor) -> None:
        """Write the image features of ``seq``'s scheduled placeholders into ``rows``.

        ``rows`` ([num_scheduled, hidden]) holds the embeddings of the tokens
        the coming step feeds; the placeholders' rows are overwritten in place.
        """
        start = seq.num_cached
        end = start + seq.num_scheduled
        for index, image in enumerate(seq.request.images):
            if not image_features.overlaps(image, start, end):
                continue
            if image_features.place_features(rows, start, image,
                                             self._image_features(seq, index)):
                self._features.pop((seq.seq_id, index), None)  # its last placeholder: done

    def _image_features(self, seq: Sequence, index: int) -> torch.Tensor:
        """The features of ``seq``'s image ``index`` ([length, hidden]), encoding it if needed."""
        key = (seq.seq_id, index)
        held = self._features.get(key)
        if held is not None:
            return held
        self.encoded += 1
        try:
            features = image_features.encode_image(self.model, seq.request.images[index])
        except image_features.ImageFeatureError as exc:
            raise RuntimeError(f"request {seq.request_id}: {exc}") from None
        self._features[key] = features
        if seq.seq_id not in self._tracked:  # drop what an aborted prefill left behind
            self._tracked.add(seq.seq_id)
            weakref.finalize(seq, self._drop, seq.seq_id)
        return features

    def _drop(self, seq_id: int) -> None:
        self._tracked.discard(seq_id)
        for key in [k for k in list(self._features) if k[0] == seq_id]:
            self._features.pop(key, None)


class PagedVisionRunner(ModelRunner):
    """The paged runner for vision-language models: image steps on input embeddings.

    ``forward`` is the packed forward chosen for the text model (see
    :func:`text_causal_lm`); steps whose chunks hold image placeholders run
    the text model's transformers forward on input embeddings instead (see
    the module).
    """

    def __init__(self, forward: PackedForward, cache: PagedKVCache, blocks: BlockManager,
                 model: torch.nn.Module, decode_kernel: PagedDecodeFn | None = None,
                 prefill_kernel: PagedPrefillFn | None = None) -> None:
        super().__init__(forward, cache, blocks, decode_kernel, prefill_kernel)
        self.text = text_causal_lm(model)
        self.images = ImageFeatures(model)
        self.embeds_steps = 0
        """Steps run on input embeddings (those holding image placeholders)."""

    @property
    def images_encoded(self) -> int:
        """Times the vision tower has run."""
        return self.images.encoded

    @property
    def held_features(self) -> int:
        """Images whose features are held between chunks."""
        return self.images.held

    def forward(self, seqs: Seq[Sequence], keep: Seq[int] | None = None) -> torch.Tensor:
        """Logits at the packed positions ``keep``, as :meth:`ModelRunner.forward`."""
        packed = self.pack(seqs, keep)
        if not any(self.images.feeds(s) for s in seqs):
            return self._forward(*packed)
        embeds = self.text.get_input_embeddings()(packed.ids)
        offset = 0
        for seq in seqs:
            if self.images.feeds(seq):
                self.images.fill(seq, embeds[offset:offset + seq.num_scheduled])
            offset += seq.num_scheduled
        self.embeds_steps += 1
        out = self.text(inputs_embeds=embeds.unsqueeze(0),
                        position_ids=packed.positions.unsqueeze(0), use_cache=False,
                        logits_to_keep=packed.keep, **{STEP_KWARG: packed.step})
        return out.logits[0]


class VisionRunner(FallbackRunner):
    """The fallback runner for vision-language models: image features in prefill (see module)."""

    def __init__(self, model: torch.nn.Module, blocks: BlockManager,
                 device: torch.device | str = "cpu", padded: bool | None = None) -> None:
        super().__init__(model, blocks, device, padded)
        self.images = ImageFeatures(model)

    @property
    def images_encoded(self) -> int:
        """Times the vision tower has run."""
        return self.images.encoded

    @property
    def held_features(self) -> int:
        """Images whose features are held between chunks."""
        return self.images.held

    def feeds_embeds(self, seq: Sequence) -> bool:
        """Whether the coming step's tokens of ``seq`` hold any image placeholder."""
        return self.images.feeds(seq)

    def input_embeds(self, seq: Sequence) -> torch.Tensor:
        """The scheduled tokens' embeddings, image placeholders replaced by image features."""
        ids = torch.tensor([seq.new_tokens], device=self.device)
        embeds = self.model.get_input_embeddings()(ids)
        self.images.fill(seq, embeds[0])
        return embeds
