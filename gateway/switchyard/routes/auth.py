"""`--api-key`: the generation routes require `Authorization: Bearer <key>`.

As in TGI, only the routes that spend model time are guarded (`POST /`,
`/generate*`, `/v1/chat/completions`, `/v1/completions`, `/v1/responses` and its stored
responses, `/invocations`,
`/tokenize`, `/chat_tokenize`); health, info, metrics and docs stay open so
probes and load balancers need no secret. A refusal is a bare 401 with an
empty body, TGI's answer, in every API.
"""

from __future__ import annotations

import hmac
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from switchyard.state import Gateway

_SCHEME = "bearer"


class MissingApiKey(Exception):
    """The request lacks the configured API key; answered with a bare 401."""


def authorized(header: str | None, api_key: str) -> bool:
    """Whether an `Authorization` header carries `api_key` as a Bearer token.

    The scheme is case-insensitive (RFC 9110); the key is compared exactly, in
    constant time (TGI lower-cases both, which also accepts a wrongly-cased key).
    """
    if header is None:
        return False
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != _SCHEME:
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


async def require_api_key(connection: ASGIConnection[Any, Any, Any, Any],
                          _: BaseRouteHandler) -> None:
    """Litestar guard: pass when no key is configured or the request carries it.

    Async on purpose: Litestar runs a sync guard in a worker thread, a thread hop
    per generation request that cost a loaded gateway more than its whole relay.
    """
    gateway: Gateway = connection.app.state["gateway"]
    api_key = gateway.settings.api_key
    if api_key and not authorized(connection.headers.get("authorization"), api_key):
        raise MissingApiKey()
