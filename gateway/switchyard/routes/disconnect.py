"""Abandoned requests: work for a client that has gone away is cancelled at once.

A streamed answer notices a disconnect when it next writes (Litestar listens for
it beside the stream). A JSON answer writes nothing until it is complete, so
without help a client that timed out would keep its sequences in the engine's
batch to the end. `unless_client_leaves` runs the work beside a wait on the ASGI
`http.disconnect` message and cancels the work when that comes first: the
generation's own clean-up then aborts every engine sequence (and closes a
remote replica's request), and the request ends as `dropped` (499, never read).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from litestar import Request

from switchyard.errors import ApiError
from switchyard.routes.errors import CLIENT_CLOSED_STATUS, CLIENT_GONE

T = TypeVar("T")


def client_left() -> ApiError:
    """The error a request ends with when its client went away before the answer."""
    return ApiError(CLIENT_CLOSED_STATUS,
                    "Client closed the connection before the answer was ready", CLIENT_GONE)


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    """Return when the client disconnects.

    Called after the body has been read, so the only message left for this
    request is `http.disconnect` (uvicorn sends it when the socket closes, or
    once the response is complete, by which time the wait is cancelled).
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(request: Request[Any, Any, Any], work: Awaitable[T]) -> T:
    """Await `work`, or cancel it and raise `client_left()` if the client goes first.

    The request's body must already be read. `work` may return a streamed
    response; once it has, the stream's own disconnect handling takes over.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        # Wait for the work's clean-up (engine aborts, permit release) to run.
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise client_left()
    finally:
        for pending in (task, watch):
            pending.cancel()
