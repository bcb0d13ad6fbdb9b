"""A prompt's token ids with each image's placeholder expanded, and the engine's images.

Each markdown image whose URL the request's :class:`~switchyard.media.intake.ImageSet`
holds becomes the model's image token in the text, the text is tokenized as
any prompt is, and each image token becomes as many as the processor said
the image takes (``PreparedImage.length``): what the model's processor does
to ``processor(text, images)``. Those tokens are prompt tokens: they count
against ``--max-input-tokens`` and ``--max-total-tokens`` like any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from switchyard.media.errors import PROMPT, Api, ImageProblem
from switchyard.media.markdown import IMAGE_MARKDOWN
from switchyard.media.processor import PreparedImage
from switchyard_spec import ImageInput

if TYPE_CHECKING:
    import re

    from switchyard.media.intake import ImageSet
    from switchyard.models.served import ServedModel


class EncodedPrompt(msgspec.Struct, frozen=True, kw_only=True):
    """Token ids with images expanded, and the images with their positions."""

    ids: list[int]
    images: tuple[ImageInput, ...] = ()


def encode_prompt(model: ServedModel, text: str, images: ImageSet | None, *,
                  add_special_tokens: bool, api: Api = "tgi") -> EncodedPrompt:
    """Tokenize ``text`` for ``model``, expanding the placeholders of ``images``.

    Raises the ``api`` route's :class:`~switchyard.errors.ApiError` when the
    text holds the image token itself (typed as text, it would be a
    placeholder with no image).
    """
    try:
        return _encode(model, text, images, add_special_tokens)
    except ImageProblem as problem:
        raise problem.api_error(api) from None


def _encode(model: ServedModel, text: str, images: ImageSet | None,
            add_special_tokens: bool) -> EncodedPrompt:
    vision = model.vision
    if vision is None:
        return EncodedPrompt(ids=model.tokenizer.encode(text, add_special_tokens))
    placed: list[PreparedImage] = []
    by_url = images.by_url if images is not None else {}

    def swap(match: re.Match[str]) -> str:
        image = by_url.get(match.group(1).strip())
        if image is None:
            return match.group(0)
        placed.append(image)
        return vision.image_token

    if vision.image_token in text:
        raise ImageProblem(f"the prompt holds the model's image token {vision.image_token!r} "
                           "as text; put images in as ![](URL) or `image_url` parts", PROMPT)
    ids = model.tokenizer.encode(IMAGE_MARKDOWN.sub(swap, text) if by_url else text,
                                 add_special_tokens)
    token = vision.image_token_id
    if sum(1 for t in ids if t == token) != len(placed):
        raise ImageProblem("the prompt's image tokens do not match its images", PROMPT)
    if not placed:
        return EncodedPrompt(ids=ids)
    out: list[int] = []
    inputs: list[ImageInput] = []
    queue = iter(placed)
    for t in ids:
        if t != token:
            out.append(t)
            continue
        image = next(queue)
        inputs.append(ImageInput(offset=len(out), length=image.length,
                                 content_hash=image.content_hash,
                                 pixel_values=image.pixel_values, shape=image.shape,
                                 image_size=image.image_size))
        out.extend([token] * image.length)
    return EncodedPrompt(ids=out, images=tuple(inputs))
