"""`GenerationPlan`: a checked request for one sequence, and how it is built.

`build_plan` takes the prompt's token ids and `PlanFields` that an adapter
has already checked (ranges, lengths) and puts the engine's defaults where a
field was not given. `truncate_prompt` and `fan_out` are the two steps around
it that every API shares.
"""

from __future__ import annotations

import secrets

import msgspec
from msgspec.structs import replace

from switchyard.errors import validation_error
from switchyard.planning.fields import PlanFields
from switchyard.settings import TokenLimits
from switchyard_spec import Constraint, ImageInput, SamplingParams, StoppingParams


class GenerationPlan(msgspec.Struct, frozen=True, kw_only=True):
    """A validated request for one sequence."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stopping: StoppingParams
    stop_strings: tuple[str, ...] = ()
    include_stop: bool = True
    """TGI keeps a matched stop string (or stop token) in the text; OpenAI drops it."""
    skip_special_tokens: bool = True
    """Leave special tokens' text out of the generated text."""
    details: bool = False
    return_full_text: bool = False
    max_new_tokens_given: bool = False
    prompt_logprobs: bool = False
    """Ask the engine for the prompt tokens' log-probabilities (TGI's `decoder_input_details`)."""
    constraint: Constraint | None = None
    """The grammar the text must follow (TGI's `grammar`, OpenAI's `response_format`)."""
    score_only: bool = False
    """Score the prompt and hand back no generated token (OpenAI's `max_tokens: 0`): the
    engine runs for one token, which telemetry counts as none generated of none asked."""
    images: tuple[ImageInput, ...] = ()
    """The prompt's images, their placeholder tokens already in `prompt_ids`
    (`switchyard.media`); empty for text."""


def truncate_prompt(prompt_ids: list[int], images: tuple[ImageInput, ...], keep: int | None,
                    param: str) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The last ``keep`` prompt tokens (TGI's `truncate`, vLLM's `truncate_prompt_tokens`),
    and the images' offsets moved with them; cutting into an image is a 422 naming ``param``."""
    if keep is None or len(prompt_ids) <= keep:
        return prompt_ids, images
    cut = len(prompt_ids) - keep
    if images and images[0].offset < cut:
        raise validation_error(
            f"`{param}` {keep} would cut the prompt's image at token {images[0].offset}; the "
            f"prompt has {len(prompt_ids)} tokens, images included", param=param)
    return prompt_ids[cut:], tuple(replace(i, offset=i.offset - cut) for i in images)


def sampling_enabled(f: PlanFields) -> bool:
    """Whether the plan samples: as asked, else when a warper would change the distribution
    (TGI's rule); `best_of` > 1 always samples (N greedy copies would be one answer N times)."""
    if (f.best_of or 1) > 1:
        return True
    if f.do_sample is not None:
        return f.do_sample
    return bool((f.temperature is not None and f.temperature != 1.0)
                or f.top_k
                or (f.top_p is not None and f.top_p < 1.0)
                or (f.typical_p is not None and f.typical_p < 1.0))


def build_plan(prompt_ids: list[int], f: PlanFields, limits: TokenLimits,
               eos_token_ids: tuple[int, ...],
               images: tuple[ImageInput, ...] = ()) -> GenerationPlan:
    """The engine's parameters for checked ``f``: defaults for what was not given, the
    generation capped by what the context leaves after the prompt (ending with "length")."""
    n_in = len(prompt_ids)
    room = limits.max_total_tokens - n_in
    cap = room if f.max_new_tokens is None else min(f.max_new_tokens, room)
    if cap <= 0:  # the adapters' length checks refuse this first, in their API's words
        raise validation_error(
            f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
            f"Given: {n_in} `inputs` tokens and 0 `max_new_tokens`", param="max_new_tokens")
    sampling = sampling_enabled(f)
    # A sampled sequence always has a seed, so that `details.seed` can replay it.
    seed = f.seed % 2**64 if f.seed is not None else (secrets.randbits(63) if sampling else None)
    warp = sampling  # greedy decoding ignores the warpers (they would turn sampling on)
    stops = tuple(dict.fromkeys((*eos_token_ids, *f.stop_token_ids)))
    return GenerationPlan(
        prompt_ids=tuple(prompt_ids),
        sampling=SamplingParams(
            do_sample=sampling,
            temperature=f.temperature if warp and f.temperature else 1.0,
            top_k=(f.top_k or 0) if warp else 0,
            top_p=f.top_p if warp and f.top_p is not None and f.top_p < 1.0 else 1.0,
            typical_p=f.typical_p if warp and f.typical_p is not None else 1.0,
            min_p=(f.min_p or 0.0) if warp else 0.0,
            seed=seed,
            repetition_penalty=1.0 if f.repetition_penalty is None else f.repetition_penalty,
            frequency_penalty=f.frequency_penalty or 0.0,
            presence_penalty=f.presence_penalty or 0.0,
            top_n_tokens=f.top_n_tokens or 0,
            logit_bias=f.logit_bias,
            watermark=f.watermark,
        ),
        stopping=StoppingParams(max_new_tokens=cap, eos_token_ids=stops,
                                min_new_tokens=min(f.min_new_tokens or 0, cap),
                                ignore_eos=f.ignore_eos),
        stop_strings=tuple(s for s in f.stop if s),
        include_stop=f.include_stop,
        skip_special_tokens=f.skip_special_tokens,
        details=f.details or f.prompt_logprobs,
        return_full_text=f.return_full_text,
        max_new_tokens_given=f.max_new_tokens is not None,
        prompt_logprobs=f.prompt_logprobs,
        constraint=f.constraint,
        score_only=f.score_only,
        images=images,
    )


def fan_out(plan: GenerationPlan, n: int) -> list[GenerationPlan]:
    """`n` plans for independent sequences of one prompt (OpenAI `n`, TGI `best_of`).

    Sampled copies get consecutive seeds, so the first one is the plan itself
    (the same text as `n=1` with that seed) and a seeded request stays
    reproducible; greedy copies are identical. Prompt log-probabilities are the
    same for every copy, so only the first asks the engine for them.
    """
    plans = [plan]
    for i in range(1, n):
        sampling = plan.sampling
        if sampling.do_sample and sampling.seed is not None:
            sampling = replace(sampling, seed=(sampling.seed + i) % 2**64)
        plans.append(replace(plan, sampling=sampling, prompt_logprobs=False))
    return plans
