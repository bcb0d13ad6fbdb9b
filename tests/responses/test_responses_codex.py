"""What the Codex CLI sends to `/v1/responses`, served: its fields, its tool types, its probes.

The request shape is Codex 0.169.0's first turn as captured against a
loopback listener (`../shared/reference/agent-clients-anchors.md`), cut to
fit the session server's 400-token prompts: two `developer` messages and
two `user` messages, a `namespace` tool, a `custom` tool
and a hosted `web_search` tool, `include: ["reasoning.encrypted_content"]`,
`client_metadata`, `store: false`, streamed. What the model sees is checked
against the chat route on the same conversation with the tools as the
Responses route offers them (namespace tools under their own names, the
custom tool as a function of one string `input`): same prompt length, same
greedy answer. The full-size request from the real Codex CLI runs in
`tests/e2e/test_real_model.py`.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from switchyard.errors import ApiError
from switchyard.responses.tools import OMITTED_HEADER, read_tools

EXEC = {"type": "function", "name": "exec_command", "description": "Runs a command.",
        "strict": False, "parameters": {"type": "object", "properties": {
            "cmd": {"type": "string", "maxLength": 12}}, "required": ["cmd"],
            "additionalProperties": False}}
SPAWN = {"type": "function", "name": "spawn_agent", "description": "",
         "strict": False, "parameters": {"type": "object", "properties": {
             "task": {"type": "string", "maxLength": 8}}, "required": ["task"],
             "additionalProperties": False}}
CLOSE = {"type": "function", "name": "close_agent", "description": "Close a sub-agent.",
         "strict": False, "parameters": {"type": "object", "properties": {
             "target": {"type": "string", "maxLength": 8}}, "required": ["target"],
             "additionalProperties": False}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1",
             "description": "Tools for sub-agents.", "tools": [SPAWN, CLOSE]}
SMALL_NAMESPACE = {**NAMESPACE, "tools": [SPAWN]}
PATCH = {"type": "custom", "name": "apply_patch", "description": "",
         "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]{3,6}"}}
WEB = {"type": "web_search", "external_web_access": False}
INPUT = [
    {"type": "message", "role": "developer",
     "content": [{"type": "input_text", "text": "You are a coding agent."}]},
    {"type": "message", "role": "developer",
     "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
    {"type": "message", "role": "user",
     "content": [{"type": "input_text", "text": "cwd: /work"}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi"}]},
]
CODEX = {
    "model": "tgi", "input": INPUT, "tools": [SMALL_NAMESPACE, PATCH, WEB],
    "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
    "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "019b0000-0000-7000-8000-000000000000",
    "client_metadata": {"session_id": "019b", "turn_id": "01a2", "x-codex-window-id": "0"},
    "max_output_tokens": 12, "temperature": 0,
}
"""Codex's first request, in shape (its sizes cut); `temperature` and `max_output_tokens`
make the answer comparable (Codex sends neither)."""
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
    for t in (SPAWN,)
] + [{"type": "function", "function": {
    "name": "apply_patch", "description": "", "strict": True,
    "parameters": {"type": "object", "properties": {"input": {"type": "string",
                                                              "pattern": "[a-z]{3,6}"}},
                   "required": ["input"], "additionalProperties": False}}}]
"""The tools as the Responses route offers them to the model (its module docstring)."""
CHAT_TOOLS[1]["function"]["description"] = PATCH["description"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", timeout=120, max_retries=0)


def _events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


def test_codexs_first_request_is_served_and_says_what_it_left_out(server):
    with httpx.stream("POST", f"{server.url}/v1/responses", json=CODEX, timeout=120,
                      headers={"originator": "codex_exec", "session-id": "019b"}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers[OMITTED_HEADER] == "web_search"
        events = _events(r)
    assert events[0]["type"] == "response.created"
    final = events[-1]["response"]
    assert events[-1]["type"] == f"response.{final['status']}"
    assert final["status"] in ("completed", "incomplete") and final["store"] is False
    assert [t["type"] for t in final["tools"]] == ["namespace", "custom"]
    assert final["client_metadata"] == CODEX["client_metadata"]
    assert final["usage"]["output_tokens"] >= 1
    assert not [o for o in final["output"] if o["type"] == "reasoning"]
    assert "web_search" in server.log()  # the log line that names the omission


def _chat_messages(history: list[dict]) -> list[dict]:
    """The Codex conversation on the chat route: developer messages are system messages,
    calls an assistant message's `tool_calls` under the names the model was offered."""
    text = {"developer": "system"}
    out: list[dict] = []
    for item in history:
        if item["type"] == "message":
            out.append({"role": text.get(item["role"], item["role"]),
                        "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] in ("function_call", "custom_tool_call"):
            arguments = (item["arguments"] if item["type"] == "function_call"
                         else json.dumps({"input": item["input"]}))
            out.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": arguments}}]})
        else:
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": item["output"]})
    return out


HISTORY = [
    INPUT[0], INPUT[3],
    {"type": "function_call", "name": "spawn_agent", "namespace": "multi_agent_v1",
     "arguments": '{"task":"ls"}', "call_id": "call_a1"},
    {"type": "function_call_output", "call_id": "call_a1", "output": "ok"},
    {"type": "custom_tool_call", "name": "apply_patch", "input": "fix", "call_id": "call_b2"},
    {"type": "custom_tool_call_output", "call_id": "call_b2", "output": "ok"},
]


def test_a_codex_tool_round_trip_prompts_the_model_as_the_chat_route_does(client):
    """A namespaced call and a custom call with their outputs in the history (as Codex resends
    it with `store: false`): the prompt is the chat route's for the same messages and tools."""
    body = {**CODEX, "input": HISTORY, "stream": False}
    turn = client.responses.create(**{k: body.pop(k) for k in ("model", "input")},
                                   extra_body=body)
    chat = client.chat.completions.create(model="tgi", messages=_chat_messages(HISTORY),
                                          tools=CHAT_TOOLS, max_tokens=12, temperature=0)
    assert turn.usage.input_tokens == chat.usage.prompt_tokens
    # The same greedy answer: text, or calls (mapped back to the client's tools).
    text = "".join(p.text for o in turn.output if o.type == "message" for p in o.content)
    calls = [(o.name, json.loads(o.arguments) if o.type == "function_call"
              else {"input": o.input}) for o in turn.output if o.type != "message"]
    message = chat.choices[0].message
    assert text == (message.content or "")
    assert calls == [(c.function.name, json.loads(c.function.arguments))
                     for c in message.tool_calls or []]


def test_a_namespaced_call_goes_back_with_its_namespace(client):
    body = {**CODEX, "tools": [NAMESPACE], "tool_choice": "required", "stream": False,
            "max_output_tokens": 60, "parallel_tool_calls": False}
    turn = client.responses.create(**{k: body.pop(k) for k in ("model", "input")},
                                   extra_body=body)
    (call,) = [o.model_dump() for o in turn.output if o.type == "function_call"]
    assert call["namespace"] == "multi_agent_v1"
    assert call["name"] in ("spawn_agent", "close_agent")
    assert set(json.loads(call["arguments"])) in ({"task"}, {"target"})


def test_a_custom_tools_call_carries_input_held_to_its_grammar(client, server):
    body = {**CODEX, "tools": [PATCH], "stream": True, "max_output_tokens": 60,
            "tool_choice": {"type": "custom", "name": "apply_patch"}}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = _events(r)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    (call,) = [i for i in done if i["type"] == "custom_tool_call"]
    assert call["name"] == "apply_patch" and "namespace" not in call
    assert re.fullmatch(PATCH["format"]["definition"], call["input"]), call
    assert not [e for e in events if e["type"].startswith("response.function_call_arguments")]
    assert events[-1]["response"]["output"][0] == call


def test_codexs_probe_is_answered(client):
    """Codex checks a provider with an empty input and one output token."""
    r = client.responses.create(model="tgi", input=[], max_output_tokens=1)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens == 1


def test_an_unserved_include_or_grammar_is_refused_by_name(client):
    for change, param in (
            ({"include": ["reasoning.encrypted_content", "file_search_call.results"]},
             "include[1]"),
            ({"tools": [{**PATCH, "format": {"type": "grammar", "syntax": "lark",
                                             "definition": "start: WORD"}}]},
             "tools[0].format.syntax"),
            ({"tools": [{"type": "frobnicate"}]}, "tools[0].type")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="tgi", input="hi", max_output_tokens=2,
                                    extra_body=change)
        assert err.value.body["param"] == param, err.value.body


def test_strict_hosted_tools_refuses_them_by_name():
    assert read_tools([EXEC, WEB]).omitted == ("web_search",)
    with pytest.raises(ApiError) as err:
        read_tools([EXEC, WEB], strict_hosted=True)
    assert err.value.status == 400 and err.value.param == "tools[1].type"


def test_a_name_taken_twice_is_offered_under_its_namespace():
    tools = read_tools([SPAWN, NAMESPACE])
    assert [t.model_name for t in tools.offered] == [
        "spawn_agent", "multi_agent_v1__spawn_agent", "close_agent"]
    assert tools.model_name("spawn_agent", "multi_agent_v1") == "multi_agent_v1__spawn_agent"


def test_client_metadata_is_stored_with_the_response(client):
    r = client.responses.create(model="tgi", input="hi", max_output_tokens=2,
                                extra_body={"client_metadata": {"turn_id": "t-1"}})
    stored = client.responses.retrieve(r.id).model_dump()
    assert stored["client_metadata"] == {"turn_id": "t-1"}


def test_the_model_catalog_in_codexs_shape(server):
    plain = httpx.get(f"{server.url}/v1/models", timeout=30).json()
    assert "models" not in plain
    catalog = httpx.get(f"{server.url}/v1/models", params={"client_version": "0.169.0"},
                        timeout=30).json()
    assert [m["id"] for m in catalog["data"]] == [m["id"] for m in plain["data"]]
    (model, *_) = catalog["models"]
    # The fields Codex's catalog parser requires, and the served context (--max-total-tokens).
    for field in ("slug", "display_name", "supported_reasoning_levels", "shell_type",
                  "visibility", "supported_in_api", "priority", "support_verbosity",
                  "truncation_policy", "experimental_supported_tools", "base_instructions"):
        assert field in model, field
    assert model["context_window"] == 512
    assert model["supported_reasoning_levels"] == []
    assert model["truncation_policy"]["mode"] in ("tokens", "bytes")
