"""The HTTP API's OpenAPI document: how it is built, completed and served.

Litestar builds the document from the route handlers and the msgspec wire types
(`switchyard.protocol`). This module adds what Litestar cannot infer on its own:

- each API's error bodies (`documented(...)`, spread into a route decorator),
  which replace Litestar's own validation-error schema: our exception handlers
  answer in the API's format, so a client never sees Litestar's;
- both media types of a route that answers JSON or a server-sent-event stream
  (Litestar documents one media type per status code);
- each wire type's docstring as its schema's description.

The document is served at `/openapi.json`, at `/api-doc/openapi.json` (TGI's
path) and at `/docs/openapi.json` (beside the Swagger UI at `/docs`), and is
checked in at `spec/openapi.json`: `switchyard openapi -o spec/openapi.json`
regenerates it, and `tests/gateway/test_openapi.py` fails when it is stale.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Union

import msgspec
from litestar import Request, get
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.openapi.spec import Example, OpenAPIResponse, Operation, Reference, RequestBody, Tag
from litestar.plugins import OpenAPISchemaPlugin

from switchyard import __version__
from switchyard.protocol import openai as oai
from switchyard.protocol import responses as rs
from switchyard.protocol import responses_events as rs_events
from switchyard.protocol import tgi

if TYPE_CHECKING:
    from litestar import Litestar
    from litestar._openapi.schema_generation import SchemaCreator
    from litestar.openapi.spec import Schema
    from litestar.typing import FieldDefinition

Api = Literal["tgi", "openai"]

SSE = "text/event-stream"

TGI_TAG = "Text Generation Inference"
OPENAI_TAG = "OpenAI"
OPS_TAG = "Operations"


class ErrorDoc(NamedTuple):
    """How one error status is documented: what it means and an example body."""

    status: int
    description: str
    message: str
    error_type: str
    code: str | None = None


# The messages are the ones `switchyard.errors` and `routes/errors.py` produce.
_ERRORS = {doc.status: doc for doc in (
    ErrorDoc(400, "Malformed JSON body", "Input validation error: JSON is malformed",
             "validation"),
    ErrorDoc(401, "Missing or wrong API key (only when the server runs with one); empty body",
             "", ""),
    ErrorDoc(404, "Unknown `model`", "The model `gpt-4` does not exist.",
             "invalid_request_error", "model_not_found"),
    ErrorDoc(413, "Body larger than `--payload-limit`",
             "Payload too large: the request body exceeds the payload limit (--payload-limit)",
             "payload_too_large", "payload_too_large"),
    ErrorDoc(422, "Input validation error: a field has the wrong type, or a value breaks a "
             "limit", "Input validation error: `top_p` must be > 0.0 and < 1.0", "validation"),
    ErrorDoc(424, "The engine failed while generating",
             "Request failed during generation: engine stopped", "generation"),
    ErrorDoc(429, "No free `--max-concurrent-requests` permit", "Model is overloaded",
             "overloaded"),
    ErrorDoc(500, "Generation ended without a final token", "Incomplete generation",
             "incomplete_generation"),
    ErrorDoc(503, "The model is still loading, or failed to load",
             "Model is not ready: the model is still loading", "unhealthy"),
)}
UNHEALTHY = ErrorDoc(503, "Not ready: the model is loading or its engine failed", "unhealthy",
                     "healthcheck")
"""`/health`'s 503, TGI's body for it."""

GENERATION_ERRORS = (400, 401, 413, 422, 424, 429, 500, 503)
"""A TGI generation route that answers JSON (no 404: TGI routes look no `model` up)."""
OPENAI_GENERATION_ERRORS = (400, 401, 404, 413, 422, 424, 429, 500, 503)
"""An OpenAI generation route: an unknown `model` is a 404."""
STREAM_ERRORS = (400, 401, 413, 422)
"""TGI's `/generate_stream`: only a body that cannot be read is a 4xx; every later
error is an in-stream event with status 200, as in TGI."""
TOKENIZE_ERRORS = (400, 401, 413, 422, 503)
"""`/tokenize`: no generation, no admission."""

# Litestar documents one media type per status code and takes the request body
# from the handler's `data` parameter. A stream's schema, or the body of a route
# that decodes its body itself, is generated under a placeholder status (so
# that its component schemas are registered) and moved to its place by
# `_Completed`, before the document is serialized.
_STREAM_PLACEHOLDER = 0
_BODY_PLACEHOLDER = 1


@dataclass
class _Completed(Operation):
    """An operation whose placeholder responses are moved to their real places."""

    def __post_init__(self) -> None:
        responses = self.responses or {}
        stream = responses.pop(str(_STREAM_PLACEHOLDER), None)
        body = responses.pop(str(_BODY_PLACEHOLDER), None)
        if isinstance(body, OpenAPIResponse) and body.content:
            self.request_body = RequestBody(content=body.content, required=True,
                                            description=body.description)
        ok = responses.get("200")
        if not isinstance(stream, OpenAPIResponse) or isinstance(ok, Reference):
            return
        if ok is None or not ok.content:
            responses["200"] = stream
            return
        ok.content = {**ok.content, **(stream.content or {})}
        ok.description = f"{ok.description}; or, when the request asks to stream, " \
                         f"{stream.description[:1].lower()}{stream.description[1:]}"


def _error_spec(apis: tuple[Api, ...], doc: ErrorDoc) -> ResponseSpec:
    if doc.status == 401:  # a bare 401, as TGI answers
        return ResponseSpec(data_container=None, description=doc.description)
    containers: list[Any] = []
    examples: list[Example] = []
    for api in apis:
        body: msgspec.Struct
        if api == "tgi":
            body = tgi.ErrorResponse(error=doc.message, error_type=doc.error_type)
        else:
            # As `routes/errors.py` maps them: TGI's types that OpenAI calls invalid requests.
            kind = ("invalid_request_error" if doc.error_type in ("validation", "payload_too_large")
                    else doc.error_type)
            param = {404: "model", 422: "top_p"}.get(doc.status)
            body = oai.ErrorResponse(error=oai.ErrorDetail(
                message=doc.message, type=kind, param=param, code=doc.code))
        containers.append(type(body))
        examples.append(Example(summary=f"{api}: {doc.description}",
                                value=msgspec.to_builtins(body)))
    container = containers[0] if len(containers) == 1 else Union[tuple(containers)]  # noqa: UP007
    return ResponseSpec(data_container=container, description=doc.description,
                        generate_examples=False, examples=examples)


def documented(
    api: Api | tuple[Api, ...],
    *,
    ok: Any = None,
    ok_description: str = "Success",
    stream: Any = None,
    stream_description: str = "Server-sent events, `data: <event>` each",
    errors: Iterable[int | ErrorDoc] = (),
    body: Any = None,
) -> dict[str, Any]:
    """Keyword arguments for a route decorator that document its answers.

    `ok` is the JSON body of a 200 (None: no body); `stream` the type of each
    `data:` event when the route can answer `text/event-stream`; `errors` the
    error statuses it can answer, each with the error body of `api` (both
    bodies when two APIs are named); `body` the request body of a route that
    decodes its body itself. Spread the result into the decorator:
    `@post("/x", **documented("tgi", ok=X, errors=GENERATION_ERRORS))`.
    """
    apis = (api,) if isinstance(api, str) else api
    responses: dict[int, ResponseSpec] = {}
    for error in errors:
        doc = error if isinstance(error, ErrorDoc) else _ERRORS[error]
        responses[doc.status] = _error_spec(apis, doc)
    streamed = None if stream is None else ResponseSpec(
        data_container=stream, description=stream_description, media_type=SSE,
        generate_examples=False)
    if ok is None and streamed is not None:
        responses[200] = streamed
    else:
        responses[200] = ResponseSpec(data_container=ok, description=ok_description,
                                      generate_examples=False)
        if streamed is not None:
            responses[_STREAM_PLACEHOLDER] = streamed
    if body is not None:
        responses[_BODY_PLACEHOLDER] = ResponseSpec(
            data_container=body, description="The request", generate_examples=False)
    return {"responses": responses, "operation_class": _Completed}


# What each route answers, for its decorator (`**openapi.GENERATE`).
GENERATE = documented("tgi", ok=tgi.GenerateResponse, ok_description="The generated text",
                      errors=GENERATION_ERRORS)
GENERATE_STREAM = documented(
    "tgi", stream=tgi.StreamResponse, errors=STREAM_ERRORS,
    stream_description="Server-sent events, `data: <StreamResponse>` per token; the stream "
                       "ends after the last one (no `[DONE]`). An error after the body was "
                       "read is a `data: <ErrorResponse>` event, and the status stays 200")
COMPAT = documented(
    "tgi", ok=list[tgi.GenerateResponse], ok_description="A one-element array of the answer",
    stream=tgi.StreamResponse, errors=GENERATION_ERRORS,
    stream_description="Server-sent events as `/generate_stream` sends them")
TOKENIZE = documented("tgi", ok=list[tgi.SimpleToken], ok_description="The tokens",
                      errors=TOKENIZE_ERRORS, body=tgi.GenerateRequest)
CHAT_TOKENIZE = documented("tgi", ok=tgi.ChatTokenizeResponse,
                           ok_description="The templated text and its tokens",
                           errors=(*TOKENIZE_ERRORS, 404))
HEALTH = documented("tgi", ok=None, ok_description="Ready: empty body", errors=(UNHEALTHY,))
CHAT_COMPLETIONS = documented(
    "openai", ok=oai.ChatCompletion, ok_description="The answer",
    stream=oai.ChatCompletionChunk, errors=OPENAI_GENERATION_ERRORS,
    stream_description="Server-sent events, `data: <ChatCompletionChunk>` each, then "
                       "`data: [DONE]`. An error after the stream began is a "
                       "`data: <OpenAIErrorResponse>` event")
COMPLETIONS = documented(
    "openai", ok=oai.Completion, ok_description="The answer",
    stream=oai.Completion, errors=OPENAI_GENERATION_ERRORS,
    stream_description="Server-sent events, `data: <Completion>` chunks of all prompts "
                       "interleaved (each choice's `index` tells its prompt), then "
                       "`data: [DONE]`")
INVOCATIONS = documented(
    ("tgi", "openai"),
    body=tgi.CompatGenerateRequest | oai.ChatCompletionRequest | oai.CompletionRequest,
    ok=list[tgi.GenerateResponse] | oai.ChatCompletion | oai.Completion,
    ok_description="As `POST /` (`inputs`), `/v1/chat/completions` (`messages`) or "
                   "`/v1/completions` (`prompt`) answer",
    stream=tgi.StreamResponse | oai.ChatCompletionChunk | oai.Completion,
    stream_description="Server-sent events of the route the body belongs to",
    errors=OPENAI_GENERATION_ERRORS,
)

RESPONSES_CREATE = documented(
    "openai", ok=rs.Response, ok_description="The response (`queued` for a background one)",
    stream=rs_events.Event, errors=OPENAI_GENERATION_ERRORS,
    stream_description="Server-sent events, `event: <type>` and `data: <event>` each, "
                       "numbered by `sequence_number`, ended by `response.completed`, "
                       "`response.incomplete` or `response.failed` (no `[DONE]`)")
RESPONSES_STORED = documented(
    "openai", ok=rs.Response, ok_description="The stored response",
    stream=rs_events.Event, errors=(400, 401, 404),
    stream_description="With `stream=true`: the kept events after `starting_after`, then "
                       "each new one while the response runs")

_LORA_REFUSED = ErrorDoc(400, "The adapter cannot be served (the reason is named), or the name "
                        "is taken", "adapter 'x': DoRA (use_dora) is not supported",
                        "invalid_request_error")
_LORA_MISSING = ErrorDoc(404, "Runtime loading is off, or no such folder or adapter",
                         "The lora adapter 'x' cannot be found.", "invalid_request_error",
                         "not_found")
LORA_LOAD = documented("openai", ok_description="`Success: LoRA adapter 'x' added "
                       "successfully.` (text/plain, as vLLM)",
                       errors=(_LORA_REFUSED, 401, _LORA_MISSING, 413, 422, 503))
LORA_UNLOAD = documented("openai", ok_description="`Success: LoRA adapter 'x' removed "
                         "successfully.` (text/plain, as vLLM)",
                         errors=(_LORA_REFUSED, 401, _LORA_MISSING, 413, 422, 503))

RESPONSES_CANCEL = documented("openai", ok=rs.Response, ok_description="The response, "
                              "`cancelled` unless it had finished", errors=(400, 401, 404))
RESPONSES_DELETE = documented("openai", ok=rs.DeletedResponse, ok_description="Deleted",
                              errors=(400, 401, 404))
RESPONSES_INPUT_ITEMS = documented("openai", ok=rs.InputItemList,
                                   ok_description="A page of input items",
                                   errors=(400, 401, 404))
RESPONSES_INPUT_TOKENS = documented("openai", ok=rs.InputTokens,
                                    ok_description="The prompt's token count",
                                    errors=(400, 401, 404, 413, 503))


class StructDescriptions(OpenAPISchemaPlugin):
    """Gives each wire type's schema its docstring as description.

    Litestar's own msgspec support writes only a title; this plugin lets it
    build the schema and then adds the docstring.
    """

    def is_plugin_supported_field(self, field_definition: FieldDefinition) -> bool:
        """The gateway's own Structs that have a docstring."""
        type_ = field_definition.type_
        return (
            not field_definition.is_union
            and field_definition.is_subclass_of(msgspec.Struct)
            and type_.__module__.startswith("switchyard")
            and bool(type_.__dict__.get("__doc__"))
        )

    def to_openapi_schema(
        self, field_definition: FieldDefinition, schema_creator: SchemaCreator
    ) -> Schema:
        """Litestar's schema for the Struct, with its docstring as description."""
        builder = next(
            plugin for plugin in schema_creator.plugins
            if plugin is not self and schema_creator.plugin_supports_field(plugin, field_definition)
        )
        schema = builder.to_openapi_schema(  # type: ignore[union-attr]
            field_definition=field_definition, schema_creator=schema_creator)
        schema.description = inspect.cleandoc(field_definition.type_.__doc__)
        return schema


def openapi_config() -> OpenAPIConfig:
    """The app's OpenAPI settings: Swagger UI and the document under `/docs`."""
    return OpenAPIConfig(
        title="Switchyard",
        version=__version__,
        description=(
            "An LLM serving gateway that speaks the text-generation-inference (TGI) API and "
            "the OpenAI API. TGI routes answer errors as `{error, error_type}`, OpenAI routes "
            "as `{error: {message, type, param, code}}`."
        ),
        path="/docs",
        render_plugins=[SwaggerRenderPlugin(path="/")],
        tags=[
            Tag(name=TGI_TAG, description="TGI's routes, quirks included."),
            Tag(name=OPENAI_TAG, description="OpenAI-compatible routes."),
            Tag(name=OPS_TAG, description="Liveness and operations."),
        ],
    )


def document(app: Litestar) -> dict[str, Any]:
    """The app's OpenAPI document as JSON-ready data."""
    return app.openapi_schema.to_schema()


def render_document(app: Litestar) -> str:
    """The document as the checked-in `spec/openapi.json` holds it: sorted keys, indented.

    The app is the caller's to build (`switchyard openapi` builds one with default
    settings): this module sits below `switchyard.app`, whose routes use it.
    """
    return json.dumps(document(app), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


@get(["/openapi.json", "/api-doc/openapi.json"], include_in_schema=False, sync_to_thread=False)
def openapi_json(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """The OpenAPI document (also at `/docs/openapi.json`; TGI serves `/api-doc/openapi.json`)."""
    return document(request.app)


schema_plugins = [StructDescriptions()]
"""OpenAPI schema plugins for the app's `plugins=`."""
