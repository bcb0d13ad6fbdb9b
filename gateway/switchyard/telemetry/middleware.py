"""The ASGI middleware that opens and closes each generation request's `RequestRecord`.

It is the one place that sees a request whole: its arrival, its route, the
status it was answered with, whether its last byte went out (a client that
goes away mid-stream leaves it unsent: TGI's "dropped"), and its W3C trace
context. Other requests (health, info, metrics, tokenize) pass straight through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from switchyard.telemetry.request import RequestRecord, activate, deactivate

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Message, Receive, Scope, Send

    from switchyard.telemetry import Telemetry

GENERATION_ROUTES = frozenset({
    "/", "/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions",
    "/invocations", "/v1/responses",
})
"""The routes that generate (POST): what TGI's request metrics count."""

_TRACE_HEADERS = (b"traceparent", b"tracestate")


def request_telemetry(telemetry: Telemetry) -> Callable[[ASGIApp], ASGIApp]:
    """A Litestar middleware factory that records every generation request."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def record_request(scope: Scope, receive: Receive, send: Send) -> None:
            if (scope["type"] != "http" or scope.get("method") != "POST"
                    or scope["path"] not in GENERATION_ROUTES):
                await app(scope, receive, send)
                return
            record = RequestRecord.begin("POST", scope["path"])
            parent = None
            if telemetry.tracing.enabled:
                parent = telemetry.tracing.extract({
                    key.decode("latin-1"): value.decode("latin-1")
                    for key, value in scope["headers"] if key in _TRACE_HEADERS
                })

            async def watch(message: Message) -> None:
                kind = message["type"]
                if kind == "http.response.start":
                    record.status = message["status"]
                elif kind == "http.response.body" and not message.get("more_body", False):
                    record.completed = True
                await send(message)

            token = activate(record)
            try:
                await app(scope, receive, watch)
            except BaseException:
                record.crashed = True
                raise
            finally:
                deactivate(token)
                telemetry.finish(record, parent)

        return record_request

    return middleware
