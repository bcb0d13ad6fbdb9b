"""Tiny random vision-language models for the tests: Llava-Next and Llava 1.5.

Each is a real transformers folder (config, safetensors weights, tokenizer,
processor): a tiny CLIP vision tower, a projector and a tiny text model
(Mistral for Llava-Next, as the seed's Llava-v1.6-Mistral; Llama for Llava
1.5), with the default model's tokenizer plus an `<image>` placeholder token,
its ChatML template, and the PIL image processor of each family sized to 32x32
tiles. Weights are random from a fixed seed (with the default model's wide
initialisation, so greedy decoding has clear margins and images change the
output). Built once into the test cache, atomically.
"""

from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

BUILD_VERSION = "1"
IMAGE_TOKEN = "<image>"
TILE = 32
"""Side of the vision tower's input (and of Llava-Next's tiles), in pixels."""
PATCH = 8
PINPOINTS = [[TILE, 2 * TILE], [2 * TILE, TILE], [2 * TILE, 2 * TILE]]
SEED = 4321
INIT_RANGE = 0.1


def _vision_config():  # -> CLIPVisionConfig
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, image_size=TILE, patch_size=PATCH,
                            projection_dim=32, initializer_range=INIT_RANGE)


def _text_config(kind: str, tokenizer, vocab: int):  # -> PretrainedConfig
    from transformers import LlamaConfig, MistralConfig

    cls = MistralConfig if kind == "llava_next" else LlamaConfig
    return cls(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
               initializer_range=INIT_RANGE, tie_word_embeddings=False)


def _build(kind: str, default_model: Path, out: Path) -> None:
    import torch
    from transformers import (
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextProcessor,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    tokenizer = PreTrainedTokenizerFast.from_pretrained(default_model)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vocab = len(tokenizer)
    text = _text_config(kind, tokenizer, vocab)
    common = dict(vision_config=_vision_config(), text_config=text, image_token_index=image_id,
                  vision_feature_layer=-2, vision_feature_select_strategy="default")
    # num_additional_image_tokens=1: the CLS token the processor counts and "default" drops.
    if kind == "llava_next":
        config = LlavaNextConfig(image_grid_pinpoints=PINPOINTS, **common)
        model_cls = LlavaNextForConditionalGeneration
        images = LlavaNextImageProcessorPil(size={"shortest_edge": TILE},
                                            crop_size={"height": TILE, "width": TILE},
                                            image_grid_pinpoints=PINPOINTS)
        processor = LlavaNextProcessor(image_processor=images, tokenizer=tokenizer,
                                       patch_size=PATCH, num_additional_image_tokens=1,
                                       vision_feature_select_strategy="default",
                                       chat_template=tokenizer.chat_template)
    else:
        config = LlavaConfig(**common)
        model_cls = LlavaForConditionalGeneration
        images = LlavaImageProcessorPil(size={"shortest_edge": TILE},
                                        crop_size={"height": TILE, "width": TILE})
        processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                                   num_additional_image_tokens=1,
                                   vision_feature_select_strategy="default",
                                   chat_template=tokenizer.chat_template)
    torch.manual_seed(SEED)
    model = model_cls(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)


def ensure_vlm(kind: str, default_model: Path, cache: Path) -> Path:
    """The folder of the tiny ``kind`` ("llava_next" or "llava") model, built on first use."""
    target = cache / f"tiny-{kind}-v{BUILD_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-vlm-", dir=cache))
    try:
        _build(kind, default_model, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def vlm_folder(kind: str, default_model: Path, cache: Path) -> SimpleNamespace:
    """The tiny ``kind`` model (``path``, built on first use) with the gateway's tokenizer
    (``tokenizer``) and image processor (``vision``) for it, as engine tests use them."""
    from switchyard.media import load_vision_processor
    from switchyard.text import load_tokenizer

    path = ensure_vlm(kind, default_model, cache)
    return SimpleNamespace(kind=kind, path=path, tokenizer=load_tokenizer(path),
                           vision=load_vision_processor(path))


def png(width: int, height: int, seed: int) -> bytes:
    """A PNG of random pixels (a different picture for each seed)."""
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def reference_greedy(model_path: Path, prompt: str, images: list[bytes],
                     max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """transformers' greedy ``generate`` on ``processor(prompt, images)``: the new token ids.

    ``prompt`` holds one `<image>` per image, where each goes. It stops at the
    model's EOS unless ``ignore_eos``.
    """
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path)
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32).eval()
    if ignore_eos:
        model.generation_config.eos_token_id = None
    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(text=prompt, images=pictures or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
