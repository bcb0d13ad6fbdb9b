"""Vision-language models on the Xeon engine: Llava-Next and Llava 1.5, paged and fallback.

The prompts are prepared as the gateway prepares them (its processor and
``encode_prompt``) and the engine's greedy tokens are compared with
transformers' ``generate`` on ``processor(text, images)``. Prefill is cut
into chunks smaller than one image, so an image's placeholders span several
forward steps; the vision tower must still run once per image. The paged
path's prefix cache keys image blocks on the images' content hashes: the same
text with another image shares only the blocks before the image.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from switchyard.media import ImageSet, encode_prompt
from switchyard.media.decode import decode_image
from switchyard_spec import (
    EngineConfig,
    EngineRequest,
    ImageInput,
    SamplingParams,
    StoppingParams,
)
from switchyard_xeon.engine import XeonEngine
from switchyard_xeon.vision import PagedVisionRunner, VisionRunner

from tests.support.engine_requests import Collector, greedy_request, token_ids
from tests.support.vlm_model import IMAGE_TOKEN, png, reference_greedy, vlm_folder
from tests.support.waiting import eventually
from tests.support.xeon_options import TEST_OPTIONS

TEXT = "What is in ![](http://h/picture.png) this picture?"
MAX_NEW = 10
CHUNK = 12
"""Prefill tokens per step: less than one image takes."""
BLOCK = 4


@pytest.fixture(scope="module", params=["llava_next", "llava"])
def vlm(request: pytest.FixtureRequest, default_model_path: Path,
        model_cache: Path) -> SimpleNamespace:
    return vlm_folder(request.param, default_model_path, model_cache)


@pytest.fixture(scope="module")
def llava_next(default_model_path: Path, model_cache: Path) -> SimpleNamespace:
    return vlm_folder("llava_next", default_model_path, model_cache)


@pytest.fixture
def start() -> Iterator[Callable[..., XeonEngine]]:
    """``start(model, options={...}, **config)``: a started engine (all shut down after)."""
    engines: list[XeonEngine] = []

    def build(model: SimpleNamespace, options: dict[str, str] | None = None,
              **config: object) -> XeonEngine:
        config.setdefault("max_batch_prefill_tokens", CHUNK)
        engine = XeonEngine(EngineConfig(
            model_path=str(model.path), dtype="float32",
            options={**TEST_OPTIONS, "block_size": str(BLOCK), **(options or {})},
            **config))  # type: ignore[arg-type]
        engine.start()
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.shutdown()


_REFERENCES: dict[tuple[Path, bytes, bool], list[int]] = {}


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
    """transformers' greedy tokens for ``TEXT`` with ``picture`` (computed once per test run)."""
    key = (vlm.path, picture, ignore_eos)
    if key not in _REFERENCES:
        prompt = TEXT.replace("![](http://h/picture.png)", IMAGE_TOKEN)
        _REFERENCES[key] = reference_greedy(vlm.path, prompt, [picture], MAX_NEW, ignore_eos)
    return _REFERENCES[key]


def _hits(engine: XeonEngine) -> int:
    """Prompt tokens served from the prefix cache so far."""
    return engine._scheduler.counters.prefix_hit_tokens


def _settle(engine: XeonEngine) -> None:
    """Wait until the loop has let every sequence go (finished ones leave after their event)."""
    eventually(lambda: not len(engine._scheduler), timeout=30, interval=0.01,
               what="no sequence in the scheduler")


def _path_line(caplog: pytest.LogCaptureFixture) -> str:
    """The engine's start-up line naming its forward path."""
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("path: ")]
    return line


def test_paged_tokens_equal_generate_per_image(vlm: SimpleNamespace,
                                               start: Callable[..., XeonEngine],
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Two images with one text, and a text-only request, in one batch with prefix caching
    on: each gets what transformers gives it, the tower runs once per image although an
    image spans prefill chunks, and the second image shares no cached block of the first."""
    caplog.set_level("INFO", logger="switchyard.xeon")
    engine = start(vlm)
    info = engine.info
    assert info is not None and info.takes_images
    text_class = "MistralForCausalLM" if vlm.kind == "llava_next" else "LlamaForCausalLM"
    assert _path_line(caplog).startswith("path: paged attention")
    assert f"its {text_class} text model" in _path_line(caplog)
    runner = engine._runner
    assert isinstance(runner, PagedVisionRunner) and engine._scheduler.blocks.prefix_caching
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
    assert runner.embeds_steps >= 2


def test_prefix_cache_keys_blocks_on_the_image(vlm: SimpleNamespace,
                                               start: Callable[..., XeonEngine]) -> None:
    """One after the other: the same text with another image hits only the blocks before
    the image; the same image and text again hits every full block but the last, and both
    still give transformers' tokens."""
    engine = start(vlm)
    runner = engine._runner
    eos = engine.info.eos_token_ids
    a, b = png(64, 48, 41), png(64, 48, 42)
    sink = Collector()
    first = _request(vlm, "a", a, eos)
    engine.submit(first, sink)
    want_a = _reference(vlm, a)
    assert token_ids(sink.wait("a")) == want_a
    _settle(engine)
    image, prompt = first.images[0], len(first.prompt_token_ids)

    before = _hits(engine)
    engine.submit(_request(vlm, "b", b, eos), sink)
    assert token_ids(sink.wait("b")) == _reference(vlm, b)
    assert _hits(engine) - before == image.offset // BLOCK * BLOCK  # the text before it only
    _settle(engine)

    before, encoded = _hits(engine), runner.images_encoded
    engine.submit(_request(vlm, "a2", a, eos), sink)
    assert token_ids(sink.wait("a2")) == want_a
    hit = (prompt - 1) // BLOCK * BLOCK  # every full block but the one holding the last token
    assert _hits(engine) - before == hit
    # The tower runs again only for placeholders outside the cached blocks.
    assert runner.images_encoded == encoded + (image.offset + image.length > hit)


def test_the_fallback_path_still_serves_images(llava_next: SimpleNamespace,
                                               start: Callable[..., XeonEngine],
                                               caplog: pytest.LogCaptureFixture) -> None:
    """``forward=fallback``: per-sequence caches, no prefix caching, the same tokens."""
    vlm = llava_next
    caplog.set_level("INFO", logger="switchyard.xeon")
    engine = start(vlm, options={"forward": "fallback"})
    assert _path_line(caplog).startswith("path: fallback")
    assert "forward=fallback" in _path_line(caplog)
    runner = engine._runner
    assert isinstance(runner, VisionRunner) and not engine._scheduler.blocks.prefix_caching
    a, b = png(50, 70, 11), png(50, 70, 12)
    sink = Collector()
    engine.submit(_request(vlm, "a", a, engine.info.eos_token_ids), sink)
    engine.submit(_request(vlm, "b", b, engine.info.eos_token_ids), sink)
    assert token_ids(sink.wait("a")) == _reference(vlm, a)
    assert token_ids(sink.wait("b")) == _reference(vlm, b)
    assert runner.images_encoded == 2 and runner.held_features == 0


@pytest.mark.parametrize("prefix_caching", ["true", "false"])
def test_preempted_image_sequences_still_match(llava_next: SimpleNamespace,
                                               start: Callable[..., XeonEngine],
                                               prefix_caching: str) -> None:
    """A cache too small for both: the one preempted is re-prefilled from its tokens (its
    image encoded again, unless the prefix cache still holds it), and both still get
    transformers' tokens."""
    vlm = llava_next
    pictures = [png(50, 70, 21), png(70, 50, 22)]
    lengths = [len(_request(vlm, "x", p, ()).prompt_token_ids) for p in pictures]
    # Both prompts are prefilled in one step and fit; their generations do not, so the newer
    # is preempted while both decode.
    blocks = sum(-(-n // BLOCK) for n in lengths) + 1  # their prompts' blocks, and the reserve's
    engine = start(vlm, options={"prefix_caching": prefix_caching},
                   max_batch_total_tokens=BLOCK * blocks,
                   max_total_tokens=max(lengths) + MAX_NEW, max_batch_prefill_tokens=sum(lengths))
    sink = Collector()
    for i, picture in enumerate(pictures):
        engine.submit(_request(vlm, f"p{i}", picture, (), ignore_eos=True), sink)
    for i, picture in enumerate(pictures):
        assert token_ids(sink.wait(f"p{i}")) == _reference(vlm, picture, ignore_eos=True)
    assert engine.cache_stats().preemptions > 0
    if prefix_caching == "false":
        assert engine._runner.images_encoded > 2


def test_an_aborted_prefill_frees_its_blocks_and_features(
        llava_next: SimpleNamespace, start: Callable[..., XeonEngine]) -> None:
    """Aborted while its image is half fed: no block stays held, no features stay kept."""
    engine = start(llava_next, max_batch_prefill_tokens=BLOCK)
    sink = Collector()
    request = _request(llava_next, "gone", png(64, 64, 31), engine.info.eos_token_ids)
    image = request.images[0]
    engine.submit(request, sink)

    def part_fed():  # the sequence, once its image is part fed
        seq = engine._scheduler.find("gone")
        if seq is not None and image.offset < seq.num_cached < image.offset + image.length - BLOCK:
            return seq
        return None

    seq = eventually(part_fed, timeout=30, interval=0.001, what="the image part fed")
    assert seq.num_cached < len(request.prompt_token_ids)
    engine.abort("gone")
    assert sink.wait("gone")[-1].finish_reason is not None
    del seq
    eventually(lambda: not (engine._runner.held_features or engine.cache_stats().used_blocks),
               timeout=30, interval=0.01, what="no features held and no block in use")
    assert engine._runner.held_features == 0
    assert engine.cache_stats().used_blocks == 0


def test_a_text_model_refuses_images(make_engine: Callable[..., XeonEngine]) -> None:
    engine = make_engine()
    sink = Collector()
    image = ImageInput(offset=0, length=1, content_hash="h", pixel_values=bytes(12),
                       shape=(1, 3))
    engine.submit(EngineRequest(request_id="img", prompt_token_ids=(1, 2, 3),
                                sampling=SamplingParams(),
                                stopping=StoppingParams(max_new_tokens=2), images=(image,)), sink)
    assert sink.wait("img")[-1].error == "this model takes no images"
