"""Errors a client can cause, independent of which API format reports them.

Routes raise `ApiError`; each API's router turns it into its own body: TGI's
`{"error", "error_type"}` or OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations


class ApiError(Exception):
    """An error with an HTTP status, a message and TGI's error type."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code


def validation_error(detail: str, *, param: str | None = None) -> ApiError:
    """A 422 with TGI's `Input validation error: ` prefix."""
    return ApiError(422, f"Input validation error: {detail}", "validation", param=param)


def overloaded_error() -> ApiError:
    """A 429: no free `--max-concurrent-requests` permit."""
    return ApiError(429, "Model is overloaded", "overloaded")


def generation_error(detail: str) -> ApiError:
    """A 424: the engine failed while generating."""
    return ApiError(424, f"Request failed during generation: {detail}", "generation")


def model_not_found(name: str) -> ApiError:
    """A 404 for an unknown `model` on the OpenAI routes."""
    return ApiError(
        404,
        f"The model `{name}` does not exist.",
        "invalid_request_error",
        param="model",
        code="model_not_found",
    )
