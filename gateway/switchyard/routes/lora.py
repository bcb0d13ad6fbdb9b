"""Runtime LoRA loading: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.

vLLM's routes and bodies (`{"lora_name", "lora_path"}`, `{"lora_name"}`),
plain-text success answers as vLLM's, OpenAI-format errors. They exist only
with `--allow-runtime-lora-updating` (a 404 otherwise, as when vLLM runs
without `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) and take the `--api-key`. The
engine reads and checks the folder on a worker thread before anything
changes, so a failed load leaves running requests and loaded adapters alone;
an unloaded adapter's requests in flight finish with it.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import msgspec
from litestar import Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from msgspec import Meta
from switchyard_spec import AdapterError, UnknownAdapterError

from switchyard import openapi
from switchyard.errors import ApiError
from switchyard.models.lora import resolve_adapter_source
from switchyard.models.served import ServedModel
from switchyard.routes.auth import require_api_key
from switchyard.routes.content_type import require_json
from switchyard.state import Gateway


class LoadLoraAdapter(msgspec.Struct, frozen=True, kw_only=True):
    """Body of `POST /v1/load_lora_adapter`."""

    lora_name: Annotated[str, Meta(min_length=1, description="The name requests will use as "
                                   "`model` (OpenAI) or `parameters.adapter_id` (TGI).")]
    lora_path: Annotated[str, Meta(min_length=1, description="A PEFT adapter folder on the "
                                   "server, or a hub id in its local cache.")]
    model: Annotated[str | None, Meta(description="The base model to load it on; default: "
                                      "the default model.")] = None


class UnloadLoraAdapter(msgspec.Struct, frozen=True, kw_only=True):
    """Body of `POST /v1/unload_lora_adapter`."""

    lora_name: Annotated[str, Meta(min_length=1, description="The adapter to stop serving.")]
    lora_int_id: Annotated[int | None, Meta(description="Accepted for vLLM's clients; unused."
                                            )] = None


def _enabled(gw: Gateway) -> None:
    if not gw.settings.allow_runtime_lora:
        raise ApiError(404, "Runtime LoRA loading is off: start the server with "
                            "--allow-runtime-lora-updating", "invalid_request_error",
                       code="not_found")


def _bad(message: str, status: int = 400, param: str = "lora_path") -> ApiError:
    return ApiError(status, message, "invalid_request_error", param=param,
                    code="not_found" if status == 404 else None)


@post("/v1/load_lora_adapter", summary="Load a LoRA adapter", tags=["OpenAI"], status_code=200,
      guards=[require_api_key, require_json], **openapi.LORA_LOAD)
async def load_lora_adapter(gw: NamedDependency[Gateway], data: JSONBody[LoadLoraAdapter]
                            ) -> Response[str]:
    """Serve the adapter in `lora_path` as `lora_name` on a model (vLLM's route)."""
    _enabled(gw)
    model = gw.model(data.model)
    if not isinstance(model, ServedModel) or model.adapter_id is not None:
        raise _bad(f"`{data.model}` is not a base model of this server", param="model")
    name = data.lora_name
    if name in model.adapters:
        raise _bad(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    if gw.registry.taken(name):
        raise _bad(f"The name '{name}' is already a served model or adapter.", param="lora_name")
    try:
        path = resolve_adapter_source(name, data.lora_path)
    except AdapterError as exc:
        raise _bad(str(exc), status=404) from None
    try:
        await asyncio.to_thread(model.engine.load_adapter, name, path)
    except AdapterError as exc:
        raise _bad(str(exc)) from None
    model.adapters[name] = path
    return Response(f"Success: LoRA adapter '{name}' added successfully.",
                    media_type="text/plain")


@post("/v1/unload_lora_adapter", summary="Unload a LoRA adapter", tags=["OpenAI"],
      status_code=200, guards=[require_api_key, require_json], **openapi.LORA_UNLOAD)
async def unload_lora_adapter(gw: NamedDependency[Gateway], data: JSONBody[UnloadLoraAdapter]
                              ) -> Response[str]:
    """Stop serving `lora_name`; its requests in flight finish (vLLM's route)."""
    _enabled(gw)
    name = data.lora_name
    model = gw.registry.adapter(name)
    if model is None:
        raise _bad(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name")
    base = gw.registry.resolve(model.parent)
    assert isinstance(base, ServedModel)
    base.adapters.pop(name, None)  # new requests stop reaching it at once
    try:
        await asyncio.to_thread(base.engine.unload_adapter, name)
    except UnknownAdapterError:
        pass  # the engine forgot it already: nothing is left to stop
    except AdapterError as exc:
        raise _bad(str(exc), param="lora_name") from None
    return Response(f"Success: LoRA adapter '{name}' removed successfully.",
                    media_type="text/plain")


ROUTES = [load_lora_adapter, unload_lora_adapter]
