"""OpenAI's wire types for chat completions, completions and models, as msgspec Structs.

These follow the OpenAI API rather than TGI's deviations from it (real ids,
`finish_reason` "stop" for stop strings, `logit_bias` as a token-id map), and
accept TGI's extensions (`repetition_penalty`, `tool_prompt`, a `value` in
`response_format`). Docstrings and `Meta(description=...)` become the
descriptions of the OpenAPI document (`switchyard openapi`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta


class ImageUrl(msgspec.Struct, kw_only=True):
    """`image_url` of an image content part."""

    url: Annotated[str, Meta(description="An http(s) URL or a `data:` URL.")]
    detail: Annotated[str | None, Meta(description="OpenAI's resolution hint.")] = None


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a multi-part message content; only `text` parts carry text."""

    type: Annotated[str, Meta(description="`text` or `image_url`.")]
    text: Annotated[str | None, Meta(description="The text of a `text` part.")] = None
    image_url: Annotated[ImageUrl | None, Meta(description="The image of an `image_url` "
                                                          "part.")] = None


class FunctionCall(msgspec.Struct, kw_only=True):
    """The function of a tool call in a message."""

    name: Annotated[str, Meta(description="Function name.")]
    arguments: Annotated[Any, Meta(
        description="Arguments: a JSON text (OpenAI) or a JSON value (TGI).")] = None
    description: Annotated[str | None, Meta(description="Function description.")] = None


class ToolCall(msgspec.Struct, kw_only=True):
    """A tool call an assistant made, in a message."""

    id: Annotated[str, Meta(description="Call id; a `tool` message answers it by this id.")]
    function: Annotated[FunctionCall, Meta(description="The function called.")]
    type: Annotated[str, Meta(description="Always `function`.")] = "function"


class ChatMessageIn(msgspec.Struct, kw_only=True):
    """A message in a chat request."""

    role: Annotated[str, Meta(description="`system`, `user`, `assistant` or `tool`.")]
    content: Annotated[str | list[ContentPart] | None, Meta(
        description="Text, or a list of content parts.")] = None
    name: Annotated[str | None, Meta(description="Name of the participant.")] = None
    tool_calls: Annotated[list[ToolCall] | None, Meta(
        description="Tool calls of an earlier assistant message.")] = None
    tool_call_id: Annotated[str | None, Meta(
        description="The call a `tool` message answers.")] = None


class StreamOptions(msgspec.Struct, kw_only=True):
    """`stream_options` of a streamed request (only with `stream: true`)."""

    include_usage: Annotated[bool, Meta(
        description="Send one more chunk before `[DONE]`, with empty `choices` and the "
                    "request's `usage`.")] = False
    include_obfuscation: Annotated[bool | None, Meta(
        description="Accepted, not used: chunks carry no obfuscation padding.")] = None
    continuous_usage_stats: Annotated[bool | None, Meta(
        description="vLLM's extension: every chunk carries `usage` so far (its choice's "
                    "tokens).")] = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    """A function the model may call."""

    name: Annotated[str, Meta(description="Function name.")]
    description: Annotated[str | None, Meta(description="What the function does.")] = None
    parameters: Annotated[Any, Meta(
        description="JSON schema of the arguments (OpenAI's name).")] = None
    arguments: Annotated[Any, Meta(
        description="JSON schema of the arguments (TGI's name for `parameters`).")] = None
    strict: Annotated[bool | None, Meta(
        description="OpenAI's strict schema: every object closed (`additionalProperties: "
                    "false`) with every property required, else a 422.")] = None


class Tool(msgspec.Struct, kw_only=True):
    """A tool the model may call."""

    function: Annotated[FunctionDefinition, Meta(description="The function.")]
    type: Annotated[str, Meta(description="Always `function`.")] = "function"


class FunctionName(msgspec.Struct, kw_only=True):
    """A function, by name."""

    name: Annotated[str, Meta(description="Function name.")]


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """`tool_choice` naming the function the model must call."""

    function: Annotated[FunctionName, Meta(description="The function to call.")]
    type: Annotated[str, Meta(description="Always `function`.")] = "function"


class JsonSchemaConfig(msgspec.Struct, kw_only=True):
    """`json_schema` of a `response_format`."""

    name: Annotated[str | None, Meta(description="Name of the schema.")] = None
    schema: Annotated[Any, Meta(description="The JSON schema.")] = None
    description: Annotated[str | None, Meta(description="What the schema describes.")] = None
    strict: Annotated[bool | None, Meta(description="OpenAI's strict schema adherence.")] = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """`response_format` of a chat request: OpenAI's form or TGI's `{type, value}`."""

    type: Annotated[str, Meta(
        description="`text`, `json_object` or `json_schema` (OpenAI); `json`, `json_schema` "
                    "or `regex` with `value` (TGI).")]
    json_schema: Annotated[JsonSchemaConfig | None, Meta(
        description="The schema, for OpenAI's `json_schema`.")] = None
    value: Annotated[Any, Meta(
        description="TGI's form: the JSON schema or the regular expression.")] = None


_MODEL = ("Served model name. Absent, or TGI's placeholders `tgi` and `dummy`, mean the "
          "default model; any other unknown name is a 404.")
_MAX_TOKENS = "Most tokens to generate. Default: what `--max-total-tokens` leaves after the prompt."
_TEMPERATURE = "Sampling temperature from 0 to 2; 0 is greedy. Default 1."
_TOP_P = "Nucleus sampling: keep the most likely tokens whose probabilities add up to p."
_N = "Number of choices to generate."
_STOP = "Up to `--max-stop-sequences` strings that end generation; they are left out of the text."
_STREAM = "Answer with server-sent events, ended by `data: [DONE]`."
_FREQUENCY = "From -2.0 to 2.0: penalize tokens by how often they already appear."
_PRESENCE = "From -2.0 to 2.0: penalize tokens that already appear."
_LOGIT_BIAS = "Map of token ids (as strings) to a bias from -100 to 100 added to their logits."
_USER = "End-user id (accepted, not used)."
_SEED = ("Sampling seed, a signed 64-bit integer, for reproducible output (a negative seed "
         "is taken modulo 2^64).")
_MIN_TOKENS = ("vLLM's extension: generate at least this many tokens; EOS and stop strings "
               "cannot end the text before then (`max_tokens` still does).")
_TOP_K = "vLLM's and TGI's extension: sample from the k most likely tokens only."
_REPETITION = "TGI's multiplicative repetition penalty (> 0); 1.0 is none."
_IGNORE_EOS = "vLLM's extension: keep generating past EOS, up to `max_tokens`."
_UNUSED = "Accepted, not used: it does not change the answer."
_REFUSED = "Not supported: any value but null is a 400 naming it."


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: one constraint on the generated text."""

    json: Annotated[Any, Meta(description="A JSON schema (an object or its JSON text).")] = None
    regex: Annotated[str | None, Meta(description="A regular expression.")] = None
    choice: Annotated[list[str] | None, Meta(
        description="The text is exactly one of these strings.")] = None
    grammar: Annotated[str | None, Meta(
        description="A grammar in xgrammar's EBNF with a `root` rule.")] = None
    json_object: Annotated[bool | None, Meta(description="Any JSON object.")] = None
    structural_tag: Annotated[Any, Meta(description=_REFUSED)] = None
    disable_any_whitespace: Annotated[bool | None, Meta(
        description="Accepted: JSON grammars here allow no whitespace between tokens "
                    "beyond what the schema's grammar allows.")] = None
    disable_fallback: Annotated[bool | None, Meta(description="Accepted: there is one "
                                                              "backend.")] = None
    disable_additional_properties: Annotated[bool | None, Meta(
        description="Not supported: any value but null is refused by name.")] = None
    whitespace_pattern: Annotated[str | None, Meta(
        description="Not supported: any value but null is refused by name.")] = None


class SamplingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields chat and completion requests share; unknown fields are a 400 naming them."""

    model: Annotated[str | None, Meta(description=_MODEL)] = None
    temperature: Annotated[float | None, Meta(description=_TEMPERATURE)] = None
    top_p: Annotated[float | None, Meta(description=_TOP_P)] = None
    n: Annotated[int | None, Meta(description=_N)] = None
    stop: Annotated[str | list[str] | None, Meta(description=_STOP)] = None
    seed: Annotated[int | None, Meta(description=_SEED)] = None
    stream: Annotated[bool, Meta(description=_STREAM)] = False
    stream_options: Annotated[StreamOptions | None, Meta(
        description="Options of a streamed answer; only with `stream: true`.")] = None
    frequency_penalty: Annotated[float | None, Meta(description=_FREQUENCY)] = None
    presence_penalty: Annotated[float | None, Meta(description=_PRESENCE)] = None
    logit_bias: Annotated[dict[str, float] | None, Meta(description=_LOGIT_BIAS)] = None
    user: Annotated[str | None, Meta(description=_USER)] = None
    min_tokens: Annotated[int | None, Meta(description=_MIN_TOKENS)] = None
    top_k: Annotated[int | None, Meta(description=_TOP_K)] = None
    repetition_penalty: Annotated[float | None, Meta(description=_REPETITION)] = None
    ignore_eos: Annotated[bool, Meta(description=_IGNORE_EOS)] = False
    stop_token_ids: Annotated[list[int] | None, Meta(
        description="vLLM's extension: token ids that end the text as EOS does "
                    "(`finish_reason` `stop`; the token's text is left out).")] = None
    include_stop_str_in_output: Annotated[bool | None, Meta(
        description="vLLM's extension: keep the matched stop string (or stop token's "
                    "text) at the end of the text.")] = None
    skip_special_tokens: Annotated[bool | None, Meta(
        description="vLLM's extension: false keeps special tokens' text in the output "
                    "(default true).")] = None
    spaces_between_special_tokens: Annotated[bool | None, Meta(
        description="vLLM's extension: only true (the default) is served.")] = None
    truncate_prompt_tokens: Annotated[int | None, Meta(
        description="vLLM's extension: keep only the last this many prompt tokens "
                    "(-1: the longest prompt the model takes).")] = None
    min_p: Annotated[float | None, Meta(
        description="vLLM's extension, from 0 to 1: drop tokens less likely than min_p times "
                    "the most likely one (after top-k and top-p, as transformers does).")
    ] = None
    allowed_token_ids: Annotated[list[int] | None, Meta(description=_REFUSED)] = None
    bad_words: Annotated[list[str] | None, Meta(description=_REFUSED)] = None
    structured_outputs: Annotated[StructuredOutputs | None, Meta(
        description="vLLM's extension: constrain the text (`json`, `regex`, `choice`, "
                    "`grammar`), through the grammar engine `response_format` uses.")] = None
    guided_json: Annotated[Any, Meta(description="vLLM's older name of "
                                                 "`structured_outputs.json`.")] = None
    guided_regex: Annotated[str | None, Meta(description="vLLM's older name of "
                                                         "`structured_outputs.regex`.")] = None
    guided_choice: Annotated[list[str] | None, Meta(
        description="vLLM's older name of `structured_outputs.choice`.")] = None
    guided_grammar: Annotated[str | None, Meta(
        description="vLLM's older name of `structured_outputs.grammar`.")] = None
    guided_decoding_backend: Annotated[str | None, Meta(
        description="`xgrammar` or `auto` (the one grammar engine); others are a 400.")] = None
    return_token_ids: Annotated[bool | None, Meta(
        description="vLLM's extension: the answer carries `prompt_token_ids` and each "
                    "choice's `token_ids`.")] = None
    return_tokens_as_token_ids: Annotated[bool | None, Meta(
        description="vLLM's extension: logprob tokens are written `token_id:N`.")] = None
    prompt_logprobs: Annotated[int | None, Meta(
        description="vLLM's extension: the prompt tokens' log-probabilities with this many "
                    "alternatives per position, in `prompt_logprobs`.")] = None


class ChatCompletionRequest(SamplingRequest, kw_only=True, forbid_unknown_fields=True):
    """Body of `POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessageIn], Meta(description="The conversation so far.")]
    max_tokens: Annotated[int | None, Meta(description=_MAX_TOKENS)] = None
    max_completion_tokens: Annotated[int | None, Meta(
        description="Same as `max_tokens` (OpenAI's newer name); wins when both are set.")] = None
    logprobs: Annotated[bool | None, Meta(
        description="Return the log-probability of each generated token.")] = None
    top_logprobs: Annotated[int | None, Meta(
        description="With `logprobs`: also return this many most likely tokens per step "
                    "(0 to 20).")] = None
    response_format: Annotated[ResponseFormat | None, Meta(
        description="Constrain the answer to JSON or a schema.")] = None
    tools: Annotated[list[Tool] | None, Meta(description="Tools the model may call.")] = None
    tool_choice: Annotated[str | NamedToolChoice | None, Meta(
        description="`auto` (the default with `tools`: text or calls, the model chooses), "
                    "`none` (tools ignored), `required` (one call or more), a named "
                    "function (a call to it), or a function's name (TGI).")] = None
    parallel_tool_calls: Annotated[bool | None, Meta(
        description="Whether the model may call several tools in one answer (default "
                    "true); false: at most one call.")] = None
    tool_prompt: Annotated[str | None, Meta(
        description="TGI: text put before the tool definitions in the prompt.")] = None
    metadata: Annotated[dict[str, str] | None, Meta(description=_UNUSED)] = None
    store: Annotated[bool | None, Meta(description=_UNUSED + " Nothing is stored.")] = None
    service_tier: Annotated[str | None, Meta(description=_UNUSED)] = None
    prompt_cache_key: Annotated[str | None, Meta(
        description=_UNUSED + " The prefix cache is shared by every request.")] = None
    prompt_cache_retention: Annotated[str | None, Meta(description=_UNUSED)] = None
    safety_identifier: Annotated[str | None, Meta(description=_UNUSED)] = None
    modalities: Annotated[list[str] | None, Meta(
        description="Output modalities: only `[\"text\"]` is served; any other is a 400.")] = None
    audio: Annotated[Any, Meta(description=_REFUSED + " (no audio output)")] = None
    prediction: Annotated[Any, Meta(description=_REFUSED)] = None
    reasoning_effort: Annotated[Any, Meta(description=_REFUSED + " (no reasoning models)")] = None
    verbosity: Annotated[Any, Meta(description=_REFUSED)] = None
    web_search_options: Annotated[Any, Meta(description=_REFUSED)] = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, Meta(
        description="vLLM's extension: extra arguments for the chat template (e.g. "
                    "`enable_thinking`).")] = None
    add_generation_prompt: Annotated[bool | None, Meta(
        description="vLLM's extension: end the prompt with the assistant's turn opening "
                    "(default true).")] = None
    continue_final_message: Annotated[bool | None, Meta(
        description="vLLM's extension: continue the last (assistant) message instead of "
                    "starting a new one.")] = None
    echo: Annotated[bool | None, Meta(
        description="vLLM's extension: when the last message is the assistant's, the "
                    "answer's content starts with it.")] = None
    chat_template: Annotated[str | None, Meta(
        description=_REFUSED + " (the model's own template is used)")] = None
    documents: Annotated[Any, Meta(description=_REFUSED)] = None
    functions: Annotated[Any, Meta(description=_REFUSED + " Use `tools`.")] = None
    function_call: Annotated[Any, Meta(description=_REFUSED + " Use `tool_choice`.")] = None


class CompletionRequest(SamplingRequest, kw_only=True, forbid_unknown_fields=True):
    """Body of `POST /v1/completions`."""

    prompt: Annotated[str | list[str | int | list[int]], Meta(
        description="A prompt as a string, a list of strings, a list of token ids, or a "
                    "list of token-id lists (ids used as given: no BOS is added). A list "
                    "holds up to `--max-client-batch-size` prompts, each an independent "
                    "sequence; mixing the forms in one list is a 400.")]
    max_tokens: Annotated[int | None, Meta(
        description=_MAX_TOKENS + " 0 with `echo` scores the prompt and generates nothing.")] = None
    best_of: Annotated[int | None, Meta(
        description="Generate this many candidates per prompt (at least `n`) and return the "
                    "`n` with the highest mean token log-probability, best first; usage "
                    "counts every candidate. Not streamed when larger than `n`.")] = None
    logprobs: Annotated[int | None, Meta(
        description="Return log-probabilities with this many alternatives per token "
                    "(at most `--max-top-n-tokens`).")] = None
    echo: Annotated[bool, Meta(
        description="Put the prompt before the completion; with `logprobs`, the prompt's "
                    "tokens and their log-probabilities come first in `logprobs`.")] = False
    suffix: Annotated[str | None, Meta(
        description="Not supported, as in TGI: any value is a 400.")] = None


class PromptTokensDetails(msgspec.Struct):
    """`usage.prompt_tokens_details`."""

    cached_tokens: Annotated[int, Meta(
        description="Prompt tokens whose keys and values came from the prefix cache "
                    "instead of being computed (whole cache blocks; 0 on a cold cache).")]


class CompletionTokensDetails(msgspec.Struct):
    """`usage.completion_tokens_details`: what OpenAI breaks the generated tokens into."""

    reasoning_tokens: Annotated[int, Meta(
        description="Tokens of hidden reasoning: always 0 (no reasoning is held back).")] = 0
    accepted_prediction_tokens: Annotated[int, Meta(
        description="Always 0: predicted outputs (`prediction`) are not served.")] = 0
    rejected_prediction_tokens: Annotated[int, Meta(
        description="Always 0: predicted outputs (`prediction`) are not served.")] = 0


class Usage(msgspec.Struct):
    """Token counts of a request."""

    prompt_tokens: Annotated[int, Meta(description="Tokens in the prompt(s).")]
    completion_tokens: Annotated[int, Meta(description="Tokens generated.")]
    total_tokens: Annotated[int, Meta(description="The sum of both.")]
    prompt_tokens_details: Annotated[PromptTokensDetails | None, Meta(
        description="Of the prompt tokens, those served from the prefix cache.")] = None
    completion_tokens_details: Annotated[CompletionTokensDetails | None, Meta(
        description="What the generated tokens were.")] = None


class TopLogprob(msgspec.Struct):
    """An alternative token in `logprobs.content[].top_logprobs`."""

    token: Annotated[str, Meta(description="The token's text.")]
    logprob: Annotated[float, Meta(description="Its log-probability.")]
    bytes: Annotated[list[int] | None, Meta(description="Its UTF-8 bytes.")]


class TokenLogprob(msgspec.Struct):
    """A chosen token's entry in `logprobs.content`."""

    token: Annotated[str, Meta(description="The token's text.")]
    logprob: Annotated[float, Meta(description="Its log-probability.")]
    bytes: Annotated[list[int] | None, Meta(description="Its UTF-8 bytes.")]
    top_logprobs: Annotated[list[TopLogprob], Meta(
        description="The most likely tokens at this step (`top_logprobs` of them).")]


class ChoiceLogprobs(msgspec.Struct):
    """`logprobs` of a chat choice."""

    content: Annotated[list[TokenLogprob], Meta(description="One entry per generated token.")]


class FunctionCallOut(msgspec.Struct):
    """The function of a tool call the model made."""

    name: Annotated[str, Meta(description="Function name.")]
    arguments: Annotated[str, Meta(
        description="The arguments as compact JSON text (an object valid against the "
                    "function's `parameters`).")]


class ToolCallOut(msgspec.Struct):
    """A tool call the model made."""

    id: Annotated[str, Meta(description="`call_` and 24 letters or digits.")]
    function: Annotated[FunctionCallOut, Meta(description="The function called.")]
    type: Annotated[str, Meta(description="Always `function`.")] = "function"


class ChatMessageOut(msgspec.Struct):
    """The assistant's message in a chat answer."""

    role: Annotated[str, Meta(description="Always `assistant`.")]
    content: Annotated[str | None, Meta(
        description="The generated text; null when the model called tools and wrote "
                    "nothing else.")]
    tool_calls: Annotated[list[ToolCallOut] | msgspec.UnsetType, Meta(
        description="Tools the model called; present only when it called one.")] = msgspec.UNSET


FinishReasonOpenAI = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]

_FINISH = "`stop` (EOS or a stop string) or `length`; null until a choice's last chunk."


class PromptLogprob(msgspec.Struct):
    """One token at a prompt position, in vLLM's `prompt_logprobs`."""

    logprob: Annotated[float, Meta(description="Its log-probability at that position.")]
    rank: Annotated[int | None, Meta(
        description="1 for the most likely token; null for the prompt's own token when it "
                    "is not among the alternatives asked for (its rank is not computed).")]
    decoded_token: Annotated[str, Meta(description="The token's text.")]


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's `prompt_logprobs`: per prompt position (the first null), token id -> its entry."""
_UNSET_IDS = "With vLLM's `return_token_ids`."
_UNSET_PROMPT_LOGPROBS = ("With vLLM's `prompt_logprobs`: per prompt token (the first null), "
                          "the token's and the alternatives' log-probabilities by token id.")


class ChatChoice(msgspec.Struct):
    """One choice of a chat answer."""

    index: Annotated[int, Meta(description="Position of the choice, from 0.")]
    message: Annotated[ChatMessageOut, Meta(description="The generated message.")]
    logprobs: Annotated[ChoiceLogprobs | None, Meta(
        description="Token log-probabilities, when `logprobs` was true.")]
    finish_reason: Annotated[ChatFinishReason, Meta(
        description="`stop` (EOS, a stop string, or a call to the function `tool_choice` "
                    "named), `length`, or `tool_calls` (the model called tools).")]
    token_ids: Annotated[list[int] | msgspec.UnsetType, Meta(
        description=_UNSET_IDS + " The generated token ids.")] = msgspec.UNSET


_ID = "Unique id of the answer; every chunk of a stream has the same one."
_CREATED = "Unix time (seconds) the request was answered."
_FINGERPRINT = "Server version and platform."


class ChatCompletion(msgspec.Struct):
    """Body of a non-streamed chat answer."""

    id: Annotated[str, Meta(description=_ID)]
    created: Annotated[int, Meta(description=_CREATED)]
    model: Annotated[str, Meta(description="The served model's name.")]
    system_fingerprint: Annotated[str, Meta(description=_FINGERPRINT)]
    choices: Annotated[list[ChatChoice], Meta(description="`n` choices.")]
    usage: Annotated[Usage, Meta(description="Token counts.")]
    object: Annotated[str, Meta(description="Always `chat.completion`.")] = "chat.completion"
    prompt_token_ids: Annotated[list[int] | msgspec.UnsetType, Meta(
        description=_UNSET_IDS + " The prompt's token ids (chat template applied).")
    ] = msgspec.UNSET
    prompt_logprobs: Annotated[PromptLogprobs | msgspec.UnsetType, Meta(
        description=_UNSET_PROMPT_LOGPROBS)] = msgspec.UNSET


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    """A fragment of a streamed tool call's function."""

    arguments: Annotated[str, Meta(
        description="The next fragment of the arguments' JSON (\"\" in a call's first "
                    "chunk).")]
    name: Annotated[str | None, Meta(
        description="Function name, in the call's first chunk only.")] = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A fragment of a tool call in a streamed chunk: the call's first chunk has its
    `id`, `type` and `function.name` (and empty `arguments`); later ones only
    `index` and an `arguments` fragment."""

    index: Annotated[int, Meta(description="Which tool call of the message, from 0.")]
    function: Annotated[FunctionDelta, Meta(description="The function fragment.")]
    id: Annotated[str | None, Meta(description="Call id, in the call's first chunk.")] = None
    type: Annotated[str | None, Meta(
        description="Always `function`, in the call's first chunk.")] = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    """The incremental message of a chunk: `role` on the first chunk only."""

    role: Annotated[str | None, Meta(description="`assistant`, on the first chunk.")] = None
    content: Annotated[str | None, Meta(description="The next piece of text.")] = None
    tool_calls: Annotated[list[DeltaToolCall] | None, Meta(
        description="Fragments of tool calls, when the model calls one.")] = None


class ChatChunkChoice(msgspec.Struct):
    """One choice of a streamed chunk."""

    index: Annotated[int, Meta(description="Which choice, from 0.")]
    delta: Annotated[ChatDelta, Meta(description="What this chunk adds to the message.")]
    logprobs: Annotated[ChoiceLogprobs | None, Meta(
        description="Log-probabilities of this chunk's tokens, when `logprobs` was true.")]
    finish_reason: Annotated[ChatFinishReason | None, Meta(
        description=_FINISH + " `tool_calls` when the model called tools; a stream with "
                    "tools ends with an empty `delta` that carries it.")]
    token_ids: Annotated[list[int] | msgspec.UnsetType, Meta(
        description=_UNSET_IDS + " The token ids this chunk adds.")] = msgspec.UNSET


class ChatCompletionChunk(msgspec.Struct):
    """One streamed chat event (`data: <chunk>`); `data: [DONE]` ends the stream."""

    id: Annotated[str, Meta(description=_ID)]
    created: Annotated[int, Meta(description=_CREATED)]
    model: Annotated[str, Meta(description="The served model's name.")]
    system_fingerprint: Annotated[str, Meta(description=_FINGERPRINT)]
    choices: Annotated[list[ChatChunkChoice], Meta(
        description="Usually one choice; empty in the `include_usage` chunk.")]
    usage: Annotated[Usage | None, Meta(
        description="Token counts, in the `include_usage` chunk only.")] = None
    object: Annotated[str, Meta(description="Always `chat.completion.chunk`.")] = (
        "chat.completion.chunk")
    prompt_token_ids: Annotated[list[int] | msgspec.UnsetType, Meta(
        description=_UNSET_IDS + " On a stream's first chunk: the prompt's token ids.")
    ] = msgspec.UNSET


class CompletionLogprobs(msgspec.Struct):
    """Legacy `logprobs` of a completion choice.

    With `echo`, the prompt's tokens come first: the first prompt token has a
    null log-probability and null alternatives (nothing precedes it). The
    token texts add up to the choice's text, and `text[text_offset[i]:]`
    starts with `tokens[i]`; a token whose bytes end inside a multi-byte
    character has the text "", and the token that completes it the whole character.
    """

    tokens: Annotated[list[str], Meta(
        description="The tokens' texts: the echoed prompt's, then the generated ones.")]
    token_logprobs: Annotated[list[float | None], Meta(
        description="Their log-probabilities (null for the first prompt token).")]
    top_logprobs: Annotated[list[dict[str, float] | None] | None, Meta(
        description="The most likely tokens at each position, text to log-probability, "
                    "always with the actual token (null for the first prompt token).")]
    text_offset: Annotated[list[int], Meta(
        description="Each token's character offset in the choice's text.")]


class CompletionChoice(msgspec.Struct):
    """One choice of a completion answer or chunk."""

    index: Annotated[int, Meta(description="Which prompt (and choice) this is, from 0.")]
    text: Annotated[str, Meta(description="The completion, or the chunk's piece of it.")]
    logprobs: Annotated[CompletionLogprobs | None, Meta(
        description="Token log-probabilities, when `logprobs` was given.")]
    finish_reason: Annotated[FinishReasonOpenAI | None, Meta(description=_FINISH)]
    token_ids: Annotated[list[int] | msgspec.UnsetType, Meta(
        description=_UNSET_IDS + " The generated token ids (of this chunk, when "
                                 "streamed).")] = msgspec.UNSET
    prompt_token_ids: Annotated[list[int] | msgspec.UnsetType, Meta(
        description=_UNSET_IDS + " The prompt's token ids (on a stream's first chunk of "
                                 "the choice).")] = msgspec.UNSET
    prompt_logprobs: Annotated[PromptLogprobs | msgspec.UnsetType, Meta(
        description=_UNSET_PROMPT_LOGPROBS)] = msgspec.UNSET


class Completion(msgspec.Struct):
    """Body of a completion answer, or one streamed completion chunk (`data: <chunk>`,
    ended by `data: [DONE]`)."""

    id: Annotated[str, Meta(description=_ID)]
    created: Annotated[int, Meta(description=_CREATED)]
    model: Annotated[str, Meta(description="The served model's name.")]
    system_fingerprint: Annotated[str, Meta(description=_FINGERPRINT)]
    choices: Annotated[list[CompletionChoice], Meta(
        description="One choice per prompt and `n`.")]
    usage: Annotated[Usage | None, Meta(
        description="Token counts, summed over prompts; null in stream chunks.")] = None
    object: Annotated[str, Meta(description="Always `text_completion`.")] = "text_completion"


class ModelCard(msgspec.Struct):
    """One entry of `GET /v1/models`."""

    id: Annotated[str, Meta(description="The name to put in `model`.")]
    created: Annotated[int, Meta(description="Unix time the model was created (0: unknown).")]
    owned_by: Annotated[str, Meta(description="Owner (the hub organisation).")]
    object: Annotated[str, Meta(description="Always `model`.")] = "model"
    input_modalities: Annotated[list[str], Meta(
        description="What prompts may hold: `text`, and `image` for a vision-language model "
                    "(`image_url` parts, markdown images).")] = msgspec.field(
        default_factory=lambda: ["text"])
    parent: Annotated[str | None, Meta(
        description="For a LoRA adapter: the base model it runs on (vLLM's lineage); null for "
                    "a model.")] = None
    root: Annotated[str | None, Meta(
        description="For a LoRA adapter: the folder it was loaded from; null for a model.")] = None


class ReasoningLevel(msgspec.Struct, kw_only=True):
    """A reasoning effort a model takes, in Codex's catalog."""

    effort: str
    description: str


class TruncationPolicy(msgspec.Struct, kw_only=True):
    """How Codex trims tool output for a model (`mode` `tokens` or `bytes`)."""

    mode: str
    limit: int


class CodexModel(msgspec.Struct, kw_only=True):
    """A served model in the catalog shape the Codex CLI reads (its `ModelInfo`)."""

    slug: str
    display_name: str
    context_window: int
    supported_reasoning_levels: list[ReasoningLevel]
    shell_type: str
    visibility: str
    supported_in_api: bool
    priority: int
    support_verbosity: bool
    truncation_policy: TruncationPolicy
    experimental_supported_tools: list[str]
    base_instructions: str
    input_modalities: list[str]
    description: str | None = None


class ModelList(msgspec.Struct):
    """Body of `GET /v1/models`."""

    data: Annotated[list[ModelCard], Meta(description="The served models.")]
    object: Annotated[str, Meta(description="Always `list`.")] = "list"
    models: Annotated[list[CodexModel] | msgspec.UnsetType, Meta(
        description="With `?client_version=...` (the Codex CLI's catalog request): the "
                    "generation models in Codex's catalog shape.")] = msgspec.UNSET


class ErrorDetail(msgspec.Struct):
    """OpenAI's error object."""

    message: Annotated[str, Meta(description="What went wrong.")]
    type: Annotated[str, Meta(
        description="`invalid_request_error`, `overloaded`, `generation`, ...")]
    param: Annotated[str | None, Meta(description="The request field at fault, if one is.")]
    code: Annotated[str | None, Meta(description="A machine-readable code, e.g. "
                                                 "`model_not_found`.")]


class OpenAIErrorResponse(msgspec.Struct):
    """OpenAI's error body, on every OpenAI route."""

    error: Annotated[ErrorDetail, Meta(description="The error.")]


ErrorResponse = OpenAIErrorResponse
"""The name routes use; the class has its own so that the OpenAPI document does
not have two `ErrorResponse` schemas (TGI's is the other)."""
