"""Bounded numbers (switchyard_engine.number_bounds): every JSON number a constrained
grammar admits ends, so a model that keeps taking digit tokens is made to close it.

Each text is checked twice: by xgrammar's matcher, and token by token through the
token masks (the tokens a model would have to take), with both required to agree:
the rewritten rules tell xgrammar where digits end (a lookahead), and a wrong one
would show as a mask that refuses what the grammar accepts. Expected answers come
from `jsonschema` and Python's `json`, not from the grammar.

Tiny tokenizer: the default model's byte-level BPE (2,048 tokens; it has multi-digit
tokens such as "00", "10", "9999", and "e"-words such as "exp").
"""

from __future__ import annotations

import json
import math
import random
import re
import struct

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from switchyard.constraints import (  # noqa: E402
    ConstraintError,
    response_format_constraint,
    schema_constraint,
    tool_function,
    tools_constraint,
)
from switchyard_engine.grammar import (  # noqa: E402
    GrammarSupport,
    compile_grammar,
    json_schema_ebnf,
)
from switchyard_engine.number_bounds import (  # noqa: E402
    INTEGER_MAX,
    INTEGER_MIN,
    NUMBER_EXPONENT_DIGITS,
    NUMBER_FRACTION_DIGITS,
    NUMBER_INTEGER_DIGITS,
    bounded_schema,
)
from switchyard_engine.sampling import RowSampler, sample  # noqa: E402
from switchyard.errors import ApiError  # noqa: E402
from switchyard.tools.calls import HERMES  # noqa: E402
from switchyard_spec import (  # noqa: E402
    Constraint,
    ConstraintKind,
    EngineRequest,
    SamplingParams,
    StoppingParams,
)

CITY = {"type": "object", "properties": {"city": {"type": "string"},
                                         "country": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["city", "country", "population"], "additionalProperties": False}
"""The schema whose `population` ran to max_tokens on a real model."""


@pytest.fixture(scope="module")
def pieces(tokenizer):
    """Each ASCII token's text and id (for random splits of a text into tokens)."""
    out: dict[str, int] = {}
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        if text and text.isascii() and i not in tokenizer.all_special_ids:
            out.setdefault(text, i)
    return out


def _canonical(schema: dict) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def _schema(compiler, schema: dict):
    constraint = schema_constraint(schema)  # the gateway's checks pass first
    return compile_grammar(compiler, constraint)


def _split(text: str, pieces: dict[str, int], rng: random.Random) -> list[int]:
    """``text`` as a random sequence of tokens that spells it (long tokens preferred, so
    multi-digit tokens cross the places where digits must end)."""
    out, i = [], 0
    while i < len(text):
        options = [p for p in (text[i:i + n] for n in range(1, 12)) if p in pieces]
        choice = max(options, key=len) if rng.random() < 0.5 else rng.choice(options)
        out.append(pieces[choice])
        i += len(choice)
    return out


def _allowed(compiled, vocab: int, tokens: list[int]) -> bool:
    """Whether every token is allowed by the mask in turn and the grammar is then complete;
    the mask and the matcher must agree at every token."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for token in tokens:
        matcher.fill_next_token_bitmask(bitmask)
        masked_in = bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)
        accepted = bool(matcher.accept_token(token))
        assert masked_in == accepted, (tokens, token)
        if not accepted:
            return False
    return bool(matcher.is_completed())


def _accepts(compiled, text: str, tokenizer, pieces, seed: int = 0) -> bool:
    """Whether the grammar takes ``text``: by the matcher, by the masks along the
    tokenizer's own split and along random splits, all agreeing."""
    matcher = xgr.GrammarMatcher(compiled)
    expected = bool(matcher.accept_string(text)) and bool(matcher.is_completed())
    vocab = len(tokenizer)
    assert _allowed(compiled, vocab, tokenizer.encode(text, add_special_tokens=False)) \
        == expected, text
    rng = random.Random(seed)
    for _ in range(3):
        assert _allowed(compiled, vocab, _split(text, pieces, rng)) == expected, text
    return expected


def _valid(schema: dict, text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(schema).is_valid(value)


# ---------------------------------------------------------------- integers

INT64_EDGES = [str(INTEGER_MAX), str(INTEGER_MIN), str(INTEGER_MAX - 1), str(INTEGER_MIN + 1),
               str(INTEGER_MAX + 1), str(INTEGER_MIN - 1), "9" * 19, "-" + "9" * 19,
               "1" * 19, "-" + "1" * 19, "1" * 18, "12345678901234567890", "1" + "0" * 19,
               "0", "-0", "00", "01", "7", "-7", "10", "9999", "-10000", "1.0", "1e3"]


@pytest.mark.parametrize("schema", [
    {"type": "integer"},
    CITY,
    {"type": "array", "items": {"type": "integer"}},
    {"$defs": {"n": {"type": "integer"}}, "type": "object",
     "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"]},
    {"type": ["integer", "null"]},
    {"anyOf": [{"type": "integer"}, {"type": "string"}]},
])
def test_integers_take_int64_exactly(compiler, tokenizer, pieces, schema):
    """int64's extremes are taken, one past them and 20 digits are not, wherever the
    schema puts its integer (xgrammar writes some of them inline, not as `basic_integer`)."""
    compiled = _schema(compiler, schema)

    def wrap(value: str) -> tuple[str, object]:
        if schema is CITY:
            return '{"city":"Oslo","country":"Norway","population":' + value + "}", value
        if schema.get("type") == "array":
            return f"[{value},3,{value}]", value
        if "$defs" in schema:
            return '{"n":' + value + "}", value
        return value, value

    for value in INT64_EDGES:
        text, _ = wrap(value)
        # JSON's integers ("-0" too is one, but the grammar writes 0 only one way)
        in_range = re.fullmatch(r"0|-?[1-9][0-9]*", value) is not None and \
            INTEGER_MIN <= int(value) <= INTEGER_MAX
        assert _accepts(compiled, text, tokenizer, pieces) == in_range, text
        if in_range:
            assert _valid(schema, text)
    assert not _accepts(compiled, wrap("1" * 20)[0], tokenizer, pieces)  # 20 digits


INTEGER_RANGES = [
    {"minimum": 0},
    {"maximum": 0},
    {"exclusiveMinimum": -3},
    {"minimum": -12, "maximum": -3},
    {"minimum": 0, "maximum": 120},
    {"minimum": 0.5, "maximum": 10.5},
    {"exclusiveMinimum": 2.5, "exclusiveMaximum": 1e30},
    {"minimum": -1e30, "maximum": 1e30},
    {"minimum": 1000, "exclusiveMaximum": 1000000},
    {"minimum": 5, "exclusiveMinimum": 5},
    {"maximum": 99999, "exclusiveMaximum": 1e5},
    {"minimum": 3, "maximum": 3},
    {"minimum": 9223372036854775000},
    {"maximum": -9223372036854775000},
]


def _edges(bounds: dict, rng: random.Random) -> list[int]:
    """Integers around every bound, int64's ends and random magnitudes."""
    values = {0, 1, -1, INTEGER_MAX, INTEGER_MIN, INTEGER_MAX + 1, INTEGER_MIN - 1, 10**19,
              -(10**19), 10**20}
    for bound in bounds.values():
        for base in (math.floor(bound), math.ceil(bound)):
            if abs(base) < 10**25:
                values.update(base + d for d in range(-2, 3))
    for digits in range(1, 21):
        values.add(rng.randrange(10 ** (digits - 1), 10**digits) * rng.choice((1, -1)))
    return sorted(values)


@pytest.mark.parametrize("bounds", INTEGER_RANGES)
def test_integer_bounds_are_enforced_exactly_within_int64(compiler, tokenizer, pieces, bounds):
    """A bounded integer takes exactly the schema's integers that int64 holds (xgrammar writes
    the range digit by digit, the open side closed at int64's end), so never a valid
    in-range value is refused and the digits are bounded by the bounds' magnitude."""
    schema = {"type": "integer", **bounds}
    compiled = _schema(compiler, schema)
    rng = random.Random(str(bounds))
    for value in _edges(bounds, rng):
        expected = _valid(schema, str(value)) and INTEGER_MIN <= value <= INTEGER_MAX
        assert _accepts(compiled, str(value), tokenizer, pieces, seed=value % 97) == expected, \
            (bounds, value)


def test_digits_follow_the_bounds_magnitude():
    """The longest integer a bounded schema's grammar admits has the digits of its bound."""
    ebnf = json_schema_ebnf(_canonical({"type": "integer", "minimum": 0, "maximum": 120}))
    assert "json_digits" not in ebnf  # three digits at most, written out by xgrammar
    closed = bounded_schema({"type": "integer", "exclusiveMaximum": 1e30, "minimum": 0.5})
    assert closed == {"type": "integer", "minimum": 1, "maximum": INTEGER_MAX}
    nested = bounded_schema({"type": "object", "properties": {
        "a": {"type": "integer", "maximum": 7}, "b": {"type": "number", "minimum": 2}},
        "$defs": {"c": {"type": ["integer", "number"], "exclusiveMinimum": 0}}})
    assert nested["properties"]["a"] == {"type": "integer", "minimum": INTEGER_MIN,
                                         "maximum": 7}
    assert nested["properties"]["b"] == {"type": "number", "minimum": 2,
                                         "exclusiveMaximum": 1e16}
    assert nested["$defs"]["c"] == {"type": ["number"], "exclusiveMinimum": 0,
                                    "exclusiveMaximum": 1e16}


@pytest.mark.parametrize("schema, words", [
    ({"type": "integer", "minimum": 1e19}, "no integer from -9223372036854775808"),
    ({"type": "integer", "maximum": -1e20}, "no integer"),
    ({"type": "integer", "minimum": 0.2, "maximum": 0.8}, "no integer"),
    ({"type": "object", "properties": {"a": {"type": "integer", "exclusiveMinimum": 4,
                                             "exclusiveMaximum": 5}}}, "#/properties/a"),
    ({"type": "number", "minimum": 1e16}, "16 integer digits"),
    ({"type": "number", "minimum": 2, "exclusiveMaximum": 2}, "no number"),
])
def test_empty_ranges_are_refused_in_each_route_format(schema, words):
    with pytest.raises(ConstraintError, match=re.escape(words)):
        schema_constraint(schema)
    with pytest.raises(ApiError) as openai:
        response_format_constraint("json_schema", {"name": "x", "schema": schema}, None)
    assert openai.value.status == 422 and openai.value.param == "response_format"


# ---------------------------------------------------------------- numbers

def _number_texts(rng: random.Random) -> list[str]:
    texts = ["0", "-0", "0.0", "1e5", "1E+05", "-2.5e-3", "1e308", "5e-324", "1.5e999",
             "1e0000", "1e-1000", "12.", ".5", "01", "1.e3", "-", "1e", "+1",
             "9" * NUMBER_INTEGER_DIGITS, "9" * (NUMBER_INTEGER_DIGITS + 1),
             "-" + "9" * NUMBER_INTEGER_DIGITS, "-" + "1" * (NUMBER_INTEGER_DIGITS + 1),
             "0." + "0" * NUMBER_FRACTION_DIGITS, "0." + "1" * (NUMBER_FRACTION_DIGITS + 1),
             "3." + "9" * NUMBER_FRACTION_DIGITS + "e-" + "9" * NUMBER_EXPONENT_DIGITS,
             "3e" + "1" * (NUMBER_EXPONENT_DIGITS + 1), "9999.0000", "100000000000e10"]
    for _ in range(40):  # random shapes around the bounds
        integer = str(rng.randint(1, 9)) + "".join(
            rng.choice("0123456789") for _ in range(rng.randint(0, NUMBER_INTEGER_DIGITS + 1)))
        text = rng.choice(["", "-"]) + integer
        if rng.random() < 0.6:
            text += "." + "".join(rng.choice("0123456789")
                                  for _ in range(rng.randint(1, NUMBER_FRACTION_DIGITS + 1)))
        if rng.random() < 0.5:
            text += rng.choice("eE") + rng.choice(["", "+", "-"]) + "".join(
                rng.choice("0123456789")
                for _ in range(rng.randint(1, NUMBER_EXPONENT_DIGITS + 1)))
        texts.append(text)
    return texts


def _number_expected(text: str) -> bool:
    """JSON's number syntax with the module's digit counts (worked out with `re`)."""
    match = re.fullmatch(r"-?(0|[1-9][0-9]*)(?:\.([0-9]+))?(?:[eE][+-]?([0-9]+))?", text)
    if not match:
        return False
    integer, fraction, exponent = match.groups()
    return (len(integer) <= NUMBER_INTEGER_DIGITS
            and len(fraction or "") <= NUMBER_FRACTION_DIGITS
            and len(exponent or "") <= NUMBER_EXPONENT_DIGITS)


@pytest.mark.parametrize("mode", ["number", "json_object", "untyped", "defs"])
def test_number_integer_fraction_and_exponent_digits_are_bounded(compiler, tokenizer, pieces,
                                                                  mode):
    if mode == "json_object":
        compiled = compile_grammar(compiler, Constraint(kind=ConstraintKind.JSON_OBJECT))
    elif mode == "untyped":
        compiled = _schema(compiler, {"type": "object", "properties": {"v": {}},
                                      "required": ["v"], "additionalProperties": False})
    elif mode == "defs":
        compiled = _schema(compiler, {"type": "object", "$defs": {"n": {"type": "number"}},
                                      "properties": {"v": {"type": "array",
                                                           "items": {"$ref": "#/$defs/n"}}},
                                      "required": ["v"], "additionalProperties": False})
    else:
        compiled = _schema(compiler, {"type": "number"})
    for i, number in enumerate(_number_texts(random.Random(7))):
        if mode == "number":
            text = number
        elif mode == "defs":
            text = '{"v":[' + number + ",1]}"
        else:
            text = '{"v":' + number + "}"
        expected = _number_expected(number)
        if expected:
            json.loads(text)  # JSON, as Python reads it
        assert _accepts(compiled, text, tokenizer, pieces, seed=i) == expected, text


def test_every_double_as_python_writes_it_is_a_number(compiler, tokenizer, pieces):
    """The digit counts are Python's: `json.dumps` of any finite double fits them."""
    compiled = _schema(compiler, {"type": "array", "items": {"type": "number"}})
    rng = random.Random(3)
    doubles = [5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 0.1 + 0.2, 1e16,
               9999999999999998.0, 1e-4, 0.00012345678901234567, 123456789.12345679, -0.0]
    while len(doubles) < 200:
        value = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        if math.isfinite(value):
            doubles.append(value)
    for i in range(0, len(doubles), 10):
        text = json.dumps(doubles[i:i + 10], separators=(",", ":"))
        assert _accepts(compiled, text, tokenizer, pieces, seed=i), text


@pytest.mark.parametrize("bounds", [
    {"minimum": 0}, {"exclusiveMaximum": 1.5}, {"minimum": -5.5, "maximum": 100},
    {"exclusiveMinimum": -1e300}, {"minimum": 0.25, "maximum": 1e300},
])
def test_bounded_numbers_close_at_16_integer_digits(compiler, tokenizer, pieces, bounds):
    """A number with a bound is xgrammar's range (at most 6 fraction digits, no exponent),
    its open or farther side closed at 1e16 (exclusive): 16 integer digits at most."""
    schema = {"type": "number", **bounds}
    compiled = _schema(compiler, schema)
    texts = ["0", "0.5", "1.25", "-0.000001", "99", "100", "100.5", "-5.5", "-5.6", "1.4999",
             "1.5", "9999999999999999", "9999999999999998.5", "10000000000000000",
             "-9999999999999998.25", "-10000000000000000", "123456.654321"]
    for i, text in enumerate(texts):
        closed = {**schema, "exclusiveMinimum": max(schema.get("exclusiveMinimum", -1e16),
                                                      -1e16),
                  "exclusiveMaximum": min(schema.get("exclusiveMaximum", 1e16), 1e16)}
        assert _accepts(compiled, text, tokenizer, pieces, seed=i) == _valid(closed, text), \
            (bounds, text)


# ---------------------------------------------------------------- the grammar's text

UNBOUNDED = re.compile(r"\[0-9\][*+]")


@pytest.mark.parametrize("schema", [
    CITY, {"type": "object"}, {}, {"type": "number"}, {"type": ["number", "integer", "null"]},
    {"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 0},
    {"type": "number", "minimum": 0}, {"type": "number", "exclusiveMaximum": 0},
    {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "number"}},
    {"type": "object", "additionalProperties": {"type": "number"}},
    {"$defs": {"a": {"type": "number"}, "b": {"type": "integer", "minimum": 1}},
     "anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}]},
])
def test_no_unbounded_digit_run_is_left(schema):
    """What the grammar says about digits, read off its text: every run is bounded."""
    ebnf = json_schema_ebnf(_canonical(schema))
    rules = dict(line.split(" ::= ", 1) for line in ebnf.splitlines())
    for name, body in rules.items():
        if body in ("(([0-9]))", '(("0"))'):
            continue
        bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', body)
        assert not UNBOUNDED.search(bare), (name, body)
        for repeated in re.findall(r"\b(\w+)\{\d+, -1\}", bare):
            assert not re.search(r"\[0-9\]", rules[repeated]), (name, body)


def test_strings_stay_unbounded(compiler, tokenizer, pieces):
    """Only numbers are bounded: strings, patterns and formats keep their digits free."""
    compiled = _schema(compiler, {"type": "object", "properties": {
        "s": {"type": "string"}, "p": {"type": "string", "pattern": "^[0-9]+$"},
        "u": {"type": "string", "format": "uri"}},
        "required": ["s", "p", "u"], "additionalProperties": False})
    digits = "1" * 300
    text = json.dumps({"s": digits, "p": digits, "u": f"http://h:{digits}/"},
                      separators=(",", ":"), sort_keys=True)  # the schema's (sorted) order
    assert _accepts(compiled, text, tokenizer, pieces)


# ---------------------------------------------------------------- a model that loves digits

class DigitLover:
    """A model-like stream: it writes ``script`` (whatever the grammar allows of it) and
    then wants ``digit`` above everything else, forever; where no digit is allowed, a
    decimal point, then a closing bracket or brace, then whatever else it likes."""

    def __init__(self, tokenizer, script: str, digit: str) -> None:
        self.script = tokenizer.encode(script, add_special_tokens=False)

        def token(text: str) -> int:
            (one,) = tokenizer.encode(text, add_special_tokens=False)
            return one

        self.digit, self.point = token(digit), token(".")
        self.closing = [token("]"), token("}")]
        self.vocab = len(tokenizer)

    def logits(self, step: int) -> torch.Tensor:
        row = torch.zeros(1, self.vocab)
        row[0, torch.arange(self.vocab) % 7 == 0] = 1.0  # something to prefer among the rest
        row[0, self.closing] = 30.0
        row[0, self.point] = 40.0
        row[0, self.digit] = 50.0
        if step < len(self.script):
            row[0, self.script[step]] = 100.0
        return row


def _run(tokenizer, constraint: Constraint, lover: DigitLover, max_tokens: int):
    """Greedy decoding of ``lover`` under ``constraint``: (text, ended before max_tokens)."""
    eos = tokenizer.eos_token_id
    support = GrammarSupport(tokenizer, len(tokenizer))
    params = SamplingParams(do_sample=False)
    request = EngineRequest(request_id="r", prompt_token_ids=(1,), sampling=params,
                            stopping=StoppingParams(max_new_tokens=max_tokens,
                                                    eos_token_ids=(eos,)),
                            constraint=constraint)
    row = RowSampler(params, (1,), len(tokenizer))
    row.grammar = support.start(request)
    out: list[int] = []
    try:
        for step in range(max_tokens):
            logits = lover.logits(step)
            assert support.apply(logits, [row]) == [None]
            (token,) = sample(logits, [row])
            row.record(token.token_id)
            out.append(token.token_id)
            if row.grammar.terminated:
                break
    finally:
        support.shutdown()
    ended = row.grammar.terminated and out[-1] == eos
    return tokenizer.decode(out[:-1] if ended else out), ended


@pytest.mark.parametrize("digit", ["1", "9", "10", "9999"])
def test_a_digit_loving_model_is_made_to_close_the_integer(tokenizer, digit):
    """The issue's schema: after the script, the model wants only digits; the grammar ends
    `population` at int64's 19 digits and the JSON closes, well before max_tokens."""
    constraint = schema_constraint(CITY)
    lover = DigitLover(tokenizer, '{"city":"Paris","country":"France","population":', digit)
    text, ended = _run(tokenizer, constraint, lover, max_tokens=200)
    assert ended, text
    value = json.loads(text)
    jsonschema.validate(value, CITY)
    assert 16 <= len(str(value["population"])) <= 19 and value["population"] <= INTEGER_MAX
    if digit == "1":  # 19 ones are below int64's end: every digit it may write
        assert value["population"] == int("1" * 19)


def test_a_digit_loving_model_closes_numbers_in_every_mode(tokenizer):
    """A `number` field, free JSON (`json_object`) and a tool call's arguments: the values
    end at the stated digit counts and the text parses."""
    number = {"type": "object", "properties": {"area": {"type": "number"}},
              "required": ["area"], "additionalProperties": False}
    lover = DigitLover(tokenizer, '{"area":', "1")
    text, ended = _run(tokenizer, schema_constraint(number), lover, max_tokens=200)
    assert ended, text
    jsonschema.validate(json.loads(text), number)
    integer, _, rest = text[len('{"area":'):].partition(".")
    assert integer == "1" * NUMBER_INTEGER_DIGITS
    assert re.match("1" * NUMBER_FRACTION_DIGITS + r"(?![0-9])", rest), text

    lover = DigitLover(tokenizer, '{"a":[', "1")
    text, ended = _run(tokenizer, Constraint(kind=ConstraintKind.JSON_OBJECT), lover, 200)
    assert ended, text
    assert isinstance(json.loads(text), dict)
    assert re.search("1" * NUMBER_INTEGER_DIGITS + r"[^0-9]", text), text

    args = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
            "additionalProperties": False}
    tools = tools_constraint([tool_function("count", args)], HERMES, required=True,
                             parallel=False)
    script = HERMES.begin("count")
    lover = DigitLover(tokenizer, script + '{"n":', "1")
    text, ended = _run(tokenizer, tools, lover, max_tokens=200)
    assert ended, text
    call = text[len(script):].removesuffix(HERMES.end)
    assert text.endswith(HERMES.end), text
    assert json.loads(call) == {"n": int("1" * 19)}, text


def test_a_cut_constrained_answer_is_still_cut(tokenizer):
    """With too few tokens the text stops where max_tokens stops it: not ended, a prefix."""
    lover = DigitLover(tokenizer, '{"city":"Paris","country":"France","population":', "1")
    text, ended = _run(tokenizer, schema_constraint(CITY), lover, max_tokens=20)
    assert not ended and text.startswith('{"city":"Paris"'), text
