"""The text of a JSON schema's grammar: what the engines compile and the gateway checks.

Torch-free at import (xgrammar, which imports torch, is imported when a
grammar is first written), so the gateway's request validation
(``switchyard.constraints``) checks a schema with the very grammar an
engine's :mod:`switchyard_engine.grammar` compiles, without loading torch.
"""

from __future__ import annotations

JSON_SEPARATORS = (",", ":")
"""Constrained JSON is compact, as OpenAI's is: no whitespace can pad it out to
``max_new_tokens`` (vllm#38696)."""


_LENGTH_BOUND_CHARACTER = r'[^\"\\\r\n]'
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\\r\n]'


def strict_json_ebnf(ebnf: str) -> str:
    """Fixes to the EBNF xgrammar 0.2.8 writes for a JSON schema.

    Length bounds (`minLength`/`maxLength`, `minItems`/`maxItems`) are bounded
    repetitions that cost milliseconds per token mask: rewritten as chains of
    rules (:func:`~switchyard_engine.ebnf_bounds.rewrite_bounds`), whose
    bounded strings take JSON's characters (escapes included, raw control
    characters not; xgrammar's own let a raw tab in, which is not JSON). Any
    bounded character rule left is narrowed the same way. The untyped values
    (`basic_array`, `basic_object`) separate items with ``", "`` whatever the
    separators asked for: made compact.
    """
    from switchyard_engine.ebnf_bounds import rewrite_bounds

    lines = []
    for line in rewrite_bounds(ebnf).replace(_LENGTH_BOUND_CHARACTER,
                                             _JSON_STRING_CHARACTER).splitlines():
        if line.startswith(("basic_array_items", "basic_object_properties")):
            line = line.replace('(", " ', '("," ')
        lines.append(line)
    return "\n".join(lines) + "\n"


def json_schema_ebnf(schema: str) -> str:
    """The grammar of compact JSON that follows ``schema`` (canonical text), as EBNF,
    every number in it bounded (``switchyard_engine.number_bounds``): its ranges are
    closed before xgrammar writes them, its plain numbers after.
    ``NumberBoundsError`` when a numeric range of the schema is empty."""
    import json

    import xgrammar as xgr

    from switchyard_engine.number_bounds import bound_numbers, bounded_schema

    closed = json.dumps(bounded_schema(json.loads(schema)), separators=(",", ":"),
                        ensure_ascii=False)  # properties keep their order
    grammar = xgr.Grammar.from_json_schema(closed, any_whitespace=False,
                                           separators=JSON_SEPARATORS, strict_mode=False)
    return strict_json_ebnf(bound_numbers(str(grammar)))
