"""The server's limits on images in prompts, from the command line."""

from __future__ import annotations

from typing import Protocol

import msgspec

DEFAULT_MAX_BYTES = 10_000_000
"""``--image-max-bytes``: the most bytes one image may have, encoded (as fetched or decoded
from base64). A ``data:`` URL is bounded by ``--payload-limit`` too."""
DEFAULT_MAX_PIXELS = 4096 * 4096
"""``--image-max-pixels``: the most pixels (width x height) one image may have; checked from
the image's header, before its pixels are decoded."""
DEFAULT_TIMEOUT_S = 10.0
"""``--image-fetch-timeout``: seconds one http(s) image may take, connection to last byte."""
DEFAULT_MAX_IMAGES = 8
"""``--max-images``: the most images one request may carry."""


class ImageSettings(Protocol):
    """The settings the limits are read from (``ServeSettings``)."""

    @property
    def image_hosts(self) -> str: ...

    @property
    def image_max_bytes(self) -> int: ...

    @property
    def image_max_pixels(self) -> int: ...

    @property
    def image_fetch_timeout(self) -> float: ...

    @property
    def max_images(self) -> int: ...


class ImageLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway accepts of an image, and where it may fetch one from."""

    hosts: tuple[str, ...] = ()
    """The ``--image-hosts`` entries (see :mod:`switchyard.media.hosts`); empty: no http(s)
    fetching at all, ``data:`` URLs only."""
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_images: int = DEFAULT_MAX_IMAGES

    @classmethod
    def from_settings(cls, settings: ImageSettings) -> ImageLimits:
        """The limits ``switchyard serve``'s flags set."""
        hosts = tuple(h.strip().lower() for h in settings.image_hosts.split(",") if h.strip())
        return cls(hosts=hosts, max_bytes=settings.image_max_bytes,
                   max_pixels=settings.image_max_pixels,
                   timeout_s=settings.image_fetch_timeout, max_images=settings.max_images)
