"""Request validation with TGI's rules, order and messages.

Both APIs end here: the OpenAI routes first map their fields onto TGI's
`GenerateParameters` (see `routes/openai.py`), so one set of rules guards the
engine. The result is a `GenerationPlan`, everything the engine and the text
pipeline need for one sequence.
"""

from __future__ import annotations

import secrets

import msgspec
from msgspec.structs import replace

from switchyard.errors import ApiError, validation_error
from switchyard.protocol.tgi import GenerateParameters
from switchyard.settings import ServeSettings, TokenLimits
from switchyard_spec import Constraint, ImageInput, SamplingParams, StoppingParams

# TGI validates the first 1024 new tokens against the total budget and re-queues
# beyond; Switchyard's engines stop at the total budget instead, with "length".
MAX_NEW_TOKENS_CHUNK = 1024


class GenerationPlan(msgspec.Struct, frozen=True, kw_only=True):
    """A validated request for one sequence."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stopping: StoppingParams
    stop_strings: tuple[str, ...] = ()
    include_stop: bool = True
    """TGI keeps a matched stop string in the text; OpenAI drops it."""
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


def _sampling_enabled(p: GenerateParameters) -> bool:
    """TGI samples when asked to, or when any warper would change the distribution."""
    return bool(
        p.do_sample
        or (p.temperature is not None and p.temperature != 1.0)
        or (p.top_k is not None and p.top_k != 0)
        or (p.top_p is not None and p.top_p < 1.0)
        or (p.typical_p is not None and p.typical_p < 1.0)
    )


def _sampling_requested(p: GenerateParameters) -> bool:
    """TGI's test for `best_of`: sampling asked for, or any warper given at all."""
    return bool(
        p.do_sample
        or p.temperature is not None
        or p.top_k is not None
        or p.top_p is not None
        or p.typical_p is not None
    )


def check_parameters(p: GenerateParameters, settings: ServeSettings, *,
                     max_top_n: int | None = None) -> None:
    """The parameter checks that need no tokenizer, in TGI's order.

    `max_top_n` replaces `--max-top-n-tokens` as the bound of `top_n_tokens` (OpenAI's
    chat allows 20 alternatives whatever TGI's flag says).
    """
    best_of = p.best_of if p.best_of is not None else 1
    if best_of > 1:
        if not _sampling_requested(p):
            raise validation_error("you must use sampling when `best_of` is > 1", param="best_of")
        if settings.max_best_of == 1:
            raise validation_error("`best_of` != 1 is not allowed for this endpoint", param="best_of")
        if best_of > settings.max_best_of:
            raise validation_error(
                f"`best_of` must be > 0 and <= {settings.max_best_of}. Given: {best_of}",
                param="best_of",
            )
    if best_of < 1:
        raise validation_error(
            f"`best_of` must be > 0 and <= {settings.max_best_of}. Given: {best_of}", param="best_of"
        )
    if p.temperature is not None and p.temperature <= 0:
        raise validation_error("`temperature` must be strictly positive", param="temperature")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0:
        raise validation_error(
            "`repetition_penalty` must be strictly positive", param="repetition_penalty"
        )
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        raise validation_error(
            "`frequency_penalty` must be >= -2.0 and <= 2.0", param="frequency_penalty"
        )
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise validation_error("`top_p` must be > 0.0 and < 1.0", param="top_p")
    if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
        raise validation_error("`typical_p` must be > 0.0 and < 1.0", param="typical_p")
    if p.top_k is not None and p.top_k <= 0:
        raise validation_error("`top_k` must be strictly positive", param="top_k")
    if p.max_new_tokens is not None and p.max_new_tokens <= 0:
        raise validation_error("`max_new_tokens` must be strictly positive", param="max_new_tokens")
    if len(p.stop) > settings.max_stop_sequences:
        raise validation_error(
            f"`stop` supports up to {settings.max_stop_sequences} stop sequences. "
            f"Given: {len(p.stop)}",
            param="stop",
        )
    if p.seed is not None and best_of > 1:
        raise validation_error("`seed` must not be set when `best_of` > 1", param="seed")
    if p.seed is not None and not 0 <= p.seed < 2**64:
        raise validation_error("`seed` must be >= 0 and < 2^64", param="seed")
    top_n = p.top_n_tokens or 0
    top_n_limit = settings.max_top_n_tokens if max_top_n is None else max_top_n
    if not 0 <= top_n <= top_n_limit:
        raise validation_error(
            f"`top_n_tokens` must be >= 0 and <= {top_n_limit}. Given: {top_n}",
            param="top_n_tokens",
        )
    # `grammar` is checked by the route (switchyard.constraints): it knows the model's engine.
    # `adapter_id` is checked by the route: it knows which model's adapters it names.


def check_inputs(inputs: str, p: GenerateParameters, limits: TokenLimits) -> None:
    """The input checks that precede tokenization."""
    if not inputs:
        raise validation_error("`inputs` cannot be empty", param="inputs")
    if p.truncate is not None and not 0 < p.truncate <= limits.max_input_tokens:
        raise validation_error(
            f"`truncate` must be strictly positive and less than {limits.max_input_tokens}. "
            f"Given: {p.truncate}",
            param="truncate",
        )


def build_plan(
    prompt_ids: list[int],
    p: GenerateParameters,
    limits: TokenLimits,
    eos_token_ids: tuple[int, ...],
    *,
    presence_penalty: float = 0.0,
    logit_bias: tuple[tuple[int, float], ...] = (),
    include_stop: bool = True,
    constraint: Constraint | None = None,
    images: tuple[ImageInput, ...] = (),
    min_new_tokens: int = 0,
    ignore_eos: bool = False,
) -> GenerationPlan:
    """Apply truncation and the token limits, then build the engine's parameters.

    `presence_penalty` and `logit_bias` come from the OpenAI routes only (TGI's
    parameters have neither); they arrive validated. `images` are the prompt's
    (`switchyard.media.encode_prompt`): their placeholder tokens are in
    `prompt_ids` and count as input tokens; a `truncate` that would cut into
    one is a 422. `min_new_tokens` and `ignore_eos` are vLLM's extensions on the OpenAI
    routes: no EOS (and no stop string) before that many tokens; no EOS at all.
    """
    if p.truncate is not None and len(prompt_ids) > p.truncate:
        cut = len(prompt_ids) - p.truncate
        if images and images[0].offset < cut:
            raise validation_error(
                f"`truncate` {p.truncate} would cut the prompt's image at token "
                f"{images[0].offset}; the prompt has {len(prompt_ids)} tokens, images included",
                param="truncate")
        images = tuple(msgspec.structs.replace(i, offset=i.offset - cut) for i in images)
        prompt_ids = prompt_ids[-p.truncate :]  # TGI keeps the last tokens
    n_in = len(prompt_ids)
    if p.max_new_tokens is not None:
        cap = p.max_new_tokens
        chunk = min(cap, MAX_NEW_TOKENS_CHUNK)
    else:
        cap = max(limits.max_total_tokens - n_in, 0)
        chunk = min(cap, MAX_NEW_TOKENS_CHUNK)
    if n_in + chunk > limits.max_total_tokens:
        raise validation_error(
            f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
            f"Given: {n_in} `inputs` tokens and {chunk} `max_new_tokens`",
            param="max_new_tokens",
        )
    if n_in > limits.max_input_tokens:
        raise validation_error(
            f"`inputs` must have less than {limits.max_input_tokens} tokens. Given: {n_in}",
            param="inputs",
        )
    # Past the total budget the sequence ends with "length", as TGI's re-queue does.
    cap = min(cap, limits.max_total_tokens - n_in)
    if cap <= 0:
        raise validation_error(
            f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
            f"Given: {n_in} `inputs` tokens and 0 `max_new_tokens`",
            param="max_new_tokens",
        )
    # best_of > 1 passed check_parameters only if sampling was asked for; N greedy
    # copies of one sequence would make it pointless, so it always samples.
    sampling = _sampling_enabled(p) or (p.best_of or 1) > 1
    seed = p.seed if p.seed is not None else (secrets.randbits(63) if sampling else None)
    return GenerationPlan(
        prompt_ids=tuple(prompt_ids),
        sampling=SamplingParams(
            do_sample=sampling,
            temperature=p.temperature if p.temperature is not None else 1.0,
            top_k=p.top_k or 0,
            top_p=p.top_p if p.top_p is not None else 1.0,
            typical_p=p.typical_p if p.typical_p is not None else 1.0,
            seed=seed,
            repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
            frequency_penalty=p.frequency_penalty or 0.0,
            presence_penalty=presence_penalty,
            top_n_tokens=p.top_n_tokens or 0,
            logit_bias=logit_bias,
            watermark=p.watermark,
        ),
        stopping=StoppingParams(max_new_tokens=cap, eos_token_ids=eos_token_ids,
                                min_new_tokens=min(min_new_tokens, cap), ignore_eos=ignore_eos),
        stop_strings=tuple(s for s in p.stop if s),
        include_stop=include_stop,
        details=p.details or p.decoder_input_details,
        return_full_text=bool(p.return_full_text),
        max_new_tokens_given=p.max_new_tokens is not None,
        prompt_logprobs=p.decoder_input_details,
        constraint=constraint,
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


__all__ = [
    "ApiError", "GenerationPlan", "build_plan", "check_inputs", "check_parameters", "fan_out",
]
