"""Constrained decoding end to end: TGI's `grammar` and OpenAI's `response_format`.

The default model has random weights, so its free text is noise: whatever
parses and validates here does so because the grammar held the engine to it.
Outputs are checked with `jsonschema` (an independent validator) and `re`.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from openai import OpenAI
from text_generation import Client
from text_generation.errors import ValidationError
from text_generation.types import Grammar, GrammarType

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{3}-\d{2,4}"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tgi_json_grammar_output_validates(server, seed):
    out = Client(server.url, timeout=120).generate(
        "hello", max_new_tokens=60, do_sample=True, temperature=1.5, seed=seed,
        grammar=Grammar(type=GrammarType.Json, value=SCHEMA))
    jsonschema.validate(json.loads(out.generated_text), SCHEMA)
    assert out.details.finish_reason == "eos_token"


def test_tgi_regex_grammar_streamed_output_fullmatches(server):
    client = Client(server.url, timeout=120)
    text = "".join(r.token.text for r in client.generate_stream(
        "hello", max_new_tokens=20, grammar=Grammar(type=GrammarType.Regex, value=REGEX))
        if not r.token.special)
    assert re.fullmatch(REGEX, text), text


def test_tgi_grammar_json_string_and_json_schema_forms(server):
    for grammar in ({"type": "json", "value": json.dumps(SCHEMA)},
                    {"type": "json_schema", "value": {"name": "p", "schema": SCHEMA}}):
        r = httpx.post(f"{server.url}/generate", json={
            "inputs": "x", "parameters": {"max_new_tokens": 60, "grammar": grammar}}, timeout=60)
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["generated_text"]), SCHEMA)


@pytest.mark.parametrize("grammar, words", [
    ({"type": "json", "value": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"type": "json", "value": {"type": "string", "pattern": "a+", "minLength": 2}},
     "minLength"),
    ({"type": "json", "value": {"type": "strin"}}, "grammar is not valid"),
    ({"type": "json", "value": "{not json"}, "not valid JSON"),
    ({"type": "regex", "value": "a(b"}, "regular expression"),
])
def test_tgi_bad_grammars_are_422_validation(server, grammar, words):
    r = httpx.post(f"{server.url}/generate", json={
        "inputs": "x", "parameters": {"max_new_tokens": 5, "grammar": grammar}}, timeout=60)
    assert r.status_code == 422
    body = r.json()
    assert body["error_type"] == "validation"
    assert body["error"].startswith("Input validation error: grammar is not valid: ")
    assert words in body["error"]
    with pytest.raises(ValidationError):
        Client(server.url, timeout=60).generate(
            "x", max_new_tokens=5, grammar=Grammar(type=GrammarType.Json,
                                                   value={"type": "array", "uniqueItems": True}))


def test_openai_json_schema_response_format(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="-")
    for stream in (False, True):
        kwargs = dict(model="tgi", messages=[{"role": "user", "content": "a person"}],
                      max_tokens=60, seed=5, response_format={
                          "type": "json_schema",
                          "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = client.chat.completions.create(**kwargs)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        jsonschema.validate(json.loads(text), SCHEMA)
        assert finish == "stop"


def test_openai_json_object_and_errors(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="-")
    r = client.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # the budget ran out inside the object: a prefix of one
        assert r.choices[0].message.content.startswith("{")
    loose = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "n", "schema": loose, "strict": True}}},
        timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "response_format"
    assert "additionalProperties" in err["message"]


# A model that keeps writing digits: every JSON number the grammar admits is bounded
# (switchyard_engine.number_bounds), so the value, and the JSON, must close.
NUMBERS = {"type": "object", "properties": {"population": {"type": "integer"},
                                            "area": {"type": "number"}},
           "required": ["population", "area"], "additionalProperties": False}


@pytest.fixture(scope="module")
def one_token(default_model_path) -> str:
    """The default model's token for the digit "1", as `logit_bias` names it."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(default_model_path))
    (token,) = tokenizer.encode("1", add_special_tokens=False)
    return str(token)


def test_a_digit_biased_model_closes_its_numbers_and_stops(server, one_token):
    """`logit_bias` makes "1" win wherever the grammar allows it: the integer ends at int64's
    19 digits, the number at 16 integer (20 fraction, 3 exponent) digits, and the reply is
    JSON that validates, with `stop`, long before `max_tokens`. Cut short, the same reply
    is `length`."""
    client = OpenAI(base_url=f"{server.url}/v1", api_key="-")
    kwargs = dict(model="tgi", messages=[{"role": "user", "content": "a city"}], temperature=0,
                  logit_bias={one_token: 100}, response_format={
                      "type": "json_schema",
                      "json_schema": {"name": "city", "schema": NUMBERS, "strict": True}})
    r = client.chat.completions.create(max_tokens=300, **kwargs)
    text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop", text
    value = json.loads(text)
    jsonschema.validate(value, NUMBERS)
    assert value["population"] == 1111111111111111111  # 19 ones: below 9223372036854775807
    # 16 integer digits, then (as the model likes) 20 fraction digits, 3 exponent digits
    assert re.fullmatch(r'\{"area":1{16}(\.1{20})?([eE][+-]?1{3})?,"population":1{19}\}',
                        text), text
    assert r.usage.completion_tokens < 300

    r = client.chat.completions.create(max_tokens=12, **kwargs)
    cut = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert text.startswith(cut) and cut.startswith('{"area":1'), cut


def test_a_digit_biased_tool_call_closes_its_arguments(server, one_token):
    """The same in a tool call's arguments: the integer closes, the call is whole."""
    args = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
            "additionalProperties": False}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "count"}], "max_tokens": 200,
        "temperature": 0, "logit_bias": {one_token: 100}, "tool_choice": "required",
        "parallel_tool_calls": False,
        "tools": [{"type": "function", "function": {"name": "count", "parameters": args}}]},
        timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "count"
    assert json.loads(call["function"]["arguments"]) == {"n": 1111111111111111111}
