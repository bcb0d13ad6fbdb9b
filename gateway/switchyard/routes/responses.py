"""OpenAI's Responses API: `/v1/responses` and its stored responses.

`POST /v1/responses` plans the turn as a chat request
(`switchyard.responses.prompt`), runs it (`switchyard.responses.runner`) and
answers as JSON, as a stream of typed events, or (`background`) at once with
a `queued` response that runs on. Stored responses (`store`, on by default)
can be read, replayed as a stream, cancelled, deleted and continued with
`previous_response_id`.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import Any

from litestar import Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody
from litestar.response import Stream

from switchyard import openapi
from switchyard.models.served import ServedModel
from switchyard.openai_mapping.plans import invalid
from switchyard.protocol import responses as rs
from switchyard.protocol import responses_events as ev
from switchyard.remote import forward as remote
from switchyard.remote.model import RemoteModel
from switchyard.responses.items import check_calls, new_id, not_found, read_input, read_tool_choice
from switchyard.responses.live import LiveResponse, Responses, replay
from switchyard.responses.prompt import check_truncation, plan_turn, wants_logprobs
from switchyard.responses.runner import Turn, run_background, run_turn, snapshot, stream_turn
from switchyard.responses.store import ACTIVE, StoredResponse
from switchyard.responses.tools import OMITTED_HEADER, ToolSet, read_tools
from switchyard.routes.auth import require_api_key
from switchyard.routes.content_type import require_json
from switchyard.routes.disconnect import unless_client_leaves
from switchyard.state import Gateway

MAX_METADATA = 16
"""OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512."""
_REFUSED = ("conversation", "prompt")


def _events(frames: Any, tools: ToolSet | None = None) -> Stream:
    return Stream(frames, media_type="text/event-stream",
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                           **_omitted(tools)})


def _omitted(tools: ToolSet | None) -> dict[str, str]:
    """The header that names the hosted tools left out of the prompt (none: no header)."""
    return {OMITTED_HEADER: ", ".join(tools.omitted)} if tools and tools.omitted else {}


def _check_fields(data: rs.ResponsesRequest, responses: Responses) -> bool:
    """OpenAI's rules on the fields the chat planner does not see; whether to store."""
    for name in _REFUSED:
        if getattr(data, name) is not None:
            raise invalid(f"'{name}' is not supported by this server (chain turns with "
                          "'previous_response_id').", name)
    check_truncation(data.truncation)
    metadata = data.metadata or {}
    if len(metadata) > MAX_METADATA or any(len(k) > 64 or len(v) > 512
                                           for k, v in metadata.items()):
        raise invalid("Invalid 'metadata': at most 16 pairs, keys up to 64 characters and "
                      "values up to 512.", "metadata")
    if data.top_logprobs is not None and not 0 <= data.top_logprobs <= 20:
        raise invalid(f"Invalid 'top_logprobs': expected a value from 0 to 20, but got "
                      f"{data.top_logprobs} instead.", "top_logprobs")
    storing = data.store is not False and responses.enabled
    if data.background:
        if data.store is False:
            raise invalid("background can only be used when `store` is true.", "background")
        if not responses.enabled:
            raise invalid("background needs the response store, which this server turns off "
                          "(--responses-store-max-entries 0).", "background")
    return storing


def _previous(responses: Responses, data: rs.ResponsesRequest | rs.InputTokensRequest
              ) -> StoredResponse | None:
    if data.previous_response_id is None:
        return None
    record = responses.store.get(data.previous_response_id)
    if record is None:
        raise not_found(data.previous_response_id, "previous_response_id")
    if record.response.status in ACTIVE:
        raise invalid(f"Response '{data.previous_response_id}' is still "
                      f"{record.response.status}; continue from it once it has finished.",
                      "previous_response_id")
    return record


def _response(data: rs.ResponsesRequest, model: ServedModel, tools: ToolSet,
              choice: str | rs.FunctionChoice, storing: bool) -> rs.Response:
    """The response object before generation, with the request's fields echoed."""
    return rs.Response(
        id=new_id("resp"), created_at=int(time.time()), model=model.name,
        status="queued" if data.background else "in_progress",
        instructions=data.instructions, max_output_tokens=data.max_output_tokens,
        max_tool_calls=data.max_tool_calls, metadata=dict(data.metadata or {}),
        parallel_tool_calls=data.parallel_tool_calls is not False,
        previous_response_id=data.previous_response_id,
        temperature=1.0 if data.temperature is None else data.temperature,
        top_p=1.0 if data.top_p is None else data.top_p,
        top_logprobs=data.top_logprobs or 0, text=data.text or rs.TextConfig(),
        tool_choice=choice, tools=tools.tools, truncation=data.truncation or "disabled",
        store=storing, background=bool(data.background),
        reasoning=data.reasoning or rs.Reasoning(), service_tier=data.service_tier or "default",
        user=data.user, safety_identifier=data.safety_identifier,
        prompt_cache_key=data.prompt_cache_key, client_metadata=data.client_metadata,
    )


async def create(gw: Gateway, data: rs.ResponsesRequest, raw: bytes) -> Response[Any] | Stream:
    """Answer `POST /v1/responses`."""
    target = gw.resolve(data.model)
    if isinstance(target, RemoteModel):
        return await remote.forward(target, "responses", "/v1/responses", raw,
                                    bool(data.stream))
    model = gw.model(data.model)
    responses = gw.responses
    storing = _check_fields(data, responses)
    previous = _previous(responses, data)
    inputs = read_input(data.input)
    tools = read_tools(data.tools, gw.settings.strict_hosted_tools)
    choice = read_tool_choice(data.tool_choice)
    history = previous.conversation if previous is not None else []
    check_calls(history, inputs)
    plan, kept = await plan_turn(gw, model, data, history + inputs, tools, choice,
                                 previous.anchors if previous is not None else ())
    response = _response(data, model, tools, choice, storing)
    # With `truncation: auto` the dropped items leave the conversation for good.
    dropped = len(history) + len(inputs) - len(kept)
    record = StoredResponse(response=response, history=history[dropped:],
                            inputs=inputs[max(0, dropped - len(history)):])
    live = LiveResponse(record, keep_events=bool(data.stream or data.background))
    turn = Turn(model=model, plan=plan, logprobs=wants_logprobs(data.include), tools=tools)
    if data.background:
        model.admission.check()
        live.emit(ev.ResponseCreated(response=snapshot(response)))
        live.emit(ev.ResponseQueued(response=snapshot(response)))
        responses.store.put(record)
        responses.running[response.id] = live
        # Its own context: the request that queued it ends now, with its own telemetry.
        live.task = asyncio.get_running_loop().create_task(
            run_background(turn, live, responses), context=contextvars.Context())
        if data.stream:
            return _events((ev.sse_frame(e) async for e in live.follow()), tools)
        return Response(snapshot(response), status_code=200, headers=_omitted(tools))
    if data.stream:
        model.admission.check()  # 429 before the stream starts
        live.emit(ev.ResponseCreated(response=snapshot(response)))
        responses.running[response.id] = live
        return _events(stream_turn(turn, live, responses), tools)
    model.admission.acquire()
    try:
        await run_turn(turn, live, responses)
    finally:
        model.admission.release()
    return Response(response, status_code=200, headers=_omitted(tools))


@post("/v1/responses", status_code=200, summary="OpenAI Responses: create", tags=["OpenAI"],
      guards=[require_api_key, require_json], **openapi.RESPONSES_CREATE)
async def create_response(gw: NamedDependency[Gateway], data: JSONBody[rs.ResponsesRequest],
                          request: Request[Any, Any, Any]) -> Response[Any] | Stream:
    """Generate a response, as JSON, as server-sent events, or in the background."""
    return await unless_client_leaves(request, create(gw, data, await request.body()))


def _stored(gw: Gateway, response_id: FromPath[str]) -> StoredResponse:
    record = gw.responses.store.get(response_id)
    if record is None:
        raise not_found(response_id)
    return record


@get("/v1/responses/{response_id:str}", summary="OpenAI Responses: retrieve", tags=["OpenAI"],
     guards=[require_api_key], **openapi.RESPONSES_STORED)
async def retrieve_response(gw: NamedDependency[Gateway], response_id: FromPath[str],
                            stream: FromQuery[bool] = False,
                            starting_after: FromQuery[int | None] = None,
                            include: FromQuery[list[str] | None] = None) -> Response[Any] | Stream:
    """A stored response; with `stream=true`, its events replayed (after `starting_after`)
    and, while it runs, followed to the end."""
    wants_logprobs(include)
    record = _stored(gw, response_id)
    if not stream:
        if starting_after is not None:
            raise invalid("'starting_after' is only used with 'stream=true'.",
                          "starting_after")
        return Response(snapshot(record.response), status_code=200)
    after = -1 if starting_after is None else starting_after
    live = gw.responses.live(response_id)
    if live is not None:
        return _events(ev.sse_frame(e) async for e in live.follow(after))
    if not record.events:
        raise invalid(f"Response '{response_id}' was neither streamed nor run in the "
                      "background, so it has no events to stream.", "stream")
    frames = [ev.sse_frame(e) for e in replay(record, after)]
    return _events(iter(frames))


async def _cancel_task(live: LiveResponse | None) -> None:
    if live is not None and live.task is not None and not live.task.done():
        live.task.cancel()
        try:
            await live.task
        except asyncio.CancelledError:
            pass


@post("/v1/responses/{response_id:str}/cancel", status_code=200,
      summary="OpenAI Responses: cancel", tags=["OpenAI"], guards=[require_api_key],
      **openapi.RESPONSES_CANCEL)
async def cancel_response(gw: NamedDependency[Gateway], response_id: FromPath[str]) -> rs.Response:
    """Stop a background response; it ends `cancelled` (a finished one is left as it is)."""
    record = _stored(gw, response_id)
    if not record.response.background:
        raise invalid("Cannot cancel a synchronous response.", "response_id")
    await _cancel_task(gw.responses.live(response_id))
    if record.response.status in ACTIVE:  # queued, its task not started yet
        record.response.status = "cancelled"
        gw.responses.store.put(record)
    return snapshot(record.response)


@delete("/v1/responses/{response_id:str}", status_code=200,
        summary="OpenAI Responses: delete", tags=["OpenAI"], guards=[require_api_key],
        **openapi.RESPONSES_DELETE)
async def delete_response(gw: NamedDependency[Gateway], response_id: FromPath[str]) -> rs.DeletedResponse:
    """Forget a stored response (a running one is cancelled first)."""
    _stored(gw, response_id)
    await _cancel_task(gw.responses.live(response_id))
    gw.responses.store.delete(response_id)
    return rs.DeletedResponse(id=response_id)


@get("/v1/responses/{response_id:str}/input_items", summary="OpenAI Responses: input items",
     tags=["OpenAI"], guards=[require_api_key], **openapi.RESPONSES_INPUT_ITEMS)
async def list_input_items(gw: NamedDependency[Gateway], response_id: FromPath[str],
                           after: FromQuery[str | None] = None, limit: FromQuery[int] = 20,
                           order: FromQuery[str] = "desc",
                           include: FromQuery[list[str] | None] = None) -> rs.InputItemList:
    """One page of the items the request sent as `input` (newest first by default)."""
    wants_logprobs(include)
    if not 1 <= limit <= 100:
        raise invalid(f"Invalid 'limit': expected a value from 1 to 100, but got {limit}.",
                      "limit")
    if order not in ("asc", "desc"):
        raise invalid(f"Invalid 'order': expected 'asc' or 'desc', but got {order!r}.",
                      "order")
    items = list(_stored(gw, response_id).inputs)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.id for item in items]
        if after not in ids:
            raise invalid(f"Invalid 'after': no input item {after!r} in response "
                          f"'{response_id}'.", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return rs.InputItemList(data=page, first_id=page[0].id if page else None,
                            last_id=page[-1].id if page else None,
                            has_more=len(items) > limit)


@post("/v1/responses/input_tokens", status_code=200, summary="OpenAI Responses: count input "
      "tokens", tags=["OpenAI"], guards=[require_api_key, require_json],
      **openapi.RESPONSES_INPUT_TOKENS)
async def count_input_tokens(gw: NamedDependency[Gateway],
                             data: JSONBody[rs.InputTokensRequest]) -> rs.InputTokens:
    """The prompt tokens a `POST /v1/responses` with these fields would have."""
    model = gw.model(data.model)
    if data.conversation is not None:
        raise invalid("'conversation' is not supported by this server.", "conversation")
    check_truncation(data.truncation)
    previous = _previous(gw.responses, data)
    inputs = read_input(data.input)
    tools = read_tools(data.tools, gw.settings.strict_hosted_tools)
    choice = read_tool_choice(data.tool_choice)
    history = previous.conversation if previous is not None else []
    check_calls(history, inputs)
    request = rs.ResponsesRequest(model=data.model, input=data.input,
                                  instructions=data.instructions, tools=data.tools,
                                  tool_choice=data.tool_choice,
                                  parallel_tool_calls=data.parallel_tool_calls, text=data.text,
                                  truncation=data.truncation, max_output_tokens=1)
    plan, _ = await plan_turn(gw, model, request, history + inputs, tools, choice,
                              previous.anchors if previous is not None else ())
    return rs.InputTokens(input_tokens=len(plan.plan.prompt_ids))


ROUTES = [create_response, count_input_tokens, retrieve_response, cancel_response,
          delete_response, list_input_items]
"""The Responses API's handlers, for the OpenAI router."""
