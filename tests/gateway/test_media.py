"""Images in prompts, gateway side: finding, fetching, decoding, preprocessing, tokenizing.

Fetches go to a loopback HTTP server started here (no network). The
processor tests use the tiny Llava-Next and Llava folders of
`tests/support/vlm_model.py` and check the gateway's ids and pixel arrays against
the model's own processor on the same prompt.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image

from switchyard_engine.admission import request_problem
from switchyard.errors import ApiError
from switchyard.media import ImageLimits, ImageProblem, chat_images, encode_prompt
from switchyard.media import errors as codes
from switchyard.media.decode import decode_image
from switchyard.media.fetch import ImageFetcher, decode_data_url
from switchyard.media.hosts import check_host, listed
from switchyard.media.intake import ImageSet, prepare_urls
from switchyard.media.markdown import image_urls
from switchyard.media.processor import VisionProcessor, load_vision_processor
from switchyard.protocol import openai as oai
from switchyard.protocol.tgi import GenerateParameters
from switchyard.settings import ServeSettings, TokenLimits
from switchyard.text import load_tokenizer
from switchyard.planning.tgi import plan_tgi_prompt
from switchyard_spec import EngineRequest, ImageInput, SamplingParams, StoppingParams
from tests.support.image_server import Answer, ImageServer
from tests.support.vlm_model import IMAGE_TOKEN, ensure_vlm, png


def _problem(job: Callable[[], object] | Coroutine[Any, Any, object]) -> ImageProblem:
    with pytest.raises(ImageProblem) as caught:
        if asyncio.iscoroutine(job):
            asyncio.run(job)
        else:
            job()  # type: ignore[operator]
    return caught.value


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


# ---------------------------------------------------------------- markdown, data: URLs
def test_markdown_images_are_tgis_pattern() -> None:
    text = "a ![](http://x/1.png) b ![alt](http://y/2.png) ![]( data:image/png;base64,QQ== )c"
    assert image_urls(text) == ["http://x/1.png", "data:image/png;base64,QQ=="]


def test_data_urls_decode_and_are_checked() -> None:
    assert decode_data_url("data:image/png;base64,aGVs\nbG8=", 100) == b"hello"
    assert decode_data_url("data:,a%20b", 100) == b"a b"
    assert _problem(lambda: decode_data_url("data:image/png;base64,@@@@", 100)).code == \
        codes.INVALID_URL
    assert _problem(lambda: decode_data_url("data:image/png;base64", 100)).code == \
        codes.INVALID_URL
    assert _problem(lambda: decode_data_url("data:image/png;base64,", 100)).code == \
        codes.INVALID_URL
    big = _data_url(b"x" * 1000)
    assert _problem(lambda: decode_data_url(big, 999)).code == codes.TOO_LARGE
    assert decode_data_url(big, 1000) == b"x" * 1000


# ---------------------------------------------------------------- hosts
def test_listed_hosts() -> None:
    entries = ("images.example.com", "*.cdn.example.org", "127.0.0.1", "::1")
    assert listed("images.example.com", entries)
    assert listed("IMAGES.example.com.", entries)
    assert not listed("example.com", entries)
    assert listed("a.cdn.example.org", entries) and listed("a.b.cdn.example.org", entries)
    assert not listed("cdn.example.org", entries)
    assert not listed("evilcdn.example.org", entries)
    assert listed("127.0.0.1", entries) and listed("[::1]", entries)
    assert not listed("127.0.0.2", entries) and not listed("localhost", entries)
    assert not listed("anything.com", ("*",))  # `*` is checked by address, not by name


def test_host_checks() -> None:
    assert _problem(check_host("example.com", 80, ())).code == codes.HOST_NOT_ALLOWED
    assert _problem(check_host("example.com", 80, ("other.com",))).code == \
        codes.HOST_NOT_ALLOWED
    asyncio.run(check_host("images.example.com", 80, ("images.example.com",)))
    # `*`: any public host; loopback, private and link-local ones only when listed.
    asyncio.run(check_host("93.184.216.34", 80, ("*",)))
    for private in ("127.0.0.1", "10.1.2.3", "192.168.0.1", "169.254.169.254", "::1",
                    "::ffff:127.0.0.1", "0.0.0.0", "localhost"):
        problem = _problem(check_host(private, 80, ("*",)))
        assert problem.code == codes.HOST_NOT_ALLOWED and "non-public" in problem.message
    asyncio.run(check_host("127.0.0.1", 80, ("*", "127.0.0.1")))


# ---------------------------------------------------------------- fetching
@pytest.fixture(scope="module")
def images() -> Iterator[ImageServer]:
    with ImageServer() as server:
        yield server


def _fetch(url: str, **limits: Any) -> bytes:
    async def run() -> bytes:
        async with ImageFetcher(ImageLimits(hosts=("127.0.0.1",), **limits)) as fetcher:
            return await fetcher.fetch(url)

    return asyncio.run(run())


def test_fetch_from_an_allowed_host(images: ImageServer) -> None:
    picture = png(20, 10, 1)
    url = images.route("/ok.png", Answer(picture))
    assert _fetch(url) == picture
    # Redirects are followed, to hosts the list allows only.
    assert _fetch(images.redirect("/moved.png", "/ok.png")) == picture
    away = images.redirect("/away.png", "http://10.9.9.9/x.png")
    assert _problem(lambda: _fetch(away)).code == codes.HOST_NOT_ALLOWED
    loop = images.redirect("/loop.png", "/loop.png")
    assert "redirected more than" in _problem(lambda: _fetch(loop)).message


def test_fetch_failures_are_the_clients(images: ImageServer) -> None:
    assert _problem(lambda: _fetch(images.url("/missing.png"))).code == codes.FETCH_FAILED
    assert "HTTP 404" in _problem(lambda: _fetch(images.url("/missing.png"))).message
    assert _problem(lambda: _fetch("http://127.0.0.1:1/x.png")).code == codes.FETCH_FAILED
    assert _problem(lambda: _fetch("ftp://127.0.0.1/x.png")).code == codes.INVALID_URL
    assert _problem(lambda: _fetch("file:///etc/passwd")).code == codes.INVALID_URL
    assert _problem(lambda: _fetch("http://10.0.0.1/x.png")).code == codes.HOST_NOT_ALLOWED


def test_fetch_limits(images: ImageServer) -> None:
    body = bytes(5000)
    declared = images.route("/big.png", Answer(body))
    streamed = images.route("/big-chunked.png", Answer(body, chunked=True))
    for url in (declared, streamed):
        assert _problem(lambda u=url: _fetch(u, max_bytes=4000)).code == codes.TOO_LARGE
        assert _fetch(url, max_bytes=5000) == body
    slow = images.route("/slow.png", Answer(b"x", delay_s=30.0))
    began = time.monotonic()
    problem = _problem(lambda: _fetch(slow, timeout_s=0.5))
    assert problem.code == codes.FETCH_FAILED and "longer than 0.5 s" in problem.message
    # Ended at its 0.5 s limit, not when the host answered (30 s).
    assert time.monotonic() - began < 10.0


# ---------------------------------------------------------------- decoding
def test_decode_formats_and_limits() -> None:
    rgba = Image.new("RGBA", (30, 20), (10, 20, 30, 128))
    for fmt in ("PNG", "GIF", "WEBP", "BMP", "JPEG"):
        source = rgba.convert("RGB") if fmt in ("JPEG", "BMP") else rgba
        image = decode_image(_encoded(source, fmt), 10_000)
        assert image.mode == "RGB" and image.size == (30, 20)
    assert _problem(lambda: decode_image(b"hello", 10_000)).code == codes.INVALID_IMAGE
    whole = _encoded(rgba, "PNG")
    assert _problem(lambda: decode_image(whole[: len(whole) // 2], 10_000)).code == \
        codes.INVALID_IMAGE
    # Formats outside the list are not opened, even when Pillow could read them.
    tiff = _encoded(rgba.convert("RGB"), "TIFF")
    assert _problem(lambda: decode_image(tiff, 10_000)).code == codes.INVALID_IMAGE
    # A small file claiming a large canvas is refused from its header.
    bomb = _encoded(Image.new("L", (4000, 4000)), "PNG")
    assert len(bomb) < 100_000
    problem = _problem(lambda: decode_image(bomb, 1_000_000))
    assert problem.code == codes.TOO_LARGE and "4000x4000" in problem.message


def test_problems_answer_in_each_apis_format() -> None:
    problem = ImageProblem("bad image", codes.INVALID_IMAGE)
    tgi, openai = problem.api_error("tgi"), problem.api_error("openai")
    assert (tgi.status, tgi.error_type) == (422, "validation")
    assert (openai.status, openai.code) == (400, codes.INVALID_IMAGE)
    assert "bad image" in tgi.message and "bad image" in openai.message


# ---------------------------------------------------------------- the model's processor
@pytest.fixture(scope="module", params=["llava_next", "llava"])
def vlm(request: pytest.FixtureRequest, default_model_path: Path,
        model_cache: Path) -> SimpleNamespace:
    """A stand-in for a served vision model: its folder, tokenizer and processor."""
    path = ensure_vlm(request.param, default_model_path, model_cache)
    return SimpleNamespace(name=request.param, path=path, tokenizer=load_tokenizer(path),
                           vision=load_vision_processor(path))


def _set(vision: VisionProcessor, **urls: bytes) -> ImageSet:
    return ImageSet({url: vision.prepare(decode_image(data, 10**7))
                     for url, data in urls.items()})


def test_prompt_ids_and_pixels_match_the_processor(vlm: SimpleNamespace) -> None:
    from transformers import AutoProcessor

    a, b = png(50, 70, 1), png(64, 40, 2)
    images = _set(vlm.vision, **{"http://h/a.png": a, "http://h/b.png": b})
    text = "Look: ![](http://h/a.png) and ![](http://h/b.png), then ![](http://h/a.png)?"
    prompt = encode_prompt(vlm, text, images, add_special_tokens=True)
    processor = AutoProcessor.from_pretrained(vlm.path)
    pictures = [Image.open(io.BytesIO(d)).convert("RGB") for d in (a, b, a)]
    want = processor(text=f"Look: {IMAGE_TOKEN} and {IMAGE_TOKEN}, then {IMAGE_TOKEN}?",
                     images=pictures, return_tensors="np")
    assert prompt.ids == want["input_ids"][0].tolist()
    assert len(prompt.images) == 3
    token = vlm.vision.image_token_id
    for image in prompt.images:
        assert prompt.ids[image.offset:image.offset + image.length] == [token] * image.length
        assert prompt.ids[image.offset - 1] != token
    first, second, third = prompt.images
    assert first.content_hash == third.content_hash != second.content_hash
    if vlm.name == "llava_next":  # tiles per image: the same count the processor padded to
        assert first.image_size == (70, 50) and second.image_size == (40, 64)
        got = np.frombuffer(first.pixel_values, dtype="<f4").reshape(first.shape)
        np.testing.assert_array_equal(got[0], want["pixel_values"][0][: first.shape[1]])
    else:
        assert first.image_size == () and first.shape == (1, 3, 32, 32)
        got = np.frombuffer(second.pixel_values, dtype="<f4").reshape(second.shape)
        np.testing.assert_array_equal(got[0], want["pixel_values"][1])


def test_prompts_without_images_and_the_image_token_as_text(vlm: SimpleNamespace) -> None:
    plain = encode_prompt(vlm, "no images here", None, add_special_tokens=True)
    assert plain.images == () and plain.ids == vlm.tokenizer.encode("no images here")
    # Markdown whose URL the request did not fetch stays text.
    text = encode_prompt(vlm, "see ![](http://h/x.png)", ImageSet({}), add_special_tokens=True)
    assert text.images == () and vlm.vision.image_token_id not in text.ids
    with pytest.raises(ApiError) as caught:
        encode_prompt(vlm, f"typed {IMAGE_TOKEN} token", None, add_special_tokens=True,
                      api="openai")
    assert caught.value.status == 400 and caught.value.code == codes.PROMPT


def test_prepare_urls_fetches_each_url_once(vlm: SimpleNamespace, images: ImageServer) -> None:
    url = images.route(f"/once-{vlm.name}.png", Answer(png(40, 40, 3)))
    data = _data_url(png(40, 40, 4))
    limits = ImageLimits(hosts=("127.0.0.1",), max_images=3)
    got = asyncio.run(prepare_urls([url, data, url], limits, vlm.vision))
    assert set(got.by_url) == {url, data} and images.hits[f"/once-{vlm.name}.png"] == 1
    assert _problem(prepare_urls([url] * 4, limits, vlm.vision)).code == codes.TOO_MANY
    # The first failure ends the request, whatever else is in flight.
    slow = images.route(f"/slow-{vlm.name}.png", Answer(png(8, 8, 5), delay_s=30.0))
    began = time.monotonic()
    problem = _problem(prepare_urls([slow, "data:image/png;base64,@@"], limits, vlm.vision))
    # Ended by the bad URL at once, not when the slow host answered (30 s).
    assert problem.code == codes.INVALID_URL and time.monotonic() - began < 10.0


def test_chat_image_parts(vlm: SimpleNamespace) -> None:
    data = _data_url(png(30, 30, 6))
    request = oai.ChatCompletionRequest(model="m", messages=[oai.ChatMessageIn(
        role="user", content=[
            oai.ContentPart(type="image_url", image_url=oai.ImageUrl(url=data, detail="low")),
            oai.ContentPart(type="text", text="What is it?")])])
    gw = SimpleNamespace(settings=ServeSettings())
    rewritten, found = asyncio.run(chat_images(gw, vlm, request))  # type: ignore[arg-type]
    parts = rewritten.messages[0].content
    assert [p.type for p in parts] == ["text", "text"] and parts[0].text == f"![]({data})"
    assert found is not None and list(found.by_url) == [data]
    text_model = SimpleNamespace(name="text", vision=None)
    with pytest.raises(ApiError) as caught:
        asyncio.run(chat_images(gw, text_model, request))  # type: ignore[arg-type]
    assert caught.value.status == 400 and caught.value.code == codes.NOT_SUPPORTED
    # A text model leaves markdown in text alone, as TGI does.
    plain = oai.ChatCompletionRequest(model="m", messages=[oai.ChatMessageIn(
        role="user", content=f"![]({data}) hi")])
    assert asyncio.run(chat_images(gw, text_model, plain)) == (plain, None)  # type: ignore


# ---------------------------------------------------------------- limits, truncation, engines
def _image(offset: int, length: int) -> ImageInput:
    return ImageInput(offset=offset, length=length, content_hash="h",
                      pixel_values=bytes(4 * 6), shape=(1, 2, 3))


def test_image_tokens_count_and_truncation_keeps_images_whole() -> None:
    ids = list(range(10))
    limits = TokenLimits(max_input_tokens=9, max_total_tokens=20)
    with pytest.raises(ApiError) as caught:  # 10 tokens, 4 of them the image's
        plan_tgi_prompt(ids, GenerateParameters(max_new_tokens=2), limits, (), images=(_image(5, 4),))
    assert "must have less than 9 tokens" in caught.value.message
    plan = plan_tgi_prompt(ids, GenerateParameters(max_new_tokens=2, truncate=6), limits, (),
                      images=(_image(5, 4),))
    assert plan.prompt_ids == tuple(range(4, 10)) and plan.images[0].offset == 1
    with pytest.raises(ApiError) as caught:
        plan_tgi_prompt(ids, GenerateParameters(max_new_tokens=2, truncate=4), limits, (),
                   images=(_image(5, 4),))
    assert caught.value.status == 422 and "would cut the prompt's image" in caught.value.message


def test_engines_check_images_against_the_prompt() -> None:
    def request(*images: ImageInput) -> EngineRequest:
        return EngineRequest(request_id="r", prompt_token_ids=tuple(range(10)),
                             sampling=SamplingParams(), stopping=StoppingParams(max_new_tokens=1),
                             images=images)

    assert request_problem(request(_image(2, 3)), 100, takes_images=True) is None
    assert request_problem(request(_image(2, 3)), 100) == "this model takes no images"
    assert "overlap" in request_problem(request(_image(2, 3), _image(4, 2)), 100, True)
    assert "past the prompt" in request_problem(request(_image(8, 3)), 100, True)
    bad = ImageInput(offset=0, length=1, content_hash="h", pixel_values=b"123", shape=(1, 2))
    assert "pixel_values" in request_problem(request(bad), 100, True)
