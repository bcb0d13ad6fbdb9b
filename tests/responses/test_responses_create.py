"""`POST /v1/responses` through the `openai` SDK against the session's live server.

The answer is checked against independent references: the chat route on the
same messages (same template, same engine) and transformers' greedy decoding
of the chat-templated prompt; logprobs against the chat route's; a
`json_schema` answer against the schema with `jsonschema`; the stream's
events against OpenAI's documented order, with every id the stream names
equal to the one in the final object.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

QUESTION = "Name three rivers of Europe."
SYSTEM = "You answer in one line."


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", timeout=120, max_retries=0)


def _chat_text(client, messages, n=12) -> str:
    done = client.chat.completions.create(model="tgi", messages=messages, max_tokens=n,
                                          temperature=0)
    return done.choices[0].message.content


def test_a_string_input_is_one_user_message(client):
    r = client.responses.create(model="tgi", input=QUESTION, max_output_tokens=12,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "incomplete"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.output_text == _chat_text(client, [{"role": "user", "content": QUESTION}])
    assert r.usage.output_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # Request fields are echoed.
    assert r.max_output_tokens == 12 and r.temperature == 0 and r.store is True
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is True


def test_items_and_instructions_make_the_chat_messages(client):
    items = [{"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
             {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    r = client.responses.create(model="tgi", input=items, instructions=SYSTEM,
                                max_output_tokens=12, temperature=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": QUESTION}]
    assert r.output_text == _chat_text(client, messages)
    assert r.instructions == SYSTEM


def test_greedy_text_equals_transformers_on_the_templated_prompt(client, default_model_path):
    tok = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, torch_dtype=torch.float32)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:]
    want = tok.decode(out, skip_special_tokens=True)
    r = client.responses.create(model="tgi", input=QUESTION, instructions=SYSTEM,
                                max_output_tokens=10, temperature=0)
    assert r.output_text == want
    assert r.usage.input_tokens == ids.shape[1]


def test_logprobs_equal_the_chat_routes(client):
    r = client.responses.create(model="tgi", input=QUESTION, max_output_tokens=6,
                                temperature=0, top_logprobs=3,
                                include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(
        model="tgi", messages=[{"role": "user", "content": QUESTION}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3)
    got = r.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(g.token, g.logprob, g.bytes) for g in got] == \
           [(w.token, w.logprob, w.bytes) for w in want]
    assert [[(t.token, t.logprob) for t in g.top_logprobs] for g in got] == \
           [[(t.token, t.logprob) for t in w.top_logprobs] for w in want]


def test_the_stream_follows_openais_event_order_with_the_final_objects_ids(client, server):
    frames = []
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=120, json={
            "model": "tgi", "input": QUESTION, "max_output_tokens": 8, "temperature": 0,
            "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == event
                frames.append(data)
    types = [f["type"] for f in frames]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [f["sequence_number"] for f in frames] == list(range(len(frames)))
    final = frames[-1]["response"]
    item = final["output"][0]
    for f in frames[2:-1]:
        assert f.get("item_id", f.get("item", {}).get("id")) == item["id"]
        assert f["output_index"] == 0
    text = "".join(f["delta"] for f in frames if f["type"] == "response.output_text.delta")
    assert text == item["content"][0]["text"] == frames[-4]["text"]
    assert frames[0]["response"]["id"] == final["id"]
    stored = client.responses.retrieve(final["id"])
    assert stored.output[0].id == item["id"] and stored.output_text == text
    assert text == _chat_text(client, [{"role": "user", "content": QUESTION}], 8)


def test_a_stored_stream_is_replayed_after_a_sequence_number(client, server):
    with client.responses.stream(model="tgi", input=QUESTION, max_output_tokens=5,
                                 temperature=0) as s:
        sent = [e for e in s]
    rid = sent[0].response.id
    replay = list(client.responses.retrieve(rid, stream=True, starting_after=3))
    assert [e.sequence_number for e in replay] == list(range(4, len(sent)))
    assert [e.type for e in replay] == [e.type for e in sent[4:]]


def test_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"river": {"type": "string", "maxLength": 12},
                                               "km": {"type": "integer", "minimum": 1}},
              "required": ["river", "km"], "additionalProperties": False}
    r = client.responses.create(
        model="tgi", input=QUESTION, max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "river", "schema": schema,
                         "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_store_false_is_not_retrievable_and_delete_forgets(client):
    r = client.responses.create(model="tgi", input="a", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(r.id)
    assert r.id in err.value.body["message"]
    kept = client.responses.create(model="tgi", input="b", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).id == kept.id
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)


def test_input_items_are_listed_and_paged(client):
    items = [{"role": "user", "content": f"line {i}"} for i in range(5)]
    r = client.responses.create(model="tgi", input=items, max_output_tokens=2)
    every = client.responses.input_items.list(r.id, order="asc", limit=100)
    assert [i.content[0].text for i in every.data] == [f"line {i}" for i in range(5)]
    assert all(i.id.startswith("msg_") for i in every.data)
    page = client.responses.input_items.list(r.id, limit=2)  # newest first
    assert [i.content[0].text for i in page.data] == ["line 4", "line 3"]
    assert page.has_more and page.last_id == page.data[-1].id
    rest = client.responses.input_items.list(r.id, limit=10, after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["line 2", "line 1", "line 0"]
    assert not rest.has_more


def test_input_tokens_count_the_prompt(client):
    counted = client.responses.input_tokens.count(model="tgi", input=QUESTION,
                                                  instructions=SYSTEM)
    r = client.responses.create(model="tgi", input=QUESTION, instructions=SYSTEM,
                                max_output_tokens=1)
    assert counted.input_tokens == r.usage.input_tokens


def _requests(server, key: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((key + "{", key + " ")))


def test_responses_requests_are_counted_and_timed_as_generation_requests(client, server):
    count = _requests(server, "tgi_request_count")
    tokens = _requests(server, "tgi_request_generated_tokens_sum")
    client.responses.create(model="tgi", input="count me", max_output_tokens=3)
    assert _requests(server, "tgi_request_count") == count + 1
    assert _requests(server, "tgi_request_generated_tokens_sum") == tokens + 3
