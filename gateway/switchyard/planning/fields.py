"""`PlanFields`: what a request asks of generation, in no API's words.

Every field is optional: `None` means the field was not given, and the plan
builder puts the engine's default in its place. An adapter fills only what
its API has; the names are the plan's, not any wire type's (`max_new_tokens`
whether the client wrote `max_tokens`, `max_completion_tokens`,
`max_output_tokens` or `max_new_tokens`).
"""

from __future__ import annotations

import msgspec

from switchyard_spec import Constraint


class PlanFields(msgspec.Struct, frozen=True, kw_only=True):
    """The generation fields of one request, checked by `switchyard.planning.rules`."""

    do_sample: bool | None = None
    """Sample (True) or take the most likely token (False). None: sample when a warper
    (temperature, top_k, top_p, typical_p) would change the distribution (TGI's rule)."""
    temperature: float | None = None
    top_k: int | None = None
    """0 or None: no limit."""
    top_p: float | None = None
    typical_p: float | None = None
    min_p: float | None = None
    """vLLM's min-p: drop tokens less likely than this times the most likely one."""
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    """In the engines' seed space, [0, 2^64)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, sorted by id."""
    watermark: bool = False
    max_new_tokens: int | None = None
    """None: what the context leaves after the prompt."""
    min_new_tokens: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the sequence as EOS does (vLLM's `stop_token_ids`)."""
    include_stop: bool = True
    """Keep a matched stop string in the text (TGI does; OpenAI does not)."""
    skip_special_tokens: bool = True
    """Leave special tokens' text out of the generated text."""
    top_n_tokens: int | None = None
    """Alternatives reported per generated token."""
    prompt_logprobs: bool = False
    """Ask the engine for the prompt tokens' log-probabilities."""
    truncate: int | None = None
    """Keep only the last this many prompt tokens."""
    best_of: int | None = None
    """Sequences generated per prompt (TGI's `best_of`, OpenAI's `n` and `best_of`)."""
    constraint: Constraint | None = None
    """The grammar the generated text follows."""
    details: bool = False
    return_full_text: bool = False
    score_only: bool = False
    """Score the prompt, hand back no generated token (OpenAI's `max_tokens: 0`)."""
