"""TGI's adapter: `GenerateParameters` read into `PlanFields`, with TGI's rules, order and
messages (every error a 422 "Input validation error: ...")."""

from __future__ import annotations

from switchyard.errors import validation_error
from switchyard.planning.fields import PlanFields
from switchyard.planning.plan import GenerationPlan, build_plan, truncate_prompt
from switchyard.planning.rules import check_fields
from switchyard.protocol.tgi import GenerateParameters
from switchyard.settings import ServeSettings, TokenLimits
from switchyard_spec import Constraint, ImageInput

MAX_NEW_TOKENS_CHUNK = 1024
"""TGI validates the first 1024 new tokens against the total budget and re-queues beyond;
Switchyard's engines stop at the total budget instead, with "length"."""


def _sampling_requested(p: GenerateParameters) -> bool:
    """TGI's test for `best_of`: sampling asked for, or any warper given at all."""
    return bool(p.do_sample or p.temperature is not None or p.top_k is not None
                or p.top_p is not None or p.typical_p is not None)


def tgi_fields(p: GenerateParameters, constraint: Constraint | None = None) -> PlanFields:
    """The plan fields of TGI's `parameters` (TGI samples only when a warper says so)."""
    return PlanFields(
        do_sample=True if p.do_sample else None,
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, typical_p=p.typical_p,
        repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
        seed=p.seed, watermark=p.watermark, max_new_tokens=p.max_new_tokens,
        stop=tuple(p.stop), top_n_tokens=p.top_n_tokens, prompt_logprobs=p.decoder_input_details,
        truncate=p.truncate, best_of=p.best_of, constraint=constraint, details=p.details,
        return_full_text=bool(p.return_full_text),
    )


def check_parameters(p: GenerateParameters, settings: ServeSettings) -> None:
    """The parameter checks that need no tokenizer, in TGI's order."""
    best_of = p.best_of if p.best_of is not None else 1
    if best_of > 1:
        if not _sampling_requested(p):
            raise validation_error("you must use sampling when `best_of` is > 1", param="best_of")
        if settings.max_best_of == 1:
            raise validation_error("`best_of` != 1 is not allowed for this endpoint",
                                   param="best_of")
    if not 0 < best_of <= settings.max_best_of:
        raise validation_error(
            f"`best_of` must be > 0 and <= {settings.max_best_of}. Given: {best_of}",
            param="best_of")
    check_fields("tgi", tgi_fields(p))
    if len(p.stop) > settings.max_stop_sequences:
        raise validation_error(
            f"`stop` supports up to {settings.max_stop_sequences} stop sequences. "
            f"Given: {len(p.stop)}", param="stop")
    if p.seed is not None and best_of > 1:
        raise validation_error("`seed` must not be set when `best_of` > 1", param="seed")
    top_n = p.top_n_tokens or 0
    if not 0 <= top_n <= settings.max_top_n_tokens:
        raise validation_error(
            f"`top_n_tokens` must be >= 0 and <= {settings.max_top_n_tokens}. Given: {top_n}",
            param="top_n_tokens")
    # `grammar` is checked by the route (switchyard.constraints): it knows the model's engine.
    # `adapter_id` is checked by the route: it knows which model's adapters it names.


def check_inputs(inputs: str, p: GenerateParameters, limits: TokenLimits) -> None:
    """The input checks that precede tokenization."""
    if not inputs:
        raise validation_error("`inputs` cannot be empty", param="inputs")
    if p.truncate is not None and not 0 < p.truncate <= limits.max_input_tokens:
        raise validation_error(
            f"`truncate` must be strictly positive and less than {limits.max_input_tokens}. "
            f"Given: {p.truncate}", param="truncate")


def check_lengths(n_in: int, max_new_tokens: int | None, limits: TokenLimits) -> None:
    """TGI's length checks on the (truncated) prompt and `max_new_tokens`."""
    room = max(limits.max_total_tokens - n_in, 0)
    chunk = min(room if max_new_tokens is None else max_new_tokens, MAX_NEW_TOKENS_CHUNK)
    too_long = validation_error(
        f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
        f"Given: {n_in} `inputs` tokens and {chunk} `max_new_tokens`", param="max_new_tokens")
    if n_in + chunk > limits.max_total_tokens:
        raise too_long
    if n_in > limits.max_input_tokens:
        raise validation_error(
            f"`inputs` must have less than {limits.max_input_tokens} tokens. Given: {n_in}",
            param="inputs")
    if room == 0:
        raise too_long


def plan_tgi_prompt(prompt_ids: list[int], p: GenerateParameters, limits: TokenLimits,
                    eos_token_ids: tuple[int, ...], *, constraint: Constraint | None = None,
                    images: tuple[ImageInput, ...] = ()) -> GenerationPlan:
    """Truncate (TGI's `truncate`), check the lengths and build the plan."""
    ids, images = truncate_prompt(prompt_ids, images, p.truncate, "truncate")
    check_lengths(len(ids), p.max_new_tokens, limits)
    return build_plan(ids, tgi_fields(p, constraint), limits, eos_token_ids, images)
