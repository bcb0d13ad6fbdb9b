"""TGI's `grammar` and OpenAI's `response_format`, validated into one engine `Constraint`.

Everything is checked before a request reaches an engine, so a bad grammar is a
422 in the route's format and never unconstrained text:

- a JSON schema must be valid against JSON Schema's draft 2020-12 meta-schema,
  must use no keyword the grammar engine (xgrammar) would silently ignore
  (:data:`IGNORED_KEYWORDS`, and `minLength`/`maxLength` beside `pattern` or
  `format`), and must compile: the gateway builds the grammar once without a
  tokenizer (``switchyard_engine.grammar_text.json_schema_ebnf``: xgrammar's
  `Grammar.from_json_schema` with every number bounded, 1-5 ms for small
  schemas), the engine compiles it again for its tokenizer; a numeric range
  that no bounded number meets (an `integer` whose bounds hold no int64) is
  refused;
- a regular expression must compile the same way and hold no NUL byte;
- either is at most :data:`MAX_GRAMMAR_BYTES` long, and a schema's length
  bounds (`minLength`/`maxLength`, `minItems`/`maxItems`) add up to at most
  :data:`MAX_BOUND_RULES` grammar rules.

The constraint's spec is canonical (compact JSON with sorted keys), so equal
schemas share one compiled grammar in the engine's cache.

OpenAI's `tools` become one structural-tag constraint (:func:`tools_constraint`):
each function's `parameters` schema passes the checks above, and the calls are
held to the model family's format (``switchyard.tools.calls``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import msgspec
from switchyard_spec import Constraint, ConstraintKind

from switchyard_engine.ebnf_bounds import chain_rules
from switchyard_engine.grammar_text import json_schema_ebnf
from switchyard_engine.number_bounds import (
    SCHEMA_LISTS,
    SCHEMA_MAPS,
    SCHEMA_ONE,
    NumberBoundsError,
)
from switchyard.errors import validation_error
from switchyard.tools.calls import ToolFormat

MAX_GRAMMAR_BYTES = 64 * 1024
"""Largest schema (as compact JSON) or pattern a request may carry."""

MAX_BOUND_RULES = 256
"""Most grammar rules a schema's length bounds may add up to: each character of a
`maxLength` (or `minLength`) and each item of a `maxItems` (or `minItems`) is one
rule of the compiled grammar (``switchyard_engine.ebnf_bounds``), and compile time
grows with them (~15 ms each for a 49k vocabulary on one core: a `maxLength: 256`
string compiles in a few seconds)."""

IGNORED_KEYWORDS = (
    "uniqueItems", "contains", "minContains", "maxContains", "multipleOf", "not", "if", "then",
    "else", "dependentRequired", "dependentSchemas", "unevaluatedProperties",
    "unevaluatedItems",
)
"""Schema keywords xgrammar 0.2 accepts but does not (or not always) enforce: a
schema with one is refused rather than answered with text that may violate it."""

def _unsupported(schema: Any, where: str = "#") -> str | None:
    """The first unenforced keyword in ``schema`` and where it is, or None."""
    if not isinstance(schema, dict):
        return None
    for key in IGNORED_KEYWORDS:
        if key in schema:
            return f"`{key}` (at {where})"
    if ("pattern" in schema or "format" in schema) and (
            "minLength" in schema or "maxLength" in schema):
        return f"`minLength`/`maxLength` together with `pattern` or `format` (at {where})"
    for key in SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                found = _unsupported(sub, f"{where}/{key}/{name}")
                if found:
                    return found
    for key in SCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                found = _unsupported(sub, f"{where}/{key}/{i}")
                if found:
                    return found
    for key in SCHEMA_ONE:
        value = schema.get(key)
        if isinstance(value, list):  # draft-4 style tuple `items`
            for i, sub in enumerate(value):
                found = _unsupported(sub, f"{where}/{key}/{i}")
                if found:
                    return found
        else:
            found = _unsupported(value, f"{where}/{key}")
            if found:
                return found
    return None


_BOUND_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
                   "maxProperties")


def _subschemas(schema: Any, where: str = "#") -> Any:
    """``schema`` and every schema inside it, each with where it is."""
    if not isinstance(schema, dict):
        return
    yield schema, where
    for key in SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield from _subschemas(sub, f"{where}/{key}/{name}")
    for key in (*SCHEMA_LISTS, *SCHEMA_ONE):
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _subschemas(sub, f"{where}/{key}/{i}")
        else:
            yield from _subschemas(value, f"{where}/{key}")


def _oversized_bound(schema: Any) -> str | None:
    """The first length or count bound over :data:`MAX_BOUND_RULES`, or None. Checked
    before xgrammar sees the schema: it unrolls a bound while building the grammar, and
    `maxLength: 1000000000` exhausts memory there."""
    for sub, where in _subschemas(schema):
        for key in _BOUND_KEYWORDS:
            value = sub.get(key)
            if isinstance(value, int) and value > MAX_BOUND_RULES:
                return f"`{key}: {value}` (at {where})"
    return None


class ConstraintError(ValueError):
    """Why a schema or pattern cannot be used; the routes word it for their API."""


def schema_constraint(schema: Any) -> Constraint:
    """A checked JSON-schema constraint; ``ConstraintError`` says what is wrong."""
    spec, _ = _checked_schema(schema)
    return Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=spec)


def _checked_schema(schema: Any) -> tuple[str, str]:
    """A schema's canonical text and its grammar (EBNF), or ``ConstraintError``."""
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise ConstraintError("the schema must be a JSON object")
    spec = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if len(spec.encode()) > MAX_GRAMMAR_BYTES:
        raise ConstraintError(f"the schema is {len(spec.encode())} bytes, more than the "
                              f"{MAX_GRAMMAR_BYTES} allowed")
    return spec, _checked_schema_text(spec)


@functools.lru_cache(maxsize=256)
def _checked_schema_text(spec: str) -> str:
    """The checks and the grammar of a canonical schema, once per schema: clients send the
    same schema with every request, and checking it costs ~1-5 ms of the event loop."""
    schema = json.loads(spec)
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ConstraintError(exc.message) from None
    found = _unsupported(schema)
    if found:
        raise ConstraintError(f"{found} is not supported: the grammar engine would not "
                              "enforce it")
    found = _oversized_bound(schema)
    if found:
        raise ConstraintError(f"{found} is more than the {MAX_BOUND_RULES} a length or "
                              "count bound may be")
    import xgrammar as xgr

    try:
        ebnf = json_schema_ebnf(spec)
    except NumberBoundsError as exc:
        raise ConstraintError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError with its reason
        raise ConstraintError(f"cannot compile the schema: {_reason(exc)}") from None
    rules = chain_rules(ebnf)
    if rules > MAX_BOUND_RULES:
        raise ConstraintError(
            f"the schema's `minLength`/`maxLength`/`minItems`/`maxItems` bounds add up to "
            f"{rules}, more than the {MAX_BOUND_RULES} allowed (each counted character or "
            "item adds to the grammar's compile time)")
    try:
        xgr.Grammar.from_ebnf(ebnf)  # the rewritten grammar parses (the engine compiles it)
    except Exception as exc:  # noqa: BLE001
        raise ConstraintError(f"cannot compile the schema: {_reason(exc)}") from None
    return ebnf


def regex_constraint(pattern: Any) -> Constraint:
    """A checked regular-expression constraint; ``ConstraintError`` says what is wrong."""
    if not isinstance(pattern, str):
        raise ConstraintError("a regex grammar's value must be a string")
    if not pattern:
        raise ConstraintError("the regular expression is empty")
    if "\x00" in pattern:
        raise ConstraintError("the regular expression holds a NUL character")
    _compiles(pattern, "the regular expression", "from_regex")
    return Constraint(kind=ConstraintKind.REGEX, spec=pattern)


def _compiles(text: str, what: str, parser: str) -> None:
    """``text`` is within the size limit and xgrammar's ``Grammar.<parser>`` reads it;
    ``ConstraintError`` names ``what`` otherwise."""
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise ConstraintError(f"{what} is {len(text.encode())} bytes, more than the "
                              f"{MAX_GRAMMAR_BYTES} allowed")
    import xgrammar as xgr

    try:
        getattr(xgr.Grammar, parser)(text)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError with its reason
        raise ConstraintError(f"cannot compile {what}: {_reason(exc)}") from None


def grammar_constraint(ebnf: Any) -> Constraint:
    """A checked grammar constraint (xgrammar's EBNF with a `root` rule); ``ConstraintError``
    says what is wrong."""
    if not isinstance(ebnf, str) or not ebnf.strip():
        raise ConstraintError("a grammar must be a non-empty string")
    _compiles(ebnf, "the grammar (EBNF with a `root` rule)", "from_ebnf")
    return Constraint(kind=ConstraintKind.GRAMMAR, spec=ebnf)


def choice_pattern(choices: Any) -> str:
    """A regular expression that matches exactly one of ``choices`` (vLLM's `choice`)."""
    if not isinstance(choices, list) or not choices or not all(
            isinstance(c, str) and c for c in choices):
        raise ConstraintError("choices must be a non-empty list of non-empty strings")
    special = set("\\.^$*+?()[]{}|/-")
    return "(" + "|".join("".join("\\" + ch if ch in special else ch for ch in choice)
                          for choice in choices) + ")"


JSON_OBJECT = Constraint(kind=ConstraintKind.JSON_OBJECT)
"""OpenAI's `{"type": "json_object"}`: any JSON object."""


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip()
    head, sep, rest = text.partition(": ")
    if sep and ".cc:" in head:
        text = rest
    return text.splitlines()[0] if text else type(exc).__name__


def _json_value(value: Any) -> Any:
    """TGI's `json` value: a schema object, or a string holding one."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ConstraintError(f"the schema is not valid JSON: {exc}") from None
    return value


def tgi_constraint(grammar_type: str, value: Any) -> Constraint:
    """TGI's `parameters.grammar` as a constraint, with TGI's message on failure.

    `json` and its alias `json_object` take a schema (or its JSON text),
    `json_schema` takes `{"name"?, "schema", "strict"?}`, `regex` a pattern.
    """
    try:
        if grammar_type in ("json", "json_object"):
            return schema_constraint(_json_value(value))
        if grammar_type == "json_schema":
            value = _json_value(value)
            if not isinstance(value, dict) or "schema" not in value:
                raise ConstraintError("a json_schema grammar's value must be an object with "
                                      "a `schema`")
            return schema_constraint(_json_value(value["schema"]))
        if grammar_type == "regex":
            return regex_constraint(value)
    except ConstraintError as exc:
        raise validation_error(f"grammar is not valid: {exc}", param="grammar") from None
    raise validation_error(f"grammar is not valid: unknown type {grammar_type!r}",
                           param="grammar")


def _strict_problem(schema: Any, where: str = "()") -> str | None:
    """Where a schema breaks OpenAI's strict mode (closed objects, every property required)."""
    if not isinstance(schema, dict):
        return None
    if schema.get("type") == "object" or "properties" in schema:
        if schema.get("additionalProperties", True) is not False:
            return (f"In context={where}, 'additionalProperties' is required to be supplied "
                    "and to be false.")
        props = schema.get("properties", {})
        missing = [k for k in props if k not in schema.get("required", [])]
        if missing:
            return (f"In context={where}, 'required' is required to be supplied and to be an "
                    f"array including every key in properties. Missing '{missing[0]}'.")
        for name, sub in props.items():
            found = _strict_problem(sub, f"('properties', '{name}')")
            if found:
                return found
    for key in ("items", "additionalProperties"):
        found = _strict_problem(schema.get(key), f"('{key}',)")
        if found:
            return found
    for key in ("anyOf", "$defs", "definitions"):
        value = schema.get(key)
        subs = value.values() if isinstance(value, dict) else value if isinstance(value, list) \
            else ()
        for sub in subs:
            found = _strict_problem(sub, f"('{key}',)")
            if found:
                return found
    return None


def response_format_constraint(rf_type: str, json_schema: Any, value: Any) -> Constraint | None:
    """OpenAI's `response_format` (or TGI's `{type, value}` form) as a constraint.

    ``json_schema`` is OpenAI's `json_schema` object (with `name`, `schema`,
    `strict`) as a dict, or None. Errors are 422s naming `response_format`.
    """
    param = "response_format"
    try:
        if rf_type == "text" and value is None:
            return None
        if rf_type == "json_object" and value is None:
            return JSON_OBJECT
        if rf_type == "json_schema" and json_schema is not None:
            schema = json_schema.get("schema")
            if schema is None:
                raise validation_error("Missing required parameter: "
                                       "'response_format.json_schema.schema'.", param=param)
            if json_schema.get("strict"):
                problem = _strict_problem(schema)
                if problem:
                    name = json_schema.get("name") or "response"
                    raise validation_error(
                        f"Invalid schema for response_format '{name}': {problem}", param=param)
            return schema_constraint(schema)
        if rf_type in ("json", "json_object", "json_schema", "regex") and value is not None:
            return tgi_constraint(rf_type, value)
    except ConstraintError as exc:
        raise validation_error(f"Invalid 'response_format': {exc}", param=param) from None
    raise validation_error(
        f"Invalid 'response_format': type {rf_type!r} needs "
        + ("`json_schema`" if rf_type == "json_schema" else "a `value`" if rf_type in
           ("json", "regex") else "one of `text`, `json_object`, `json_schema`"),
        param=param)


def engine_can_constrain(model: Any) -> bool:
    """Whether the served model's engine declares ``EngineSpec.constrained_decoding``."""
    spec = getattr(model, "engine_spec", None)
    return bool(getattr(spec, "constrained_decoding", False))


# ----------------------------------------------------------------- tool calling

MAX_TOOLS_GRAMMAR_BYTES = 256 * 1024
"""Largest tool-calling grammar (every tool's arguments grammar and call format) a
request may carry."""

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                    "additionalProperties": False}
"""A function declared without `parameters` takes none: its arguments are `{}`."""


class ToolFunction(msgspec.Struct, frozen=True, kw_only=True):
    """A tool's function, checked: its name, its arguments' schema and their grammar."""

    name: str
    schema: str
    """The arguments' JSON schema, canonical text."""
    grammar: str
    """The arguments' grammar (xgrammar EBNF for compact JSON)."""


def tool_function(name: str, parameters: Any, strict: bool = False) -> ToolFunction:
    """A function of `tools`, checked; ``ConstraintError`` says what is wrong.

    Its `parameters` must be a JSON schema of type `object` that passes the
    same checks as a `response_format` schema (and OpenAI's strict rules when
    `strict`); absent, the function takes no arguments.
    """
    schema = EMPTY_PARAMETERS if parameters is None else parameters
    if not isinstance(schema, dict) or schema.get("type") != "object":
        got = schema.get("type") if isinstance(schema, dict) else type(schema).__name__
        raise ConstraintError(f"schema must be a JSON Schema of 'type: \"object\"', got "
                              f"'type: \"{got}\"'.")
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return _tool_function(name, text, strict)


@functools.lru_cache(maxsize=256)
def _tool_function(name: str, schema_text: str, strict: bool) -> ToolFunction:
    schema = json.loads(schema_text)
    if strict:
        problem = _strict_problem(schema)
        if problem:
            raise ConstraintError(problem)
    spec, grammar = _checked_schema(schema)
    return ToolFunction(name=name, schema=spec, grammar=grammar)


def tools_constraint(functions: Sequence[ToolFunction], fmt: ToolFormat, *,
                     required: bool, parallel: bool) -> Constraint:
    """The grammar of tool calls to ``functions`` in the model family's format ``fmt``.

    ``required`` (OpenAI's `required`, or a named function with ``functions``
    holding it alone): the text is one call, or with ``parallel`` one or more
    calls separated by ``fmt.separator``, and nothing else. Otherwise
    (`auto`): the text is free until the format's trigger, then a call to one of
    ``functions``; after it, with ``parallel``, free text again (and more
    calls), without, the end. Each call's arguments follow the function's
    schema as compact JSON.
    """
    tags = [{"type": "tag", "begin": fmt.begin(f.name), "end": fmt.end,
             "content": {"type": "grammar", "grammar": f.grammar}} for f in functions]
    if required:
        layout: dict[str, Any] = {"type": "tags_with_separator", "separator": fmt.separator,
                                  "tags": tags, "at_least_one": True,
                                  "stop_after_first": not parallel}
    else:
        layout = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
                  "at_least_one": False, "stop_after_first": not parallel}
    spec = json.dumps({"type": "structural_tag", "format": layout}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False)
    size = len(spec.encode())
    if size > MAX_TOOLS_GRAMMAR_BYTES:
        raise ConstraintError(f"the tools' grammar is {size} bytes, more than the "
                              f"{MAX_TOOLS_GRAMMAR_BYTES} allowed")
    import xgrammar as xgr

    try:
        xgr.Grammar.from_structural_tag(spec)
    except Exception as exc:  # noqa: BLE001
        raise ConstraintError(f"cannot compile the tools' grammar: {_reason(exc)}") from None
    return Constraint(kind=ConstraintKind.STRUCTURAL_TAG, spec=spec)
