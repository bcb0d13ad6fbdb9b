"""OpenAI's Responses API on the wire (`/v1/responses`), as msgspec Structs.

The request keeps `input`, `tools` and `tool_choice` loose (`Any`) on purpose:
their items are told apart by a `type` that a message may leave out, so
`switchyard.responses.items` reads them one by one and names the exact field
(`input[2].call_id`) when one is wrong. Everything a client reads back (the
response object, its output items, the stream events) is typed here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed",
                         "cancelled"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


# ------------------------------------------------------------------ request

class TextFormat(msgspec.Struct, kw_only=True):
    """`text.format`: plain text, any JSON object, or JSON valid against a schema."""

    type: Annotated[str, Meta(description="`text`, `json_object` or `json_schema`.")] = "text"
    name: Annotated[str | None, Meta(description="The schema's name (`json_schema`).")] = None
    schema: Annotated[Any, Meta(description="The JSON schema (`json_schema`).")] = None
    description: Annotated[str | None, Meta(description="What the schema describes.")] = None
    strict: Annotated[bool | None, Meta(description="OpenAI's strict schema adherence.")] = None


class TextConfig(msgspec.Struct, kw_only=True):
    """`text`: the output's format."""

    format: Annotated[TextFormat, Meta(description="The output's format.")] = msgspec.field(
        default_factory=TextFormat)
    verbosity: Annotated[str | None, Meta(description="Accepted, not used.")] = None


class Reasoning(msgspec.Struct, kw_only=True):
    """`reasoning`: accepted; no reasoning items are produced (see docs/api.md)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponseStreamOptions(msgspec.Struct, kw_only=True):
    """`stream_options` (accepted: events carry no obfuscation padding)."""

    include_obfuscation: bool | None = None


_UNUSED = "Accepted and echoed; it does not change the answer."


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of `POST /v1/responses`; unknown fields are a 400 naming them."""

    model: Annotated[str | None, Meta(description="Served model name, as on chat.")] = None
    input: Annotated[str | list[Any], Meta(
        description="A string (one user message) or a list of items: `message`, "
                    "`function_call`, `function_call_output`, earlier output items.")] = ""
    instructions: Annotated[str | None, Meta(
        description="A system message put first; not carried to later turns.")] = None
    max_output_tokens: Annotated[int | None, Meta(description="Most tokens to generate.")] = None
    temperature: Annotated[float | None, Meta(description="0 to 2; 0 is greedy. Default 1.")] = None
    top_p: Annotated[float | None, Meta(description="Nucleus sampling.")] = None
    tools: Annotated[list[Any] | None, Meta(
        description="Tools: `function` (flat: `{type, name, description, parameters, "
                    "strict}`), `custom` (free-form input, optionally a `regex` grammar) and "
                    "`namespace` (functions grouped under a name) are offered to the model; "
                    "hosted tools (`web_search`, `file_search`, ...) are left out and named "
                    "in the `X-Switchyard-Omitted-Tools` header (a 400 under "
                    "`--strict-hosted-tools`).")] = None
    tool_choice: Annotated[Any, Meta(
        description="`auto`, `none`, `required`, or `{type: function, name}`.")] = None
    parallel_tool_calls: Annotated[bool | None, Meta(
        description="Whether one answer may call several tools (default true).")] = None
    max_tool_calls: Annotated[int | None, Meta(description="Most function calls in one "
                                                          "answer (1: no parallel calls).")] = None
    text: Annotated[TextConfig | None, Meta(description="The output's format.")] = None
    include: Annotated[list[str] | None, Meta(
        description="`message.output_text.logprobs` adds logprobs to output text; "
                    "`reasoning.encrypted_content` is accepted (no reasoning items are "
                    "produced); any other value is a 400 naming it.")] = None
    client_metadata: Annotated[dict[str, Any] | None, Meta(
        description="Client ids (Codex sends its session, thread and turn): request "
                    "metadata, no effect on the answer; stored with the response.")] = None
    top_logprobs: Annotated[int | None, Meta(
        description="With the logprobs include: most likely tokens per position (0 to 20).")
    ] = None
    store: Annotated[bool | None, Meta(
        description="Keep the response for `GET`, chaining and input items (default true).")
    ] = None
    previous_response_id: Annotated[str | None, Meta(
        description="Continue from a stored response: its input and output come first.")] = None
    background: Annotated[bool | None, Meta(
        description="Answer `queued` at once and generate in the background (needs store).")
    ] = None
    stream: Annotated[bool | None, Meta(description="Answer with server-sent events.")] = None
    stream_options: Annotated[ResponseStreamOptions | None, Meta(description=_UNUSED)] = None
    metadata: Annotated[dict[str, str] | None, Meta(
        description="Up to 16 string pairs, echoed and stored.")] = None
    truncation: Annotated[str | None, Meta(
        description="`disabled` (default: too long is a 400) or `auto` (drop the oldest "
                    "items until the input fits).")] = None
    user: Annotated[str | None, Meta(description=_UNUSED)] = None
    safety_identifier: Annotated[str | None, Meta(description=_UNUSED)] = None
    prompt_cache_key: Annotated[str | None, Meta(description=_UNUSED)] = None
    prompt_cache_retention: Annotated[str | None, Meta(description=_UNUSED)] = None
    service_tier: Annotated[str | None, Meta(description=_UNUSED)] = None
    reasoning: Annotated[Reasoning | None, Meta(description=_UNUSED)] = None
    seed: Annotated[int | None, Meta(description="Sampling seed (an extension, as on chat).")
                    ] = None
    conversation: Annotated[Any, Meta(description="Not supported: a 400 (use "
                                                  "`previous_response_id`).")] = None
    prompt: Annotated[Any, Meta(description="Not supported: a 400 (stored prompts).")] = None


class InputTokensRequest(msgspec.Struct, kw_only=True):
    """Body of `POST /v1/responses/input_tokens`: the fields that make the prompt."""

    model: str | None = None
    input: str | list[Any] = ""
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    text: TextConfig | None = None
    truncation: str | None = None
    reasoning: Reasoning | None = None
    conversation: Any = None


# ------------------------------------------------------------------ items

class InputText(msgspec.Struct, tag="input_text", tag_field="type", kw_only=True):
    """A text part of an input message."""

    text: str


class InputImage(msgspec.Struct, tag="input_image", tag_field="type", kw_only=True):
    """An image part of an input message (an http(s) or `data:` URL)."""

    image_url: str | None = None
    file_id: str | None = None
    detail: str = "auto"


class LogprobTop(msgspec.Struct, kw_only=True):
    """One alternative at a position of `output_text.logprobs`."""

    token: str
    bytes: list[int]
    logprob: float


class Logprob(msgspec.Struct, kw_only=True):
    """A generated token's log-probability and its alternatives."""

    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[LogprobTop] = msgspec.field(default_factory=list)


class OutputText(msgspec.Struct, tag="output_text", tag_field="type", kw_only=True):
    """Text the model wrote (an assistant message's part)."""

    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Logprob] | None = None


class Refusal(msgspec.Struct, tag="refusal", tag_field="type", kw_only=True):
    """A refusal part (passed back from another server's output)."""

    refusal: str


ContentPart = InputText | InputImage | OutputText | Refusal


class MessageItem(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    """A message: input (`user`, `system`, `developer`) or an assistant's output."""

    id: str
    role: str
    content: list[ContentPart]
    status: ItemStatus = "completed"


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type", kw_only=True):
    """A call the model made; `call_id` pairs it with its `function_call_output`."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus = "completed"
    namespace: str | msgspec.UnsetType = msgspec.UNSET
    """The `namespace` tool the function belongs to (absent for a top-level function)."""


class CustomToolCallItem(msgspec.Struct, tag="custom_tool_call", tag_field="type",
                         kw_only=True):
    """A call of a `custom` tool: its free-form `input`; `call_id` pairs it with its output."""

    id: str
    call_id: str
    name: str
    input: str
    status: ItemStatus = "completed"
    namespace: str | msgspec.UnsetType = msgspec.UNSET


class FunctionCallOutputItem(msgspec.Struct, tag="function_call_output", tag_field="type",
                             kw_only=True):
    """A function's result, for the call with the same `call_id`."""

    id: str
    call_id: str
    output: str
    status: ItemStatus = "completed"


class CustomToolCallOutputItem(msgspec.Struct, tag="custom_tool_call_output", tag_field="type",
                               kw_only=True):
    """A custom tool's result, for the call with the same `call_id`."""

    id: str
    call_id: str
    output: str
    status: ItemStatus = "completed"


Item = (MessageItem | FunctionCallItem | CustomToolCallItem | FunctionCallOutputItem
        | CustomToolCallOutputItem)
"""Every item a conversation holds, input or output."""
CallItem = FunctionCallItem | CustomToolCallItem
"""A call the model made."""
CallOutputItem = FunctionCallOutputItem | CustomToolCallOutputItem
"""A call's result, sent by the client."""


class FunctionTool(msgspec.Struct, tag="function", tag_field="type", kw_only=True):
    """A function the model may call (the Responses API's flat form)."""

    name: str
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None


class CustomToolFormat(msgspec.Struct, kw_only=True):
    """A custom tool's input format: free `text`, or a `grammar` (`regex` or `lark` syntax)."""

    type: str = "text"
    syntax: str | None = None
    definition: str | None = None


class CustomTool(msgspec.Struct, tag="custom", tag_field="type", kw_only=True):
    """A tool whose input is free-form text, optionally held to a grammar."""

    name: str
    description: str | None = None
    format: CustomToolFormat = msgspec.field(default_factory=CustomToolFormat)


class NamespaceTool(msgspec.Struct, tag="namespace", tag_field="type", kw_only=True):
    """Function and custom tools grouped under a name; calls carry it as `namespace`."""

    name: str
    description: str | None = None
    tools: list[FunctionTool | CustomTool] = msgspec.field(default_factory=list)


class HostedTool(msgspec.Struct, kw_only=True):
    """A tool the server would run itself (`web_search`, `file_search`, ...): this server
    runs none, so it is left out of the prompt (see docs/api.md)."""

    type: str


Tool = FunctionTool | CustomTool | NamespaceTool
"""A tool the client runs: the Responses API's typed tools."""


class FunctionChoice(msgspec.Struct, tag="function", tag_field="type", kw_only=True):
    """`tool_choice` naming the function to call."""

    name: str


# ------------------------------------------------------------------ response

class InputTokensDetails(msgspec.Struct, kw_only=True):
    """Prompt tokens the prefix cache served."""

    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    """Reasoning tokens (always 0: no reasoning format is served)."""

    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    """A response's token counts."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(
        default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct, kw_only=True):
    """Why a response is `incomplete`."""

    reason: str


class ResponseError(msgspec.Struct, kw_only=True):
    """Why a response `failed`."""

    code: str
    message: str


class Response(msgspec.Struct, kw_only=True):
    """The response object, as `POST`, `GET` and the stream's events carry it."""

    id: str
    created_at: int
    model: str
    status: ResponseStatus
    output: list[Item] = msgspec.field(default_factory=list)
    object: str = "response"
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    completed_at: int | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_logprobs: int = 0
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    tool_choice: str | FunctionChoice = "auto"
    tools: list[FunctionTool | CustomTool | NamespaceTool] = msgspec.field(default_factory=list)
    truncation: str = "disabled"
    store: bool = True
    background: bool = False
    reasoning: Reasoning = msgspec.field(default_factory=Reasoning)
    service_tier: str = "default"
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None


class DeletedResponse(msgspec.Struct, kw_only=True):
    """Body of `DELETE /v1/responses/{id}`."""

    id: str
    object: str = "response"
    deleted: bool = True


class InputItemList(msgspec.Struct, kw_only=True):
    """Body of `GET /v1/responses/{id}/input_items`: one page of the input items."""

    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


class InputTokens(msgspec.Struct, kw_only=True):
    """Body of `POST /v1/responses/input_tokens`."""

    input_tokens: int
    object: str = "response.input_tokens"
