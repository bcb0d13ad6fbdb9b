"""Generated steps read into output items, with the stream events that build them.

`OutputBuilder` turns each step into events: an assistant `message` item
with one `output_text` part whose text grows by deltas, and, when the turn
has tools, a call item per call the parser reads: a `function_call` whose
`arguments` grow by deltas (with its `namespace` where its tool has one), or
a `custom_tool_call` whose `input` arrives whole when the call is done. An item is closed (its `.done` events, then
`output_item.done`) before the next one opens, and the finished items are
what the response's `output` holds, ids included, so a stream and the final
object always agree.
"""

from __future__ import annotations

from collections.abc import Sequence

from switchyard_spec import FinishReason

from switchyard.generation import Finished, Step
from switchyard.protocol import responses as rs
from switchyard.protocol import responses_events as ev
from switchyard.responses.items import new_id
from switchyard.responses.tools import ToolSet, call_item
from switchyard.text.tokenizer import TextTokenizer
from switchyard.tools.calls import ToolCallParser, ToolEvent
from switchyard.tools.openai import ToolSetup, step_text


def step_logprobs(tokenizer: TextTokenizer, steps: Sequence[Step]) -> list[rs.Logprob]:
    """`output_text.logprobs` entries for these steps (as chat's `logprobs.content`)."""
    out = []
    for step in steps:
        t = step.token
        text = t.text if not t.special else tokenizer.token_text(t.id)
        out.append(rs.Logprob(
            token=text, bytes=list(text.encode()), logprob=t.logprob,
            top_logprobs=[rs.LogprobTop(token=tokenizer.token_text(a.id), logprob=a.logprob,
                                        bytes=list(tokenizer.token_text(a.id).encode()))
                          for a in t.top_tokens]))
    return out


class _Message:
    """The assistant message being written."""

    def __init__(self, index: int) -> None:
        self.id = new_id("msg")
        self.index = index
        self.text: list[str] = []
        self.logprobs: list[rs.Logprob] = []


class _Call:
    """The function call being written."""

    def __init__(self, index: int, call_id: str, name: str) -> None:
        self.id = new_id("fc")
        self.index = index
        self.call_id = call_id
        self.name = name
        self.arguments: list[str] = []


class OutputBuilder:
    """Reads one generation's steps into output items and the events that build them."""

    def __init__(self, tokenizer: TextTokenizer, tools: ToolSetup | None,
                 logprobs: bool, offered: ToolSet | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.offered = offered or ToolSet(tools=[])
        """The client's tools, which the model's calls are mapped back to."""
        self.logprobs = logprobs
        self.parser = ToolCallParser(tools.format, tools.functions) if tools else None
        self.items: list[rs.Item] = []
        """The finished items, in output order."""
        self._message: _Message | None = None
        self._call: _Call | None = None
        self._pending: list[rs.Logprob] = []
        """Logprobs of steps whose text is not visible yet (they go with the next delta)."""

    # ---------------------------------------------------------------- feeding

    def feed(self, step: Step) -> list[ev.Event]:
        """The events one step adds."""
        out: list[ev.Event] = []
        if self.logprobs:
            self._pending += step_logprobs(self.tokenizer, [step])
        if self.parser is None:
            if self._message is None:
                out += self._open_message()
            if step.text or (self._pending and step.finished is not None):
                out += self._text(step.text)
            return out
        for event in self.parser.feed(step_text(self.parser.format, step)):
            out += self._tool_event(event)
        return out

    def finish(self, finished: Finished) -> list[ev.Event]:
        """The events that close the output; `items` is final after this."""
        out: list[ev.Event] = []
        if self.parser is not None:
            for event in self.parser.finish():
                out += self._tool_event(event)
        if self._pending and self._message is not None:
            out += self._text("")
        cut = finished.reason is FinishReason.LENGTH
        out += self._close(cut)
        if not self.items:  # nothing at all was written: an empty message, as OpenAI has
            out += self._open_message()
            out += self._close(cut)
        return out

    # ---------------------------------------------------------------- items

    def _tool_event(self, event: ToolEvent) -> list[ev.Event]:
        if event.kind == "content":
            out = [] if self._message is not None else self._close(False) + self._open_message()
            return out + self._text(event.text)
        if event.kind == "call":
            out = self._close(False)
            call = self._call = _Call(len(self.items), event.call_id, event.name)
            item = call_item(self.offered, call.id, call.call_id, call.name, "", "in_progress")
            return out + [ev.OutputItemAdded(output_index=call.index, item=item)]
        assert self._call is not None
        self._call.arguments.append(event.text)
        if self.offered.is_custom(self._call.name):
            return []  # a custom tool's input is not its JSON arguments: it comes whole
        return [ev.FunctionCallArgumentsDelta(item_id=self._call.id,
                                              output_index=self._call.index, delta=event.text)]

    def _open_message(self) -> list[ev.Event]:
        m = self._message = _Message(len(self.items))
        item = rs.MessageItem(id=m.id, role="assistant", content=[], status="in_progress")
        return [ev.OutputItemAdded(output_index=m.index, item=item),
                ev.ContentPartAdded(item_id=m.id, output_index=m.index, content_index=0,
                                    part=self._part("", None))]

    def _part(self, text: str, logprobs: list[rs.Logprob] | None) -> rs.OutputText:
        return rs.OutputText(text=text, logprobs=logprobs if self.logprobs else None)

    def _text(self, text: str) -> list[ev.Event]:
        m = self._message
        assert m is not None
        logprobs, self._pending = self._pending, []
        m.text.append(text)
        m.logprobs += logprobs
        return [ev.OutputTextDelta(item_id=m.id, output_index=m.index, content_index=0,
                                   delta=text, logprobs=logprobs)]

    def _close(self, cut: bool) -> list[ev.Event]:
        """Close the open item (message or call); `cut`: the token limit ended it."""
        status: rs.ItemStatus = "incomplete" if cut else "completed"
        if self._message is not None:
            m, self._message = self._message, None
            text = "".join(m.text)
            part = self._part(text, m.logprobs)
            item: rs.Item = rs.MessageItem(id=m.id, role="assistant", content=[part],
                                           status=status)
            self.items.append(item)
            return [ev.OutputTextDone(item_id=m.id, output_index=m.index, content_index=0,
                                      text=text, logprobs=m.logprobs),
                    ev.ContentPartDone(item_id=m.id, output_index=m.index, content_index=0,
                                       part=part),
                    ev.OutputItemDone(output_index=m.index, item=item)]
        if self._call is not None:
            c, self._call = self._call, None
            arguments = "".join(c.arguments)
            parsed = next((p for p in self.parser.calls if p.id == c.call_id), None) \
                if self.parser is not None else None
            done = parsed is not None and parsed.complete and not cut
            call = call_item(self.offered, c.id, c.call_id, c.name, arguments,
                             "completed" if done else "incomplete")
            self.items.append(call)
            if isinstance(call, rs.CustomToolCallItem):
                return [ev.OutputItemDone(output_index=c.index, item=call)]
            return [ev.FunctionCallArgumentsDone(item_id=c.id, output_index=c.index,
                                                 name=call.name, arguments=arguments),
                    ev.OutputItemDone(output_index=c.index, item=call)]
        return []
