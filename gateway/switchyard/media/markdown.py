"""TGI's way of putting an image in a prompt: markdown ``![](URL)``.

The pattern is TGI's (an empty alt text, a URL with no closing parenthesis),
so prompts written for TGI find the same images here and other markdown stays
text. OpenAI's ``image_url`` content parts are rewritten to the same form
before the chat template runs, so the image's placeholder lands where the
part was.
"""

from __future__ import annotations

import re

IMAGE_MARKDOWN = re.compile(r"!\[\]\(([^)]+)\)")
"""``![](URL)``; group 1 is the URL."""


def image_urls(text: str) -> list[str]:
    """The URL of each markdown image in ``text``, in order (repeats kept)."""
    return [url.strip() for url in IMAGE_MARKDOWN.findall(text)]


def image_markdown(url: str) -> str:
    """The markdown that puts the image at ``url`` in a prompt."""
    return f"![]({url})"
