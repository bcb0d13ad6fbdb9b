"""`POST /invocations`: SageMaker's single entry point, dispatched on the body's shape.

As TGI does, a body with `inputs` is a compat generate request (`POST /`), one
with `messages` is a chat request and one with `prompt` a completion request;
anything else is a 422. Each shape answers, errors included, in the format of
the API it belongs to.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, Router, post
from litestar.di import NamedDependency
from litestar.response import ServerSentEvent

from switchyard import openapi
from switchyard.errors import validation_error
from switchyard.protocol import openai as oai
from switchyard.protocol import tgi
from switchyard.routes.auth import require_api_key
from switchyard.routes.content_type import require_json
from switchyard.routes.disconnect import unless_client_leaves
from switchyard.routes.errors import (
    openai_error_response,
    tgi_error_response,
    tgi_exception_handlers,
)
from switchyard.routes.openai_chat import chat_response
from switchyard.routes.openai_completions import completion_response
from switchyard.routes.tgi import ModelHeader, compat_response
from switchyard.state import Gateway


class _Shape(msgspec.Struct):
    """Which of the three request kinds a body is: the keys present, values unread.

    An absent key stays an empty `Raw` (falsy); a present one holds its JSON text.
    """

    inputs: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()


@post("/invocations", status_code=200, summary="Generate tokens from a SageMaker request",
      tags=["Text Generation Inference"], guards=[require_api_key, require_json],
      **openapi.INVOCATIONS)
async def invocations(
    gw: NamedDependency[Gateway], request: Request[Any, Any, Any], x_model: ModelHeader = None,
) -> Response[Any] | ServerSentEvent:
    """Dispatch to compat generate (`inputs`), chat (`messages`) or completions (`prompt`)."""
    body = await request.body()
    return await unless_client_leaves(request, _dispatch(gw, request, body, x_model))


async def _dispatch(gw: Gateway, request: Request[Any, Any, Any], body: bytes,
                    x_model: str | None) -> Response[Any] | ServerSentEvent:
    shape = msgspec.json.decode(body, type=_Shape)
    if shape.inputs:
        return await compat_response(
            gw, msgspec.json.decode(body, type=tgi.CompatGenerateRequest), x_model, body)
    if shape.messages:
        try:
            chat = msgspec.json.decode(body, type=oai.ChatCompletionRequest)
            return await chat_response(gw, chat, body)
        except Exception as exc:  # noqa: BLE001 - every error answers in OpenAI's format
            return openai_error_response(exc, request)
    if shape.prompt:
        try:
            completion = msgspec.json.decode(body, type=oai.CompletionRequest)
            return await completion_response(gw, completion, body)
        except Exception as exc:  # noqa: BLE001
            return openai_error_response(exc, request)
    return tgi_error_response(validation_error(
        "the body must be a generate request (`inputs`), a chat request (`messages`) "
        "or a completion request (`prompt`)"
    ), request)


router = Router(path="/", route_handlers=[invocations], exception_handlers=tgi_exception_handlers())
