"""Forwarding a request for a remote model to one of its replicas, and its answer back.

The body goes as the client sent it (OpenAI's `model` rewritten to the name
the replica serves); the answer comes back as the replica sent it: a JSON
body whole, a stream event by event as each arrives (never held until the
end). A replica is chosen by the model (`remote/affinity.py` on the prompt's
prefix, else `remote/balancer.py` on load); a connection error, a 5xx,
a timeout or an answer that is not JSON or SSE before anything reached the
client is retried on another replica, each tried once. After the first event
went out, a failure ends the stream with an error event in the route's API
format. Replica addresses go to the log, never into an answer.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import httpx
import msgspec
from litestar import Response
from litestar.response import Stream

from switchyard.errors import ApiError, validation_error
from switchyard.protocol import tgi
from switchyard.remote.affinity import prefix_chain
from switchyard.remote.model import RemoteModel
from switchyard.remote.relay import RelayResponse
from switchyard.remote.sse import EventCutter, Garbage, stream_ended
from switchyard.remote.upstream import Replica
from switchyard.routes.errors import openai_error_json
from switchyard.state import Gateway
from switchyard.telemetry.request import note_error

log = logging.getLogger("switchyard.upstream")

Api = Literal["openai", "tgi", "responses"]
"""The API a forwarded request speaks: how its stream ends and how an error is written
(`responses`: OpenAI's Responses API, typed events ended by a terminal one)."""
STREAM_HEADERS = {"X-Accel-Buffering": "no", "Cache-Control": "no-cache"}
"""Told to every proxy between here and the client: pass each event on at once."""
_PASSED_HEADERS = ("x-compute-type", "x-compute-time", "x-compute-characters", "x-total-time",
                   "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token",
                   "x-prompt-tokens", "x-generated-tokens")
"""TGI's timing headers: measured by the replica, passed on as it sent them."""


@dataclass
class _Opened:
    """A replica's answer once it can go to the client."""

    replica: Replica
    answer: RelayResponse
    first: bytes
    """The whole body (not streamed), or the stream's first whole events."""
    cutter: EventCutter | None = None
    """Where the stream's next events are cut (streams only)."""
    chunks: AsyncIterator[bytes] | None = None
    """The rest of the stream's bytes (streams only; the iterator can be opened once)."""


class _Failure(Exception):
    """An attempt that failed before anything reached the client: try another replica."""

    def __init__(self, why: str, status: int = 502) -> None:
        super().__init__(why)
        self.status = status


def remote_target(gw: Gateway, name: str | None, api: Api) -> RemoteModel | None:
    """The remote model a request names, if it names one.

    Any other outcome (a local model, an unknown name, start-up still running)
    is None: the local path answers it as it always has (TGI streams in-stream).
    """
    try:
        target = gw.resolve(name, api)
    except ApiError:
        return None
    return target if isinstance(target, RemoteModel) else None


async def forward_tgi(model: RemoteModel, path: str, raw: bytes,
                      stream: bool) -> Response[bytes] | Stream:
    """`forward` for TGI's routes: a stream that fails before it began is answered as TGI
    answers every stream error, with status 200 and one in-stream error event."""
    try:
        return await forward(model, "tgi", path, raw, stream)
    except ApiError as exc:
        if not stream:
            raise
        event = _error_event("tgi", exc)

        async def error() -> AsyncIterator[bytes]:
            yield event
        return Stream(error(), status_code=200, media_type="text/event-stream",
                      headers=STREAM_HEADERS)


def refuse_tgi(model: RemoteModel) -> ApiError:
    """TGI's routes for a model whose replicas speak only OpenAI's API: refused, never translated."""
    return validation_error(
        f"model `{model.name}` is served by OpenAI-compatible servers, which have no TGI "
        "routes; send it to /v1/chat/completions or /v1/completions", param="model")


async def forward(model: RemoteModel, api: Api, path: str, raw: bytes,
                  stream: bool) -> Response[bytes] | Stream:
    """Send the request to a replica and answer with what it answers.

    Raises `ApiError` when no replica gave an answer (429 over the model's
    permits; 503 when every replica is out; 502/504 when every one tried failed).
    """
    if api == "tgi" and not (model.speaks_tgi or model.pools):  # TEI's routes are TGI-shaped
        raise refuse_tgi(model)
    model.admission.acquire()
    released = False
    try:
        opened = await _open(model, api, path, raw, stream)
        answer = opened.answer
        if opened.cutter is None:
            return Response(opened.first, status_code=answer.status_code,
                            headers=_headers(answer),
                            media_type=answer.headers.get("content-type", "application/json"))
        released = True  # the stream releases the permit and the replica when it ends
        return Stream(_relay(model, api, opened), status_code=answer.status_code,
                      media_type="text/event-stream",
                      headers={**_headers(answer), **STREAM_HEADERS})
    finally:
        if not released:
            model.admission.release()


async def _open(model: RemoteModel, api: Api, path: str, raw: bytes, stream: bool) -> _Opened:
    """The first replica that answers: its response and its body (non-streamed) or first events."""
    document: dict[str, Any] | None = None
    if api != "tgi":
        document = msgspec.json.decode(raw)  # valid: the route decoded it already
    chain = prefix_chain(_prompt_bytes(document, raw)) \
        if model.entry.balancing == "prefix" else []
    tried: list[Replica] = []
    last: _Failure | None = None
    while (replica := model.choose(tried, chain)) is not None:
        tried.append(replica)
        headers = {"content-type": "application/json", **model.auth}
        body = raw
        if document is not None:
            body = msgspec.json.encode({**document, "model": model.upstream_model(replica)})
        else:  # TGI's routes carry no `model`: a Switchyard replica reads the header
            headers["x-model"] = model.upstream_model(replica)
        replica.in_flight += 1
        try:
            opened = await _attempt(model, replica, path, body, headers, stream)
        except _Failure as exc:
            replica.in_flight -= 1
            model.failed(replica, f"POST {path}: {exc}")
            last = exc
            continue
        if opened.cutter is None:
            replica.in_flight -= 1
        return opened
    if last is None:
        raise ApiError(503, f"Model `{model.name}` has no replica available: every one failed "
                            "recently and is out until its health check passes", "unhealthy")
    word = "timed out" if last.status == 504 else "failed"
    raise ApiError(last.status, f"Model `{model.name}`: every replica tried {word}; the last: "
                                f"{last}", "upstream")


async def _attempt(model: RemoteModel, replica: Replica, path: str, body: bytes,
                   headers: dict[str, str], stream: bool) -> _Opened:
    """One try: the status line and what must arrive before the client is answered."""
    timeout = model.entry.timeout_s
    try:
        answer = await model.relay.post(replica.url + path, body, headers, timeout,
                                        min(5.0, timeout))
    except httpx.TimeoutException as exc:
        raise _Failure(f"no answer within the timeout ({type(exc).__name__})", 504) from None
    except httpx.HTTPError as exc:  # refused, reset, not HTTP
        raise _Failure(f"no answer ({type(exc).__name__})") from None
    try:
        if answer.status_code >= 500:
            raise _Failure(f"it answered {answer.status_code}")
        if answer.status_code in (401, 403):
            # The gateway's credentials, not the client's: a 401 passed on would blame the client.
            raise _Failure(f"it refused the gateway's credentials ({answer.status_code}); "
                           "check the model's `api_key_env`")
        if not stream or answer.status_code != 200:
            content = await answer.aread()  # an error body is answered whole, whatever asked
            _check_json(content)
            await answer.aclose()
            replica.succeeded()
            return _Opened(replica, answer, content)
        if not answer.headers.get("content-type", "").startswith("text/event-stream"):
            raise _Failure("its stream is not server-sent events")
        cutter, chunks = EventCutter(), answer.aiter_raw()
        return _Opened(replica, answer, await _first_events(chunks, cutter), cutter, chunks)
    except httpx.TimeoutException as exc:
        await answer.aclose()
        raise _Failure(f"no answer within the timeout ({type(exc).__name__})", 504) from None
    except (httpx.HTTPError, _Failure, Garbage) as exc:
        await answer.aclose()
        if isinstance(exc, _Failure):
            raise
        raise _Failure(f"broken answer ({exc if isinstance(exc, Garbage) else type(exc).__name__})"
                       ) from None
    except BaseException:  # cancelled (the client left): the connection is not reused
        await answer.aclose()
        raise


def _prompt_bytes(document: dict[str, Any] | None, raw: bytes) -> bytes:
    """What a request's prompt begins with, as bytes, for prefix affinity: OpenAI's messages
    (role and text of each, in order; a Responses request's instructions and input items
    alike) or prompt, TGI's `inputs`."""
    if document is None:  # TGI's routes: the body was checked by the route, not decoded
        try:
            document = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return b""
    if not isinstance(document, dict):
        return b""
    messages = document.get("messages")
    if "input" in document:  # a Responses request: its instructions, then its input items
        items = document["input"]
        messages = [{"role": "user", "content": items}] if isinstance(items, str) else items
        if document.get("instructions"):
            messages = [{"role": "system", "content": document["instructions"]}, *messages]
    if isinstance(messages, list):
        parts: list[str] = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):  # content parts: text, and images by their URL
                content = "".join(str(part.get("text") or part.get("image_url") or "")
                                  for part in content if isinstance(part, dict))
            parts.append(f"{message.get('role')}\x1f{content}\x1e")
        return "".join(parts).encode()
    prompt = document.get("prompt", document.get("inputs"))
    if isinstance(prompt, list):  # several prompts, or token ids: the first one leads
        prompt = prompt[0] if prompt else ""
    return prompt.encode() if isinstance(prompt, str) else str(prompt).encode()


def _check_json(content: bytes) -> None:
    try:
        msgspec.json.decode(content)
    except msgspec.DecodeError:
        raise Garbage("its body is not JSON") from None


async def _first_events(chunks: AsyncIterator[bytes], cutter: EventCutter) -> bytes:
    """Read until one whole event has arrived (a stream that breaks before it can be retried)."""
    async for chunk in chunks:
        events = cutter.feed(chunk)
        if events:
            return events
    raise Garbage("it ended its stream before sending an event")


async def _relay(model: RemoteModel, api: Api, opened: _Opened) -> AsyncIterator[bytes]:
    """The replica's events to the client, as they arrive; a failure becomes an error event."""
    replica, answer, cutter, chunks = opened.replica, opened.answer, opened.cutter, opened.chunks
    assert cutter is not None and chunks is not None
    last = opened.first
    try:
        yield last
        async for chunk in chunks:
            events = cutter.feed(chunk)
            if events:
                last = events
                yield events
        if not stream_ended(api, last):
            raise Garbage("it closed the stream before its last event")
        replica.succeeded()
    except (httpx.HTTPError, Garbage) as exc:
        why = str(exc) if isinstance(exc, Garbage) else type(exc).__name__
        model.failed(replica, f"stream broke after it began: {why}")
        yield _error_event(api, ApiError(
            502, f"Model `{model.name}`: the replica's stream broke after it began ({why})",
            "upstream"))
    finally:
        replica.in_flight -= 1
        model.admission.release()
        # Shielded: a client that left cancels this task, and the upstream connection
        # must still be closed (which aborts the sequence there).
        with anyio.CancelScope(shield=True):
            await answer.aclose()


def _error_event(api: Api, err: ApiError) -> bytes:
    note_error(err)  # in-stream errors never reach the exception handlers
    if api == "tgi":
        body = msgspec.json.encode(tgi.ErrorResponse(error=err.message, error_type=err.error_type))
        return b"data:" + body + b"\n\n"
    if api == "responses":  # OpenAI's `error` event; the stream has no `[DONE]`
        detail = msgspec.json.decode(openai_error_json(err))["error"]
        return b"event: error\ndata:" + msgspec.json.encode({"type": "error", **detail}) + b"\n\n"
    return b"data:" + openai_error_json(err) + b"\n\ndata: [DONE]\n\n"


def _headers(answer: RelayResponse) -> dict[str, str]:
    return {name: answer.headers[name] for name in _PASSED_HEADERS if name in answer.headers}
