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
import re
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
from switchyard.telemetry.request import CLIENT_CLOSED_STATUS, note_error

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

_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")
_TGI_PREFIX = "Input validation error: "
_BODY_KWARG = "data"
"""Litestar names the body by the handler's argument when a field is unknown at its top."""
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
        message, _, path = str(exc).partition(" - at `$.")
        return ApiError(400 if malformed else 422, f"Input validation error: {exc}", "validation",
                        param=_param(message, path.rstrip("`")))
    if isinstance(exc, ValidationException):
        # Litestar reports body decoding problems here: say what was wrong.
        extra = [e for e in (exc.extra if isinstance(exc.extra, list) else [])
                 if isinstance(e, dict)]
        reasons = "; ".join(
            f"{e.get('message')}" + (f" at {e.get('key')}" if e.get("key") else "")
            for e in extra
        )
        detail = reasons or exc.detail
        malformed = "malformed" in detail.lower() or "JSON is malformed" in detail
        first = extra[0] if extra else {}
        return ApiError(
            400 if malformed else 422,
            f"Input validation error: {detail}",
            "validation",
            param=_param(str(first.get("message", "")), str(first.get("key") or "")),
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


def _param(message: str, key: str) -> str | None:
    """The request field a body decoding error is about: the unknown field it names, or
    the path msgspec reports (`logit_bias[...]` is `logit_bias`)."""
    if key == _BODY_KWARG:
        key = ""
    unknown = _UNKNOWN_FIELD.search(message)
    if unknown:
        return f"{key}.{unknown[1]}" if key else unknown[1]
    return key.split("[", 1)[0] or None


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


def openai_status(err: ApiError) -> int:
    """The status OpenAI gives: 400 for every invalid request (TGI's routes answer 422)."""
    return 400 if err.status == 422 else err.status


def _openai_detail(err: ApiError) -> oai.ErrorResponse:
    invalid = err.error_type in INVALID_REQUEST or openai_status(err) == 400
    kind = "invalid_request_error" if invalid else err.error_type
    code = err.code
    if code is None and invalid and err.error_type not in INVALID_REQUEST:
        code = err.error_type  # e.g. `tool_error`, `template_error`: kept as the code
    message = err.message.removeprefix(_TGI_PREFIX)
    unknown = _UNKNOWN_FIELD.search(message)
    if unknown and err.param:
        message = f"Unrecognized request argument supplied: {err.param}"
    return oai.ErrorResponse(
        error=oai.ErrorDetail(message=message, type=kind, param=err.param, code=code))


def openai_error_response(
    exc: Exception, request: Request[Any, Any, Any] | None = None
) -> Response[Any]:
    """`exc` as an OpenAI error response."""
    if isinstance(exc, MissingApiKey):
        return _unauthorized()
    err = as_api_error(exc, request)
    return Response(_openai_detail(err), status_code=openai_status(err), headers=_headers(exc))


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
