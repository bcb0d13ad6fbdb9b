"""Turn every error a route can raise into the body format of that route's API.

TGI routes answer `{"error", "error_type"}`; OpenAI routes answer
`{"error": {"message", "type", "param", "code"}}`. Body decoding errors
(malformed JSON, wrong types) and an over-large body are caught here too, so a
client never sees Litestar's own format on an API route. A missing API key is
the exception: TGI answers it with a bare 401, and so do we.

A request that matches no route (an unknown path, or a method the path does
not serve) never reaches a router, so the app answers it (`routing_exception_handlers`):
in OpenAI's format under `/v1/`, in TGI's elsewhere, with OpenAI's messages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import (
    HTTPException,
    InternalServerException,
    MethodNotAllowedException,
    NotFoundException,
    ValidationException,
)
from litestar.status_codes import HTTP_413_REQUEST_ENTITY_TOO_LARGE

from switchyard.errors import ApiError
from switchyard.protocol import openai as oai
from switchyard.protocol import tgi
from switchyard.routes.auth import MissingApiKey
from switchyard.telemetry.request import note_error

log = logging.getLogger("switchyard.http")

Handler = Callable[[Request[Any, Any, Any], Exception], Response[Any]]

PAYLOAD_TOO_LARGE = "payload_too_large"
NOT_FOUND = "not_found"
METHOD_NOT_ALLOWED = "method_not_allowed"
INVALID_REQUEST = frozenset({"validation", PAYLOAD_TOO_LARGE, NOT_FOUND, METHOD_NOT_ALLOWED})
"""TGI's error types of what OpenAI calls an `invalid_request_error`."""
OPENAI_PREFIX = "/v1/"
CLIENT_GONE = "dropped"
"""The error type (and `tgi_request_failure` label) of a client that went away."""
CLIENT_CLOSED_STATUS = 499
"""nginx's "client closed request": the status logged for it (no client reads it)."""
_LITESTAR_DISCONNECT = "client disconnected prematurely"
"""What Litestar's `Request.stream` raises (as a 500) when the client goes away mid-body."""


def _payload_too_large(request: Request[Any, Any, Any] | None) -> ApiError:
    limit = request.route_handler.resolve_request_max_body_size() if request is not None else None
    size = f" of {limit} bytes" if limit else ""
    return ApiError(
        413,
        f"Payload too large: the request body exceeds the payload limit{size} (--payload-limit)",
        PAYLOAD_TOO_LARGE,
        code=PAYLOAD_TOO_LARGE,
    )


def as_api_error(exc: Exception, request: Request[Any, Any, Any] | None = None) -> ApiError:
    """The `ApiError` that describes `exc` (a 500 for anything unexpected, logged).

    Every error answered as a response goes through here: the request's
    telemetry notes it (`tgi_request_failure{err}`, the request log line).
    """
    err = _as_api_error(exc, request)
    note_error(err)
    return err


def client_went_away(exc: Exception) -> bool:
    """Whether `exc` says the client disconnected while its body was being read.

    Litestar raises a plain `InternalServerException` then: a 500 to Litestar,
    but the server did nothing wrong, so it must not count or log as one.
    """
    return type(exc) is InternalServerException and exc.detail == _LITESTAR_DISCONNECT


def _as_api_error(exc: Exception, request: Request[Any, Any, Any] | None) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if client_went_away(exc):
        # Nobody reads the answer; the request log line (WARNING, no traceback) and
        # tgi_request_failure{err="dropped"} say what happened.
        return ApiError(CLIENT_CLOSED_STATUS, "Client closed the request before sending its "
                        "whole body", CLIENT_GONE)
    if isinstance(exc, (msgspec.DecodeError, msgspec.ValidationError)):
        # Bodies a route decodes itself (e.g. /invocations) fail here rather than in Litestar.
        malformed = isinstance(exc, msgspec.DecodeError) and not isinstance(
            exc, msgspec.ValidationError)
        return ApiError(400 if malformed else 422, f"Input validation error: {exc}", "validation")
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
    if isinstance(exc, NotFoundException) and request is not None:
        # OpenAI's words for a path it does not serve.
        return ApiError(404, f"Invalid URL ({request.method} {request.url.path})", NOT_FOUND)
    if isinstance(exc, MethodNotAllowedException) and request is not None:
        return ApiError(405, f"Invalid method for URL ({request.method} {request.url.path})",
                        METHOD_NOT_ALLOWED)
    if isinstance(exc, HTTPException):
        if exc.status_code == HTTP_413_REQUEST_ENTITY_TOO_LARGE:
            return _payload_too_large(request)
        if exc.status_code == 400:  # Litestar's word for a body it could not parse
            return ApiError(400, f"Input validation error: {exc.detail}", "validation")
        return ApiError(exc.status_code, exc.detail, "invalid_request_error")
    log.error("unexpected error while serving a request", exc_info=exc)
    return ApiError(500, f"Internal error: {exc.__class__.__name__}", "internal")


def _unauthorized() -> Response[bytes]:
    return Response(b"", status_code=401)


def _headers(exc: Exception) -> dict[str, str] | None:
    # Litestar's exceptions carry the headers their status needs (a 405's `Allow`).
    return exc.headers if isinstance(exc, HTTPException) else None


def tgi_error_response(
    exc: Exception, request: Request[Any, Any, Any] | None = None
) -> Response[Any]:
    """`exc` as a TGI error response."""
    if isinstance(exc, MissingApiKey):
        return _unauthorized()
    err = as_api_error(exc, request)
    return Response(tgi.ErrorResponse(error=err.message, error_type=err.error_type),
                    status_code=err.status, headers=_headers(exc))


def _openai_detail(err: ApiError) -> oai.ErrorResponse:
    kind = "invalid_request_error" if err.error_type in INVALID_REQUEST else err.error_type
    return oai.ErrorResponse(
        error=oai.ErrorDetail(message=err.message, type=kind, param=err.param, code=err.code)
    )


def openai_error_response(
    exc: Exception, request: Request[Any, Any, Any] | None = None
) -> Response[Any]:
    """`exc` as an OpenAI error response."""
    if isinstance(exc, MissingApiKey):
        return _unauthorized()
    err = as_api_error(exc, request)
    return Response(_openai_detail(err), status_code=err.status, headers=_headers(exc))


def tgi_exception_handlers() -> dict[type[Exception], Handler]:
    """Exception handlers for TGI routes."""
    return {Exception: lambda request, exc: tgi_error_response(exc, request)}


def openai_exception_handlers() -> dict[type[Exception], Handler]:
    """Exception handlers for OpenAI routes."""
    return {Exception: lambda request, exc: openai_error_response(exc, request)}


def is_openai_path(path: str) -> bool:
    """Whether `path` belongs to the OpenAI API (`/v1` and below)."""
    return path == OPENAI_PREFIX.rstrip("/") or path.startswith(OPENAI_PREFIX)


def routing_error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """A request no route matched, answered in the format of the API its path belongs to."""
    if is_openai_path(request.url.path):
        return openai_error_response(exc, request)
    return tgi_error_response(exc, request)


def routing_exception_handlers() -> dict[type[Exception], Handler]:
    """The app's handlers for requests that match no route: unknown paths, wrong methods.

    Routers' handlers take precedence for everything raised inside a route; these
    two exceptions are raised while routing, before any router is chosen.
    """
    return {NotFoundException: routing_error_response,
            MethodNotAllowedException: routing_error_response}


def openai_error_json(err: ApiError) -> bytes:
    """An OpenAI-style error as raw JSON, for errors raised after a stream began."""
    note_error(err)
    return msgspec.json.encode(_openai_detail(err))
