"""The images of a request: found in its prompt, fetched, decoded and preprocessed.

Routes call :func:`tgi_images` or :func:`chat_images` before they plan the
request (fetching is I/O, planning is not); the :class:`ImageSet` they get
goes to :func:`switchyard.media.prompt.encode_prompt`, which puts each image's
placeholders where its markdown is. All images of a request are fetched at
once; the first that fails cancels the others. Decoding and preprocessing run
on a worker thread, off the event loop.

For a model that takes no images, markdown images in text stay text (as TGI
leaves them), and an OpenAI ``image_url`` part is a 400 that says the model
takes no images.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, TypeVar

import msgspec

from switchyard.media.decode import decode_image
from switchyard.media.errors import (
    INVALID_IMAGE,
    INVALID_URL,
    NOT_SUPPORTED,
    TOO_MANY,
    Api,
    ImageProblem,
)
from switchyard.media.fetch import ImageFetcher
from switchyard.media.limits import ImageLimits
from switchyard.media.markdown import image_markdown, image_urls
from switchyard.media.processor import PreparedImage, VisionProcessor
from switchyard.protocol import openai as oai

if TYPE_CHECKING:
    from switchyard.models.served import ServedModel
    from switchyard.state import Gateway

_T = TypeVar("_T")


class ImageSet(msgspec.Struct, frozen=True):
    """The prepared images of one request, by their URL as the prompt's markdown spells it."""

    by_url: dict[str, PreparedImage]


async def _first_failure_cancels(jobs: Sequence[Awaitable[_T]]) -> list[_T]:
    """Run ``jobs`` together; the first exception cancels the rest and propagates."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()


def _prepare(data: bytes, max_pixels: int, vision: VisionProcessor) -> PreparedImage:
    image = decode_image(data, max_pixels)
    try:
        return vision.prepare(image)
    except Exception as exc:  # noqa: BLE001 - e.g. an image too small for the processor
        raise ImageProblem(f"the model's processor cannot take this {image.width}x"
                           f"{image.height} image: {type(exc).__name__}: {exc}",
                           INVALID_IMAGE) from None


def _prepare_all(datas: list[bytes], max_pixels: int,
                 vision: VisionProcessor) -> list[PreparedImage]:
    return [_prepare(data, max_pixels, vision) for data in datas]


async def prepare_urls(urls: Sequence[str], limits: ImageLimits,
                       vision: VisionProcessor) -> ImageSet:
    """Fetch, decode and preprocess the images ``urls`` name (each distinct URL once)."""
    if len(urls) > limits.max_images:
        raise ImageProblem(f"{len(urls)} images in one request; this server takes at most "
                           f"{limits.max_images} (--max-images)", TOO_MANY)
    unique = list(dict.fromkeys(urls))
    async with ImageFetcher(limits) as fetcher:
        datas = await _first_failure_cancels([fetcher.fetch(url) for url in unique])
    prepared = await asyncio.to_thread(_prepare_all, datas, limits.max_pixels, vision)
    return ImageSet(dict(zip(unique, prepared, strict=True)))


async def _images(gw: Gateway, vision: VisionProcessor, urls: Sequence[str],
                  api: Api) -> ImageSet | None:
    if not urls:
        return None
    try:
        return await prepare_urls(urls, ImageLimits.from_settings(gw.settings), vision)
    except ImageProblem as problem:
        raise problem.api_error(api) from None


async def tgi_images(gw: Gateway, model: ServedModel, inputs: str) -> ImageSet | None:
    """The images of TGI ``inputs`` (markdown ``![](URL)``); None for a text-only model or
    prompt."""
    if model.vision is None:
        return None
    return await _images(gw, model.vision, image_urls(inputs), "tgi")


def _texts(message: oai.ChatMessageIn) -> list[str]:
    content = message.content
    if isinstance(content, str):
        return [content]
    return [part.text for part in content or () if part.type == "text" and part.text]


def _inline_parts(req: oai.ChatCompletionRequest) -> tuple[oai.ChatCompletionRequest, int]:
    """``req`` with each ``image_url`` part rewritten as a text part ``![](URL)``; how many
    there were. ``detail`` is accepted and has no effect: the model's processor decides the
    resolution."""
    found = 0
    messages = []
    for message in req.messages:
        content = message.content
        if isinstance(content, list) and any(p.type == "image_url" for p in content):
            parts = []
            for part in content:
                if part.type != "image_url":
                    parts.append(part)
                    continue
                found += 1
                url = part.image_url.url if part.image_url is not None else ""
                url = "".join(url.split())  # wrapped base64 stays one URL
                if not url:
                    raise ImageProblem("an `image_url` content part needs `image_url.url`",
                                       INVALID_URL)
                parts.append(oai.ContentPart(type="text", text=image_markdown(url)))
            message = msgspec.structs.replace(message, content=parts)
        messages.append(message)
    return (msgspec.structs.replace(req, messages=messages) if found else req), found


async def chat_images(gw: Gateway, model: ServedModel, req: oai.ChatCompletionRequest
                      ) -> tuple[oai.ChatCompletionRequest, ImageSet | None]:
    """A chat request with its ``image_url`` parts written as markdown, and its images.

    Images are looked for in every message's text (markdown, as TGI does)
    and in ``image_url`` parts. A 400 when the model takes no images and the
    request has ``image_url`` parts.
    """
    try:
        req, parts = _inline_parts(req)
        if parts and model.vision is None:
            raise ImageProblem(f"model {model.name!r} does not take images (an `image_url` "
                               "content part was sent)", NOT_SUPPORTED)
    except ImageProblem as problem:
        raise problem.api_error("openai") from None
    if model.vision is None:
        return req, None
    urls = [url for message in req.messages for text in _texts(message)
            for url in image_urls(text)]
    return req, await _images(gw, model.vision, urls, "openai")
