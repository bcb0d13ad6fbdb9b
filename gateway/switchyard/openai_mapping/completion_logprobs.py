"""The legacy `logprobs` object of a completion choice: echoed prompt tokens, then generated ones.

OpenAI's legacy API (and vLLM) answer `echo: true` with `logprobs: N` with one
entry per prompt token before the generated ones: the first prompt token has
a null log-probability and null alternatives, since nothing precedes it.
Evaluation harnesses read a continuation's log-likelihood from these entries
(lm-evaluation-harness sums `token_logprobs[ctxlen:]` and calls the
continuation greedy when each value equals the largest of its
`top_logprobs`), so every number comes from the engine's prefill, never
from a guess.
"""

from __future__ import annotations

from collections.abc import Sequence

from switchyard.errors import ApiError
from switchyard.generation import Step
from switchyard.models.served import ServedModel
from switchyard.protocol import openai as oai
from switchyard.text.echo import EchoedPrompt
from switchyard_spec import TopToken


def _label(model: ServedModel, token_id: int, as_ids: bool) -> str:
    """A token as `logprobs` names it: its text, or `token_id:N` (vLLM's
    `return_tokens_as_token_ids`)."""
    return f"token_id:{token_id}" if as_ids else model.tokenizer.token_text(token_id)


def _alternatives(model: ServedModel, top: Sequence[TopToken], text: str,
                  logprob: float, as_ids: bool = False) -> dict[str, float]:
    """Text to log-probability of the alternatives, always with the actual token.

    Alternatives come most likely first; two tokens with one text (lone bytes
    of multi-byte characters) keep the larger value, so the maximum is never lost.
    """
    alternatives: dict[str, float] = {}
    for alt in top:
        alternatives.setdefault(_label(model, alt.id, as_ids), alt.logprob)
    alternatives.setdefault(text, logprob)
    return alternatives


def generated_logprobs(
    model: ServedModel, steps: Sequence[Step], offset: int, alternatives: int | None = None,
    as_ids: bool = False,
) -> tuple[oai.CompletionLogprobs, int]:
    """The legacy `logprobs` object for these generated steps, and the text offset after them.

    `offset` is where the first token's text starts in the choice's text (after
    the prompt when it is echoed). `top_logprobs` always holds the chosen
    token besides the alternatives asked for, as OpenAI's does.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for step in steps:
        t = step.token
        label = f"token_id:{t.id}" if as_ids else t.text
        tokens.append(label)
        token_logprobs.append(t.logprob)
        top.append(_alternatives(model, t.top_tokens[:alternatives], label, t.logprob, as_ids))
        text_offset.append(offset)
        if not t.special:  # special tokens are not part of the text
            offset += len(t.text)
    return oai.CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs,
                                  top_logprobs=top, text_offset=text_offset), offset


def echo_logprobs(
    model: ServedModel,
    echoed: EchoedPrompt,
    prompt_logprobs: Sequence[float],
    prompt_top_tokens: Sequence[Sequence[TopToken]],
    alternatives: int | None = None,
) -> oai.CompletionLogprobs:
    """The entries of an echoed prompt: one per prompt token, the first without a value.

    `prompt_logprobs` and `prompt_top_tokens` are the engine's (one per
    prompt token after the first). An engine that reported no log-probability
    for some prompt token fails the request rather than answer a made-up number.
    """
    count = len(echoed.tokens)
    if len(prompt_logprobs) != count - 1:
        raise ApiError(500, f"the engine reported {len(prompt_logprobs)} prompt log-probabilities "
                            f"for a prompt of {count} tokens", "incomplete_generation")
    token_logprobs: list[float | None] = [None, *prompt_logprobs]
    top: list[dict[str, float] | None] = [None]
    for i, logprob in enumerate(prompt_logprobs):
        at = prompt_top_tokens[i][:alternatives] if i < len(prompt_top_tokens) else ()
        top.append(_alternatives(model, at, echoed.tokens[i + 1], logprob))
    return oai.CompletionLogprobs(tokens=list(echoed.tokens), token_logprobs=token_logprobs,
                                  top_logprobs=top, text_offset=list(echoed.offsets))


def joined(first: oai.CompletionLogprobs, then: oai.CompletionLogprobs) -> oai.CompletionLogprobs:
    """Two `logprobs` objects one after the other (the echoed prompt's, then the completion's)."""
    return oai.CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=(first.top_logprobs or []) + (then.top_logprobs or []),
        text_offset=first.text_offset + then.text_offset,
    )
