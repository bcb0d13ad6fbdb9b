"""Vision-language models on the Xeon engine: Llava-Next and Llava 1.5 on the fallback path.

The prompts are prepared as the gateway prepares them (its processor and
``encode_prompt``) and the engine's greedy tokens are compared with
transformers' ``generate`` on ``processor(text, images)``. Prefill is cut
into chunks smaller than one image, so an image's placeholders span several
forward steps; the vision tower must still run once per image.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from switchyard.media import ImageSet, encode_prompt, load_vision_processor
from switchyard.media.decode import decode_image
from switchyard.text import load_tokenizer
from switchyard_spec import (
    EngineConfig,
    EngineRequest,
    ImageInput,
    SamplingParams,
    StoppingParams,
)
from switchyard_xeon.engine import XeonEngine
from switchyard_xeon.vision import VisionRunner
from tests.e2e.vlm_model import IMAGE_TOKEN, ensure_vlm, png, reference_greedy
from tests.xeon.conftest import TEST_OPTIONS, Collector, greedy_request, token_ids

TEXT = "What is in ![](http://h/picture.png) this picture?"
MAX_NEW = 10
CHUNK = 12
"""Prefill tokens per step: less than one image takes."""


def _folder(kind: str, default_model: Path, cache: Path) -> SimpleNamespace:
    """A tiny model of ``kind`` with the gateway's tokenizer and processor for it."""
    path = ensure_vlm(kind, default_model, cache)
    return SimpleNamespace(kind=kind, path=path, tokenizer=load_tokenizer(path),
                           vision=load_vision_processor(path))


@pytest.fixture(scope="module", params=["llava_next", "llava"])
def vlm(request: pytest.FixtureRequest, default_model_path: Path,
        model_cache: Path) -> SimpleNamespace:
    return _folder(request.param, default_model_path, model_cache)


@pytest.fixture(scope="module")
def llava_next(default_model_path: Path, model_cache: Path) -> SimpleNamespace:
    return _folder("llava_next", default_model_path, model_cache)


@pytest.fixture
def start() -> Iterator[Callable[..., XeonEngine]]:
    """``start(model, **config)``: a started engine on that model (all shut down after)."""
    engines: list[XeonEngine] = []

    def build(model: SimpleNamespace, **config: object) -> XeonEngine:
        config.setdefault("max_batch_prefill_tokens", CHUNK)
        engine = XeonEngine(EngineConfig(
            model_path=str(model.path), dtype="float32",
            options={**TEST_OPTIONS, "block_size": "4"}, **config))  # type: ignore[arg-type]
        engine.start()
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.shutdown()


def _request(vlm: SimpleNamespace, rid: str, picture: bytes, eos: tuple[int, ...],
             ignore_eos: bool = False) -> EngineRequest:
    images = ImageSet({"http://h/picture.png": vlm.vision.prepare(decode_image(picture, 10**7))})
    prompt = encode_prompt(vlm, TEXT, images, add_special_tokens=True)
    return EngineRequest(request_id=rid, prompt_token_ids=tuple(prompt.ids),
                         sampling=SamplingParams(),
                         stopping=StoppingParams(max_new_tokens=MAX_NEW, eos_token_ids=eos,
                                                 ignore_eos=ignore_eos),
                         images=prompt.images)


def _reference(vlm: SimpleNamespace, picture: bytes, ignore_eos: bool = False) -> list[int]:
    prompt = TEXT.replace("![](http://h/picture.png)", IMAGE_TOKEN)
    return reference_greedy(vlm.path, prompt, [picture], MAX_NEW, ignore_eos)


def test_greedy_tokens_equal_generate_per_image(vlm: SimpleNamespace,
                                                start: Callable[..., XeonEngine]) -> None:
    """Two images with one text, and a text-only request, in one batch: each gets what
    transformers gives it, the tower runs once per image although prefill is chunked, and
    nothing is cached across sequences."""
    engine = start(vlm)
    info = engine.info
    assert info is not None and info.takes_images
    runner = engine._runner
    assert isinstance(runner, VisionRunner) and not engine._scheduler.blocks.prefix_caching
    a, b = png(50, 70, 11), png(50, 70, 12)
    sink = Collector()
    first = _request(vlm, "a", a, info.eos_token_ids)
    image = first.images[0]
    assert image.offset // CHUNK != (image.offset + image.length - 1) // CHUNK  # split
    engine.submit(first, sink)
    engine.submit(_request(vlm, "b", b, info.eos_token_ids), sink)
    engine.submit(greedy_request("text", vlm.tokenizer.encode("Hello there"), MAX_NEW), sink)
    got_a, got_b = token_ids(sink.wait("a")), token_ids(sink.wait("b"))
    assert got_a == _reference(vlm, a)
    assert got_b == _reference(vlm, b)
    assert got_a != got_b
    assert sink.wait("text")[-1].error is None
    assert sink.events("a")[0].prompt_tokens == len(first.prompt_token_ids)
    assert runner.images_encoded == 2 and runner.held_features == 0
    # The same image again: encoded again (no cache across sequences), same tokens.
    engine.submit(_request(vlm, "a2", a, info.eos_token_ids), sink)
    assert token_ids(sink.wait("a2")) == got_a and runner.images_encoded == 3


def test_preempted_image_sequences_are_re_encoded(llava_next: SimpleNamespace,
                                                  start: Callable[..., XeonEngine]) -> None:
    """A cache too small for both: the one preempted is re-prefilled from its tokens, its
    image encoded again, and both still get transformers' tokens."""
    vlm = llava_next
    pictures = [png(50, 70, 21), png(70, 50, 22)]
    lengths = [len(_request(vlm, "x", p, ()).prompt_token_ids) for p in pictures]
    # Both prompts are prefilled in one step and fit; their generations do not, so the newer
    # is preempted while both decode.
    blocks = sum(-(-n // 4) for n in lengths) + 1  # their prompts' blocks, and the reserve's
    engine = start(vlm, max_batch_total_tokens=4 * blocks,
                   max_total_tokens=max(lengths) + MAX_NEW, max_batch_prefill_tokens=sum(lengths))
    sink = Collector()
    for i, picture in enumerate(pictures):
        engine.submit(_request(vlm, f"p{i}", picture, (), ignore_eos=True), sink)
    for i, picture in enumerate(pictures):
        assert token_ids(sink.wait(f"p{i}")) == _reference(vlm, picture, ignore_eos=True)
    assert engine.cache_stats().preemptions > 0
    assert engine._runner.images_encoded > 2


def test_an_aborted_prefill_lets_its_features_go(llava_next: SimpleNamespace,
                                                 start: Callable[..., XeonEngine]) -> None:
    engine = start(llava_next)
    sink = Collector()
    request = _request(llava_next, "gone", png(64, 64, 31), engine.info.eos_token_ids)
    engine.submit(request, sink)
    engine.abort("gone")
    sink.wait("gone")
    deadline = time.monotonic() + 10
    while engine._runner.held_features and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine._runner.held_features == 0


def test_a_text_model_refuses_images(make_engine: Callable[..., XeonEngine]) -> None:
    engine = make_engine()
    sink = Collector()
    image = ImageInput(offset=0, length=1, content_hash="h", pixel_values=bytes(12),
                       shape=(1, 3))
    engine.submit(EngineRequest(request_id="img", prompt_token_ids=(1, 2, 3),
                                sampling=SamplingParams(),
                                stopping=StoppingParams(max_new_tokens=2), images=(image,)), sink)
    assert sink.wait("img")[-1].error == "this model takes no images"
