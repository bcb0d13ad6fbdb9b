"""A Responses turn as a chat request: the same template, tool format and grammar as chat.

The conversation (earlier turns' items, then this request's) becomes chat
messages: `instructions` a system message first (this turn's only: OpenAI
does not carry them over), `developer` messages system messages, function
calls an assistant message's `tool_calls` and their outputs `tool` messages.
The chat route's planner then renders and tokenizes it, so a Responses
request and a chat request for the same messages get the same prompt and the
same answer. The generation fields are read by this API's own adapter
(`responses_fields`) and checked in its own names (`max_output_tokens`,
`input`, `text.format`).

Chained turns extend their tokens: a turn's prompt is the chat route's
tokenization when that starts with the tokens an earlier turn ended with
(its prompt, or its prompt and what it generated); otherwise, when the
rendered text still starts with that turn's text, it is those token ids
plus the rest tokenized. Either way the prefix cache serves the earlier
turn, and a chain is not re-prefilled from the start each turn.
"""

from __future__ import annotations

from switchyard.errors import ApiError
from switchyard.media import EncodedPrompt, ImageSet, chat_images
from switchyard.models.served import ServedModel
from switchyard.openai_mapping.plans import (
    CONTEXT_EXCEEDED,
    ChatPlan,
    WireNames,
    encode_chat_prompt,
    invalid,
    plan_chat_call,
)
from switchyard.planning.defaults import GenerationDefaults, apply_defaults
from switchyard.planning.fields import PlanFields
from switchyard.planning.rules import check_fields
from switchyard.protocol import openai as oai
from switchyard.protocol import responses as rs
from switchyard.responses.store import Anchor
from switchyard.responses.tools import ToolSet, model_call
from switchyard.state import Gateway

LOGPROBS_INCLUDE = "message.output_text.logprobs"
REASONING_INCLUDE = "reasoning.encrypted_content"
INCLUDES = (LOGPROBS_INCLUDE, REASONING_INCLUDE)
"""`include` values served; others are a 400 naming them. Reasoning content is accepted
and adds nothing: no served model has a reasoning format, so there are no reasoning items."""
RESPONSES_NAMES = WireNames(prompt="input", max_tokens="max_output_tokens",
                            response_format="text.format")


def _text_parts(content: list[rs.ContentPart]) -> str | list[oai.ContentPart]:
    """A message's content as chat content: plain text, or parts when it holds images."""
    if not any(isinstance(p, rs.InputImage) for p in content):
        return "".join(p.refusal if isinstance(p, rs.Refusal) else p.text for p in content
                       if not isinstance(p, rs.InputImage))
    parts = []
    for p in content:
        if isinstance(p, rs.InputImage):
            parts.append(oai.ContentPart(type="image_url",
                                         image_url=oai.ImageUrl(url=p.image_url or "",
                                                                detail=p.detail)))
        else:
            parts.append(oai.ContentPart(type="text", text=p.refusal if isinstance(
                p, rs.Refusal) else p.text))
    return parts


def chat_messages(instructions: str | None, items: list[rs.Item],
                  tools: ToolSet) -> list[oai.ChatMessageIn]:
    """The conversation as chat messages (calls folded into the assistant's message, under
    the names the model was offered their tools by). An empty conversation (a client's probe
    request) is one empty user message."""
    out: list[oai.ChatMessageIn] = []
    if instructions:
        out.append(oai.ChatMessageIn(role="system", content=instructions))
    for item in items:
        if isinstance(item, rs.MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append(oai.ChatMessageIn(role=role, content=_text_parts(item.content)))
        elif isinstance(item, rs.CallItem):
            name, arguments = model_call(tools, item)
            call = oai.ToolCall(id=item.call_id, function=oai.FunctionCall(
                name=name, arguments=arguments))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and (
                    last.tool_calls or isinstance(last.content, str)):
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(oai.ChatMessageIn(role="assistant", content=None, tool_calls=[call]))
        else:
            out.append(oai.ChatMessageIn(role="tool", content=item.output,
                                         tool_call_id=item.call_id))
    if not any(m.role != "system" for m in out):
        out.append(oai.ChatMessageIn(role="user", content=""))
    return out


def _response_format(text: rs.TextConfig | None) -> oai.ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return oai.ResponseFormat(type="json_object")
    if fmt.type == "json_schema":
        if fmt.schema is None:
            raise invalid("Missing required parameter: 'text.format.schema'.",
                          "text.format.schema")
        return oai.ResponseFormat(type="json_schema", json_schema=oai.JsonSchemaConfig(
            name=fmt.name, schema=fmt.schema, description=fmt.description, strict=fmt.strict))
    raise invalid(f"Invalid value for 'text.format.type': expected 'text', 'json_object' or "
                  f"'json_schema', but got {fmt.type!r}.", "text.format.type")


def wants_logprobs(include: list[str] | None) -> bool:
    """Whether `include` asks for output text logprobs (values not served are a 400)."""
    for i, value in enumerate(include or []):
        if value not in INCLUDES:
            raise invalid(f"Invalid value for 'include[{i}]': {value!r} is not served (this "
                          f"server serves {', '.join(INCLUDES)}).", f"include[{i}]")
    return LOGPROBS_INCLUDE in (include or [])


def chat_request(req: rs.ResponsesRequest, items: list[rs.Item], tools: ToolSet,
                 choice: str | rs.FunctionChoice) -> oai.ChatCompletionRequest:
    """The chat request that stands for this turn."""
    logprobs = wants_logprobs(req.include)
    if req.top_logprobs is not None and not logprobs:
        # OpenAI accepts it alone; it then has nothing to return: say so.
        raise invalid(f"'top_logprobs' needs include: [\"{LOGPROBS_INCLUDE}\"].",
                      "top_logprobs")
    offered = tools.chat_tools()
    if logprobs and offered and choice != "none":
        raise invalid("Output text logprobs are not served together with function tools: "
                      "the tokens of a call are not output text.", "include")
    if not offered and choice not in ("auto", "none"):
        raise invalid("Invalid value for 'tool_choice': 'tool_choice' is only allowed when "
                      "'tools' are specified.", "tool_choice")
    calls = req.parallel_tool_calls
    if req.max_tool_calls is not None:
        if req.max_tool_calls < 1:
            raise invalid(f"Invalid 'max_tool_calls': expected a value >= 1, but got "
                          f"{req.max_tool_calls}.", "max_tool_calls")
        if req.max_tool_calls == 1:
            calls = False
    return oai.ChatCompletionRequest(
        model=req.model,
        messages=chat_messages(req.instructions, items, tools),
        logprobs=logprobs or None, top_logprobs=req.top_logprobs if logprobs else None,
        response_format=_response_format(req.text),
        tools=offered,
        tool_choice=(choice if isinstance(choice, str) else oai.NamedToolChoice(
            function=oai.FunctionName(name=tools.model_name(choice.name, None))))
        if offered else None,
        parallel_tool_calls=calls,
    )


def responses_fields(req: rs.ResponsesRequest, top_n: int,
                     defaults: GenerationDefaults) -> PlanFields:
    """The Responses API's adapter: the request's generation fields, checked in its names,
    with the server's defaults for those it leaves out."""
    fields = PlanFields(
        do_sample=req.temperature != 0.0, temperature=req.temperature, top_p=req.top_p,
        seed=req.seed, max_new_tokens=req.max_output_tokens, include_stop=False,
        top_n_tokens=top_n, details=True)
    check_fields("openai", fields, RESPONSES_NAMES.renames())
    return apply_defaults(fields, defaults)


def anchored(anchors: tuple[Anchor, ...]):
    """An encoder that keeps the chat route's tokens when they extend an earlier turn's,
    and otherwise keeps the earlier turn's tokens and tokenizes the rest after them."""

    def encode(model: ServedModel, text: str, images: ImageSet | None) -> EncodedPrompt:
        plain = encode_chat_prompt(model, text, images)
        if images is not None or not anchors:
            return plain
        ids = plain.ids
        for anchor in anchors:
            if ids[:len(anchor.ids)] == list(anchor.ids):
                return plain  # the chat route's own tokens already extend this turn
        for anchor in anchors:
            if text.startswith(anchor.text):
                # The template's text merges across the turn boundary, or the model wrote
                # tokens its tokenizer would not: keep them, so the prefix cache serves them.
                rest = model.tokenizer.encode(text[len(anchor.text):], False)
                return EncodedPrompt(ids=[*anchor.ids, *rest])
        return plain

    return encode


async def plan_turn(gw: Gateway, model: ServedModel, req: rs.ResponsesRequest,
                    items: list[rs.Item], tools: ToolSet,
                    choice: str | rs.FunctionChoice,
                    anchors: tuple[Anchor, ...]) -> tuple[ChatPlan, list[rs.Item]]:
    """Plan the turn; with `truncation: auto`, the oldest items are dropped until it fits.

    Returns the plan and the items it kept.
    """
    kept = list(items)
    while True:
        chat = chat_request(req, kept, tools, choice)
        fields = responses_fields(req, chat.top_logprobs or 0, gw.settings.generation_defaults)
        try:
            chat, images = await chat_images(gw, model, chat)
            return plan_chat_call(gw, model, chat, images, anchored(anchors),
                                  adapted=(fields, RESPONSES_NAMES)), kept
        except ApiError as exc:
            if (req.truncation == "auto" and exc.code == CONTEXT_EXCEEDED
                    and exc.param == RESPONSES_NAMES.prompt and len(kept) > 1):
                kept = _drop_oldest(kept)
                continue
            raise


def _drop_oldest(items: list[rs.Item]) -> list[rs.Item]:
    """The conversation without its oldest item, and without outputs of calls it lost."""
    rest = items[1:]
    called = {i.call_id for i in rest if isinstance(i, rs.CallItem)}
    return [i for i in rest if not (isinstance(i, rs.CallOutputItem) and i.call_id not in called)]


def check_truncation(value: str | None) -> None:
    """`truncation`: `auto` or `disabled`."""
    if value not in (None, "auto", "disabled"):
        raise invalid(f"Invalid value for 'truncation': expected 'auto' or 'disabled', but "
                      f"got {value!r}.", "truncation")

