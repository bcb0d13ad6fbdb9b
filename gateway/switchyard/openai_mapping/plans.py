"""The adapters of chat and completion requests: their wire types read into `PlanFields`.

Each field is read once (`sampling_fields` for what chat and completions
share), checked by the range table in OpenAI's words (`switchyard.planning.rules`)
and built into a plan by `switchyard.planning.plan.build_plan`. vLLM's request
extensions are read here too (`min_tokens`, `stop_token_ids`,
`include_stop_str_in_output`, `truncate_prompt_tokens`, the chat template
fields, structured outputs); the few this server does not serve are a 400
naming them (`UNSERVED_VLLM_FIELDS`).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from switchyard.constraints import engine_can_constrain, response_format_constraint
from switchyard.errors import ApiError, validation_error
from switchyard.media import EncodedPrompt, ImageSet, encode_prompt
from switchyard.models.served import ServedModel
from switchyard.openai_mapping.completion_prompts import CompletionPrompt, completion_prompts
from switchyard.openai_mapping.extras import AnswerExtras, answer_extras
from switchyard.openai_mapping.structured import structured_output, structured_output_field
from switchyard.planning.defaults import apply_defaults
from switchyard.planning.fields import PlanFields
from switchyard.planning.plan import GenerationPlan, build_plan, truncate_prompt
from switchyard.planning.rules import check_fields
from switchyard.protocol import openai as oai
from switchyard.settings import ServeSettings, TokenLimits
from switchyard.state import Gateway
from switchyard.text.chat import ChatTemplateError, render_chat
from switchyard.tools.openai import ToolSetup, chat_messages, template_tools, tool_setup
from switchyard_spec import Constraint

MAX_N = 128
"""Most choices one request may ask for (OpenAI's own limit)."""
MAX_LOGIT_BIAS_ENTRIES = 300
"""Most tokens one `logit_bias` may name (OpenAI's own limit)."""
LOGIT_BIAS_RANGE = 100.0
MAX_TOP_LOGPROBS = 20
"""Chat's `top_logprobs` range is 0 to 20 (OpenAI's), whatever `--max-top-n-tokens` says."""
CONTEXT_EXCEEDED = "context_length_exceeded"
_REFUSED_CHAT_FIELDS = ("audio", "prediction", "reasoning_effort", "verbosity",
                        "web_search_options", "functions", "function_call", "chat_template",
                        "documents")
"""OpenAI and vLLM chat fields that would change the answer and are not served: a 400 names
them (`chat_template`: the server renders with the model's own template only)."""
UNSERVED_VLLM_FIELDS: tuple[tuple[str, str], ...] = (
    ("allowed_token_ids", "the engines have no allowed-token mask"),
    ("bad_words", "the engines have no banned-sequence filter"),
)
"""vLLM sampling fields refused by name, with the reason the error gives."""
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "tokenize", "add_generation_prompt",
    "continue_final_message", "chat_template", "return_dict", "return_assistant_tokens_mask",
})
"""Template arguments the request sets through its own fields."""


def invalid(message: str, param: str, code: str | None = None) -> ApiError:
    """An invalid request on the OpenAI routes (a 400 there, in OpenAI's words)."""
    return ApiError(400, message, "validation", param=param, code=code)


class WireNames(msgspec.Struct, frozen=True, kw_only=True):
    """What one request calls the fields its errors name (chat's, or the Responses API's)."""

    prompt: str = "messages"
    max_tokens: str = "max_tokens"
    response_format: str = "response_format"

    def renames(self) -> dict[str, str]:
        """Plan field names to this request's wire names, for `check_fields`."""
        return {"max_new_tokens": self.max_tokens}


CHAT_NAMES = WireNames()
COMPLETION_NAMES = WireNames(prompt="prompt")


def check_stream_options(stream: bool, options: oai.StreamOptions | None) -> None:
    """`stream_options` is only allowed with `stream: true`, as in OpenAI."""
    if options is not None and not stream:
        raise invalid("The 'stream_options' parameter is only allowed when 'stream' is "
                      "enabled.", "stream_options")


def check_context(n_in: int, max_tokens: int | None, limits: TokenLimits,
                  names: WireNames) -> None:
    """OpenAI's length rules: a prompt over the context, or a `max_tokens` over what the
    context leaves after the prompt, is a 400 that names the limit (never clamped)."""
    room = limits.max_total_tokens - n_in
    prompt = names.prompt
    if n_in > limits.max_input_tokens or room <= 0:
        longest = min(limits.max_input_tokens, limits.max_total_tokens - 1)
        raise invalid(
            f"This model's maximum input length is {longest} "
            f"tokens. However, your {prompt} resulted in {n_in} tokens. Please reduce "
            f"the length of the {prompt}.", prompt, CONTEXT_EXCEEDED)
    if max_tokens is not None and max_tokens > room:
        raise invalid(
            f"'{names.max_tokens}' is too large: {max_tokens}. This model's maximum context "
            f"length is {limits.max_total_tokens} tokens and your {prompt} resulted in "
            f"{n_in} tokens, so at most {room} tokens can be generated.",
            names.max_tokens, CONTEXT_EXCEEDED)


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def choice_count(n: int | None) -> int:
    """`n`, checked: how many independent choices to generate per prompt."""
    if n is None:
        return 1
    if not 1 <= n <= MAX_N:
        raise invalid(f"Invalid 'n': expected a value >= 1 and <= {MAX_N}, but got {n} "
                      "instead.", "n")
    return n


def logit_bias_pairs(
    bias: dict[str, float] | None, vocab_size: int
) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"<token id>": bias}` object as (token id, bias) pairs for the engine.

    Keys must be decimal token ids inside the model's vocabulary and biases in
    [-100, 100]; anything else is a 400 naming `logit_bias`.
    """
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(f"Invalid 'logit_bias': at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got "
                      f"{len(bias)}.", "logit_bias")
    pairs: list[tuple[int, float]] = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise invalid(f"Invalid 'logit_bias': keys must be token ids (decimal integers), "
                          f"got {key!r}.", "logit_bias")
        token_id = int(key)
        if token_id >= vocab_size:
            raise invalid(f"Invalid 'logit_bias': token id {token_id} is outside the "
                          f"vocabulary (ids 0 to {vocab_size - 1}).", "logit_bias")
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise invalid(f"Invalid 'logit_bias': values must be >= -100 and <= 100, got "
                          f"{value} for token {key}.", "logit_bias")
        pairs.append((token_id, float(value)))
    return tuple(sorted(pairs))


def _token_ids(ids: list[int] | None, vocab_size: int, param: str) -> tuple[int, ...]:
    for token_id in ids or ():
        if not 0 <= token_id < vocab_size:
            raise invalid(f"Invalid '{param}': token id {token_id} is outside the vocabulary "
                          f"(ids 0 to {vocab_size - 1}).", param)
    return tuple(ids or ())


def _refuse_unserved(req: oai.SamplingRequest) -> None:
    """vLLM's fields this server does not serve: a 400 naming the field, never silence."""
    for name, why in UNSERVED_VLLM_FIELDS:
        if getattr(req, name) is not None:
            raise invalid(f"'{name}' is not supported by this server: {why}.", name)
    if req.spaces_between_special_tokens is False:
        raise invalid("'spaces_between_special_tokens': false is not supported: special "
                      "tokens are decoded by the model's fast tokenizer, which writes no "
                      "spaces between them either way.", "spaces_between_special_tokens")


def sampling_fields(settings: ServeSettings, model: ServedModel, req: oai.SamplingRequest, *,
                    max_tokens: int | None, top_n: int, names: WireNames) -> PlanFields:
    """The plan fields chat and completion requests share, checked in OpenAI's words.

    OpenAI's meanings are kept where TGI's differ: temperature 0 is greedy and an
    absent temperature samples at 1; `presence_penalty` and `frequency_penalty` are
    OpenAI's additive penalties; stop strings are left out of the text (vLLM's
    `include_stop_str_in_output` keeps them).
    """
    _refuse_unserved(req)
    stop = _stops(req.stop)
    if len(stop) > settings.max_stop_sequences:
        raise invalid(f"Invalid 'stop': at most {settings.max_stop_sequences} stop sequences, "
                      f"got {len(stop)}.", "stop")
    vocab = model.info.vocab_size
    stop_ids = _token_ids(req.stop_token_ids, vocab, "stop_token_ids")
    if stop_ids and req.ignore_eos:
        raise invalid("'stop_token_ids' cannot be combined with 'ignore_eos': this server "
                      "ends on both through one set of end tokens.", "stop_token_ids")
    truncate = req.truncate_prompt_tokens
    if truncate == -1:  # vLLM: the model's longest prompt
        truncate = model.limits.max_input_tokens
    fields = PlanFields(
        do_sample=req.temperature != 0.0,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty, seed=req.seed,
        logit_bias=logit_bias_pairs(req.logit_bias, vocab),
        max_new_tokens=max_tokens, min_new_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
        stop=stop, stop_token_ids=stop_ids,
        include_stop=bool(req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False,
        top_n_tokens=top_n, truncate=truncate, details=True,
    )
    check_fields("openai", fields, names.renames())
    fields = apply_defaults(fields, settings.generation_defaults)
    if req.min_tokens is not None and max_tokens is not None and req.min_tokens > max_tokens:
        raise invalid(f"Invalid 'min_tokens': {req.min_tokens} is more than "
                      f"'{names.max_tokens}' ({max_tokens}).", "min_tokens")
    return fields


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
    chat template, with vLLM's template fields (`chat_template_kwargs`,
    `add_generation_prompt`, `continue_final_message`)."""
    if not req.messages:
        raise validation_error("`messages` cannot be empty", param="messages")
    messages = chat_messages(model, req, _message_text, tools)
    kwargs = req.chat_template_kwargs or {}
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise invalid(f"Invalid 'chat_template_kwargs': {', '.join(reserved)} "
                      f"{'is' if len(reserved) == 1 else 'are'} set by the request's own "
                      "fields, not by template arguments.", "chat_template_kwargs")
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise invalid("'continue_final_message' and 'add_generation_prompt' cannot both "
                          "be true.", "continue_final_message")
        if req.messages[-1].role != "assistant":
            raise invalid("'continue_final_message' needs the last message to be the "
                          "assistant's.", "continue_final_message")
    try:
        return render_chat(model.tokenizer, messages, tools=template_tools(tools),
                           template_kwargs=kwargs,
                           generation_prompt=req.add_generation_prompt is not False,
                           continue_final=req.continue_final_message)
    except ChatTemplateError as exc:
        raise ApiError(422, str(exc), "template_error") from exc


def _reject_unsupported_chat_fields(req: oai.ChatCompletionRequest) -> None:
    """Fields that cannot go together get a 422 that names them, never silence."""
    rf = req.response_format
    if req.tools is not None and rf is not None and (rf.type != "text" or rf.value is not None):
        # TGI's answer, even for `tools: []`.
        raise ApiError(422, "Tool error: Grammar and tools are mutually exclusive",
                       "tool_error", param="tools")


def chat_constraint(model: ServedModel, req: oai.ChatCompletionRequest,
                    names: WireNames = CHAT_NAMES) -> Constraint | None:
    """The constraint of a chat request's `response_format` or vLLM's structured-output
    fields, checked (None for text)."""
    rf = req.response_format
    constraint, param = structured_output(req), names.response_format
    if constraint is not None:
        param = structured_output_field(req)
        if rf is not None and rf.type != "text":
            raise invalid(f"'{param}' and 'response_format' cannot both constrain the answer.",
                          param)
    elif rf is not None:
        schema_config = None
        if rf.json_schema is not None:
            schema_config = msgspec.to_builtins(rf.json_schema)
            schema_config["schema"] = rf.json_schema.schema
        try:
            constraint = response_format_constraint(rf.type, schema_config, rf.value)
        except ApiError as exc:
            raise ApiError(exc.status, exc.message, exc.error_type, param=param) from None
    if constraint is not None and not engine_can_constrain(model):
        raise validation_error(
            f"`{param}` is not supported for model {model.name!r}: its engine "
            f"({model.engine_spec.name}) cannot constrain decoding", param=param)
    return constraint


class ChatPlan(msgspec.Struct, frozen=True, kw_only=True):
    """A validated chat request: one choice's plan, and how it calls tools (if it does)."""

    plan: GenerationPlan
    tools: ToolSetup | None = None
    prompt_text: str = ""
    """The rendered prompt (chat template applied) the plan's token ids encode."""
    extras: AnswerExtras = AnswerExtras()
    """vLLM's answer extensions the request asked for."""
    echo: str = ""
    """vLLM's chat `echo`: the last (assistant) message's text, which the answer starts with."""


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
    """OpenAI's rules on chat fields that are not generation fields."""
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


def chat_fields(gw: Gateway, model: ServedModel, req: oai.ChatCompletionRequest,
                extras: AnswerExtras) -> tuple[PlanFields, WireNames]:
    """Chat's adapter: the request's generation fields, and the names its errors use."""
    newer = req.max_completion_tokens is not None
    names = WireNames(max_tokens="max_completion_tokens" if newer else "max_tokens")
    fields = sampling_fields(
        gw.settings, model, req, names=names,
        top_n=max(req.top_logprobs or 0, extras.prompt_top_n),
        max_tokens=req.max_completion_tokens if newer else req.max_tokens)
    if req.echo and req.tools:
        raise invalid("'echo' is not served together with 'tools'.", "echo")
    choice_count(req.n)
    return msgspec.structs.replace(
        fields, prompt_logprobs=extras.prompt_logprobs is not None), names


def plan_chat_call(gw: Gateway, model: ServedModel, req: oai.ChatCompletionRequest,
                   images: ImageSet | None = None,
                   encode: PromptEncoder = encode_chat_prompt,
                   adapted: tuple[PlanFields, WireNames] | None = None) -> ChatPlan:
    """:func:`plan_chat`, with the request's tool calling (`tools`, `tool_choice`) and its
    `images` (from `switchyard.media.chat_images`, which also rewrote its `image_url` parts).
    ``encode`` tokenizes the rendered prompt; ``adapted`` holds the generation fields when
    another API's adapter read them (the Responses API plans its prompt as a chat)."""
    _check_chat_fields(req)
    # The Responses API has none of vLLM's answer extensions.
    extras = answer_extras(req, MAX_TOP_LOGPROBS) if adapted is None else AnswerExtras()
    fields, names = adapted or chat_fields(gw, model, req, extras)
    _reject_unsupported_chat_fields(req)
    constraint = chat_constraint(model, req, names)
    tools = tool_setup(model, req)
    if tools is not None:
        constraint = tools.constraint
    text = chat_prompt(model, req, tools)
    prompt = encode(model, text, images)
    ids, kept_images = truncate_prompt(prompt.ids, prompt.images, fields.truncate,
                                       "truncate_prompt_tokens")
    check_context(len(ids), fields.max_new_tokens, model.limits, names)
    plan = build_plan(ids, msgspec.structs.replace(fields, constraint=constraint), model.limits,
                      model.info.eos_token_ids, kept_images)
    echo = ""
    if req.echo and req.messages[-1].role == "assistant":
        echo = _message_text(req.messages[-1])
    return ChatPlan(plan=plan, tools=tools, prompt_text=text, extras=extras, echo=echo)


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
    extras: AnswerExtras = AnswerExtras()
    """vLLM's answer extensions the request asked for."""


def _best_of(req: oai.CompletionRequest, n: int) -> int:
    """`best_of`, checked: candidates per prompt, `n` when absent."""
    if req.best_of is None:
        return n
    if not n <= req.best_of <= MAX_N:
        raise invalid(f"Invalid 'best_of': expected a value >= 'n' ({n}) and <= {MAX_N}, but "
                      f"got {req.best_of} instead.", "best_of")
    if req.stream and req.best_of > n:
        raise invalid("'best_of' larger than 'n' cannot be streamed.", "best_of")
    return req.best_of


def plan_completion(gw: Gateway, model: ServedModel, req: oai.CompletionRequest) -> CompletionPlan:
    """Completions' adapter: the prompts, and one plan per prompt (one choice each)."""
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
    n = choice_count(req.n)
    best_of = _best_of(req, n)
    extras = answer_extras(req, top_n)
    fields = sampling_fields(
        gw.settings, model, req, names=COMPLETION_NAMES,
        top_n=max(req.logprobs or 0, extras.prompt_top_n),
        # Scoring runs the engine for one token and drops it: the forward pass over the
        # prompt computes that token's logits anyway, so it costs one sampling row, and
        # engines keep their one rule (every sequence ends with a token event).
        max_tokens=1 if score_only else req.max_tokens)
    constraint = structured_output(req)
    if constraint is not None and not engine_can_constrain(model):
        param = structured_output_field(req)
        raise invalid(f"'{param}' is not supported for model {model.name!r}: its engine "
                      f"({model.engine_spec.name}) cannot constrain decoding.", param)
    fields = msgspec.structs.replace(
        fields, prompt_logprobs=score_prompt or extras.prompt_logprobs is not None,
        score_only=score_only, constraint=constraint)
    plans = []
    for prompt in prompts:
        ids, _ = truncate_prompt(list(prompt.ids), (), fields.truncate, "truncate_prompt_tokens")
        check_context(len(ids), None if score_only else fields.max_new_tokens, model.limits,
                      COMPLETION_NAMES)
        plans.append(build_plan(ids, fields, model.limits, model.info.eos_token_ids))
    return CompletionPlan(prompts=prompts, plans=plans, n=n, best_of=best_of,
                          score_only=score_only, extras=extras)
