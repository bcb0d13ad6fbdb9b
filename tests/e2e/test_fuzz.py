"""Schema-driven fuzzing of the generation routes, bounded so CI runs it on every change.

Schemathesis turns the server's own OpenAPI document (`/openapi.json`) into
Hypothesis strategies: bodies that fit the request schemas (positive) and
bodies that break them (negative: wrong types, missing fields, junk). Every
case goes to a real `switchyard serve` with small token limits, so a
generation is a few dozen tokens at most, and every answer must:

- arrive within `REQUEST_TIMEOUT` seconds (no hung request),
- not be a 5xx, nor a 424 (the engine must not fail on a request that
  passed validation),
- be, when it is a 4xx, in the route's API error format: TGI's
  `{error, error_type}` or OpenAI's `{error: {message, type, param, code}}`,
- when it is a stream, consist of well-formed events that end properly,
- report every chosen token with a log-probability: a null one is a NaN or
  an infinity that JSON cannot hold, the sign of broken sampling numerics.

`EDGE_CASES` adds bodies the generator finds only by luck: extreme floats
and integers at the edges of what validation lets through.

The run is bounded (`CASES` per route and mode, generation lengths capped by
`bounded`) and reproducible (derandomized); `SWITCHYARD_FUZZ_CASES=200
SWITCHYARD_FUZZ_SEED=7` explores further locally.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from schemathesis import GenerationMode

from tests.support.live_server import LiveServer, start_server, stop_server

CASES = {
    GenerationMode.POSITIVE: int(os.environ.get("SWITCHYARD_FUZZ_CASES", "20")),
    GenerationMode.NEGATIVE: int(os.environ.get("SWITCHYARD_FUZZ_CASES", "12")),
}
"""Cases per route and generation mode: 32 per route in CI."""
SEED = os.environ.get("SWITCHYARD_FUZZ_SEED")
REQUEST_TIMEOUT = 30.0
"""Seconds for one whole answer; a generation here is a few tokens."""
MAX_TOTAL_TOKENS = 40
"""The fuzz server's budget per request; room for a chat template around a short message."""
MAX_NEW_TOKENS = 3
N_CHOICES = 2
_LENGTH_FIELDS = ("max_new_tokens", "max_tokens", "max_completion_tokens", "max_output_tokens")
_FAN_OUT_FIELDS = ("n", "best_of")

TGI_ROUTES = ["/generate", "/generate_stream", "/", "/tokenize", "/chat_tokenize"]
OPENAI_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
RESPONSES_ROUTES = ["/v1/responses"]
"""Streams of typed events (`event:` + `data:`), ended by a terminal event, no `[DONE]`."""
RESPONSES_TERMINAL = ("response.completed", "response.incomplete", "response.failed")
EITHER_ROUTES = ["/invocations"]
"""Answers in TGI's format for a generate body, in OpenAI's for a chat or completion body."""


@pytest.fixture(scope="module")
def fuzz_server(default_model_path: Path, model_cache: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server with small limits: any generation the fuzzer asks for stays short."""
    live = start_server(model_cache, tmp_path_factory.mktemp("fuzz-logs"),
                        "--dtype", "float32", "--max-total-tokens", str(MAX_TOTAL_TOKENS),
                        "--max-input-tokens", str(MAX_TOTAL_TOKENS - 8))
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def api_schema(fuzz_server: LiveServer) -> schemathesis.BaseSchema:
    """The document the server serves, as Schemathesis strategies."""
    document = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=10).json()
    return schemathesis.openapi.from_dict(document)


@dataclass
class Failure:
    """One answer that broke a rule, with what it takes to reproduce it."""

    rule: str
    status: int | None
    body: Any
    answer: str

    def __str__(self) -> str:
        return (f"{self.rule} (status {self.status})\n  request: {_short(self.body)}\n"
                f"  answer:  {self.answer[:300]!r}")


def _short(value: Any) -> str:
    text = json.dumps(value, default=repr, ensure_ascii=False)
    return text if len(text) < 400 else text[:400] + "..."


def _is_tgi_error(payload: Any) -> bool:
    return (isinstance(payload, dict) and set(payload) == {"error", "error_type"}
            and isinstance(payload["error"], str) and isinstance(payload["error_type"], str))


def _is_openai_error(payload: Any) -> bool:
    if not isinstance(payload, dict) or set(payload) != {"error"}:
        return False
    err = payload["error"]
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and isinstance(err["type"], str))


def _error_format_ok(path: str, payload: Any) -> bool:
    if path in TGI_ROUTES:
        return _is_tgi_error(payload)
    if path in OPENAI_ROUTES:
        return _is_openai_error(payload)
    return _is_tgi_error(payload) or _is_openai_error(payload)


_ALTERNATIVES = frozenset({"top_tokens", "top_logprobs", "prefill", "token_logprobs"})
"""Keys whose log-probabilities may be missing: a filtered-out alternative has -inf
(written as null, by TGI too), the first prompt token has none."""


def _null_logprob(value: Any) -> str | None:
    """Where a chosen token has no log-probability, if anywhere.

    A chosen token, TGI's `Token` in `token`/`tokens` or OpenAI's entry of
    `logprobs.content`, was drawn from a distribution that gave it a finite
    log-probability; null there is a NaN or an infinity that JSON cannot hold.
    """
    if isinstance(value, list):
        return next((w for w in map(_null_logprob, value) if w), None)
    if not isinstance(value, dict):
        return None
    if "logprob" in value and not isinstance(value["logprob"], int | float):
        return json.dumps(value)[:160]
    return next((w for key, item in value.items() if key not in _ALTERNATIVES
                 if (w := _null_logprob(item))), None)


def _sse_data(text: str) -> list[str]:
    return [line[len("data:"):].strip() for line in text.splitlines() if line.startswith("data:")]


def _stream_problem(path: str, text: str) -> str | None:
    """What is wrong with a complete SSE answer, if anything."""
    events = _sse_data(text)
    if not events:
        return "stream without events"
    if path in RESPONSES_ROUTES:
        return _responses_stream_problem(text, events)
    openai_style = events[-1] == "[DONE]"
    if path in OPENAI_ROUTES and not openai_style:
        return "OpenAI stream not ended by [DONE]"
    payloads = events[:-1] if openai_style else events
    for raw in payloads:
        try:
            event = json.loads(raw)
        except json.JSONDecodeError:
            return f"event is not JSON: {raw[:80]!r}"
        if not isinstance(event, dict):
            return f"event is not an object: {raw[:80]!r}"
        if "error" in event and not _error_format_ok(path, event):
            return f"in-stream error in the wrong format: {raw[:120]!r}"
        if "error" in event and ("token" in event or "choices" in event):
            return f"event mixes an error and data: {raw[:120]!r}"
        if where := _null_logprob(event):
            return f"a chosen token without a log-probability (NaN/inf): {where}"
    if not openai_style:  # TGI: the stream ends with the last token's event or an error
        last = json.loads(payloads[-1])
        if "error" not in last and last.get("generated_text") is None:
            return "TGI stream ended before a final event"
    return None


def _responses_stream_problem(text: str, events: list[str]) -> str | None:
    """A Responses stream: each `data:` an object whose `type` its `event:` line names,
    numbered 0, 1, 2, ..., ended by one terminal event."""
    names = [line[len("event:"):].strip() for line in text.splitlines()
             if line.startswith("event:")]
    if len(names) != len(events):
        return "a Responses event without its `event:` line"
    for number, (name, raw) in enumerate(zip(names, events, strict=True)):
        try:
            event = json.loads(raw)
        except json.JSONDecodeError:
            return f"event is not JSON: {raw[:80]!r}"
        if not isinstance(event, dict) or event.get("type") != name:
            return f"event type differs from its `event:` line: {raw[:80]!r}"
        if event.get("sequence_number") != number:
            return f"event {number} is numbered {event.get('sequence_number')!r}"
        if where := _null_logprob(event):
            return f"a chosen token without a log-probability (NaN/inf): {where}"
    if names[-1] not in RESPONSES_TERMINAL:
        return f"Responses stream ended by {names[-1]!r}, not a terminal event"
    return None


def check_answer(path: str, body: Any, response: httpx.Response, elapsed: float) -> list[Failure]:
    """Every rule the answer breaks."""
    failures: list[Failure] = []
    status = response.status_code

    def fail(rule: str) -> None:
        failures.append(Failure(rule, status, body, response.text))

    if elapsed > REQUEST_TIMEOUT:
        fail(f"answer took {elapsed:.1f}s")
    if status >= 500:
        fail("server error")
    elif status == 424:
        fail("the engine failed on a request that passed validation")
    elif 400 <= status < 500:
        if status == 401:
            return failures  # bare, as TGI answers; the fuzz server has no API key
        try:
            payload = response.json()
        except ValueError:
            fail("4xx body is not JSON")
        else:
            if not _error_format_ok(path, payload):
                fail("4xx body is not in the route's error format")
    elif status == 200:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            problem = _stream_problem(path, response.text)
            if problem:
                fail(problem)
        else:
            try:
                payload = response.json()
            except ValueError:
                fail("200 body is not JSON")
            else:
                if where := _null_logprob(payload):
                    fail(f"a chosen token without a log-probability (NaN/inf): {where}")
    else:
        fail("unexpected status")
    return failures


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bounded_lengths(fields: dict[str, Any], length_key: str) -> dict[str, Any]:
    out = dict(fields)
    if not any(key in fields for key in _LENGTH_FIELDS):
        out[length_key] = MAX_NEW_TOKENS
    for key, value in fields.items():
        if key in _LENGTH_FIELDS and _is_int(value) and value > MAX_NEW_TOKENS:
            out[key] = value % MAX_NEW_TOKENS + 1
        elif key in _FAN_OUT_FIELDS and _is_int(value) and value > N_CHOICES:
            out[key] = value % N_CHOICES + 1
    return out


def bounded(body: Any) -> Any:
    """`body` asking for at most MAX_NEW_TOKENS tokens and N_CHOICES choices.

    Generation on this CPU takes tens of milliseconds a token, so long or
    absent lengths would only make the run slow: a large length becomes a
    small one (1 to MAX_NEW_TOKENS) and an absent one MAX_NEW_TOKENS, while
    zero, negative and non-integer values stay as they are, because they
    test validation. A TGI body without `parameters` gets a length and keeps
    what absent parameters mean (sampling on).
    """
    if not isinstance(body, dict):
        return body
    out = dict(body)
    if "messages" in body or "prompt" in body:
        out = _bounded_lengths(out, "max_tokens")
    elif "input" in body:  # a Responses body
        out = _bounded_lengths(out, "max_output_tokens")
    if "inputs" in body:
        parameters = body.get("parameters")
        if parameters is None:
            out["parameters"] = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": True}
        elif isinstance(parameters, dict):
            out["parameters"] = _bounded_lengths(parameters, "max_new_tokens")
    return out


def fuzz_route(schema: schemathesis.BaseSchema, url: str, path: str,
               mode: GenerationMode) -> tuple[Counter[int], list[Failure]]:
    """Send `CASES[mode]` generated bodies to `POST path`; returns the statuses and the failures."""
    strategy = schema[path]["POST"].as_strategy(generation_mode=mode)
    cases = CASES[mode]
    failures: list[Failure] = []
    statuses: Counter[int] = Counter()

    @settings(max_examples=cases, deadline=None, database=None, derandomize=SEED is None,
              phases=[Phase.explicit, Phase.generate], print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        case.body = bounded(case.body)
        kwargs = case.as_transport_kwargs(base_url=url)
        kwargs.pop("method", None)
        kwargs.pop("url", None)
        kwargs.pop("timeout", None)
        start = time.monotonic()
        try:
            with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
                response = client.request("POST", f"{url}{path}", **_httpx_kwargs(kwargs))
                response.read()
        except httpx.TimeoutException:
            failures.append(Failure(f"no answer within {REQUEST_TIMEOUT}s", None, case.body, ""))
            return
        except httpx.TransportError as exc:
            failures.append(Failure(f"connection failed: {exc!r}", None, case.body, ""))
            return
        statuses[response.status_code] += 1
        failures.extend(check_answer(path, case.body, response, time.monotonic() - start))

    if SEED is not None:
        run = hypothesis_seed(int(SEED))(run)
    run()
    return statuses, failures


def _httpx_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Schemathesis's transport arguments (requests' names) for httpx."""
    out: dict[str, Any] = {}
    for key in ("headers", "params", "cookies"):
        if kwargs.get(key):
            out[key] = kwargs[key]
    if "json" in kwargs:
        out["content"] = json.dumps(kwargs["json"]).encode()
        out.setdefault("headers", {})
        out["headers"] = {**out["headers"], "content-type": "application/json"}
    elif "data" in kwargs:
        data = kwargs["data"]
        out["content"] = data if isinstance(data, bytes | str) else json.dumps(data).encode()
    return out


_TINY = 5e-324  # the smallest double: 0.0 once it is a float32 on the device
EDGE_CASES: list[tuple[str, dict[str, Any]]] = [
    *(("/generate", {"inputs": "hi", "parameters": {**p, "max_new_tokens": 2, "details": True,
                                                   "top_n_tokens": 2}})
      for p in ({"temperature": _TINY}, {"temperature": 1e-300}, {"temperature": 1e308},
                {"top_p": _TINY}, {"typical_p": _TINY}, {"typical_p": 1 - 1e-16},
                {"repetition_penalty": _TINY}, {"repetition_penalty": 1e308},
                {"frequency_penalty": -2.0, "do_sample": True},
                {"top_k": 2**63 - 1, "do_sample": True}, {"seed": 2**64 - 1, "do_sample": True},
                {"temperature": _TINY, "watermark": True},
                {"best_of": 2, "temperature": _TINY})),
    ("/generate_stream", {"inputs": "hi", "parameters": {"temperature": _TINY, "top_p": _TINY,
                                                         "max_new_tokens": 2}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "temperature": _TINY, "top_p": _TINY, "logprobs": True,
                              "top_logprobs": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 2.0, "top_p": _TINY,
                         "logprobs": 2, "logit_bias": {"5": 100.0}}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "temperature": _TINY,
                       "top_p": _TINY, "top_logprobs": 2, "stream": True,
                       "include": ["message.output_text.logprobs"]}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "background": True,
                       "stream": True}),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f",
                                  "arguments": "{}"},
                                 {"type": "function_call_output", "call_id": "c", "output": ""}],
                       "tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
                       "max_output_tokens": 3, "stream": True}),
]


@pytest.mark.parametrize(("path", "body"), EDGE_CASES,
                         ids=[f"{p} {json.dumps(b.get('parameters', b))[:60]}" for p, b in EDGE_CASES])
def test_edge_case(fuzz_server: LiveServer, path: str, body: dict[str, Any]) -> None:
    start = time.monotonic()
    response = httpx.post(f"{fuzz_server.url}{path}", json=body, timeout=REQUEST_TIMEOUT)
    failures = check_answer(path, body, response, time.monotonic() - start)
    assert not failures, "\n".join(map(str, failures))


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=["valid", "invalid"])
@pytest.mark.parametrize("path", TGI_ROUTES + OPENAI_ROUTES + EITHER_ROUTES)
def test_fuzz_route(api_schema: schemathesis.BaseSchema, fuzz_server: LiveServer, path: str,
                    mode: GenerationMode) -> None:
    statuses, failures = fuzz_route(api_schema, fuzz_server.url, path, mode)
    sent = sum(statuses.values()) + sum(f.status is None for f in failures)
    print(f"POST {path} ({mode.value}): {sent} cases, statuses {dict(sorted(statuses.items()))}")
    assert sent > 0
    if failures:
        listed = "\n".join(str(f) for f in failures[:8])
        pytest.fail(f"{len(failures)} of {sent} answers broke the rules on POST {path}:\n{listed}")


def test_server_survives_the_fuzzing(fuzz_server: LiveServer) -> None:
    """Runs after the fuzzing (file order): still ready and generating."""
    assert httpx.get(f"{fuzz_server.url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{fuzz_server.url}/generate",
                   json={"inputs": "hello", "parameters": {"max_new_tokens": 3}}, timeout=30)
    assert r.status_code == 200, r.text
