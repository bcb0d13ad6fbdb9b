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

from switchyard.drain import in_flight_counter
from switchyard.models.config import ConfigError, ModelEntry, RemoteEntry, entries_from_settings
from switchyard.models.loader import load_model
from switchyard.remote.model import RemoteModel
from switchyard.models.pooling import PoolingModel
from switchyard.models.served import ServedModel
from switchyard.remote.upstream import new_client
from switchyard.openapi import openapi_config, openapi_json, schema_plugins
from switchyard.plugins import PluginHost
from switchyard.routes import embeddings, openai, ops, sagemaker, tgi, vllm
from switchyard.routes.errors import routing_exception_handlers
from switchyard.settings import ServeSettings
from switchyard.state import Gateway
from switchyard.telemetry import Telemetry, Tracing
from switchyard_spec import EngineStartError

log = logging.getLogger("switchyard")

ModelLoader = Callable[[ModelEntry, PluginHost], ServedModel | PoolingModel]


def create_app(
    settings: ServeSettings,
    plugins: PluginHost | None = None,
    loader: ModelLoader | None = None,
    on_startup_failure: Callable[[], None] | None = None,
    tracing: Tracing | None = None,
) -> Litestar:
    """Build the app; the models `settings` names load when the app starts.

    `loader` defaults to `load_model` with the app's step observer (metrics).
    `on_startup_failure` runs if no model can be served (the CLI exits then);
    with several models, one that fails is reported and the others serve.
    `tracing` defaults to OTLP export when `settings.otlp_endpoint` is set.
    """
    gateway = Gateway(settings=settings)
    telemetry = Telemetry(
        gateway.registry.models,
        tracing or Tracing.otlp(settings.otlp_endpoint, settings.otlp_service_name),
        enabled=not settings.disable_telemetry,
    )
    telemetry.pooling.watch(gateway.registry.pooling_models)
    load = loader or partial(load_model, step_observer=telemetry.step_observer)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        host = plugins or PluginHost.from_entry_points()
        task = asyncio.create_task(_load(gateway, telemetry, host, load, on_startup_failure))
        try:
            yield
        finally:
            task.cancel()
            for remote in gateway.registry.remotes():
                await remote.stop()
            if gateway.upstream_client is not None:
                await gateway.upstream_client.aclose()
            for model in [*gateway.registry.models(), *gateway.registry.pooling_models()]:
                await asyncio.to_thread(model.engine.shutdown)
            await asyncio.to_thread(telemetry.shutdown)

    return Litestar(
        route_handlers=[ops.router, tgi.router, openai.router, vllm.router, sagemaker.router,
                        openapi_json,
                        embeddings.openai_router, embeddings.tei_router],
        dependencies={"gw": Provide(lambda: gateway, sync_to_thread=False),
                      "telemetry": Provide(lambda: telemetry, sync_to_thread=False)},
        # The in-flight count a SIGTERM drain waits on (`switchyard.drain`), then telemetry.
        middleware=[in_flight_counter(gateway), *telemetry.middleware()],
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
    """Load every model in turn; one that fails is reported and does not stop the others."""
    try:
        entries = entries_from_settings(gateway.settings)
    except ConfigError as exc:
        log.error("start-up failed: %s", exc)
        return _give_up(gateway, f"ConfigError: {exc}", on_failure)
    for entry in entries:
        if isinstance(entry, RemoteEntry):
            await _add_remote(gateway, entry)
            continue
        try:
            model = await asyncio.to_thread(loader, entry, plugins)
            if isinstance(model, PoolingModel):
                gateway.registry.add_pooling(model)
                log.info("model %s: served as %s", model.model_id,
                         ", ".join([model.name, *sorted(model.aliases)]))
                continue
            telemetry.metrics.add_model(model.limits.max_input_tokens,
                                        model.limits.max_total_tokens)
            gateway.registry.add(model)
        except Exception as exc:  # reported by /health, the model's 503s and the log
            reason = f"{exc.__class__.__name__}: {exc}"
            # An EngineStartError says what is wrong in words: no traceback under it.
            expected = isinstance(exc, EngineStartError)
            if len(entries) == 1:
                if expected:
                    log.error("start-up failed: %s", exc)
                else:
                    log.exception("start-up failed")
                return _give_up(gateway, reason, on_failure)
            log.error("model %s failed to load; the other models are served: %s", entry.name,
                      exc, exc_info=not expected)
            gateway.registry.fail((entry.name, *entry.aliases), reason)
            continue
        log.info("model %s: served as %s", model.model_id,
                 ", ".join([model.name, *sorted(model.aliases)]))
    if not (gateway.registry.everything() or gateway.registry.pooling_models()
            or gateway.registry.remotes()):
        log.error("start-up failed: no model could be loaded (each one's reason is above)")
        return _give_up(gateway, "no model could be loaded: " + "; ".join(
            f"{name}: {why}" for name, why in gateway.registry.failed.items()), on_failure)
    gateway.ready = True
    log.info("ready: serving %s", ", ".join(m.name for m in [
        *gateway.registry.everything(), *gateway.registry.pooling_models()]))


async def _add_remote(gateway: Gateway, entry: RemoteEntry) -> None:
    """Serve a model other servers serve; its replicas need not be up yet (they are watched)."""
    if gateway.upstream_client is None:
        gateway.upstream_client = new_client()
    model = RemoteModel(entry, gateway.upstream_client)
    await model.start()
    gateway.registry.add(model)
    up = [r for r in model.replicas if r.available]
    log.info("model %s: served by %d replicas (%d answering now), aliases %s", model.name,
             len(model.replicas), len(up), ", ".join(sorted(model.aliases)) or "none")


def _give_up(gateway: Gateway, reason: str, on_failure: Callable[[], None] | None) -> None:
    gateway.startup_error = reason
    if on_failure is not None:
        on_failure()
