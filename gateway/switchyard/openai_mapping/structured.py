"""vLLM's structured-output fields read into a constraint: `structured_outputs` and the older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

They reach the same grammar engine as `response_format`: `json` a JSON schema,
`regex` a regular expression, `choice` a pattern that matches exactly one of
the strings, `grammar` xgrammar's EBNF (vLLM's `grammar` with the xgrammar
backend). At most one may be given; an invalid one is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from switchyard.constraints import (
    JSON_OBJECT,
    ConstraintError,
    choice_pattern,
    grammar_constraint,
    regex_constraint,
    schema_constraint,
)
from switchyard.errors import ApiError
from switchyard.protocol import openai as oai
from switchyard_spec import Constraint

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
BACKENDS = (None, "auto", "xgrammar")
"""`guided_decoding_backend` values served: the one grammar engine this server has."""


def _invalid(message: str, param: str) -> ApiError:
    return ApiError(400, message, "validation", param=param)


def _given(req: oai.SamplingRequest) -> list[tuple[str, str, Any]]:
    """(field, kind, value) of every structured-output field the request set."""
    given = [(f, f.removeprefix("guided_"), getattr(req, f)) for f in GUIDED_FIELDS
             if getattr(req, f) is not None]
    so = req.structured_outputs
    if so is not None:
        for kind in ("json", "regex", "choice", "grammar", "json_object"):
            value = getattr(so, kind)
            if value is not None and value is not False:
                given.append((f"structured_outputs.{kind}", kind, value))
        for name in ("disable_additional_properties", "whitespace_pattern"):
            if getattr(so, name) is not None:
                raise _invalid(f"'structured_outputs.{name}' is not supported by this server.",
                               f"structured_outputs.{name}")
        if so.structural_tag is not None:
            raise _invalid("'structured_outputs.structural_tag' is not supported by this "
                           "server (tool calling uses `tools`).", "structured_outputs")
    return given


def structured_output_field(req: oai.SamplingRequest) -> str:
    """The wire name of the request's structured-output field (for errors that name it)."""
    given = _given(req)
    return given[0][0] if given else "structured_outputs"


def structured_output(req: oai.SamplingRequest) -> Constraint | None:
    """The request's structured-output constraint, checked; None when it asks for none."""
    if req.guided_decoding_backend not in BACKENDS:
        raise _invalid(f"Invalid 'guided_decoding_backend': {req.guided_decoding_backend!r} "
                       "is not served (this server's grammar engine is xgrammar).",
                       "guided_decoding_backend")
    given = _given(req)
    if not given:
        return None
    if len(given) > 1:
        raise _invalid(f"Only one structured output may be asked for, got "
                       f"{', '.join(f for f, _, _ in given)}.", given[1][0])
    field, kind, value = given[0]
    try:
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise ConstraintError(f"the schema is not valid JSON: {exc}") from None
            return schema_constraint(value)
        if kind == "json_object":
            return JSON_OBJECT
        if kind == "regex":
            return regex_constraint(value)
        if kind == "choice":
            return regex_constraint(choice_pattern(value))
        return grammar_constraint(value)
    except ConstraintError as exc:
        raise _invalid(f"Invalid '{field}': {exc}.", field) from None
