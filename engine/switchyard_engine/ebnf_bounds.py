"""Length bounds in xgrammar's JSON-schema EBNF, rewritten as chains of rules.

xgrammar 0.2.8 writes `maxLength`/`minLength` as a bounded repetition of one
character rule (``"\\"" root_characters{0, 12} "\\""``) and `maxItems`/`minItems`
as one of an item rule (``"[" item root_items{0, 11} "]"``). It unrolls the
repetition so that the rule may end after any count, and at every such place the
tokens that would run past the end cannot be decided at compile time: filling one
row's token mask inside a `maxLength: 12` string costs 7-15 ms, on every visit.

:func:`rewrite_bounds` writes each ``X{m, n} "lit"`` (a repetition followed by a
literal: the closing quote or bracket) as a chain that ends in the literal
itself, so no rule of it can end early:

    X_r3 ::= x X_r2            (m required items, here m = 3)
    ...
    X_r1 ::= x X_o{n-m}
    X_o2 ::= "lit" | x X_o1    (then at most n - m optional ones)
    X_o1 ::= "lit" | x X_o0
    X_o0 ::= "lit"

and without an upper bound (``{m, -1}``) the optional part is one rule,
``X_t ::= "lit" | x X_t``. A filled row then costs ~35 us, as a free string's
does. Each chain rule is compiled on its own (~15 ms each for a 49k vocabulary),
so compile time grows with the bound: :func:`chain_rules` counts them, and the
gateway refuses schemas whose bounds add up to more than it allows.

A bounded string's characters are JSON's: any character but the quote, the
backslash and controls, or one escape (``\\n``, ``\\uXXXX``) counted as one
character. ``\\u`` escapes of UTF-16 surrogates are left out, since a pair of
them is one character to a JSON reader and the chain would count two.
"""

from __future__ import annotations

import re

_STRING_CHARACTER_BODIES = (r'(([^\"\\\r\n]))', r'(([^\0-\x1f\"\\\r\n]))')
"""The body xgrammar gives the character rule of a length-bounded string (and that
body narrowed to JSON's characters)."""
_XGRAMMAR_CHARACTER = r'[^\"\\\r\n]'
_STRING_CHARACTER_ALTERNATIVES = (r'[^\0-\x1f\"\\]', r'"\\" json_bounded_escape')
_STRING_CHARACTER_GROUP = f"({' | '.join(_STRING_CHARACTER_ALTERNATIVES)})"
_BOUNDED_ESCAPE_RULE = (
    r'json_bounded_escape ::= ([\"\\/bfnrt] | "u" ([0-9A-Ca-c] json_hex json_hex json_hex'
    r' | [Dd] [0-7] json_hex json_hex | [E-Fe-f] json_hex json_hex json_hex))'
    "\njson_hex ::= [A-Fa-f0-9]")
# NAME{m, n} followed by a string literal (xgrammar prints literals with backslash escapes).
_BOUNDED = re.compile(r'\b([A-Za-z_][A-Za-z0-9_]*)\{(\d+), (-?\d+)\} ("(?:[^"\\]|\\.)*")')
_RULE = re.compile(r'^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$')


def _alternatives(body: str) -> tuple[str, ...] | None:
    """The sequences of a repeated rule, written so a chain rule can inline them: the
    string character's two, or a one-sequence body ``((seq))`` as itself; None when the
    body is anything else (the rule is then referenced by name)."""
    if body in _STRING_CHARACTER_BODIES:
        return _STRING_CHARACTER_ALTERNATIVES
    if body.startswith("((") and body.endswith("))"):
        inner = body[2:-2]
        depth, quoted, escaped = 0, False, False
        for ch in inner:  # one sequence: no `|` and no `)` closing the outer group early
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = not quoted
            elif quoted:
                continue
            elif ch in "([":
                depth += 1
            elif ch in ")]":
                depth -= 1
                if depth < 0:
                    return None
            elif ch == "|" and depth == 0:
                return None
        return (inner,)
    return None


def _chain(name: str, low: int, high: int, literal: str, items: tuple[str, ...],
           tag: str) -> list[str]:
    """The rules of ``name{low, high} literal`` (``high`` -1: unbounded); the first is
    the chain's start."""
    base = f"{name}_{tag}"

    def step(then: str) -> str:
        return " | ".join(f"{item} {then}" for item in items)

    if high < 0:
        tail = [f"{base}_t ::= {literal} | {step(base + '_t')}"]
        last = f"{base}_t"
    else:
        optional = high - low
        tail = [f"{base}_o{k} ::= {literal} | {step(f'{base}_o{k - 1}')}"
                for k in range(optional, 0, -1)] + [f"{base}_o0 ::= {literal}"]
        last = f"{base}_o{optional}"
    required = [f"{base}_r{k} ::= {step(f'{base}_r{k - 1}' if k > 1 else last)}"
                for k in range(low, 0, -1)]
    return required + tail


def rewrite_bounds(ebnf: str) -> str:
    """``ebnf`` (xgrammar's printed grammar) with every bounded repetition that is
    followed by a literal written as a chain of rules; the language is unchanged except
    that length-bounded strings take JSON's escapes (and no raw control characters)."""
    lines = ebnf.splitlines()
    bodies = {}
    for line in lines:
        match = _RULE.match(line)
        if match:
            bodies[match.group(1)] = match.group(2)
    added: list[str] = []
    made: dict[tuple[tuple[str, ...], int, int, str], str] = {}
    uses_escape = False

    def replace(match: re.Match[str]) -> str:
        nonlocal uses_escape
        name, low, high, literal = (match.group(1), int(match.group(2)), int(match.group(3)),
                                    match.group(4))
        if name.startswith("basic_") or (low == 0 and high < 0) or name not in bodies:
            return match.group(0)  # a plain star: no bound, nothing unrolled
        items = _alternatives(bodies[name]) or (name,)
        key = (items, low, high, literal)  # equal bounds on equal items share one chain
        if key not in made:
            uses_escape = uses_escape or items is _STRING_CHARACTER_ALTERNATIVES
            tag = f"n{low}_{'x' if high < 0 else high}_{len(made)}"
            rules = _chain(name, low, high, literal, items, tag)
            added.extend(rules)
            made[key] = rules[0].split(" ::= ", 1)[0]
        return made[key]

    out = [_BOUNDED.sub(replace, line) for line in lines]
    # Bounds xgrammar writes without a repetition ({0, 1} as an optional, {1, 1} inline)
    # keep its character class: given JSON's characters too.
    for i, line in enumerate(out):
        if _XGRAMMAR_CHARACTER in line:
            out[i] = line.replace(_XGRAMMAR_CHARACTER, _STRING_CHARACTER_GROUP)
            uses_escape = True
    if uses_escape:
        added.append(_BOUNDED_ESCAPE_RULE)
    return "\n".join(out + added) + "\n"


_CHAIN_RULE = re.compile(r"^[A-Za-z0-9_]+_n\d+_(?:x|\d+)_\d+_(?:r\d+|o[1-9]\d*) ::= ", re.MULTILINE)


def chain_rules(ebnf: str) -> int:
    """How many characters or items the chains :func:`rewrite_bounds` wrote into ``ebnf``
    count (``{m, n}``: n, ``{m, -1}``: m): what the grammar's compile time grows with."""
    return len(_CHAIN_RULE.findall(ebnf))
