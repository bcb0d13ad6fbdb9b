"""JSON routes take JSON: a body sent as another media type is refused with a 415.

OpenAI's API and TGI (axum's JSON extractor) both refuse a body whose
`Content-Type` is not JSON, so a `curl -d` without `-H 'Content-Type:
application/json'` (which sends `application/x-www-form-urlencoded`) is told
so instead of being parsed as JSON anyway. A request with no `Content-Type`
at all is read as JSON.
"""

from __future__ import annotations

from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from switchyard.errors import ApiError

UNSUPPORTED_MEDIA_TYPE = 415


def is_json(content_type: str) -> bool:
    """Whether a `Content-Type` value names JSON: `application/json` or `application/*+json`,
    parameters (`; charset=utf-8`) allowed, in any letter case."""
    media = content_type.split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


async def require_json(connection: ASGIConnection[Any, Any, Any, Any],
                       _: BaseRouteHandler) -> None:
    """Litestar guard: refuse a body declared as anything but JSON (415)."""
    content_type = connection.headers.get("content-type")
    if content_type is not None and not is_json(content_type):
        raise ApiError(
            UNSUPPORTED_MEDIA_TYPE,
            f"Unsupported Content-Type {content_type!r}: this route takes a JSON body sent "
            "as 'application/json'.",
            "validation", code="unsupported_content_type")
