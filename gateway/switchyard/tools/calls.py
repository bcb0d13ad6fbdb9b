"""Tool calls as text: each model family's call format, and a parser from text to calls.

A model calls a tool by writing text in the format its chat template taught
it. :func:`tool_format` reads the template and picks the family:

- ``hermes`` (Hermes 2/3, Qwen 2/2.5/3 and the many templates that copied
  them; the template mentions ``<tool_call>``): each call is
  ``<tool_call>\\n{"name": "<function>", "arguments": <JSON object>}\\n</tool_call>``,
  calls separated by a newline. The template renders the tools itself.
- ``llama3_json`` (Llama 3.1 to 3.3; the template asks for
  ``{"name": function name, "parameters": ...}``): each call is
  ``{"name": "<function>", "parameters": <JSON object>}``, calls separated by
  ``"; "``. The template renders the tools itself.
- ``json``, the fallback for every other template: each call is
  ``{"name": "<function>", "arguments": <JSON object>}``, one per line. The
  template is not trusted to render tools: the gateway appends an instruction
  and the tools' definitions (one JSON object per line) to the last message,
  as TGI does (TGI's ``tool_prompt`` replaces the instruction).

The grammar the engine applies (``switchyard.constraints.tools_constraint``)
holds the text to exactly these strings, so :class:`ToolCallParser` reads them
back without guessing: text before a call's trigger is the message's content,
a call's ``arguments`` are the JSON object's text as generated (compact, as
every constrained JSON is), and whitespace between calls belongs to no one.
The parser is incremental, so a stream can send each call's name as soon as
it is complete and its arguments as they are generated.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgspec

_ID_ALPHABET = string.ascii_letters + string.digits
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""Function names OpenAI accepts; names are written into the grammar's literal strings."""


def new_call_id() -> str:
    """A tool call id as OpenAI writes them: ``call_`` and 24 letters or digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class ToolFormat(msgspec.Struct, frozen=True, kw_only=True):
    """How one model family writes a tool call: ``prefix + name + infix + arguments + end``."""

    name: str
    """The family: ``hermes``, ``llama3_json`` or ``json``."""
    trigger: str
    """The text that starts every call (a prefix of ``prefix``)."""
    prefix: str
    infix: str
    end: str
    separator: str
    """Between consecutive calls."""
    arguments_key: str
    """The key the arguments are under (``arguments`` or Llama 3's ``parameters``)."""
    native: bool
    """Whether the chat template renders the tools and earlier calls itself."""

    def spells(self, text: str) -> bool:
        """Whether ``text`` (a special token's) is one of the format's markers, such as
        ``<tool_call>`` where a tokenizer makes it a special token."""
        return bool(text.strip()) and (text in self.prefix or text in self.end)

    def begin(self, function: str) -> str:
        """The text of a call to ``function`` up to its arguments."""
        return f"{self.prefix}{function}{self.infix}"

    def render(self, function: str, arguments: Any) -> str:
        """A whole call, as the model would write it (for templates that cannot)."""
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
        return f"{self.begin(function)}{arguments}{self.end}"


HERMES = ToolFormat(name="hermes", trigger="<tool_call>", prefix='<tool_call>\n{"name": "',
                    infix='", "arguments": ', end="}\n</tool_call>", separator="\n",
                    arguments_key="arguments", native=True)
LLAMA3_JSON = ToolFormat(name="llama3_json", trigger='{"name": "', prefix='{"name": "',
                         infix='", "parameters": ', end="}", separator="; ",
                         arguments_key="parameters", native=True)
JSON_FALLBACK = ToolFormat(name="json", trigger='{"name": "', prefix='{"name": "',
                           infix='", "arguments": ', end="}", separator="\n",
                           arguments_key="arguments", native=False)

DEFAULT_TOOL_PROMPT = (
    "You can call the functions below. To call one, answer with a JSON object "
    '{"name": <function name>, "arguments": <the arguments as a JSON object>} and '
    "nothing else; to call several, write one such object per line. Functions:"
)
"""The instruction put before the tool definitions for ``json``-family templates."""

_LLAMA3_MARK = '"parameters": dictionary of argument name'


def tool_format(template: str | dict[str, str] | None) -> ToolFormat:
    """The tool-call format of the model whose chat template is ``template``."""
    if isinstance(template, dict):  # named templates: transformers uses `tool_use` for tools
        template = template.get("tool_use") or template.get("default") or ""
    text = template or ""
    if "<tool_call>" in text:
        return HERMES
    if _LLAMA3_MARK in text:
        return LLAMA3_JSON
    return JSON_FALLBACK


def tool_prompt(tools: Sequence[dict[str, Any]], instruction: str | None = None) -> str:
    """What a ``json``-family prompt gets appended to its last message: the instruction,
    then each tool's definition as one line of JSON."""
    lines = [instruction if instruction is not None else DEFAULT_TOOL_PROMPT]
    lines += [json.dumps(tool, ensure_ascii=False) for tool in tools]
    return "\n".join(lines)


class ToolEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One thing the parser found: content text, a call's start, or arguments text."""

    kind: Literal["content", "call", "arguments"]
    text: str = ""
    """The content or the arguments fragment."""
    index: int = 0
    """Which call (from 0), for ``call`` and ``arguments``."""
    call_id: str = ""
    """For ``call``: the new call's id."""
    name: str = ""
    """For ``call``: the function's name."""


class ParsedCall(msgspec.Struct, kw_only=True):
    """A call read from the text so far."""

    id: str
    name: str
    arguments: str = ""
    complete: bool = False
    """Whether its arguments and end marker were read in full."""


_FREE, _BEGIN, _ARGS, _END = range(4)


class ToolCallParser:
    """Reads generated text, in pieces, into content and tool calls.

    ``feed`` takes the next piece and returns what it adds (:class:`ToolEvent`);
    ``finish`` returns what the end of the text releases. Text that may be
    the start of a call is held back until it is known not to be one;
    whitespace is held until non-blank text follows it, so blanks between
    calls or around them never become content.
    """

    def __init__(self, fmt: ToolFormat, functions: Iterable[str]) -> None:
        self.format = fmt
        self._begins = {fmt.begin(name): name for name in functions}
        self.calls: list[ParsedCall] = []
        self.content_parts: list[str] = []
        self._buf = ""
        self._state = _FREE
        self._blank = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._after_call = False

    @property
    def content(self) -> str | None:
        """The content so far (text outside calls), or None if there was none."""
        text = "".join(self.content_parts)
        return text or None

    def feed(self, text: str) -> list[ToolEvent]:
        """The events ``text`` completes."""
        events: list[ToolEvent] = []
        self._buf += text
        while self._buf:
            if not self._step(events):
                break
        return events

    def finish(self) -> list[ToolEvent]:
        """The events the end of the text releases (held-back content)."""
        events: list[ToolEvent] = []
        if self._state == _FREE and self._buf:
            self._free(self._buf, events)
        # A call cut off before its name was complete is dropped; one cut off in its
        # arguments stays, with the arguments generated so far.
        self._buf = ""
        if self._blank and not self.calls and self.content_parts:
            self._emit_content(self._blank, events)
        self._blank = ""
        return events

    # ------------------------------------------------------------------ states
    def _step(self, events: list[ToolEvent]) -> bool:
        """Consume what the buffer allows in the current state; False when it needs more."""
        if self._state == _FREE:
            return self._step_free(events)
        if self._state == _BEGIN:
            return self._step_begin(events)
        if self._state == _ARGS:
            return self._step_args(events)
        return self._step_end(events)

    def _step_free(self, events: list[ToolEvent]) -> bool:
        if self._after_call:  # the separator between two calls is no one's text
            separator = self.format.separator.strip()
            if separator:
                body = self._buf.lstrip()
                if not body or (separator.startswith(body) and len(body) < len(separator)):
                    return False
                if body.startswith(separator):
                    self._buf = body[len(separator):]
            self._after_call = False
        trigger = self.format.trigger
        at = self._buf.find(trigger)
        if at >= 0:
            self._free(self._buf[:at], events)
            self._buf = self._buf[at:]
            self._state = _BEGIN
            return True
        hold = _partial_suffix(self._buf, trigger)
        self._free(self._buf[: len(self._buf) - hold], events)
        self._buf = self._buf[len(self._buf) - hold:]
        return False

    def _step_begin(self, events: list[ToolEvent]) -> bool:
        buf = self._buf
        for begin, name in self._begins.items():
            if buf.startswith(begin):
                call = ParsedCall(id=new_call_id(), name=name)
                self.calls.append(call)
                events.append(ToolEvent(kind="call", index=len(self.calls) - 1,
                                        call_id=call.id, name=name))
                self._buf = buf[len(begin):]
                self._state = _ARGS
                self._depth, self._in_string, self._escaped = 0, False, False
                self._blank = ""
                return True
        if any(begin.startswith(buf) for begin in self._begins):
            return False  # a call's start, not complete yet
        # Not a call after all (only possible in unconstrained text): its first
        # character is text, and the rest is read again.
        self._free(buf[0], events)
        self._buf = buf[1:]
        self._state = _FREE
        return True

    def _step_args(self, events: list[ToolEvent]) -> bool:
        buf = self._buf
        done_at = -1
        for i, ch in enumerate(buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    done_at = i + 1
                    break
        piece = buf if done_at < 0 else buf[:done_at]
        call = self.calls[-1]
        if piece:
            call.arguments += piece
            events.append(ToolEvent(kind="arguments", index=len(self.calls) - 1, text=piece))
        if done_at < 0:
            self._buf = ""
            return False
        self._buf = buf[done_at:]
        self._state = _END
        return True

    def _step_end(self, events: list[ToolEvent]) -> bool:
        end = self.format.end
        if self._buf.startswith(end):
            self._buf = self._buf[len(end):]
            self.calls[-1].complete = True
            self._state = _FREE
            self._after_call = True
            return True
        if end.startswith(self._buf):
            return False
        self._state = _FREE  # no end marker (unconstrained text): the rest is text
        return True

    # ----------------------------------------------------------------- content
    def _free(self, text: str, events: list[ToolEvent]) -> None:
        body = text.rstrip()
        if not body:
            self._blank += text
            return
        self._emit_content(self._blank + body, events)
        self._blank = text[len(body):]

    def _emit_content(self, text: str, events: list[ToolEvent]) -> None:
        self.content_parts.append(text)
        events.append(ToolEvent(kind="content", text=text))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def parse_tool_calls(fmt: ToolFormat, functions: Iterable[str], text: str) -> ToolCallParser:
    """The whole ``text`` read by a fresh parser (content and calls on the result)."""
    parser = ToolCallParser(fmt, functions)
    parser.feed(text)
    parser.finish()
    return parser
