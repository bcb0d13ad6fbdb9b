"""The Litestar application: routes, DI of the gateway state, and start-up.

The HTTP port opens at once so that liveness can be probed, and the model
loads on a worker thread; `/health` turns 200 only when loading and warmup
are done (readiness), and generation routes answer 503 until then.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial

from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.di import Provide

from switchyard.models.loader import load_model
from switchyard.models.served import ServedModel
from switchyard.openapi import openapi_config, openapi_json, schema_plugins
from switchyard.plugins import PluginHost
from switchyard.routes import openai, ops, sagemaker, tgi
from switchyard.routes.errors import routing_exception_handlers
from switchyard.settings import ServeSettings
from switchyard.state import Gateway
from switchyard.telemetry import Telemetry, Tracing

log = logging.getLogger("switchyard")

ModelLoader = Callable[[ServeSettings, PluginHost], ServedModel]


def create_app(
    settings: ServeSettings,
    plugins: PluginHost | None = None,
    loader: ModelLoader | None = None,
    on_startup_failure: Callable[[], None] | None = None,
    tracing: Tracing | None = None,
) -> Litestar:
    """Build the app; the model named by `settings` loads when the app starts.

    `loader` defaults to `load_model` with the app's step observer (metrics).
    `on_startup_failure` runs if the model cannot be loaded (the CLI exits then).
    `tracing` defaults to OTLP export when `settings.otlp_endpoint` is set.
    """
    gateway = Gateway(settings=settings)
    telemetry = Telemetry(
        gateway.registry.models,
        tracing or Tracing.otlp(settings.otlp_endpoint, settings.otlp_service_name),
        enabled=not settings.disable_telemetry,
    )
    load = loader or partial(load_model, step_observer=telemetry.step_observer)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        host = plugins or PluginHost.from_entry_points()
        task = asyncio.create_task(_load(gateway, telemetry, host, load, on_startup_failure))
        try:
            yield
        finally:
            task.cancel()
            for model in gateway.registry.models():
                await asyncio.to_thread(model.engine.shutdown)
            await asyncio.to_thread(telemetry.shutdown)

    return Litestar(
        route_handlers=[ops.router, tgi.router, openai.router, sagemaker.router, openapi_json],
        dependencies={"gw": Provide(lambda: gateway, sync_to_thread=False),
                      "telemetry": Provide(lambda: telemetry, sync_to_thread=False)},
        middleware=telemetry.middleware(),
        # Unknown paths and wrong methods: in the format of the API the path belongs to.
        exception_handlers=routing_exception_handlers(),
        lifespan=[lifespan],
        # Logging is configured once, by the CLI (`telemetry.logs`); Litestar's own
        # configuration would replace its format.
        logging_config=None,
        request_max_body_size=settings.payload_limit,
        # TGI allows content-type only; authorization is added so that a browser can
        # send the `--api-key` bearer token.
        cors_config=CORSConfig(allow_methods=["GET", "POST"],
                               allow_headers=["content-type", "authorization"]),
        openapi_config=openapi_config(),
        plugins=list(schema_plugins),
        state={"gateway": gateway},
    )


async def _load(
    gateway: Gateway,
    telemetry: Telemetry,
    plugins: PluginHost,
    loader: ModelLoader,
    on_failure: Callable[[], None] | None,
) -> None:
    try:
        model = await asyncio.to_thread(loader, gateway.settings, plugins)
    except Exception as exc:  # reported by /health and the 503s, and in the log
        log.exception("start-up failed")
        gateway.startup_error = f"{exc.__class__.__name__}: {exc}"
        if on_failure is not None:
            on_failure()
        return
    telemetry.metrics.add_model(model.limits.max_input_tokens, model.limits.max_total_tokens)
    gateway.registry.add(model)
    gateway.ready = True
    log.info("ready: serving %s", model.name)
