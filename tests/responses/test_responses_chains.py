"""Stored conversations: `previous_response_id` chains, forks, background runs, tool round trips.

A chained turn must see every earlier item (messages, function calls and
their outputs) and must extend the earlier turn's tokens, so the prefix
cache serves them: `usage.input_tokens_details.cached_tokens` is checked
against the earlier prompt's length in whole cache blocks, read from the
server's own `/metrics`. What a turn saw is checked through the chat route
on the same messages (an independent rendering of the same conversation).
"""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest

from tests.support.abandoned import MAX_NEW, decode_steps, sequences_in_engine, wait_until_idle
from tests.support.waiting import eventually

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Forecast",
        "parameters": WEATHER, "strict": True}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", timeout=120, max_retries=0)


def _block_size(server) -> int:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return int(re.search(r'switchyard_cache_config_info\{[^}]*block_size="(\d+)"', text)[1])


def _chat(client, messages, n):
    return client.chat.completions.create(model="tgi", messages=messages, max_tokens=n,
                                          temperature=0).choices[0].message.content


def test_a_three_turn_chain_sees_every_turn_and_hits_the_prefix_cache(client, server):
    block = _block_size(server)
    story = "the quick brown fox jumps over the lazy dog " * 4
    first = client.responses.create(model="tgi", input=f"Remember: {story}",
                                    max_output_tokens=6, temperature=0)
    second = client.responses.create(model="tgi", input="My name is John.",
                                     previous_response_id=first.id, max_output_tokens=6,
                                     temperature=0)
    third = client.responses.create(model="tgi", input="What is my name?",
                                    previous_response_id=second.id, max_output_tokens=6,
                                    temperature=0)
    messages = [{"role": "user", "content": f"Remember: {story}"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "My name is John."},
                {"role": "assistant", "content": second.output_text},
                {"role": "user", "content": "What is my name?"}]
    assert third.output_text == _chat(client, messages, 6)
    assert third.previous_response_id == second.id
    assert second.usage.input_tokens_details.cached_tokens >= \
        first.usage.input_tokens // block * block
    assert third.usage.input_tokens_details.cached_tokens >= \
        second.usage.input_tokens // block * block > 0


def test_instructions_are_not_carried_to_the_next_turn(client):
    first = client.responses.create(model="tgi", input="Hi", instructions="Be terse.",
                                    max_output_tokens=4, temperature=0)
    second = client.responses.create(model="tgi", input="More?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "More?"}]
    assert second.output_text == _chat(client, messages, 4)
    assert second.instructions is None


def test_two_forks_of_one_parent_do_not_see_each_other(client):
    parent = client.responses.create(model="tgi", input="Count with me.", max_output_tokens=4,
                                     temperature=0)
    a = client.responses.create(model="tgi", input="Fork A speaks first.",
                                previous_response_id=parent.id, max_output_tokens=4,
                                temperature=0)
    b = client.responses.create(model="tgi", input="Fork B.", previous_response_id=parent.id,
                                max_output_tokens=4, temperature=0)
    b_after_a = client.responses.create(model="tgi", input="Fork B, again.",
                                        previous_response_id=b.id, max_output_tokens=4,
                                        temperature=0)
    base = [{"role": "user", "content": "Count with me."},
            {"role": "assistant", "content": parent.output_text}]
    assert b.output_text == _chat(client, [*base, {"role": "user", "content": "Fork B."}], 4)
    assert b_after_a.output_text == _chat(client, [
        *base, {"role": "user", "content": "Fork B."},
        {"role": "assistant", "content": b.output_text},
        {"role": "user", "content": "Fork B, again."}], 4)
    assert a.usage.input_tokens != b.usage.input_tokens  # different inputs, same parent


def test_a_function_call_round_trip_through_previous_response_id(client):
    call_turn = client.responses.create(model="tgi", input="Weather in Rome?", tools=[TOOL],
                                        tool_choice="required", max_output_tokens=60,
                                        temperature=0)
    assert call_turn.status == "completed"
    calls = [o for o in call_turn.output if o.type == "function_call"]
    assert calls, call_turn.output
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answer = client.responses.create(
        model="tgi", previous_response_id=call_turn.id, tools=[TOOL], max_output_tokens=8,
        temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert answer.status in ("completed", "incomplete")
    # The same conversation on the chat route: the call and its output included.
    chat_tool = {"type": "function", "function": {k: v for k, v in TOOL.items()
                                                  if k != "type"}}
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": c.call_id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    chat = client.chat.completions.create(model="tgi", messages=messages, tools=[chat_tool],
                                          max_tokens=8, temperature=0)
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    listed = client.responses.input_items.list(answer.id)
    assert [i.type for i in listed.data] == ["function_call_output"]


def test_a_streamed_call_names_the_same_ids_as_the_final_object(client, server):
    with client.responses.stream(model="tgi", input="Weather in Oslo?", tools=[TOOL],
                                 tool_choice="required", max_output_tokens=60,
                                 temperature=0) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types
    assert "response.function_call_arguments.done" in types
    assert "response.output_text.delta" not in types
    (item,) = [o for o in final.output if o.type == "function_call"][:1]
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.id == item.id and added.item.call_id == item.call_id
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                   and e.item_id == item.id)
    assert args == item.arguments
    assert client.responses.retrieve(final.id).output[0].id == item.id


def test_background_is_queued_polled_and_completes(client):
    r = client.responses.create(model="tgi", input="Go on.", background=True,
                                max_output_tokens=6, temperature=0)
    assert r.status in ("queued", "in_progress") and r.background is True
    deadline = time.monotonic() + 60
    while (got := client.responses.retrieve(r.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)  # polling a background response is what this test exercises
    assert got.status == "incomplete" and got.usage.output_tokens == 6
    assert got.output_text == _chat(client, [{"role": "user", "content": "Go on."}], 6)
    replay = list(client.responses.retrieve(r.id, stream=True))
    assert [e.type for e in replay[:3]] == ["response.created", "response.queued",
                                            "response.in_progress"]
    assert replay[-1].type == "response.incomplete"


def test_cancel_stops_a_background_response_and_it_stays_cancelled(client, server):
    """`cancel` aborts the engine sequence: the engine goes idle after fewer decode steps
    than the response's tokens take, and the response stays `cancelled`."""
    model = "switchyard/tiny-llama-random"
    steps = decode_steps(server, model)
    r = client.responses.create(model="tgi", input="Write forever.", background=True,
                                max_output_tokens=MAX_NEW, temperature=0)
    # Cancelled while its sequence runs (an event, not a guessed time: a fast machine
    # decodes MAX_NEW tokens of the tiny model in a fraction of a second).
    eventually(lambda: sequences_in_engine(server, model) >= 1, interval=0.01,
               what="the background response's sequence in the engine")
    done = client.responses.cancel(r.id)
    assert done.status == "cancelled"
    wait_until_idle(server, model, steps)
    assert client.responses.retrieve(r.id).status == "cancelled"
    sync = client.responses.create(model="tgi", input="x", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(sync.id)
    assert "synchronous" in err.value.body["message"]


def test_a_background_stream_resumes_after_a_sequence_number(client):
    r = client.responses.create(model="tgi", input="Hello", background=True,
                                max_output_tokens=6, temperature=0)
    events = list(client.responses.retrieve(r.id, stream=True, starting_after=2))
    assert events[0].sequence_number == 3
    assert events[-1].type == "response.incomplete"
