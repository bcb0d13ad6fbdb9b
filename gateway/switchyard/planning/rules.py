"""One table of range rules for the plan's fields, with each API's bounds and words.

A row names a `PlanFields` field and its bounds on each API: TGI refuses what
OpenAI allows in a few places (`top_p` 1.0, `top_k` 0, `temperature` 0) and
the other way round, and each API words its errors its own way (TGI: a 422
"Input validation error: `top_p` must be > 0.0 and < 1.0"; OpenAI and
Responses: a 400 "Invalid 'top_p': expected a value > 0 and <= 1, but got 1.5
instead."). The wire name of a field is the API's (`max_tokens` on
completions); an adapter may rename a field for its request
(`max_completion_tokens`, `max_output_tokens`).

Bounds that depend on the server's flags (`top_n_tokens`, the number of stop
strings, `best_of`) are checked by the adapters, which know the flags.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import msgspec

from switchyard.errors import ApiError, validation_error
from switchyard.planning.fields import PlanFields

Api = Literal["tgi", "openai"]
"""Whose bounds and words apply: TGI's routes, or OpenAI's (chat, completions, Responses)."""


class Range(msgspec.Struct, frozen=True, kw_only=True):
    """Allowed values: `low` and `high` (None: unbounded), each end open or closed."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    words: str | None = None
    """The API's own description of the range, where it words it its own way."""

    def allows(self, value: float) -> bool:
        """Whether ``value`` is inside the range."""
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self, api: Api) -> str:
        """The range in words: "> 0 and <= 1" (TGI writes floats as floats: "> 0.0")."""
        if self.words is not None:
            return self.words
        if api == "tgi" and self.low == 0 and self.low_open and self.high is None:
            return "strictly positive"

        def number(x: float) -> str:
            return repr(float(x)) if api == "tgi" and isinstance(x, float) else f"{x:g}"

        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {number(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {number(self.high)}")
        return " and ".join(parts)


class Rule(msgspec.Struct, frozen=True, kw_only=True):
    """A plan field's bounds on each API (None: the API has no such field)."""

    field: str
    tgi: Range | None = None
    openai: Range | None = None
    openai_name: str | None = None
    """OpenAI's name for the field where it is not the plan's."""


_POSITIVE = Range(low=0.0, low_open=True)
_PENALTY = Range(low=-2.0, high=2.0)
_UNIT_OPEN = Range(low=0.0, high=1.0, low_open=True, high_open=True)

RULES: tuple[Rule, ...] = (
    # In TGI's order of checks (its router's `validate`).
    Rule(field="temperature", tgi=_POSITIVE, openai=Range(low=0, high=2)),
    Rule(field="repetition_penalty", tgi=_POSITIVE, openai=Range(low=0, low_open=True)),
    Rule(field="frequency_penalty", tgi=_PENALTY, openai=Range(low=-2, high=2)),
    Rule(field="presence_penalty", openai=Range(low=-2, high=2)),
    Rule(field="top_p", tgi=_UNIT_OPEN, openai=Range(low=0, high=1, low_open=True)),
    Rule(field="typical_p", tgi=_UNIT_OPEN),
    Rule(field="min_p", openai=Range(low=0, high=1)),
    Rule(field="top_k", tgi=Range(low=0, low_open=True),
         openai=Range(low=0, words=">= 0 (0 or absent: no limit)")),
    Rule(field="max_new_tokens", tgi=Range(low=0, low_open=True), openai=Range(low=1),
         openai_name="max_tokens"),
    Rule(field="min_new_tokens", openai=Range(low=0), openai_name="min_tokens"),
    Rule(field="seed", tgi=Range(low=0, high=2**64, high_open=True, words=">= 0 and < 2^64"),
         openai=Range(low=-(2**63), high=2**63 - 1,
                      words=f"a signed 64-bit integer ({-(2**63)} to {2**63 - 1})")),
    Rule(field="truncate", openai=Range(low=1), openai_name="truncate_prompt_tokens"),
)
_BY_FIELD = {rule.field: rule for rule in RULES}


def wire_name(api: Api, field: str, names: Mapping[str, str] | None = None) -> str:
    """The name a client of ``api`` knows ``field`` by (``names`` renames it for one request)."""
    if names and field in names:
        return names[field]
    rule = _BY_FIELD.get(field)
    if api == "openai" and rule is not None and rule.openai_name is not None:
        return rule.openai_name
    return field


def out_of_range(api: Api, name: str, bounds: Range, value: float) -> ApiError:
    """The API's error for a value outside its bounds."""
    if api == "tgi":
        return validation_error(f"`{name}` must be {bounds.describe(api)}", param=name)
    expected = bounds.describe(api)
    verb = "expected" if expected.startswith("a ") else "expected a value"
    return ApiError(400, f"Invalid '{name}': {verb} {expected}, but got {value} instead.",
                    "validation", param=name)


def check_fields(api: Api, fields: PlanFields, names: Mapping[str, str] | None = None) -> None:
    """Every rule of ``api`` on ``fields``, in the table's order; the first broken one raises.

    A field set on a request whose API has no rule for it is the adapter's mistake, not
    the client's: adapters only fill fields their API has.
    """
    for rule in RULES:
        bounds = rule.tgi if api == "tgi" else rule.openai
        value = getattr(fields, rule.field)
        if bounds is None or value is None:
            continue
        if not bounds.allows(value):
            raise out_of_range(api, wire_name(api, rule.field, names), bounds, value)
