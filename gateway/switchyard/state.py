"""The gateway's run-time state, shared by all routes through Litestar's DI."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field

from switchyard import __version__
import httpx

from switchyard.errors import ApiError, validation_error
from switchyard.models.registry import AnyModel, ModelRegistry
from switchyard.remote.model import REMOTE_ENGINE, RemoteModel
from switchyard.responses.live import Responses
from switchyard.models.served import ServedModel
from switchyard.settings import ServeSettings
from switchyard.telemetry.request import note_model


@dataclass
class Gateway:
    """Settings, served models and readiness. Routes reach models only through `model`."""

    settings: ServeSettings
    registry: ModelRegistry = field(default_factory=ModelRegistry)
    ready: bool = False
    """True once every model is loaded and warmed up."""
    startup_error: str | None = None
    upstream_client: httpx.AsyncClient | None = None
    """The one pooled client of every remote model (made when the first one is added)."""
    draining: bool = False
    """Set on SIGTERM: readiness fails and new generation requests get 503 while the
    requests in flight finish (`switchyard.drain`)."""
    in_flight: int = 0
    """HTTP requests in progress, probes and scrapes excepted (`switchyard.drain`)."""
    responses: Responses = field(init=False)
    """Stored and running responses of `/v1/responses` (`switchyard.responses`)."""

    def __post_init__(self) -> None:
        self.responses = Responses(self.settings.responses_store_max_entries,
                                   self.settings.responses_store_max_bytes)

    @property
    def system_fingerprint(self) -> str:
        """`<version>-native`, as TGI reports outside its Docker image."""
        return f"{__version__}-native-{platform.machine()}"

    def resolve(self, name: str | None = None, api: str = "openai") -> AnyModel:
        """The model for a request, local or remote, or 503 while start-up is still running.

        ``name`` is an OpenAI request's `model`, or the `X-Model` header of a
        TGI route (``api="tgi"``: an unknown name is then TGI's 422).
        """
        if self.draining:
            raise ApiError(503, "The server is shutting down", "unhealthy")
        if not self.ready:
            detail = self.startup_error or "the model is still loading"
            raise ApiError(503, f"Model is not ready: {detail}", "unhealthy")
        model = self.registry.resolve(name, api)
        # Labels the request's metrics and log line.
        note_model(model.name, REMOTE_ENGINE if isinstance(model, RemoteModel)
                   else model.engine_spec.name)
        if isinstance(model, ServedModel):
            model.check_available()  # a 503 while its engine process restarts
        return model

    def with_adapter(self, model: ServedModel, adapter_id: str | None) -> ServedModel:
        """``model`` as TGI's `parameters.adapter_id` asks; an adapter it lacks is a 422."""
        if adapter_id is None or adapter_id == model.name or adapter_id == model.adapter_id:
            return model
        base = self.registry.resolve(model.parent, "tgi") if model.parent else model
        if isinstance(base, ServedModel) and adapter_id in base.adapters:
            return base.for_adapter(adapter_id)
        served = ", ".join(sorted(base.adapters)) if isinstance(base, ServedModel) else ""
        raise validation_error(f"adapter_id `{adapter_id}` is not a LoRA adapter of model "
                               f"`{model.name}`; its adapters: {served or 'none'}",
                               param="adapter_id")

    def model(self, name: str | None = None, api: str = "openai") -> ServedModel:
        """As `resolve`, for routes that need the model's tokenizer: a remote model is a 422."""
        model = self.resolve(name, api)
        if isinstance(model, RemoteModel):
            raise validation_error(f"model `{model.name}` is served by other servers, and this "
                                   "route is not forwarded to them", param="model")
        return model
