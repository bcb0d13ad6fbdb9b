"""OpenAI request fields mapped onto Switchyard's generation plans.

OpenAI's ranges and fields (`n`, `logit_bias`, `logprobs`, `presence_penalty`)
are checked here first, then the request becomes TGI `GenerateParameters` and
passes the same rules as a TGI request (`switchyard.validation`), so one set of
rules guards the engine. OpenAI's meanings are kept where TGI's differ:
temperature 0 is greedy and an absent temperature samples at 1;
`presence_penalty` and `frequency_penalty` are OpenAI's additive penalties,
not TGI's `repetition_penalty` mapping; stop strings are left out of the text.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from switchyard.constraints import engine_can_constrain, response_format_constraint
from switchyard.errors import ApiError, validation_error
from switchyard.media import EncodedPrompt, ImageSet, encode_prompt
from switchyard.models.served import ServedModel
from switchyard.protocol import openai as oai
from switchyard.protocol.tgi import GenerateParameters
from switchyard.openai_mapping.completion_prompts import CompletionPrompt, completion_prompts
from switchyard.tools.openai import ToolSetup, chat_messages, template_tools, tool_setup
from switchyard.settings import TokenLimits
from switchyard.state import Gateway
from switchyard.text.chat import ChatTemplateError, render_chat
from switchyard.validation import GenerationPlan, build_plan, check_parameters
from switchyard_spec import Constraint

MAX_N = 128
"""Most choices one request may ask for (OpenAI's own limit)."""
MAX_LOGIT_BIAS_ENTRIES = 300
"""Most tokens one `logit_bias` may name (OpenAI's own limit)."""
LOGIT_BIAS_RANGE = 100.0
MAX_TOP_LOGPROBS = 20
"""Chat's `top_logprobs` range is 0 to 20 (OpenAI's), whatever `--max-top-n-tokens` says."""
SEED_RANGE = (-(2**63), 2**63 - 1)
"""OpenAI's `seed` is a signed 64-bit integer; the engines' seed space is [0, 2^64)."""
CONTEXT_EXCEEDED = "context_length_exceeded"
_REFUSED_CHAT_FIELDS = ("audio", "prediction", "reasoning_effort", "verbosity",
                        "web_search_options", "functions", "function_call")
"""OpenAI chat fields that would change the answer and are not served: a 400 names them."""


def invalid(message: str, param: str, code: str | None = None) -> ApiError:
    """An invalid request on the OpenAI routes (a 400 there, in OpenAI's words)."""
    return ApiError(400, message, "validation", param=param, code=code)


class SamplingFields(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling fields chat and completion requests share."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    stop: str | list[str] | None
    seed: int | None
    frequency_penalty: float | None
    presence_penalty: float | None
    top_n_tokens: int
    n: int | None
    top_k: int | None = None
    repetition_penalty: float | None = None
    max_tokens_param: str = "max_tokens"
    """The field the client set `max_tokens` with (chat also has `max_completion_tokens`)."""


def engine_seed(seed: int | None) -> int | None:
    """OpenAI's signed 64-bit `seed` in the engines' [0, 2^64): a negative seed is taken
    modulo 2^64 (-1 is 2^64 - 1), so every seed maps to its own engine seed."""
    if seed is None:
        return None
    low, high = SEED_RANGE
    if not low <= seed <= high:
        raise invalid(f"Invalid 'seed': expected a signed 64-bit integer ({low} to {high}), "
                      f"but got {seed} instead.", "seed")
    return seed % 2**64


def check_stream_options(stream: bool, options: oai.StreamOptions | None) -> None:
    """`stream_options` is only allowed with `stream: true`, as in OpenAI."""
    if options is not None and not stream:
        raise invalid("The 'stream_options' parameter is only allowed when 'stream' is "
                      "enabled.", "stream_options")


def check_min_tokens(min_tokens: int | None, max_tokens: int | None) -> int:
    """vLLM's `min_tokens`, checked: 0 when absent, never above `max_tokens`."""
    if min_tokens is None:
        return 0
    if min_tokens < 0:
        raise invalid(f"Invalid 'min_tokens': expected a value >= 0, but got {min_tokens} "
                      "instead.", "min_tokens")
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid(f"Invalid 'min_tokens': {min_tokens} is more than 'max_tokens' "
                      f"({max_tokens}).", "min_tokens")
    return min_tokens


def check_context(n_in: int, max_tokens: int | None, limits: TokenLimits, prompt_param: str,
                  max_tokens_param: str = "max_tokens") -> None:
    """OpenAI's length rules: a prompt over the context, or a `max_tokens` over what the
    context leaves after the prompt, is a 400 that names the limit (never clamped)."""
    room = limits.max_total_tokens - n_in
    if n_in > limits.max_input_tokens or room <= 0:
        longest = min(limits.max_input_tokens, limits.max_total_tokens - 1)
        raise invalid(
            f"This model's maximum input length is {longest} "
            f"tokens. However, your {prompt_param} resulted in {n_in} tokens. Please reduce "
            f"the length of the {prompt_param}.", prompt_param, CONTEXT_EXCEEDED)
    if max_tokens is not None and max_tokens > room:
        raise invalid(
            f"'{max_tokens_param}' is too large: {max_tokens}. This model's maximum context "
            f"length is {limits.max_total_tokens} tokens and your {prompt_param} resulted in "
            f"{n_in} tokens, so at most {room} tokens can be generated.",
            max_tokens_param, CONTEXT_EXCEEDED)


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def choice_count(n: int | None) -> int:
    """`n`, checked: how many independent choices to generate per prompt."""
    if n is None:
        return 1
    if n < 1:
        raise validation_error(
            "Invalid 'n': integer below minimum value. "
            f"Expected a value >= 1, but got {n} instead.",
            param="n",
        )
    if n > MAX_N:
        raise validation_error(
            f"Invalid 'n': integer above maximum value. Expected a value <= {MAX_N}, "
            f"but got {n} instead.",
            param="n",
        )
    return n


def logit_bias_pairs(
    bias: dict[str, float] | None, vocab_size: int
) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"<token id>": bias}` object as (token id, bias) pairs for the engine.

    Keys must be decimal token ids inside the model's vocabulary and biases in
    [-100, 100]; anything else is a 422 naming `logit_bias`.
    """
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise validation_error(
            f"`logit_bias` may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens. Given: {len(bias)}",
            param="logit_bias",
        )
    pairs: list[tuple[int, float]] = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise validation_error(
                f"`logit_bias` keys must be token ids (decimal integers). Given: {key!r}",
                param="logit_bias",
            )
        token_id = int(key)
        if token_id >= vocab_size:
            raise validation_error(
                f"`logit_bias` token id {token_id} is outside the vocabulary "
                f"(ids 0 to {vocab_size - 1})",
                param="logit_bias",
            )
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise validation_error(
                f"`logit_bias` values must be >= -100 and <= 100. Given: {value} for token {key}",
                param="logit_bias",
            )
        pairs.append((token_id, float(value)))
    return tuple(sorted(pairs))


def _in_range(value: float | None, param: str, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:
        side = "below minimum" if value < low else "above maximum"
        bound = f">= {low}" if value < low else f"<= {high}"
        raise invalid(f"Invalid '{param}': decimal {side} value. Expected a value {bound}, "
                      f"but got {value} instead.", param)


def to_parameters(f: SamplingFields) -> GenerateParameters:
    """Map OpenAI sampling fields onto TGI's, with OpenAI's ranges checked first (so that
    TGI's checks, worded with TGI's names, never see a value they would refuse)."""
    _in_range(f.temperature, "temperature", 0.0, 2.0)
    if f.top_p is not None and not 0.0 < f.top_p <= 1.0:
        raise invalid(f"Invalid 'top_p': expected a value > 0 and <= 1, but got {f.top_p} "
                      "instead.", "top_p")
    _in_range(f.presence_penalty, "presence_penalty", -2.0, 2.0)
    _in_range(f.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    if f.max_tokens is not None and f.max_tokens <= 0:
        raise invalid(f"Invalid '{f.max_tokens_param}': integer below minimum value. Expected "
                      f"a value >= 1, but got {f.max_tokens} instead.", f.max_tokens_param)
    if f.top_k is not None and f.top_k < 0:
        raise invalid(f"Invalid 'top_k': expected a value >= 0 (0 or absent: no limit), but "
                      f"got {f.top_k} instead.", "top_k")
    if f.repetition_penalty is not None and f.repetition_penalty <= 0:
        raise invalid(f"Invalid 'repetition_penalty': expected a value > 0, but got "
                      f"{f.repetition_penalty} instead.", "repetition_penalty")
    choice_count(f.n)
    greedy = f.temperature == 0.0
    return GenerateParameters(
        # OpenAI's default temperature is 1: absent temperature samples, 0 is greedy.
        do_sample=not greedy,
        temperature=None if greedy else f.temperature,
        # Temperature 0 is greedy whatever the warpers say (they would turn sampling on).
        top_p=None if greedy or f.top_p is None or f.top_p >= 1.0 else f.top_p,
        top_k=None if greedy else f.top_k or None,
        repetition_penalty=f.repetition_penalty,
        max_new_tokens=f.max_tokens,
        stop=_stops(f.stop),
        seed=engine_seed(f.seed),
        frequency_penalty=f.frequency_penalty,
        top_n_tokens=f.top_n_tokens,
        details=True,
    )


def _message_text(message: oai.ChatMessageIn) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise validation_error(
                f"content part of type {part.type!r} is not supported by this model",
                param="messages",
            )
        parts.append(part.text)
    return "".join(parts)


def chat_prompt(model: ServedModel, req: oai.ChatCompletionRequest,
                tools: ToolSetup | None = None) -> str:
    """The prompt text of a chat request: its messages (and ``tools``) through the model's
    chat template."""
    if not req.messages:
        raise validation_error("`messages` cannot be empty", param="messages")
    messages = chat_messages(model, req, _message_text, tools)
    try:
        return render_chat(model.tokenizer, messages, tools=template_tools(tools))
    except ChatTemplateError as exc:
        raise ApiError(422, str(exc), "template_error") from exc


def _reject_unsupported_chat_fields(req: oai.ChatCompletionRequest) -> None:
    """Fields that cannot go together get a 422 that names them, never silence."""
    rf = req.response_format
    if req.tools is not None and rf is not None and (rf.type != "text" or rf.value is not None):
        # TGI's answer, even for `tools: []`.
        raise ApiError(422, "Tool error: Grammar and tools are mutually exclusive",
                       "tool_error", param="tools")


def chat_constraint(model: ServedModel, req: oai.ChatCompletionRequest) -> Constraint | None:
    """The constraint of a chat request's `response_format`, checked (None for text)."""
    rf = req.response_format
    if rf is None:
        return None
    schema_config = None
    if rf.json_schema is not None:
        schema_config = msgspec.to_builtins(rf.json_schema)
        schema_config["schema"] = rf.json_schema.schema
    constraint = response_format_constraint(rf.type, schema_config, rf.value)
    if constraint is not None and not engine_can_constrain(model):
        raise validation_error(
            f"`response_format` of type {rf.type!r} is not supported for model {model.name!r}: "
            f"its engine ({model.engine_spec.name}) cannot constrain decoding",
            param="response_format")
    return constraint


class ChatPlan(msgspec.Struct, frozen=True, kw_only=True):
    """A validated chat request: one choice's plan, and how it calls tools (if it does)."""

    plan: GenerationPlan
    tools: ToolSetup | None = None
    prompt_text: str = ""
    """The rendered prompt (chat template applied) the plan's token ids encode."""


PromptEncoder = Callable[[ServedModel, str, ImageSet | None], EncodedPrompt]
"""Tokenizes a rendered chat prompt (the Responses API's encoder reuses a stored
conversation's tokens)."""


def encode_chat_prompt(model: ServedModel, text: str, images: ImageSet | None) -> EncodedPrompt:
    """A rendered chat prompt's tokens: the template wrote the special tokens itself."""
    return encode_prompt(model, text, images, add_special_tokens=False, api="openai")


def plan_chat(gw: Gateway, model: ServedModel, req: oai.ChatCompletionRequest) -> GenerationPlan:
    """Validate a chat request, render its template and tokenize it (one choice's plan)."""
    return plan_chat_call(gw, model, req).plan


def _check_chat_fields(req: oai.ChatCompletionRequest) -> None:
    """OpenAI's rules on chat fields that TGI's checks do not know."""
    if not req.messages:
        raise invalid("Invalid 'messages': empty array. Expected an array with minimum "
                      "length 1, but got an empty array instead.", "messages")
    for name in _REFUSED_CHAT_FIELDS:
        if getattr(req, name) is not None:
            raise invalid(f"'{name}' is not supported by this server.", name)
    if req.modalities is not None and set(req.modalities) - {"text"}:
        raise invalid(f"Invalid 'modalities': only [\"text\"] is served, got "
                      f"{req.modalities}.", "modalities")
    check_stream_options(req.stream, req.stream_options)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise invalid("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise invalid(f"Invalid 'top_logprobs': expected a value from 0 to "
                          f"{MAX_TOP_LOGPROBS}, but got {req.top_logprobs} instead.",
                          "top_logprobs")


def plan_chat_call(gw: Gateway, model: ServedModel, req: oai.ChatCompletionRequest,
                   images: ImageSet | None = None,
                   encode: PromptEncoder = encode_chat_prompt) -> ChatPlan:
    """:func:`plan_chat`, with the request's tool calling (`tools`, `tool_choice`) and its
    `images` (from `switchyard.media.chat_images`, which also rewrote its `image_url` parts).
    ``encode`` tokenizes the rendered prompt."""
    _check_chat_fields(req)
    _reject_unsupported_chat_fields(req)
    constraint = chat_constraint(model, req)
    tools = tool_setup(model, req)
    if tools is not None:
        constraint = tools.constraint
    newer = req.max_completion_tokens is not None
    max_tokens = req.max_completion_tokens if newer else req.max_tokens
    max_param = "max_completion_tokens" if newer else "max_tokens"
    params = to_parameters(SamplingFields(
        max_tokens=max_tokens, max_tokens_param=max_param,
        temperature=req.temperature, top_p=req.top_p, stop=req.stop, seed=req.seed,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        top_n_tokens=req.top_logprobs or 0, n=req.n, top_k=req.top_k,
        repetition_penalty=req.repetition_penalty,
    ))
    min_tokens = check_min_tokens(req.min_tokens, max_tokens)
    check_parameters(params, gw.settings, max_top_n=MAX_TOP_LOGPROBS)
    bias = logit_bias_pairs(req.logit_bias, model.info.vocab_size)
    text = chat_prompt(model, req, tools)
    prompt = encode(model, text, images)
    check_context(len(prompt.ids), max_tokens, model.limits, "messages", max_param)
    plan = build_plan(
        prompt.ids, params, model.limits, model.info.eos_token_ids,
        presence_penalty=req.presence_penalty or 0.0, logit_bias=bias, include_stop=False,
        constraint=constraint, images=prompt.images, min_new_tokens=min_tokens,
        ignore_eos=req.ignore_eos,
    )
    return ChatPlan(plan=plan, tools=tools, prompt_text=text)


class CompletionPlan(msgspec.Struct, frozen=True, kw_only=True):
    """A validated completion request: its prompts, one plan per prompt, and how to answer."""

    prompts: list[CompletionPrompt]
    plans: list[GenerationPlan]
    """One per prompt; `fan_out` makes the `best_of` candidates of each."""
    n: int
    """Choices returned per prompt."""
    best_of: int
    """Candidates generated per prompt (>= `n`)."""
    score_only: bool
    """`max_tokens: 0` with `echo`: score the prompt, return no generated token."""


def _best_of(req: oai.CompletionRequest, n: int) -> int:
    """`best_of`, checked: candidates per prompt, `n` when absent."""
    if req.best_of is None:
        return n
    if not n <= req.best_of <= MAX_N:
        raise validation_error(
            f"`best_of` must be >= `n` ({n}) and <= {MAX_N}. Given: {req.best_of}",
            param="best_of")
    if req.stream and req.best_of > n:
        raise validation_error("`best_of` larger than `n` cannot be streamed", param="best_of")
    return req.best_of


def plan_completion(gw: Gateway, model: ServedModel, req: oai.CompletionRequest) -> CompletionPlan:
    """Validate a completion request: its prompts, and one plan per prompt (one choice each)."""
    # With echo, logprobs cover the prompt's tokens too: the engine scores them in prefill.
    score_prompt = req.echo and req.logprobs is not None
    prompts = completion_prompts(
        req.prompt, model.tokenizer, model.info.vocab_size,
        gw.settings.max_client_batch_size, with_spans=score_prompt)
    if req.suffix is not None:
        raise ApiError(
            422,
            "Suffix is not supported and can be achieved by preprocessing the prompt.",
            "suffix not supported",
            param="suffix",
        )
    check_stream_options(req.stream, req.stream_options)
    top_n = gw.settings.max_top_n_tokens
    if req.logprobs is not None and not 0 <= req.logprobs <= top_n:
        raise invalid(f"Invalid 'logprobs': expected a value from 0 to {top_n}, but got "
                      f"{req.logprobs} instead.", "logprobs")
    score_only = req.max_tokens == 0
    if score_only and not req.echo:
        raise invalid(
            "'max_tokens' 0 generates nothing and so needs 'echo' (to score the prompt); "
            "without it 'max_tokens' must be at least 1.", "max_tokens")
    min_tokens = check_min_tokens(req.min_tokens, req.max_tokens)
    n = choice_count(req.n)
    best_of = _best_of(req, n)
    params = to_parameters(SamplingFields(
        # Scoring runs the engine for one token and drops it: the forward pass over the
        # prompt computes that token's logits anyway, so it costs one sampling row, and
        # engines keep their one rule (every sequence ends with a token event).
        max_tokens=1 if score_only else req.max_tokens,
        temperature=req.temperature, top_p=req.top_p, stop=req.stop,
        seed=req.seed, frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty, top_n_tokens=req.logprobs or 0, n=req.n,
        top_k=req.top_k, repetition_penalty=req.repetition_penalty,
    ))
    params.decoder_input_details = score_prompt
    check_parameters(params, gw.settings)
    bias = logit_bias_pairs(req.logit_bias, model.info.vocab_size)
    for prompt in prompts:
        check_context(len(prompt.ids), None if score_only else req.max_tokens, model.limits,
                      "prompt")
    plans = [
        msgspec.structs.replace(build_plan(
            list(prompt.ids), params, model.limits, model.info.eos_token_ids,
            presence_penalty=req.presence_penalty or 0.0, logit_bias=bias, include_stop=False,
            min_new_tokens=min_tokens, ignore_eos=req.ignore_eos), score_only=score_only)
        for prompt in prompts
    ]
    return CompletionPlan(prompts=prompts, plans=plans, n=n, best_of=best_of,
                          score_only=score_only)
