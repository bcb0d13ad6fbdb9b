"""OpenAI tool calling end to end: `tools`, `tool_choice`, `parallel_tool_calls`, on the wire.

Two servers: the session's default model, whose ChatML template has no tool
format (so the gateway writes the tools into the prompt and the calls come in
the fallback JSON format), and a copy of it with Qwen 2.5's tool template
(`tests/support/hermes_model.py`), whose calls come as `<tool_call>` blocks. The
model is random, so every call that parses and validates does so because the
grammar held the engine to it. Wire shapes are read from the raw JSON and
server-sent events (httpx), and again through the OpenAI SDK's own
accumulation (`client.chat.completions.stream`, `.parse`).

Parallel calls: a random model ends after its first call or writes another as
chance has it, so the parallel tests try a few seeds and require one with two
calls; the parser and the stream shape of two calls are also pinned on
hand-written text in tests/gateway/test_tool_calls.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.support.hermes_model import TOOL_CALL_ID, build_hermes_model
from tests.support.live_server import start_server, stop_server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "set_unit": UNIT}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_unit", "parameters": UNIT}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Rome?"}]
CALL_ID = re.compile(r"^call_[A-Za-z0-9]{24}$")


def _post(server, **body) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 100, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _events(server, **body) -> list[Any]:
    """The stream's events as sent: decoded chunks, then the literal `[DONE]`."""
    events: list[Any] = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                      json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 100,
                            "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _check_call(call: dict[str, Any], names=tuple(SCHEMAS)) -> None:
    """A finished call: OpenAI's shape, compact arguments valid against its function."""
    assert set(call) == {"id", "type", "function"}
    assert CALL_ID.match(call["id"]) and call["type"] == "function"
    assert set(call["function"]) == {"name", "arguments"}
    assert call["function"]["name"] in names
    args = call["function"]["arguments"]
    assert isinstance(args, str)
    value = json.loads(args)
    assert args == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    jsonschema.validate(value, SCHEMAS[call["function"]["name"]])


def _check_message(choice: dict[str, Any], finish: str = "tool_calls",
                   names=tuple(SCHEMAS)) -> list[dict[str, Any]]:
    """The choice's calls, checked: all of them when it finished, all but a cut-off last one
    when it ran out of tokens."""
    message = choice["message"]
    assert message["role"] == "assistant"
    assert "content" in message and message["content"] is None
    calls = message["tool_calls"]
    assert calls and len({c["id"] for c in calls}) == len(calls)
    assert choice["finish_reason"] in (finish, "length")
    for call in calls if choice["finish_reason"] == finish else calls[:-1]:
        _check_call(call, names)
    return calls


def _stream_calls(events: list[Any], finish: str = "tool_calls") -> tuple[list[dict], dict]:
    """The calls a raw stream spells, with every chunk's shape checked; and its usage chunk."""
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    last = chunks[-2]["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] in (finish, "length")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    calls: list[dict[str, Any]] = []
    for chunk in chunks[1:-2]:
        (choice,) = chunk["choices"]
        assert choice["finish_reason"] is None
        delta = choice["delta"]
        assert set(delta) == {"tool_calls"}, delta
        (part,) = delta["tool_calls"]
        if "id" in part:  # a call's first chunk: everything but arguments
            assert part["index"] == len(calls)
            assert set(part) == {"index", "id", "type", "function"}
            assert part["type"] == "function" and part["function"]["arguments"] == ""
            calls.append({"id": part["id"], "type": "function",
                          "function": {"name": part["function"]["name"], "arguments": ""}})
        else:  # later chunks: the index and an arguments fragment, nothing else
            assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
            assert part["index"] == len(calls) - 1
            calls[-1]["function"]["arguments"] += part["function"]["arguments"]
    assert len({c["id"] for c in calls}) == len(calls)
    return calls, {"finish_reason": last["finish_reason"], "usage": usage["usage"]}


# ------------------------------------------------ the default model (JSON format)

@pytest.mark.parametrize("seed, temperature", [(1, 0.7), (2, 1.0), (3, 1.5), (4, 1.0)])
def test_required_calls_validate_and_usage_counts_their_tokens(server, seed, temperature):
    body = _post(server, tool_choice="required", seed=seed, temperature=temperature,
                 logprobs=True)
    (choice,) = body["choices"]
    calls = _check_message(choice)
    # Usage counts the generated tokens, and those tokens spell exactly the calls.
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    assert body["usage"]["completion_tokens"] == len(tokens)
    text = "".join(tokens)
    if choice["finish_reason"] == "tool_calls":
        written = "\n".join(f'{{"name": "{c["function"]["name"]}", "arguments": '
                            f'{c["function"]["arguments"]}}}' for c in calls)
        assert text == written + "<|im_end|>"


def test_required_stream_shape_matches_the_answer(server):
    kwargs = dict(tool_choice="required", seed=11, temperature=0)
    whole = _post(server, **kwargs)
    calls, end = _stream_calls(_events(server, stream_options={"include_usage": True},
                                       **kwargs))
    expected = whole["choices"][0]["message"]["tool_calls"]
    assert [c["function"] for c in calls] == [c["function"] for c in expected]
    assert end["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert end["usage"] == whole["usage"]
    _check_message({"message": {"role": "assistant", "content": None, "tool_calls": calls},
                    "finish_reason": end["finish_reason"]})


def test_sdk_stream_helper_accumulates_the_calls(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="-")
    with client.chat.completions.stream(model="tgi", messages=MESSAGES, tools=TOOLS,
                                        tool_choice="required", max_tokens=100, seed=12,
                                        temperature=1.0, parallel_tool_calls=False) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.message.content is None
    _check_message({"finish_reason": choice.finish_reason, "message": {
        "role": choice.message.role, "content": None, "tool_calls": [
            {"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                      "arguments": c.function.arguments}}
            for c in choice.message.tool_calls]}})


def test_named_tool_choice_calls_that_function_and_finishes_with_stop(server):
    named = {"type": "function", "function": {"name": "set_unit"}}
    for seed in (1, 2):
        body = _post(server, tool_choice=named, seed=seed, temperature=1.2)
        (call,) = _check_message(body["choices"][0], finish="stop", names=("set_unit",))
        assert body["choices"][0]["finish_reason"] == "stop"
        calls, end = _stream_calls(_events(server, tool_choice=named, seed=seed,
                                           temperature=1.2,
                                           stream_options={"include_usage": True}),
                                   finish="stop")
        assert end["finish_reason"] == "stop" and len(calls) == 1
        _check_call(calls[0], names=("set_unit",))


def test_parallel_calls_have_indices_and_ids_once_and_false_means_one(server):
    found = None
    for seed in range(10):
        body = _post(server, tool_choice="required", seed=seed, temperature=1.0)
        calls = _check_message(body["choices"][0])
        if len(calls) >= 2:
            found = seed
            break
    assert found is not None, "no seed gave two calls"
    events = _events(server, tool_choice="required", seed=found, temperature=1.0,
                     stream_options={"include_usage": True})
    calls, _ = _stream_calls(events)
    assert len(calls) >= 2
    # Between the role chunk and the empty delta, usage and [DONE] at the end.
    firsts = [p for e in events[1:-3] for p in e["choices"][0]["delta"]["tool_calls"]
              if "id" in p]
    assert [p["index"] for p in firsts] == list(range(len(calls)))
    for seed in range(found, found + 3):
        body = _post(server, tool_choice="required", seed=seed, temperature=1.0,
                     parallel_tool_calls=False)
        assert len(_check_message(body["choices"][0])) == 1
        assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_with_a_random_model_answers_text(server):
    """`auto` leaves the text free until a call's trigger, which noise never writes."""
    body = _post(server, seed=3, max_tokens=12)
    (choice,) = body["choices"]
    assert isinstance(choice["message"]["content"], str) and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] in ("stop", "length")
    events = _events(server, seed=3, max_tokens=12)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant"} and deltas[-1] == {}
    assert "".join(d.get("content", "") for d in deltas) == choice["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_history_with_calls_and_results_reaches_the_prompt(server):
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Rome","days":1}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 24C"},
    ]
    r = httpx.post(f"{server.url}/chat_tokenize", json={"messages": history}, timeout=30)
    text = r.json()["templated_text"]
    assert '{"name": "get_weather", "arguments": {"city":"Rome","days":1}}' in text
    assert "<|im_start|>tool\nsunny, 24C<|im_end|>" in text
    body = _post(server, messages=history, tool_choice="required", seed=1, temperature=0.8)
    _check_message(body["choices"][0])
    without = _post(server, tool_choice="required", seed=1, temperature=0.8)
    assert body["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"]


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)


class GetWeather(BaseModel):
    """Forecast for a city."""

    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


def test_sdk_parse_with_a_pydantic_response_format_and_pydantic_tools(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="-")
    out = client.chat.completions.parse(model="tgi", messages=MESSAGES, response_format=Person,
                                        max_tokens=60, seed=4)
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(out.choices[0].message.parsed, Person)
    tool = openai.pydantic_function_tool(GetWeather)
    for choice in ("required", {"type": "function", "function": {"name": "GetWeather"}}):
        out = client.chat.completions.parse(model="tgi", messages=MESSAGES, tools=[tool],
                                            tool_choice=choice, max_tokens=60, seed=5,
                                            parallel_tool_calls=False)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == ("stop" if isinstance(choice, dict)
                                                else "tool_calls")
        (call,) = message.tool_calls
        assert isinstance(call.function.parsed_arguments, GetWeather)
        assert CALL_ID.match(call.id)


@pytest.mark.parametrize("change, param, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "no function named 'nope'"),
    ({"tool_choice": "nope"}, "tool_choice", "no function named 'nope'"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "only allowed when 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools", "Invalid schema for function 'f'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]},
     "tools", "uniqueItems"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]}, "tools",
     "Invalid schema for function 'f'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]}, "tools",
     "additionalProperties"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools",
     "does not match pattern"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "more than once"),
])
def test_bad_tools_are_400s_in_openais_format(server, change, param, words):
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 5, **change}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"], err["message"]


def test_tools_with_response_format_is_tgis_tool_error_and_sdk_raises(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": MESSAGES, "tools": TOOLS, "response_format": {"type": "json_object"}},
        timeout=30)
    # TGI's words and error type (as the code); OpenAI's status and type.
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "tool_error", r.text
    assert err["type"] == "invalid_request_error"
    assert err["message"] == "Tool error: Grammar and tools are mutually exclusive"
    client = OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tgi", messages=MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})


# --------------------------------------------- a Hermes/Qwen template (<tool_call>)

@pytest.fixture(scope="module")
def hermes_server(default_model_path, model_cache, tmp_path_factory):
    folder = build_hermes_model(default_model_path, tmp_path_factory.mktemp("hermes") / "m")
    live = start_server(model_cache, tmp_path_factory.mktemp("logs"), "--model-id", str(folder),
                        "--dtype", "float32", "--max-total-tokens", "1024",
                        "--max-input-tokens", "900")
    live.folder = folder  # type: ignore[attr-defined]
    yield live
    stop_server(live)


def test_hermes_auto_call_is_parsed_from_its_tool_call_block(hermes_server):
    """`auto`: the bias makes the first token `<tool_call>`; from there the grammar writes
    a whole call, and without parallel calls the answer ends after it."""
    force = {"logit_bias": {str(TOOL_CALL_ID): 100}, "parallel_tool_calls": False}
    for seed in (1, 2):
        body = _post(hermes_server, seed=seed, temperature=1.0, **force)
        (call,) = _check_message(body["choices"][0])
        assert body["choices"][0]["finish_reason"] == "tool_calls"
        calls, end = _stream_calls(_events(hermes_server, seed=seed, temperature=1.0,
                                           stream_options={"include_usage": True}, **force))
        assert len(calls) == 1 and end["finish_reason"] == "tool_calls"
        _check_call(calls[0])
    client = OpenAI(base_url=f"{hermes_server.url}/v1", api_key="-")
    with client.chat.completions.stream(model="tgi", messages=MESSAGES, tools=TOOLS,
                                        max_tokens=100, seed=3, **force) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].message.content is None
    assert final.choices[0].finish_reason == "tool_calls" and CALL_ID.match(call.id)
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_hermes_required_and_the_template_renders_tools_and_history(hermes_server):
    from transformers import AutoTokenizer

    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Rome","days":1}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 24C"},
    ]
    body = _post(hermes_server, messages=history, tool_choice="required", seed=2,
                 temperature=1.0)
    _check_message(body["choices"][0])
    # The prompt is the template's rendering of the tools and the history, counted
    # here with transformers, independently of the server.
    tok = AutoTokenizer.from_pretrained(str(hermes_server.folder))
    hf_history = [history[0], {**history[1], "tool_calls": [
        {**history[1]["tool_calls"][0], "function": {"name": "get_weather",
                                                     "arguments": {"city": "Rome", "days": 1}}}]},
        history[2]]
    text = tok.apply_chat_template(hf_history, tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    assert "<tool_response>\nsunny, 24C\n</tool_response>" in text
    assert '"arguments": {"city": "Rome", "days": 1}}\n</tool_call>' in text
    assert body["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))
