"""What goes wrong with a client's image, and how each API reports it.

Every problem with an image is the client's (a bad URL, a host the server may
not fetch from, an unreachable or slow host, bytes that are not an image, an
image over a limit, a model that takes no images), so it is a 4xx and never a
5xx: TGI's routes answer 422 ``validation`` (TGI's status for what fails
validation), OpenAI's 400 ``invalid_request_error`` (what OpenAI answers for
an image it cannot use). ``code`` names the cause on OpenAI's routes.
"""

from __future__ import annotations

from typing import Literal

from switchyard.errors import ApiError

Api = Literal["tgi", "openai"]
"""Which API's route the image arrived on."""

INVALID_URL = "invalid_image_url"
"""Not a data: or http(s) URL, or a data: URL whose payload is not base64."""
HOST_NOT_ALLOWED = "image_host_not_allowed"
"""An http(s) URL whose host ``--image-hosts`` does not allow."""
FETCH_FAILED = "image_fetch_failed"
"""The host did not answer, answered an error status, or timed out."""
TOO_LARGE = "image_too_large"
"""Over ``--image-max-bytes`` or ``--image-max-pixels``."""
INVALID_IMAGE = "invalid_image"
"""Bytes Pillow cannot decode as one of the accepted formats."""
TOO_MANY = "too_many_images"
"""More images in one request than ``--max-images``."""
NOT_SUPPORTED = "images_not_supported"
"""An image for a model that takes none."""
PROMPT = "invalid_image_prompt"
"""The prompt does not fit its images (the image token typed as text, a truncation through one)."""


class ImageProblem(Exception):
    """A client's image could not be used; ``code`` is one of this module's constants."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    def api_error(self, api: Api) -> ApiError:
        """This problem as the error the route of ``api`` answers."""
        if api == "tgi":
            return ApiError(422, f"Input validation error: {self.message}", "validation",
                            param="inputs", code=self.code)
        return ApiError(400, f"Input validation error: {self.message}", "validation",
                        param="messages", code=self.code)
