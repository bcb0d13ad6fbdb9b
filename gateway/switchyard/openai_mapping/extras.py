"""vLLM's additions to an OpenAI answer: token ids, prompt log-probabilities, usage on every
chunk, logprob tokens written as ids.

`AnswerExtras` holds what a chat or completion request asked for (checked
here); the routes ask it for each piece of the answer. The prompt's
log-probabilities are the engine's (the prompt tokens scored in prefill, raw
logits, as vLLM's default); a position's alternatives are the engine's top
tokens there, ranked 1, 2, ...; the prompt's own token carries its rank when
it is among them and null when it is not (the engine does not rank the whole
vocabulary).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from switchyard.errors import ApiError
from switchyard.models.served import ServedModel
from switchyard.protocol import openai as oai
from switchyard_spec import TopToken


def _invalid(message: str, param: str) -> ApiError:
    return ApiError(400, message, "validation", param=param)


class AnswerExtras(msgspec.Struct, frozen=True, kw_only=True):
    """What of vLLM's answer extensions a request asked for."""

    token_ids: bool = False
    """`return_token_ids`: the prompt's and each choice's token ids."""
    tokens_as_ids: bool = False
    """`return_tokens_as_token_ids`: logprob tokens written `token_id:N`."""
    prompt_logprobs: int | None = None
    """`prompt_logprobs`: alternatives per prompt position (None: not asked)."""
    continuous_usage: bool = False
    """`stream_options.continuous_usage_stats`: usage on every chunk."""

    @property
    def prompt_top_n(self) -> int:
        """Alternatives the engine must report per prompt position."""
        return self.prompt_logprobs or 0


def answer_extras(req: oai.SamplingRequest, max_alternatives: int) -> AnswerExtras:
    """The request's answer extensions, checked (`max_alternatives`: the route's bound)."""
    k = req.prompt_logprobs
    if k is not None:
        if not 0 <= k <= max_alternatives:
            raise _invalid(f"Invalid 'prompt_logprobs': expected a value from 0 to "
                           f"{max_alternatives}, but got {k} instead.", "prompt_logprobs")
        if req.stream:
            raise _invalid("'prompt_logprobs' is not served with 'stream': true (as in vLLM).",
                           "prompt_logprobs")
    options = req.stream_options
    return AnswerExtras(
        token_ids=bool(req.return_token_ids),
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
        prompt_logprobs=k,
        continuous_usage=bool(options is not None and options.continuous_usage_stats),
    )


def token_label(model: ServedModel, token_id: int, text: str, extras: AnswerExtras) -> str:
    """How a logprob entry names its token: its text, or `token_id:N`."""
    return f"token_id:{token_id}" if extras.tokens_as_ids else text


def prompt_logprobs(model: ServedModel, prompt_ids: Sequence[int], logprobs: Sequence[float],
                    top: Sequence[Sequence[TopToken]], k: int) -> oai.PromptLogprobs:
    """vLLM's `prompt_logprobs`: null for the first token, then per position the prompt's token
    and the ``k`` most likely ones, keyed by token id.

    An engine that scored a different number of positions than the prompt has fails the
    request rather than answer a made-up number.
    """
    if len(logprobs) != len(prompt_ids) - 1:
        raise ApiError(500, f"the engine reported {len(logprobs)} prompt log-probabilities for "
                            f"a prompt of {len(prompt_ids)} tokens", "incomplete_generation")
    tok = model.tokenizer
    out: oai.PromptLogprobs = [None]
    for i, logprob in enumerate(logprobs):
        actual = prompt_ids[i + 1]
        alternatives = list(top[i])[:k] if i < len(top) else []
        entry: dict[str, oai.PromptLogprob] = {}
        rank = next((r for r, alt in enumerate(alternatives, 1) if alt.id == actual), None)
        entry[str(actual)] = oai.PromptLogprob(logprob=logprob, rank=rank,
                                               decoded_token=tok.token_text(actual))
        for r, alt in enumerate(alternatives, 1):
            entry.setdefault(str(alt.id), oai.PromptLogprob(
                logprob=alt.logprob, rank=r, decoded_token=tok.token_text(alt.id)))
        out.append(entry)
    return out


def chunk_usage(prompt_tokens: int, generated: int) -> oai.Usage:
    """`usage` on one streamed chunk (`continuous_usage_stats`): the prompt and the tokens its
    choice has generated so far."""
    return oai.Usage(prompt_tokens=prompt_tokens, completion_tokens=generated,
                     total_tokens=prompt_tokens + generated)
