"""Bad Responses requests get OpenAI's 4xx error objects naming the field, never a 5xx.

Each case changes one field of a valid request; the `openai` SDK must raise
the 4xx class OpenAI would (`BadRequestError`, `NotFoundError`) and the
error's `param` must name the field the client sent, in the Responses API's
names (`max_output_tokens`, `text.format`, `input[1].call_id`), not chat's.
"""

from __future__ import annotations

import httpx
import openai
import pytest

VALID = {"model": "tgi", "input": "hi", "max_output_tokens": 2}
FN = {"type": "function", "name": "f", "parameters": {"type": "object"}}
STRICT_BAD = {"type": "function", "name": "f", "strict": True,
              "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", timeout=120, max_retries=0)


# (fields changed in a valid request, the `param` the error names)
BAD = [
    ({"input": [{"type": "bogus"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": "a"},
                {"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     "input[1].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"tools": [{"type": "frobnicate"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name"),
    ({"tools": [FN, FN]}, "tools"),
    ({"tools": [STRICT_BAD]}, "tools"),
    ({"tools": [FN], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}},
     "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10_000}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"include": ["message.output_text.logprobs"], "tools": [FN]}, "include"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"background": True, "store": False}, "background"),
    ({"max_tool_calls": 0, "tools": [FN]}, "max_tool_calls"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"input": "word " * 600}, "input"),
]


@pytest.mark.parametrize(("change", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_fields_are_bad_request_errors_naming_the_field(client, change, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**VALID, extra_body=change)
    body = err.value.body
    assert body["type"] == "invalid_request_error", body
    assert body["param"] == param, body


def test_a_context_overflow_names_the_limit_in_the_responses_words(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**{**VALID, "max_output_tokens": 10_000})
    assert err.value.body["code"] == "context_length_exceeded"
    assert "'max_output_tokens'" in err.value.body["message"]


def test_truncation_auto_drops_the_oldest_items_until_the_input_fits(client):
    old = [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]
    r = client.responses.create(model="tgi", input=[*old, {"role": "user", "content": "hi"}],
                                truncation="auto", max_output_tokens=2, temperature=0)
    alone = client.responses.create(model="tgi", input=[*old[1:], {"role": "user",
                                                                    "content": "hi"}],
                                    max_output_tokens=2, temperature=0)
    assert r.usage.input_tokens == alone.usage.input_tokens
    assert r.truncation == "auto"


def test_unknown_ids_are_not_found_errors_naming_them(client):
    for call in (lambda: client.responses.retrieve("resp_nope"),
                 lambda: client.responses.cancel("resp_nope"),
                 lambda: client.responses.delete("resp_nope"),
                 lambda: client.responses.input_items.list("resp_nope")):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert "resp_nope" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(**VALID, previous_response_id="resp_gone")
    assert err.value.body["param"] == "previous_response_id"


def test_an_unknown_model_and_an_unknown_field_are_refused(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(**{**VALID, "model": "no-such-model"})
    assert err.value.body["code"] == "model_not_found"
    r = httpx.post(f"{server.url}/v1/responses", json={**VALID, "shoe_size": 9}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "shoe_size"
    r = httpx.post(f"{server.url}/v1/responses", content=b"{", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param",
                                                                "code"}


def test_bad_query_parameters_of_stored_responses_are_bad_requests(client):
    r = client.responses.create(**VALID)
    for kwargs, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                          ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.input_items.list(r.id, **kwargs)
        assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.retrieve(r.id, stream=True)  # not streamed: no events kept
    assert err.value.body["param"] == "stream"
