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
