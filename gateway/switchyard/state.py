"""The gateway's run-time state, shared by all routes through Litestar's DI."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field

from switchyard import __version__
from switchyard.errors import ApiError
from switchyard.models.registry import ModelRegistry
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

    @property
    def system_fingerprint(self) -> str:
        """`<version>-native`, as TGI reports outside its Docker image."""
        return f"{__version__}-native-{platform.machine()}"

    def model(self, name: str | None = None, api: str = "openai") -> ServedModel:
        """The served model for a request, or 503 while start-up is still running.

        ``name`` is an OpenAI request's `model`, or the `X-Model` header of a
        TGI route (``api="tgi"``: an unknown name is then TGI's 422).
        """
        if not self.ready:
            detail = self.startup_error or "the model is still loading"
            raise ApiError(503, f"Model is not ready: {detail}", "unhealthy")
        model = self.registry.resolve(name, api)
        note_model(model.name, model.engine_spec.name)  # labels the request's metrics
        return model
