"""Image bytes to RGB pixels with Pillow, under the pixel limit.

Only common web formats are opened (:data:`FORMATS`): Pillow's other readers
include ones that run external programs (EPS through Ghostscript) or rarely
exercised parsers, which a server has no reason to expose to its clients. The
pixel limit is checked from the header, before any pixel is decoded, so a
small file that claims a huge canvas (a decompression bomb) costs nothing.
Animated images give their first frame; transparency is dropped (RGB), as the
models' own processors do.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

from switchyard.media.errors import INVALID_IMAGE, TOO_LARGE, ImageProblem

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
"""The formats an image may have."""


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """``data`` decoded to an RGB image; :class:`ImageProblem` if it is not one or too large."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width * height > max_pixels:
                raise ImageProblem(f"image of {width}x{height} pixels is over the limit of "
                                   f"{max_pixels} pixels (--image-max-pixels)", TOO_LARGE)
            image.load()
            return image.convert("RGB")
    except ImageProblem:
        raise
    except UnidentifiedImageError:
        raise ImageProblem(f"the data is not an image in a supported format "
                           f"({', '.join(FORMATS)})", INVALID_IMAGE) from None
    except Image.DecompressionBombError as exc:
        raise ImageProblem(f"image is too large to decode: {exc}", TOO_LARGE) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:  # truncated or corrupt data
        raise ImageProblem(f"the image cannot be decoded: {exc}", INVALID_IMAGE) from None
