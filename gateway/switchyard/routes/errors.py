"""Turn every error a route can raise into the body format of that route's API.

TGI routes answer `{"error", "error_type"}`; OpenAI routes answer
`{"error": {"message", "type", "param", "code"}}`. Body decoding errors
(malformed JSON, wrong types) are caught here too, so a client never sees
Litestar's own format on an API route.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from switchyard.errors import ApiError
from switchyard.protocol import openai as oai
from switchyard.protocol import tgi

log = logging.getLogger("switchyard.http")

Handler = Callable[[Request[Any, Any, Any], Exception], Response[Any]]


def _as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationException):
        # Litestar reports body decoding problems here: say what was wrong.
        extra = exc.extra if isinstance(exc.extra, list) else []
        reasons = "; ".join(
            f"{e.get('message')}" + (f" at {e.get('key')}" if e.get("key") else "")
            for e in extra
            if isinstance(e, dict)
        )
        detail = reasons or exc.detail
        malformed = "malformed" in detail.lower() or "JSON is malformed" in detail
        return ApiError(
            400 if malformed else 422,
            f"Input validation error: {detail}",
            "validation",
        )
    if isinstance(exc, HTTPException):
        if exc.status_code == 400:  # Litestar's word for a body it could not parse
            return ApiError(400, f"Input validation error: {exc.detail}", "validation")
        return ApiError(exc.status_code, exc.detail, "invalid_request_error")
    log.exception("unexpected error while serving a request")
    return ApiError(500, f"Internal error: {exc.__class__.__name__}", "internal")


def _tgi_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    err = _as_api_error(exc)
    return Response(tgi.ErrorResponse(error=err.message, error_type=err.error_type),
                    status_code=err.status)


def _openai_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    err = _as_api_error(exc)
    kind = err.error_type
    if kind == "validation":
        kind = "invalid_request_error"
    body = oai.ErrorResponse(
        error=oai.ErrorDetail(message=err.message, type=kind, param=err.param, code=err.code)
    )
    return Response(body, status_code=err.status)


def tgi_exception_handlers() -> dict[type[Exception], Handler]:
    """Exception handlers for TGI routes."""
    return {Exception: _tgi_response}


def openai_exception_handlers() -> dict[type[Exception], Handler]:
    """Exception handlers for OpenAI routes."""
    return {Exception: _openai_response}


def openai_error_json(err: ApiError) -> bytes:
    """An OpenAI-style error as raw JSON, for errors raised after a stream began."""
    import msgspec

    kind = "invalid_request_error" if err.error_type == "validation" else err.error_type
    return msgspec.json.encode(
        oai.ErrorResponse(
            error=oai.ErrorDetail(message=err.message, type=kind, param=err.param, code=err.code)
        )
    )
