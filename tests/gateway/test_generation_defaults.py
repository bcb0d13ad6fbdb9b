"""`--override-generation-config`: defaults for the sampling fields a request leaves out."""

from __future__ import annotations

import pytest

from switchyard.planning.defaults import GenerationDefaults, apply_defaults, parse_defaults
from switchyard.planning.fields import PlanFields


def test_defaults_fill_only_what_the_request_left_out() -> None:
    defaults = parse_defaults('{"temperature": 0, "top_p": 0.9}')
    assert defaults == GenerationDefaults(temperature=0.0, top_p=0.9)
    unset = apply_defaults(PlanFields(do_sample=True), defaults)
    assert (unset.temperature, unset.top_p, unset.do_sample) == (0.0, 0.9, False)
    asked = apply_defaults(PlanFields(do_sample=True, temperature=1.2), defaults)
    assert (asked.temperature, asked.top_p, asked.do_sample) == (1.2, 0.9, True)


@pytest.mark.parametrize(("text", "words"), [
    ('{"temperature": 7}', "Invalid 'temperature'"),
    ('{"min_p": 2}', "Invalid 'min_p'"),
    ('{"seed": 1}', "unknown field `seed`"),
    ("[1]", "Expected `object`"),
])
def test_bad_defaults_are_refused_at_start_with_the_reason(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_defaults(text)
