"""A Responses request's loose fields read into typed items, tools and a tool choice.

`input` items are told apart by `type`, which a message may leave out
(`{"role": "user", "content": "hi"}`); each is checked on its own so that an
error names the exact field (`input[2].call_id`). Items without an `id` get
one (`msg_...`, `fc_...`, `fco_...`, `ctc_...`, `ctco_...`) so that
`GET .../input_items` can list and page them. Tools are read in
`switchyard.responses.tools`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from switchyard.errors import ApiError
from switchyard.openai_mapping.plans import invalid
from switchyard.protocol import responses as rs

ROLES = ("user", "system", "developer", "assistant")
_PARTS: dict[str, type[rs.ContentPart]] = {
    "input_text": rs.InputText, "input_image": rs.InputImage,
    "output_text": rs.OutputText, "refusal": rs.Refusal,
}
IGNORED_ITEMS = ("reasoning",)
"""Item types accepted and left out of the prompt: no served model reads them back."""


def new_id(prefix: str) -> str:
    """A fresh item or response id: `<prefix>_` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"Invalid type for '{param}': expected an object, but got "
                      f"{_kind(value)} instead.", param)
    return value


def _kind(value: Any) -> str:
    return {str: "a string", list: "an array", dict: "an object", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a decimal"}.get(type(value), "a value")


def _string(obj: dict[str, Any], key: str, param: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        what = "missing" if key not in obj else f"{_kind(value)}, not a string"
        raise invalid(f"Invalid '{param}.{key}': {what}.", f"{param}.{key}")
    return value


def read_as(value: dict[str, Any], kind: type[Any], param: str) -> Any:
    """``value`` read as ``kind``; a mismatch is a 400 naming the exact field under ``param``."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        message, _, path = str(exc).partition(" - at `$")
        where = f"{param}{path.rstrip('`')}" if path else param
        raise invalid(f"Invalid '{where}': {message}.", where) from None


def _content(value: Any, role: str, param: str) -> list[rs.ContentPart]:
    if isinstance(value, str):
        return [rs.OutputText(text=value) if role == "assistant" else rs.InputText(text=value)]
    if not isinstance(value, list):
        raise invalid(f"Invalid type for '{param}': expected a string or an array of content "
                      f"parts, but got {_kind(value)} instead.", param)
    parts: list[rs.ContentPart] = []
    for i, raw in enumerate(value):
        where = f"{param}[{i}]"
        part = _object(raw, where)
        kind = part.get("type")
        if kind not in _PARTS:
            raise invalid(f"Invalid value for '{where}.type': {kind!r} is not a content part "
                          f"this server reads (it reads {', '.join(_PARTS)}).", f"{where}.type")
        parsed = read_as(part, _PARTS[kind], where)
        if isinstance(parsed, rs.InputImage) and parsed.image_url is None:
            raise invalid(f"Invalid '{where}': images are read from 'image_url' (an http(s) "
                          "or data: URL); 'file_id' needs a files API this server does not "
                          "have.", f"{where}.image_url")
        parts.append(parsed)
    return parts


def read_item(raw: Any, param: str) -> rs.Item | None:
    """One input item, checked; None for an item type the prompt leaves out (reasoning)."""
    item = _object(raw, param)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise invalid(f"Invalid value for '{param}.role': expected one of "
                          f"{', '.join(ROLES)}, but got {role!r}.", f"{param}.role")
        status = item.get("status", "completed")
        return rs.MessageItem(id=item.get("id") or new_id("msg"), role=role,
                              content=_content(item.get("content"), role, f"{param}.content"),
                              status=status if status in ("in_progress", "incomplete")
                              else "completed")
    if kind == "function_call":
        arguments = _string(item, "arguments", param)
        try:
            json.loads(arguments)
        except ValueError:
            raise invalid(f"Invalid '{param}.arguments': not valid JSON text.",
                          f"{param}.arguments") from None
        namespace = item.get("namespace")
        return rs.FunctionCallItem(id=item.get("id") or new_id("fc"),
                                   call_id=_string(item, "call_id", param),
                                   name=_string(item, "name", param), arguments=arguments,
                                   namespace=namespace if isinstance(namespace, str)
                                   else msgspec.UNSET)
    if kind == "custom_tool_call":
        namespace = item.get("namespace")
        return rs.CustomToolCallItem(id=item.get("id") or new_id("ctc"),
                                     call_id=_string(item, "call_id", param),
                                     name=_string(item, "name", param),
                                     input=_string(item, "input", param),
                                     namespace=namespace if isinstance(namespace, str)
                                     else msgspec.UNSET)
    if kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output")
        if isinstance(output, list):  # content parts: their text, in order
            output = "".join(p.text for p in _content(output, "user", f"{param}.output")
                             if isinstance(p, rs.InputText | rs.OutputText))
        if not isinstance(output, str):
            raise invalid(f"Invalid '{param}.output': expected a string.", f"{param}.output")
        if kind == "custom_tool_call_output":
            return rs.CustomToolCallOutputItem(id=item.get("id") or new_id("ctco"),
                                               call_id=_string(item, "call_id", param),
                                               output=output)
        return rs.FunctionCallOutputItem(id=item.get("id") or new_id("fco"),
                                         call_id=_string(item, "call_id", param), output=output)
    if kind in IGNORED_ITEMS:
        return None
    raise invalid(f"Invalid value for '{param}.type': {kind!r} is not an input item this "
                  "server reads (it reads message, function_call, function_call_output, "
                  "custom_tool_call, custom_tool_call_output; reasoning items are accepted "
                  "and left out of the prompt).", f"{param}.type")


def read_input(value: str | list[Any]) -> list[rs.Item]:
    """`input`: a string is one user message; a list is read item by item."""
    if isinstance(value, str):
        return [rs.MessageItem(id=new_id("msg"), role="user",
                               content=[rs.InputText(text=value)])]
    items = [read_item(raw, f"input[{i}]") for i, raw in enumerate(value)]
    return [item for item in items if item is not None]


def check_calls(history: list[rs.Item], inputs: list[rs.Item]) -> None:
    """Every call output answers a call made before it."""
    called = {item.call_id for item in history if isinstance(item, rs.CallItem)}
    for i, item in enumerate(inputs):
        if isinstance(item, rs.CallItem):
            called.add(item.call_id)
        elif isinstance(item, rs.CallOutputItem) and item.call_id not in called:
            raise invalid(f"No tool call found for function call output with call_id "
                          f"{item.call_id!r}.", f"input[{i}].call_id")


def read_tool_choice(value: Any) -> str | rs.FunctionChoice:
    """`tool_choice`: `auto` (absent), `none`, `required`, or a named function."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise invalid(f"Invalid value for 'tool_choice': expected 'auto', 'none', "
                          f"'required' or an object, but got {value!r}.", "tool_choice")
        return value
    choice = _object(value, "tool_choice")
    if choice.get("type") not in ("function", "custom"):
        raise invalid(f"Invalid value for 'tool_choice.type': only 'function' and 'custom' "
                      f"choices are served, got {choice.get('type')!r}.", "tool_choice.type")
    return rs.FunctionChoice(name=_string(choice, "name", "tool_choice"))


def not_found(response_id: str, param: str | None = None) -> ApiError:
    """A 404 for an id the store does not hold, in vLLM's and OpenAI's words."""
    return ApiError(404, f"Response with id '{response_id}' not found.",
                    "invalid_request_error", param=param)
