"""The Responses API's stream events, as msgspec Structs tagged by `type`.

A stream is `event: <type>` + `data: <json>` frames with no `[DONE]`: it ends
with `response.completed`, `response.incomplete` or `response.failed`. Every
event carries `sequence_number` (0, 1, 2, ... within one response), which is
what `GET /v1/responses/{id}?stream=true&starting_after=N` resumes from.
"""

from __future__ import annotations

import msgspec

from switchyard.protocol.responses import Item, Logprob, OutputText, Response


class _Event(msgspec.Struct, kw_only=True, tag_field="type"):
    sequence_number: int = 0


class ResponseCreated(_Event, tag="response.created"):
    """The response exists (status `queued` or `in_progress`)."""

    response: Response


class ResponseQueued(_Event, tag="response.queued"):
    """A background response waits for its turn."""

    response: Response


class ResponseInProgress(_Event, tag="response.in_progress"):
    """Generation started."""

    response: Response


class OutputItemAdded(_Event, tag="response.output_item.added"):
    """An output item (message or function call) begins."""

    output_index: int
    item: Item


class OutputItemDone(_Event, tag="response.output_item.done"):
    """An output item is complete, as it appears in the final response."""

    output_index: int
    item: Item


class ContentPartAdded(_Event, tag="response.content_part.added"):
    """A message's `output_text` part begins."""

    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(_Event, tag="response.content_part.done"):
    """A message's `output_text` part is complete."""

    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(_Event, tag="response.output_text.delta"):
    """Text added to an `output_text` part (with its tokens' logprobs when asked)."""

    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Logprob] = msgspec.field(default_factory=list)


class OutputTextDone(_Event, tag="response.output_text.done"):
    """An `output_text` part's whole text."""

    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Logprob] = msgspec.field(default_factory=list)


class FunctionCallArgumentsDelta(_Event, tag="response.function_call_arguments.delta"):
    """Arguments text added to a function call."""

    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event, tag="response.function_call_arguments.done"):
    """A function call's whole arguments."""

    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseCompleted(_Event, tag="response.completed"):
    """The end: the response finished."""

    response: Response


class ResponseIncomplete(_Event, tag="response.incomplete"):
    """The end: the response stopped early (`incomplete_details` says why)."""

    response: Response


class ResponseFailed(_Event, tag="response.failed"):
    """The end: generation failed, or the response was cancelled (`status` says which)."""

    response: Response


Event = (ResponseCreated | ResponseQueued | ResponseInProgress | OutputItemAdded
         | OutputItemDone | ContentPartAdded | ContentPartDone | OutputTextDelta
         | OutputTextDone | FunctionCallArgumentsDelta | FunctionCallArgumentsDone
         | ResponseCompleted | ResponseIncomplete | ResponseFailed)
"""Every event a Responses stream sends."""

TERMINAL = (ResponseCompleted, ResponseIncomplete, ResponseFailed)
"""The events that end a stream."""


def event_type(event: Event) -> str:
    """The event's `type` (its tag)."""
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def sse_frame(event: Event) -> str:
    """The event as one server-sent event: `event: <type>` then `data: <json>`."""
    return f"event: {event_type(event)}\ndata: {msgspec.json.encode(event).decode()}\n\n"
