"""One streamed request against one API, timed token by token.

Three APIs: `tgi` (`POST /generate_stream`), `openai-chat`
(`POST /v1/chat/completions`) and `openai-completions` (`POST /v1/completions`).
Time to first token is taken at the first event that carries text (TGI: any
token event), not at the first byte: OpenAI chat streams open with a role-only
chunk before any token exists.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import httpx
import msgspec

Api = Literal["tgi", "openai-chat", "openai-completions"]
APIS: tuple[Api, ...] = ("tgi", "openai-chat", "openai-completions")


class RequestSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one benchmark request asks for."""

    prompt: str
    prompt_tokens: int
    """As the prompt builder counted them; the server's own count wins when it reports one."""
    max_tokens: int
    temperature: float = 0.0
    """0 means greedy."""
    ignore_eos: bool = False


class RequestResult(msgspec.Struct, kw_only=True):
    """How one request went. Times are seconds; `sent_at` is from the phase start."""

    sent_at: float
    e2e_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = []
    """Gaps between consecutive token events (an event may carry more than one token)."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Finished without error and produced at least one token."""
        return self.error is None and self.output_tokens > 0


class Endpoint(msgspec.Struct, frozen=True, kw_only=True):
    """Where and how requests go."""

    url: str
    """Server root, without `/v1`."""
    api: Api
    model: str | None = None
    """Sent as `model` on the OpenAI APIs (TGI routes take none)."""


# Lenient views of the stream events: only the fields the benchmark reads.
class _TgiToken(msgspec.Struct):
    id: int = 0


class _TgiDetails(msgspec.Struct):
    generated_tokens: int | None = None
    input_length: int | None = None


class _TgiEvent(msgspec.Struct):
    token: _TgiToken | None = None
    details: _TgiDetails | None = None
    error: str | None = None


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _OpenAIChunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None


def request_body(endpoint: Endpoint, spec: RequestSpec) -> dict[str, Any]:
    """The JSON body for one request on the endpoint's API."""
    if endpoint.api == "tgi":
        params: dict[str, Any] = {"max_new_tokens": spec.max_tokens, "details": True}
        # TGI rejects temperature=0: greedy is do_sample=false.
        if spec.temperature > 0:
            params.update(do_sample=True, temperature=spec.temperature)
        # TGI has no per-request ignore_eos; the server's
        # TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN=true does it.
        return {"inputs": spec.prompt, "parameters": params}
    body: dict[str, Any] = {"max_tokens": spec.max_tokens, "temperature": spec.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.model:
        body["model"] = endpoint.model
    if spec.ignore_eos:
        # vLLM's and SGLang's extension; servers that do not know it ignore the field.
        body["ignore_eos"] = True
    if endpoint.api == "openai-chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


def request_path(api: Api) -> str:
    """The route each API streams from."""
    return {"tgi": "/generate_stream", "openai-chat": "/v1/chat/completions",
            "openai-completions": "/v1/completions"}[api]


class _Timer:
    """Collects token-event times for one request."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.last: float | None = None
        self.ttft: float | None = None
        self.gaps: list[float] = []
        self.events = 0

    def token_event(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.ttft = now - self.started
        else:
            self.gaps.append(now - self.last)
        self.last = now
        self.events += 1


def _tgi_event(data: bytes, timer: _Timer, result: RequestResult) -> None:
    event = msgspec.json.decode(data, type=_TgiEvent)
    if event.error is not None:
        result.error = event.error
        return
    if event.token is not None:
        timer.token_event()
    if event.details is not None:
        if event.details.generated_tokens is not None:
            result.output_tokens = event.details.generated_tokens
        if event.details.input_length is not None:
            result.prompt_tokens = event.details.input_length


def _openai_event(data: bytes, timer: _Timer, result: RequestResult) -> None:
    chunk = msgspec.json.decode(data, type=_OpenAIChunk)
    if chunk.error is not None:
        message = chunk.error.get("message") if isinstance(chunk.error, dict) else chunk.error
        result.error = str(message)
        return
    for choice in chunk.choices:
        text = choice.delta.content if choice.delta is not None else choice.text
        if text:
            timer.token_event()
            break
    if chunk.usage is not None:
        if chunk.usage.completion_tokens is not None:
            result.output_tokens = chunk.usage.completion_tokens
        if chunk.usage.prompt_tokens is not None:
            result.prompt_tokens = chunk.usage.prompt_tokens


async def send(client: httpx.AsyncClient, endpoint: Endpoint, spec: RequestSpec,
               sent_at: float) -> RequestResult:
    """Stream one request to its end and time it. Never raises for a failed request."""
    result = RequestResult(sent_at=sent_at)
    handle = _tgi_event if endpoint.api == "tgi" else _openai_event
    started = time.perf_counter()
    timer = _Timer(started)
    try:
        async with client.stream("POST", endpoint.url + request_path(endpoint.api),
                                 json=request_body(endpoint, spec)) as reply:
            if reply.status_code != 200:
                body = (await reply.aread()).decode(errors="replace")
                result.error = f"HTTP {reply.status_code}: {body[:200]}"
            else:
                async for line in reply.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    handle(data.encode(), timer, result)
                    if result.error is not None:
                        break
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    result.e2e_s = time.perf_counter() - started
    result.ttft_s = timer.ttft
    result.itl_s = timer.gaps
    # Without a count from the server, count token events (a lower bound when events merge).
    if result.output_tokens == 0:
        result.output_tokens = timer.events
    if result.prompt_tokens == 0:
        result.prompt_tokens = spec.prompt_tokens
    if result.error is None and timer.events == 0:
        result.error = "stream ended without a token"
    return result
