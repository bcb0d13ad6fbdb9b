"""OpenAI tool calling on `/v1/chat/completions`: `tools`, `tool_choice`, `parallel_tool_calls`.

A request with tools (and a `tool_choice` other than `none`) becomes a
:class:`ToolSetup`: the tools are checked (names, schemas), rendered into the
prompt (by the chat template, or by the gateway for templates that cannot:
``switchyard.tools.calls``), and turned into one grammar that holds the
generated text to the model family's call format
(``switchyard.constraints.tools_constraint``):

- `required`: one or more calls (exactly one when `parallel_tool_calls` is
  false), nothing else;
- a named function: one call to it; the answer's `finish_reason` is `stop`;
- `auto` (the default): free text, or calls, in one generation: the text is
  free until the format's trigger (`<tool_call>` for Hermes/Qwen templates),
  after which it must be a whole call to one of the tools.

The text is then read back into OpenAI's `tool_calls` (:func:`tool_message`,
and :class:`ToolStreamer` for streams). Earlier calls and their results
(`assistant` messages with `tool_calls`, `tool` messages with
`tool_call_id`) reach the template in Hugging Face's message format
(:func:`chat_messages`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from switchyard.constraints import (
    EMPTY_PARAMETERS,
    ConstraintError,
    ToolFunction,
    engine_can_constrain,
    tool_function,
    tools_constraint,
)
from switchyard.errors import validation_error
from switchyard.generation import Finished, Step
from switchyard.models.served import ServedModel
from switchyard.protocol import openai as oai
from switchyard.openai_mapping.streaming import finish_reason
from switchyard.text.chat import ChatMessage
from switchyard.tools.calls import (
    FUNCTION_NAME,
    ToolCallParser,
    ToolEvent,
    ToolFormat,
    tool_format,
    tool_prompt,
)
from switchyard_spec import Constraint, FinishReason


class ToolSetup(msgspec.Struct, frozen=True, kw_only=True):
    """How a chat request calls tools: its format, callable functions and grammar."""

    format: ToolFormat
    functions: tuple[str, ...]
    """The functions the answer may call (one, for a named `tool_choice`)."""
    named: bool
    """`tool_choice` named the function: the answer's `finish_reason` is `stop`."""
    constraint: Constraint
    template_tools: tuple[dict[str, Any], ...]
    """Every tool, in Hugging Face's format, for the prompt."""


def model_tool_format(model: ServedModel) -> ToolFormat:
    """The tool-call format of the model's chat template."""
    return tool_format(model.tokenizer.hf_tokenizer.chat_template)


def _choice(req: oai.ChatCompletionRequest) -> tuple[str, str | None]:
    """`tool_choice` as (mode, function name): mode `none`, `auto`, `required` or `named`."""
    choice = req.tool_choice
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice in ("none", "auto", "required"):
            return choice, None
        return "named", choice  # TGI accepts a function's name alone
    if choice.type != "function":
        raise validation_error(
            f"Invalid value for 'tool_choice.type': expected 'function', got {choice.type!r}.",
            param="tool_choice")
    return "named", choice.function.name


def tool_setup(model: ServedModel, req: oai.ChatCompletionRequest) -> ToolSetup | None:
    """The request's tool calling, checked; None when it has none (no tools, or `none`).

    Errors are 422s in OpenAI's format naming `tools` or `tool_choice`.
    """
    mode, wanted = _choice(req)
    tools = req.tools or []
    if mode == "none":
        return None
    if not tools:
        if mode in ("required", "named"):
            raise validation_error(
                "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
                "are specified.", param="tool_choice")
        return None
    if not engine_can_constrain(model):
        raise validation_error(
            f"`tools` are not supported for model {model.name!r}: its engine "
            f"({model.engine_spec.name}) cannot constrain decoding", param="tools")
    functions: list[ToolFunction] = []
    template_tools: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if tool.type != "function":
            raise validation_error(
                f"Invalid value for 'tools[{i}].type': expected 'function', got "
                f"{tool.type!r}.", param="tools")
        if not FUNCTION_NAME.match(fn.name):
            raise validation_error(
                f"Invalid 'tools[{i}].function.name': string does not match pattern. Expected "
                f"a string that matches the pattern '^[a-zA-Z0-9_-]{{1,64}}$'.", param="tools")
        if fn.name in seen:
            raise validation_error(
                f"Invalid 'tools': the function name {fn.name!r} is used more than once.",
                param="tools")
        seen.add(fn.name)
        parameters = fn.parameters if fn.parameters is not None else fn.arguments
        try:
            functions.append(tool_function(fn.name, parameters, bool(fn.strict)))
        except ConstraintError as exc:
            raise validation_error(f"Invalid schema for function '{fn.name}': {exc}",
                                   param="tools") from None
        entry: dict[str, Any] = {"name": fn.name}
        if fn.description is not None:
            entry["description"] = fn.description
        entry["parameters"] = parameters if parameters is not None else EMPTY_PARAMETERS
        template_tools.append({"type": "function", "function": entry})
    if mode == "named":
        chosen = [f for f in functions if f.name == wanted]
        if not chosen:
            raise validation_error(
                f"Invalid value for 'tool_choice': no function named {wanted!r} in 'tools' "
                f"(they are: {', '.join(sorted(seen))}).", param="tool_choice")
        functions = chosen
    fmt = model_tool_format(model)
    parallel = mode != "named" and req.parallel_tool_calls is not False
    try:
        constraint = tools_constraint(functions, fmt, required=mode != "auto",
                                      parallel=parallel)
    except ConstraintError as exc:
        raise validation_error(f"Invalid 'tools': {exc}", param="tools") from None
    return ToolSetup(format=fmt, functions=tuple(f.name for f in functions),
                     named=mode == "named", constraint=constraint,
                     template_tools=tuple(template_tools))


# ------------------------------------------------------------------- prompt

def _arguments_value(arguments: Any) -> Any:
    """A call's arguments as a value for the template (OpenAI sends JSON text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return {} if arguments is None else arguments


def chat_messages(model: ServedModel, req: oai.ChatCompletionRequest,
                  text_of: Callable[[oai.ChatMessageIn], str],
                  setup: ToolSetup | None) -> list[ChatMessage]:
    """The request's messages for the chat template, tool calls and results included.

    A template with a tool format gets assistant `tool_calls` as structured
    calls (arguments as objects); for any other template they are written into
    the message's text in the fallback JSON format, and with ``setup`` the tool
    instruction and definitions are appended to the last message that is not
    the assistant's (after a `---` line, as TGI does).
    """
    fmt = setup.format if setup is not None else model_tool_format(model)
    out: list[ChatMessage] = []
    for m in req.messages:
        content = text_of(m)
        calls: tuple[dict[str, Any], ...] | None = None
        if m.tool_calls:
            if fmt.native:
                calls = tuple(
                    {"id": c.id, "type": c.type or "function",
                     "function": {"name": c.function.name,
                                  "arguments": _arguments_value(c.function.arguments)}}
                    for c in m.tool_calls)
            else:
                written = fmt.separator.join(
                    fmt.render(c.function.name, _arguments_value(c.function.arguments))
                    for c in m.tool_calls)
                content = f"{content}\n{written}" if content else written
        out.append(ChatMessage(role=m.role, content=content, tool_calls=calls,
                               tool_call_id=m.tool_call_id, name=m.name))
    if setup is not None and not fmt.native and out:
        at = next((i for i in range(len(out) - 1, -1, -1) if out[i].role != "assistant"),
                  len(out) - 1)
        prompt = tool_prompt(setup.template_tools, req.tool_prompt)
        last = out[at]
        out[at] = msgspec.structs.replace(
            last, content=f"{last.content}\n---\n{prompt}" if last.content else prompt)
    return out


def template_tools(setup: ToolSetup | None) -> list[dict[str, Any]] | None:
    """The tools the chat template renders itself (None when the gateway writes them)."""
    if setup is None or not setup.format.native:
        return None
    return list(setup.template_tools)


# ------------------------------------------------------------------- answer

def step_text(fmt: ToolFormat, step: Step) -> str:
    """The text a step adds, with a call marker that is a special token spelled out
    (the detokenizer leaves special tokens out of the text)."""
    token = step.token
    if token.special and fmt.spells(token.text):
        return token.text
    return step.text


def _finish(setup: ToolSetup, parser: ToolCallParser,
            finished: Finished) -> oai.ChatFinishReason:
    calls = parser.calls
    if calls and calls[-1].complete and finished.reason is not FinishReason.LENGTH:
        return "stop" if setup.named else "tool_calls"
    return finish_reason(finished.reason)


def tool_message(setup: ToolSetup, steps: Sequence[Step],
                 finished: Finished) -> tuple[oai.ChatMessageOut, oai.ChatFinishReason]:
    """The assistant message and finish reason of a whole generation."""
    parser = ToolCallParser(setup.format, setup.functions)
    for step in steps:
        parser.feed(step_text(setup.format, step))
    parser.finish()
    if not parser.calls:
        # Text only (`auto`), or a call cut off before its name: what a stream sent.
        return (oai.ChatMessageOut(role="assistant", content=parser.content or ""),
                finish_reason(finished.reason))
    calls = [oai.ToolCallOut(id=c.id, function=oai.FunctionCallOut(name=c.name,
                                                                   arguments=c.arguments))
             for c in parser.calls]
    return (oai.ChatMessageOut(role="assistant", content=parser.content, tool_calls=calls),
            _finish(setup, parser, finished))


def _delta(event: ToolEvent) -> oai.ChatDelta:
    if event.kind == "content":
        return oai.ChatDelta(content=event.text)
    if event.kind == "call":
        return oai.ChatDelta(tool_calls=[oai.DeltaToolCall(
            index=event.index, id=event.call_id, type="function",
            function=oai.FunctionDelta(name=event.name, arguments=""))])
    return oai.ChatDelta(tool_calls=[oai.DeltaToolCall(
        index=event.index, function=oai.FunctionDelta(arguments=event.text))])


class ToolStreamer:
    """One streamed choice's text as OpenAI deltas: content, call starts, argument fragments."""

    def __init__(self, setup: ToolSetup) -> None:
        self.setup = setup
        self.parser = ToolCallParser(setup.format, setup.functions)

    def feed(self, step: Step) -> list[oai.ChatDelta]:
        """The deltas a step adds (none while text is held back)."""
        return [_delta(e) for e in self.parser.feed(step_text(self.setup.format, step))]

    def finish(self, finished: Finished) -> tuple[list[oai.ChatDelta], oai.ChatFinishReason]:
        """The deltas the end releases, and the choice's finish reason (sent after them
        with an empty delta)."""
        deltas = [_delta(e) for e in self.parser.finish()]
        return deltas, _finish(self.setup, self.parser, finished)
