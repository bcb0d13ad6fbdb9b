"""Length and count bounds (switchyard_engine.ebnf_bounds) against xgrammar's own grammar
and `jsonschema`, and constrained generation with them from a tiny random model.

xgrammar 0.2.8 writes `maxLength`/`maxItems` as bounded repetitions that cost
milliseconds per token mask; the rewrite must accept the same JSON values. It
differs from xgrammar's grammar on purpose in one way: a bounded string takes
JSON's characters (escapes counted as one character, no raw control
characters), as a JSON reader and `jsonschema` count them.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from switchyard.constraints import (
    MAX_BOUND_RULES,
    ConstraintError,
    response_format_constraint,
    schema_constraint,
    tgi_constraint,
)
from switchyard_engine.ebnf_bounds import chain_rules
from switchyard_engine.grammar import GrammarSupport
from switchyard_engine.grammar_text import json_schema_ebnf
from switchyard_engine.sampling import RowSampler, sample
from switchyard.errors import ApiError
from switchyard_spec import (
    Constraint,
    ConstraintKind,
    EngineRequest,
    SamplingParams,
    StoppingParams,
)

STRING_BOUNDS = [(0, 0), (0, 1), (0, 5), (2, 5), (4, 4), (3, None), (1, None)]
ALPHABET = ["a", "Z", "7", " ", "é", "€", "😀", "\t", "\n", "\x1b", "\x7f", '"', "\\", "/"]


def _canonical(schema: dict) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def _grammars(compiler, schema: dict):
    """(xgrammar's own grammar, the rewritten one), compiled."""
    spec = _canonical(schema)
    original = str(xgr.Grammar.from_json_schema(spec, any_whitespace=False,
                                                separators=(",", ":"), strict_mode=False))
    rewritten = json_schema_ebnf(spec)
    # no bounded repetition before a literal is left (plain stars are)
    assert set(re.findall(r'\{(\d+), (-?\d+)\} "', rewritten)) <= {("0", "-1")}
    return compiler.compile_grammar(original), compiler.compile_grammar(rewritten)


def _accepts(compiled, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return bool(matcher.accept_string(text)) and bool(matcher.is_completed())


def _string_texts(rng: random.Random, top: int) -> list[str]:
    """JSON texts around a bound: valid strings written with and without escapes, and
    raw texts JSON forbids (control characters, a lone backslash)."""
    texts = []
    for _ in range(120):
        value = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, top + 2)))
        texts.append(json.dumps(value, ensure_ascii=rng.random() < 0.3))
        texts.append('"' + value + '"')
    texts += ['"\\ud83d\\ude00"', '"\\u00e9"', '"\\uD800"', '"\\x"', '"\\u12"', '""']
    return texts


def _valid(schema: dict, text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(schema).is_valid(value)


@pytest.mark.parametrize(("low", "high"), STRING_BOUNDS)
def test_bounded_strings_accept_what_xgrammar_and_jsonschema_do(compiler, low, high):
    schema: dict = {"type": "string"}
    if low:
        schema["minLength"] = low
    if high is not None:
        schema["maxLength"] = high
    original, rewritten = _grammars(compiler, schema)
    rng = random.Random(low * 100 + (high or 0))
    checked = 0
    for text in _string_texts(rng, max(low, high or 0)):
        got = _accepts(rewritten, text)
        surrogate = "\\ud" in text.lower()
        # jsonschema counts a decoded surrogate pair as one character; the grammar takes
        # no surrogate escapes at all (such a character is written as itself).
        assert got == (_valid(schema, text) and not surrogate), text
        if "\\" not in text and not any(ord(c) < 0x20 for c in text):
            assert got == _accepts(original, text), text  # same language as xgrammar's
            checked += 1
    assert checked > 50


@pytest.mark.parametrize(("low", "high"), [(0, 3), (2, 4), (3, 3), (2, None)])
def test_bounded_arrays_and_objects_accept_what_xgrammar_does(compiler, low, high):
    arrays: dict = {"type": "array", "items": {"type": "integer"}, "minItems": low}
    objects: dict = {"type": "object", "minProperties": low,
                     "additionalProperties": {"type": "integer"}}
    if high is not None:
        arrays["maxItems"] = high
        objects["maxProperties"] = high
    rng = random.Random(low)
    for schema, make in ((arrays, lambda n: [rng.randint(-9, 99) for _ in range(n)]),
                         (objects, lambda n: {f"k{i}": i for i in range(n)})):
        original, rewritten = _grammars(compiler, schema)
        for n in range((high or low) + 3):
            text = json.dumps(make(n), separators=(",", ":"))
            expected = _valid(schema, text)
            assert _accepts(rewritten, text) == expected == _accepts(original, text), text
        assert not _accepts(rewritten, "[1, 2]" if schema is arrays else '{"a":1 }')


def test_equal_bounds_share_one_chain_and_are_counted():
    two = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 7},
                                            "b": {"type": "string", "maxLength": 7},
                                            "c": {"type": "array", "maxItems": 3,
                                                  "minItems": 1}},
           "required": ["a", "b", "c"], "additionalProperties": False}
    # a and b share one chain; xgrammar writes the first item outside the repetition
    assert chain_rules(json_schema_ebnf(_canonical(two))) == 7 + 2
    assert chain_rules(json_schema_ebnf(_canonical({"type": "string", "minLength": 5}))) == 5
    assert chain_rules(json_schema_ebnf(_canonical({"type": "string"}))) == 0


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": MAX_BOUND_RULES + 1},
    {"type": "string", "minLength": 10**9},  # xgrammar alone would exhaust memory on it
    {"type": "object", "properties": {"a": {"type": "array", "maxItems": 10**6}}},
    {"type": "array", "maxItems": 200, "items": {"type": "string", "maxLength": 100}},
])
def test_oversized_bounds_are_refused_in_each_route_format(schema):
    with pytest.raises(ConstraintError, match=str(MAX_BOUND_RULES)):
        schema_constraint(schema)
    with pytest.raises(ApiError) as tgi:
        tgi_constraint("json", schema)
    assert tgi.value.status == 422 and "grammar is not valid" in tgi.value.message
    with pytest.raises(ApiError) as openai:
        response_format_constraint("json_schema", {"name": "x", "schema": schema}, None)
    assert openai.value.status == 422 and openai.value.param == "response_format"


def test_largest_allowed_bound_compiles():
    constraint = schema_constraint({"type": "string", "maxLength": MAX_BOUND_RULES})
    assert chain_rules(json_schema_ebnf(constraint.spec)) == MAX_BOUND_RULES


@pytest.fixture(scope="module")
def model(default_model_path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(default_model_path)).eval()


GENERATED = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 2, "maxLength": 6},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1,
             "maxItems": 3}}, "required": ["name", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_generation_from_a_random_model_validates(tokenizer, model, temperature):
    """The tiny random model's own logits, masked by the rewritten grammar, sampled at
    several temperatures: every output parses and validates."""
    vocab = model.config.vocab_size
    support = GrammarSupport(tokenizer, vocab)
    eos = tokenizer.eos_token_id
    constraint = Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=_canonical(GENERATED))
    for seed in (1, 2):
        params = SamplingParams(do_sample=True, temperature=temperature, seed=seed)
        request = EngineRequest(request_id="r", prompt_token_ids=(1, 5, 6), sampling=params,
                                stopping=StoppingParams(max_new_tokens=80,
                                                        eos_token_ids=(eos,)),
                                constraint=constraint)
        row = RowSampler(params, (1, 5, 6), vocab, seed=seed)
        row.grammar = support.start(request)
        ids = [1, 5, 6]
        out: list[int] = []
        with torch.no_grad():
            for _ in range(80):
                logits = model(torch.tensor([ids])).logits[:, -1].float()
                assert support.apply(logits, [row]) == [None]
                (tok,) = sample(logits, [row])
                row.record(tok.token_id)
                ids.append(tok.token_id)
                out.append(tok.token_id)
                if row.grammar.terminated:
                    break
        assert row.grammar.terminated and out[-1] == eos, tokenizer.decode(out)
        value = json.loads(tokenizer.decode(out[:-1]))
        jsonschema.validate(value, GENERATED)
    support.shutdown()
