"""Bounds on every JSON number a constrained grammar allows, so a value always ends.

xgrammar 0.2.8 writes a JSON number's digits as unbounded repetitions
(``[1-9] [0-9]*``, ``digits{1, -1}``): a model that keeps taking digit tokens
is never forced to close the value and runs to ``max_new_tokens`` with JSON that
does not parse. Here every number the grammar of a JSON schema (or of free JSON)
admits gets a bounded digit count:

- ``integer``: the int64 range, exactly: -9223372036854775808 to
  9223372036854775807 (at most 19 digits and a leading minus). With
  ``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum`` the range is
  the schema's, exactly, intersected with int64 (:func:`bounded_schema` turns
  the bounds into one inclusive integer ``minimum`` and ``maximum`` and
  xgrammar writes the range digit by digit); a schema whose range holds no
  int64 is refused.
- ``number`` (and every number of free JSON, ``json_object`` mode or an
  untyped value): at most :data:`NUMBER_INTEGER_DIGITS` integer digits,
  :data:`NUMBER_FRACTION_DIGITS` fraction digits and
  :data:`NUMBER_EXPONENT_DIGITS` exponent digits. Chosen so that every finite
  double is accepted as Python's ``json.dumps``/``repr`` writes it: fixed
  notation for ``1e-4 <= |x| < 1e16`` (at most 16 integer digits, and at most
  17 significant digits after at most 3 zeros: 20 fraction digits), exponent
  notation otherwise (one integer digit, at most 16 fraction digits, and
  ``e-324`` to ``e+308``: 3 digits). A longer integer part could not be read
  back exactly as a double anyway (2**53 has 16 digits).
- ``number`` with a bound: xgrammar writes the range digit by digit, with at
  most 6 fraction digits and no exponent (its own rule); a side the schema
  leaves open (or sets beyond) is closed at ``±1e16`` (exclusive), so the
  integer part has at most 16 digits there too.

Strings are left as they are (unbounded unless the schema bounds them), and so
are the digits of string formats (``date-time``, ``uri``) and patterns.

:func:`bound_numbers` writes the digits as chains of rules shared by every number
of the grammar (``json_digits_u3 ::= "" | [0-9] json_digits_u2``: up to 3 digits;
``json_digits_x3``: exactly 3), not as bounded repetitions, whose token masks
cost milliseconds where they may end early (``switchyard_engine.ebnf_bounds``).
Each chain rule says that no digit follows it (a lookahead): xgrammar then
decides when compiling which digit tokens would run past the bound, and a token
mask inside a number costs what it did unbounded (a few microseconds); the
chains add ~20-40 rules, ~10-20 ms to a schema's compile for a 49k vocabulary.
"""

from __future__ import annotations

import math
import re
from typing import Any

INTEGER_MIN = -(2**63)
INTEGER_MAX = 2**63 - 1
NUMBER_INTEGER_DIGITS = 16
NUMBER_FRACTION_DIGITS = 20
NUMBER_EXPONENT_DIGITS = 3
NUMBER_LIMIT = 1e16
"""A bounded ``number`` lies strictly between ``-NUMBER_LIMIT`` and ``NUMBER_LIMIT``."""


class NumberBoundsError(ValueError):
    """A schema's numeric range that no bounded number can satisfy."""


# ------------------------------------------------------------------ the schema

# Where a JSON schema holds subschemas (also walked by switchyard.constraints).
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
               "dependentSchemas")
"""Keywords whose value maps names to subschemas."""
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
"""Keywords whose value is a list of subschemas."""
SCHEMA_ONE = ("additionalProperties", "items", "propertyNames", "contains", "not", "if",
              "then", "else", "unevaluatedItems", "unevaluatedProperties",
              "additionalItems")
"""Keywords whose value is one subschema (or a boolean)."""
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and (
        not isinstance(value, float) or math.isfinite(value))


def _integer_range(schema: dict[str, Any], where: str) -> tuple[int, int]:
    """The schema's integer bounds as one inclusive int64 range."""
    low, high = INTEGER_MIN, INTEGER_MAX
    if _is_number(schema.get("minimum")):
        low = max(low, math.ceil(schema["minimum"]))
    if _is_number(schema.get("exclusiveMinimum")):
        low = max(low, math.floor(schema["exclusiveMinimum"]) + 1)
    if _is_number(schema.get("maximum")):
        high = min(high, math.floor(schema["maximum"]))
    if _is_number(schema.get("exclusiveMaximum")):
        high = min(high, math.ceil(schema["exclusiveMaximum"]) - 1)
    if low > high:
        raise NumberBoundsError(f"no integer from {INTEGER_MIN} to {INTEGER_MAX} meets the "
                                f"bounds at {where}")
    return low, high


def _number_range(schema: dict[str, Any], where: str) -> dict[str, float]:
    """The schema's number bounds, one per side, closed at ±NUMBER_LIMIT (exclusive)."""
    low: tuple[float, bool] = (-NUMBER_LIMIT, True)  # (value, exclusive)
    high: tuple[float, bool] = (NUMBER_LIMIT, True)
    for key, exclusive in (("minimum", False), ("exclusiveMinimum", True)):
        value = schema.get(key)
        if _is_number(value) and (value > low[0] or (value == low[0] and exclusive)):
            low = (value, exclusive)
    for key, exclusive in (("maximum", False), ("exclusiveMaximum", True)):
        value = schema.get(key)
        if _is_number(value) and (value < high[0] or (value == high[0] and exclusive)):
            high = (value, exclusive)
    if low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1])):
        raise NumberBoundsError(f"no number of at most {NUMBER_INTEGER_DIGITS} integer digits "
                                f"meets the bounds at {where}")
    return {"exclusiveMinimum" if low[1] else "minimum": low[0],
            "exclusiveMaximum" if high[1] else "maximum": high[0]}


def bounded_schema(schema: Any, where: str = "#") -> Any:
    """``schema`` with every bounded ``integer`` or ``number`` range closed as the
    module says (a new object; ``schema`` is not changed); ``NumberBoundsError``
    when a range is empty."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            out[key] = {name: bounded_schema(sub, f"{where}/{key}/{name}")
                        for name, sub in value.items()}
    for key in (*SCHEMA_LISTS, *SCHEMA_ONE):
        value = schema.get(key)
        if isinstance(value, list):
            out[key] = [bounded_schema(sub, f"{where}/{key}/{i}")
                        for i, sub in enumerate(value)]
        elif isinstance(value, dict):
            out[key] = bounded_schema(value, f"{where}/{key}")
    if not any(_is_number(schema.get(key)) for key in _BOUNDS):
        return out  # unbounded: the number rules of the grammar bound it
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "number" in kinds:
        if "integer" in kinds:  # every integer is a number: one range, the number's
            out["type"] = [k for k in kinds if k != "integer"]
        for key in _BOUNDS:
            out.pop(key, None)
        out.update(_number_range(schema, where))
    elif "integer" in kinds:
        low, high = _integer_range(schema, where)
        for key in _BOUNDS:
            out.pop(key, None)
        out.update(minimum=low, maximum=high)
    return out


# ------------------------------------------------------------------ the grammar

_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$")
_LITERAL_OR_CLASS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')
_NAME = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
_REPEAT = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\{(\d+), (\d+)\}")
_SIGN = '("" | ("-"))'
_RUNS = {"(([0-9]))": ("[0-9]", "digits"), '(("0"))': ('"0"', "zeros")}
"""The bodies of the rules xgrammar repeats in a numeric range, and the chains' names."""
_PREFIXES = ("json_digits_", "json_zeros_", "json_int64_")
_END = " (=([^0-9]))"
"""Where a rule here ends, a digit run ends: no digit follows. Said as a lookahead, it
lets xgrammar decide when compiling the tokens that would run past the end (a digit
token longer than the digits left); without it each such token is checked on every
mask, ~0.1-0.3 ms a mask for a 49k vocabulary."""


class _Chains:
    """The chain rules a grammar needs, each made once and shared."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}

    def _add(self, name: str, body: str) -> str:
        self.rules.setdefault(name, body + _END)
        return name

    def upto(self, char: str, tag: str, n: int) -> str:
        """0 to ``n`` (>= 1) characters ``char``."""
        if f"json_{tag}_u{n}" in self.rules:
            return f"json_{tag}_u{n}"
        rest = f" {self.upto(char, tag, n - 1)}" if n > 1 else ""
        return self._add(f"json_{tag}_u{n}", f'("" | ({char}{rest}))')

    def exact(self, char: str, tag: str, n: int) -> str:
        """Exactly ``n`` (>= 1)."""
        if f"json_{tag}_x{n}" in self.rules:
            return f"json_{tag}_x{n}"
        rest = f" {self.exact(char, tag, n - 1)}" if n > 1 else ""
        return self._add(f"json_{tag}_x{n}", f"(({char}{rest}))")

    def between(self, char: str, tag: str, low: int, high: int) -> str:
        """``low`` (>= 1) to ``high`` (> low)."""
        rest = (self.between(char, tag, low - 1, high - 1) if low > 1
                else self.upto(char, tag, high - low))
        return self._add(f"json_{tag}_b{low}_{high}", f"(({char} {rest}))")

    def int64(self) -> str:
        """19-digit integers up to 9223372036854775807, one rule per digit."""
        top = str(INTEGER_MAX)
        for i in reversed(range(len(top))):
            digit, rest = top[i], len(top) - i - 1
            first = "1" if i == 0 else "0"
            alternatives = []
            if digit > first:
                below = f"[{first}-{chr(ord(digit) - 1)}]"
                alternatives.append(f"({below} {self.exact('[0-9]', 'digits', rest)})"
                                    if rest else f"({below})")
            alternatives.append(f'("{digit}" json_int64_{i + 1})' if rest else f'("{digit}")')
            self._add(f"json_int64_{i}", f"({' | '.join(alternatives)})")
        return "json_int64_0"


def _masked(body: str) -> str:
    """``body`` with its string literals and character classes blanked out (a pattern's
    ``Regex("...")`` is a literal), positions unchanged."""
    return _LITERAL_OR_CLASS.sub(lambda m: " " * len(m.group(0)), body)


def bound_numbers(ebnf: str) -> str:
    """``ebnf`` (xgrammar's printed grammar of a :func:`bounded_schema`) with every
    number's digits bounded as the module says, and the bounded digit repetitions of its
    ranges written as chains; rules nothing reaches any more are dropped."""
    bodies: dict[str, str] = {}
    for line in ebnf.splitlines():
        match = _RULE.match(line)
        if match:
            bodies[match.group(1)] = match.group(2)
    if any(name.startswith(_PREFIXES) for name in bodies):
        raise ValueError("the grammar already has a rule named as the number bounds name theirs")
    chains = _Chains()
    digits = ("[0-9]", "digits")
    out: dict[str, str] = {}
    for name, body in bodies.items():
        # An integer: "0" | sign [1-9] [0-9]* (xgrammar's basic_integer, or a copy of it).
        if body == f'(("0") | ({name}_1 [1-9] [0-9]*))' and bodies.get(f"{name}_1") == _SIGN:
            out[name] = (f'(("0") | ({name}_1 [1-9] {chains.upto(*digits, 17)}) | '
                         f'({name}_1 {chains.int64()}) | ("-9223372036854775808")){_END}')
            continue
        # A number: sign, integer part, fraction, exponent (xgrammar's basic_number or a copy).
        parts = [f"{name}_{i}" for i in (1, 2, 3, 4, 5)]
        run = f"{name}_digits" if f"{name}_digits" in bodies else "basic_number_digits"
        if body == f"(({parts[0]} {parts[1]} {parts[2]} {parts[4]}))" and \
                bodies.get(parts[1]) == '(("0") | ([1-9] [0-9]*))' and \
                bodies.get(parts[2]) == f'("" | ("." {run}{{1, -1}}))' and \
                bodies.get(parts[4]) == f'("" | ([eE] {parts[3]} {run}{{1, -1}}))':
            out[parts[1]] = (f'(("0") | ([1-9] '
                             f'{chains.upto(*digits, NUMBER_INTEGER_DIGITS - 1)})){_END}')
            out[parts[2]] = (f'("" | ("." '
                             f'{chains.between(*digits, 1, NUMBER_FRACTION_DIGITS)})){_END}')
            out[parts[4]] = (f'("" | ([eE] {parts[3]} '
                             f'{chains.between(*digits, 1, NUMBER_EXPONENT_DIGITS)})){_END}')
    for name, body in bodies.items():
        if name not in out:
            out[name] = _chain_repetitions(body, bodies, chains)
    out.update(chains.rules)
    keep = _reachable(out)
    return "".join(f"{name} ::= {body}\n" for name, body in out.items() if name in keep)


def _chain_repetitions(body: str, bodies: dict[str, str], chains: _Chains) -> str:
    """``body`` with each bounded repetition of a digit rule that ends one of its
    alternatives (where a range's digits end) written as a chain, and then the
    digits-end lookahead."""
    if "{" not in body:
        return body
    masked = _masked(body)
    pieces, last = [], 0
    for match in _REPEAT.finditer(masked):
        run = _RUNS.get(bodies.get(match.group(1), ""))
        low, high = int(match.group(2)), int(match.group(3))
        before = masked[:match.start()]
        if run is None or high < max(low, 1) or masked[match.end():match.end() + 1] != ")" \
                or before.count("(") - before.count(")") != 2:
            continue
        if low == high:
            chain = chains.exact(*run, low)
        elif low == 0:
            chain = chains.upto(*run, high)
        else:
            chain = chains.between(*run, low, high)
        pieces += [body[last:match.start()], chain]
        last = match.end()
    if not pieces:
        return body
    # A range's rule (the whole number, or its integer part) ends where its digits do.
    return "".join(pieces) + body[last:] + ("" if "(=" in masked else _END)


def _reachable(rules: dict[str, str]) -> set[str]:
    """The rules ``root`` reaches."""
    seen = {"root"}
    todo = ["root"]
    while todo:
        for word in _NAME.findall(_masked(rules.get(todo.pop(), ""))):
            if word in rules and word not in seen:
                seen.add(word)
                todo.append(word)
    return seen
