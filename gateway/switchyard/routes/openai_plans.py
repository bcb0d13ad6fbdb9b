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

import msgspec

from switchyard.constraints import engine_can_constrain, response_format_constraint
from switchyard.errors import ApiError, validation_error
from switchyard.media import ImageSet, encode_prompt
from switchyard.models.served import ServedModel
from switchyard.protocol import openai as oai
from switchyard.protocol.tgi import GenerateParameters
from switchyard.routes.completion_prompts import CompletionPrompt, completion_prompts
from switchyard.routes.openai_tools import ToolSetup, chat_messages, template_tools, tool_setup
from switchyard.state import Gateway
from switchyard.text.chat import ChatTemplateError, render_chat
from switchyard.validation import GenerationPlan, build_plan, check_parameters
from switchyard_spec import Constraint

MAX_N = 128
"""Most choices one request may ask for (OpenAI's own limit)."""
MAX_LOGIT_BIAS_ENTRIES = 300
"""Most tokens one `logit_bias` may name (OpenAI's own limit)."""
LOGIT_BIAS_RANGE = 100.0


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


def to_parameters(f: SamplingFields) -> GenerateParameters:
    """Map OpenAI sampling fields onto TGI's, with OpenAI's ranges checked first."""
    if f.temperature is not None and not 0.0 <= f.temperature <= 2.0:
        raise validation_error("`temperature` must be >= 0.0 and <= 2.0", param="temperature")
    if f.top_p is not None and not 0.0 < f.top_p <= 1.0:
        raise validation_error("`top_p` must be > 0.0 and <= 1.0", param="top_p")
    if f.presence_penalty is not None and not -2.0 <= f.presence_penalty <= 2.0:
        raise validation_error(
            "`presence_penalty` must be >= -2.0 and <= 2.0", param="presence_penalty"
        )
    if f.max_tokens is not None and f.max_tokens <= 0:
        raise validation_error("`max_tokens` must be strictly positive", param="max_tokens")
    choice_count(f.n)
    greedy = f.temperature == 0.0
    return GenerateParameters(
        # OpenAI's default temperature is 1: absent temperature samples, 0 is greedy.
        do_sample=not greedy,
        temperature=None if greedy else f.temperature,
        top_p=None if f.top_p is None or f.top_p >= 1.0 else f.top_p,
        max_new_tokens=f.max_tokens,
        stop=_stops(f.stop),
        seed=f.seed,
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


def plan_chat(gw: Gateway, model: ServedModel, req: oai.ChatCompletionRequest) -> GenerationPlan:
    """Validate a chat request, render its template and tokenize it (one choice's plan)."""
    return plan_chat_call(gw, model, req).plan


def plan_chat_call(gw: Gateway, model: ServedModel, req: oai.ChatCompletionRequest,
                   images: ImageSet | None = None) -> ChatPlan:
    """:func:`plan_chat`, with the request's tool calling (`tools`, `tool_choice`) and its
    `images` (from `switchyard.media.chat_images`, which also rewrote its `image_url` parts)."""
    if not req.messages:
        raise validation_error("`messages` cannot be empty", param="messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise validation_error("`top_logprobs` requires `logprobs` to be true",
                               param="top_logprobs")
    _reject_unsupported_chat_fields(req)
    constraint = chat_constraint(model, req)
    tools = tool_setup(model, req)
    if tools is not None:
        constraint = tools.constraint
    max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                  else req.max_tokens)
    params = to_parameters(SamplingFields(
        max_tokens=max_tokens,
        temperature=req.temperature, top_p=req.top_p, stop=req.stop, seed=req.seed,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        top_n_tokens=req.top_logprobs or 0, n=req.n,
    ))
    check_parameters(params, gw.settings)
    bias = logit_bias_pairs(req.logit_bias, model.info.vocab_size)
    prompt = encode_prompt(model, chat_prompt(model, req, tools), images,
                           add_special_tokens=False, api="openai")
    plan = build_plan(
        prompt.ids, params, model.limits, model.info.eos_token_ids,
        presence_penalty=req.presence_penalty or 0.0, logit_bias=bias, include_stop=False,
        constraint=constraint, images=prompt.images,
    )
    return ChatPlan(plan=plan, tools=tools)


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
    top_n = gw.settings.max_top_n_tokens
    if req.logprobs is not None and not 0 <= req.logprobs <= top_n:
        raise validation_error(f"`logprobs` must be >= 0 and <= {top_n}. Given: {req.logprobs}",
                               param="logprobs")
    score_only = req.max_tokens == 0
    if score_only and not req.echo:
        raise validation_error(
            "`max_tokens` 0 generates nothing and so needs `echo` (to score the prompt); "
            "without it `max_tokens` must be strictly positive",
            param="max_tokens")
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
    ))
    if req.repetition_penalty is not None:
        params.repetition_penalty = req.repetition_penalty
    params.decoder_input_details = score_prompt
    check_parameters(params, gw.settings)
    bias = logit_bias_pairs(req.logit_bias, model.info.vocab_size)
    plans = [
        msgspec.structs.replace(build_plan(list(prompt.ids), params, model.limits, model.info.eos_token_ids,
                           presence_penalty=req.presence_penalty or 0.0, logit_bias=bias,
                           include_stop=False), score_only=score_only)
        for prompt in prompts
    ]
    return CompletionPlan(prompts=prompts, plans=plans, n=n, best_of=best_of,
                          score_only=score_only)
