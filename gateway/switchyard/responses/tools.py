"""A Responses request's `tools` read into typed tools, and what the model is offered.

The model sees function tools only, in the chat route's format:

- `function` tools as they are;
- the tools of a `namespace` under their own names (`spawn_agent`), or
  `<namespace>__<name>` where a name is taken twice; their calls go back to the
  client with `name` and `namespace` as it sent them;
- `custom` tools as a function of one string argument, `input` (held to the
  tool's grammar when it has a `regex` one); their calls go back as
  `custom_tool_call` items carrying that string;
- hosted tools (`web_search`, `file_search`, ...), which the server would have
  to run itself and this server runs none of, are left out: the response says
  so in its `X-Switchyard-Omitted-Tools` header and the log says so too.
  `--strict-hosted-tools` refuses them with a 400 instead.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

import msgspec

from switchyard.openai_mapping.plans import invalid
from switchyard.protocol import openai as oai
from switchyard.protocol import responses as rs
from switchyard.responses.items import read_as

log = logging.getLogger("switchyard.responses")

HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "image_generation", "computer_use", "computer_use_preview",
    "computer", "mcp", "local_shell", "shell", "apply_patch", "tool_search",
})
"""Tool types the server, not the client, would run."""
OMITTED_HEADER = "X-Switchyard-Omitted-Tools"
"""The response header that names the hosted tools left out of the prompt."""
CUSTOM_INPUT = "input"
"""The one argument a custom tool is offered to the model with."""
_TYPES: dict[str, type[Any]] = {"function": rs.FunctionTool, "custom": rs.CustomTool,
                                "namespace": rs.NamespaceTool}


class OfferedTool(msgspec.Struct, frozen=True, kw_only=True):
    """One tool as the model sees it, and the client tool its calls go back to."""

    model_name: str
    kind: Literal["function", "custom"]
    name: str
    namespace: str | None = None
    definition: oai.FunctionDefinition


class ToolSet(msgspec.Struct, frozen=True, kw_only=True):
    """A turn's tools: what the client sent (typed), what the model is offered, what was
    left out."""

    tools: list[rs.Tool]
    offered: tuple[OfferedTool, ...] = ()
    omitted: tuple[str, ...] = ()
    """Hosted tool types left out of the prompt."""

    def chat_tools(self) -> list[oai.Tool] | None:
        """The offered tools in the chat route's format (None without any)."""
        return [oai.Tool(function=t.definition) for t in self.offered] or None

    def by_model_name(self, model_name: str) -> OfferedTool | None:
        """The tool the model called by ``model_name``."""
        return next((t for t in self.offered if t.model_name == model_name), None)

    def is_custom(self, model_name: str) -> bool:
        """Whether the model's call of ``model_name`` goes back as a `custom_tool_call`."""
        tool = self.by_model_name(model_name)
        return tool is not None and tool.kind == "custom"

    def model_name(self, name: str, namespace: str | None) -> str:
        """The name the model knows a client tool by (the name itself when not offered)."""
        return next((t.model_name for t in self.offered
                     if t.name == name and t.namespace == namespace), name)


def _custom_parameters(tool: rs.CustomTool, where: str) -> dict[str, Any]:
    """The JSON schema of a custom tool's one argument, with its grammar where one is given."""
    text: dict[str, Any] = {"type": "string"}
    fmt = tool.format
    if fmt.type == "grammar":
        if fmt.syntax != "regex":
            raise invalid(f"Invalid '{where}.format': a {fmt.syntax!r} grammar cannot be "
                          "compiled by this server's grammar engine (xgrammar); custom tools "
                          "take 'regex' grammars or free text.", f"{where}.format.syntax")
        if not fmt.definition:
            raise invalid(f"Missing '{where}.format.definition'.", f"{where}.format.definition")
        text["pattern"] = fmt.definition
    elif fmt.type != "text":
        raise invalid(f"Invalid '{where}.format.type': expected 'text' or 'grammar', got "
                      f"{fmt.type!r}.", f"{where}.format.type")
    return {"type": "object", "properties": {CUSTOM_INPUT: text}, "required": [CUSTOM_INPUT],
            "additionalProperties": False}


def _flat(tool: rs.FunctionTool | rs.CustomTool, where: str, namespace: str | None
          ) -> tuple[str, Literal["function", "custom"], oai.FunctionDefinition]:
    if isinstance(tool, rs.CustomTool):
        return tool.name, "custom", oai.FunctionDefinition(
            name=tool.name, description=tool.description,
            parameters=_custom_parameters(tool, where), strict=True)
    return tool.name, "function", oai.FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters,
        strict=tool.strict)


def read_tools(raw: list[Any] | None, strict_hosted: bool = False) -> ToolSet:
    """`tools`, typed; hosted tools left out (or, with ``strict_hosted``, a 400)."""
    tools: list[rs.Tool] = []
    omitted: list[str] = []
    flat: list[tuple[str, Literal["function", "custom"], oai.FunctionDefinition,
                     str | None]] = []
    for i, value in enumerate(raw or []):
        where = f"tools[{i}]"
        if not isinstance(value, dict):
            raise invalid(f"Invalid type for '{where}': expected an object.", where)
        kind = value.get("type")
        if kind in HOSTED_TOOLS:
            if strict_hosted:
                raise invalid(f"Tool type {kind!r} ({where}) is not supported: this server "
                              "runs no hosted tools (--strict-hosted-tools).", f"{where}.type")
            omitted.append(kind)
            continue
        if kind not in _TYPES:
            raise invalid(f"Invalid value for '{where}.type': {kind!r} is not a tool type this "
                          f"server knows (it serves {', '.join(_TYPES)}; hosted tools "
                          f"{', '.join(sorted(HOSTED_TOOLS))} are left out).", f"{where}.type")
        if kind == "function" and "function" in value and "name" not in value:
            raise invalid(f"Invalid '{where}': the Responses API's tools are flat "
                          "({type, name, parameters}), not nested under 'function' as on "
                          "chat completions.", f"{where}.name")
        tool = read_as(value, _TYPES[kind], where)
        tools.append(tool)
        if isinstance(tool, rs.NamespaceTool):
            for j, inner in enumerate(tool.tools):
                flat.append((*_flat(inner, f"{where}.tools[{j}]", tool.name), tool.name))
        else:
            flat.append((*_flat(tool, where, None), None))
    counts: dict[str, int] = {}
    for name, _, _, _ in flat:
        counts[name] = counts.get(name, 0) + 1
    offered = []
    for name, kind, definition, namespace in flat:
        model_name = name
        if namespace is not None and counts[name] > 1:
            model_name = f"{namespace}__{name}"
        offered.append(OfferedTool(model_name=model_name, kind=kind, name=name,
                                   namespace=namespace,
                                   definition=msgspec.structs.replace(definition,
                                                                      name=model_name)))
    names = [t.model_name for t in offered]
    for name in names:
        if names.count(name) > 1:
            raise invalid(f"Invalid 'tools': the name {name!r} is given to more than one tool.",
                          "tools")
    if omitted:
        log.info("hosted tools left out of the prompt (this server runs none): %s",
                 ", ".join(omitted))
    return ToolSet(tools=tools, offered=tuple(offered), omitted=tuple(omitted))


def call_item(tools: ToolSet, item_id: str, call_id: str, model_name: str, arguments: str,
              status: rs.ItemStatus) -> rs.CallItem:
    """The call the client receives for the model's call of ``model_name``."""
    tool = tools.by_model_name(model_name)
    namespace = tool.namespace if tool is not None and tool.namespace else msgspec.UNSET
    name = tool.name if tool is not None else model_name
    if tool is not None and tool.kind == "custom":
        try:
            text = json.loads(arguments).get(CUSTOM_INPUT, "") if arguments else ""
        except (ValueError, AttributeError):
            text = ""  # an unfinished call (cut by the token limit): no input yet
        return rs.CustomToolCallItem(id=item_id, call_id=call_id, name=name,
                                     input=text if isinstance(text, str) else "",
                                     status=status, namespace=namespace)
    return rs.FunctionCallItem(id=item_id, call_id=call_id, name=name, arguments=arguments,
                               status=status, namespace=namespace)


def model_call(tools: ToolSet, item: rs.CallItem) -> tuple[str, str]:
    """An earlier call as the model wrote it: its tool's name and its arguments' JSON."""
    namespace = item.namespace if isinstance(item.namespace, str) else None
    name = tools.model_name(item.name, namespace)
    if isinstance(item, rs.CustomToolCallItem):
        return name, json.dumps({CUSTOM_INPUT: item.input}, ensure_ascii=False)
    return name, item.arguments
