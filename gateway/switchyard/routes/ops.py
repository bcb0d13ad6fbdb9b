"""Operational routes: readiness (`/health`, `/ping`, `GET /`), liveness (`/live`), `/info`,
and Prometheus metrics (`/metrics`)."""

from __future__ import annotations

import msgspec
from litestar import Response, Router, get
from litestar.di import NamedDependency

from switchyard import __version__, openapi
from switchyard.protocol import tgi
from switchyard.routes.errors import tgi_exception_handlers
from switchyard.state import Gateway
from switchyard.telemetry import Telemetry
from switchyard.telemetry.exposition import CONTENT_TYPE

_UNHEALTHY = tgi.ErrorResponse(error="unhealthy", error_type="healthcheck")


class Degraded(msgspec.Struct, frozen=True, kw_only=True):
    """`/health`'s body when some models cannot serve and the rest do: models of a config
    file that failed to load, and remote models whose every replica is out."""

    status: str = "degraded"
    failed: dict[str, str] = {}
    """Each name of a model that failed to load -> why."""
    unreachable: dict[str, str] = {}
    """Each name of a remote model with no replica in service -> how many are out (their
    addresses are in the log, not here)."""


@get(["/health", "/ping"], summary="Readiness", tags=["Text Generation Inference"],
     **openapi.HEALTH)
async def health(gw: NamedDependency[Gateway]) -> Response[tgi.ErrorResponse | Degraded | bytes]:
    """200 once every model is loaded and warmed up and can generate; 503 otherwise, and
    from the SIGTERM that starts a drain until the process exits.

    A model whose last generation failed is probed with a real 1-token
    generation, and the answer follows the probe (TGI's health check). Models
    of a config file that failed to load, and remote models whose replicas are
    all out, are listed in a 200's body: the others serve, so the server stays
    ready.
    """
    if gw.draining:
        return Response(_UNHEALTHY, status_code=503)
    ok = gw.ready
    for model in gw.registry.models():
        ok = await model.check_health() and ok
    for pooling in gw.registry.pooling_models():  # embedding and reranker engines
        ok = pooling.engine.healthy() and ok
    if not ok:
        return Response(_UNHEALTHY, status_code=503)
    unreachable = {
        remote.name: f"all {len(remote.replicas)} replicas are out until their health "
                     "checks pass"
        for remote in gw.registry.remotes() if not any(r.available for r in remote.replicas)
    }
    if gw.registry.failed or unreachable:
        return Response(Degraded(failed=dict(gw.registry.failed), unreachable=unreachable),
                        status_code=200)
    return Response(b"", status_code=200)


@get("/live", summary="Liveness", tags=["Operations"])
async def live() -> Response[bytes]:
    """200 while the process serves HTTP, loaded or not."""
    return Response(b"", status_code=200)


@get("/info", summary="Model and server info", tags=["Text Generation Inference"])
async def info(gw: NamedDependency[Gateway]) -> tgi.Info:
    """TGI's `/info`: the served model and the server's limits."""
    s = gw.settings
    # The first local model: a remote one has no limits or id of its own to report.
    model = next(iter(gw.registry.models()), None)
    return tgi.Info(
        model_id=model.model_id if model else (s.model_id or "loading"),
        model_sha=None,
        # The hub's tag for a model that takes images with its text, as TGI reports it.
        model_pipeline_tag=("image-text-to-text" if model and model.info.takes_images
                            else "text-generation"),
        max_concurrent_requests=s.max_concurrent_requests,
        max_best_of=s.max_best_of,
        max_stop_sequences=s.max_stop_sequences,
        max_input_tokens=model.limits.max_input_tokens if model else s.max_input_tokens,
        max_total_tokens=model.limits.max_total_tokens if model else s.max_total_tokens,
        validation_workers=1,
        max_client_batch_size=s.max_client_batch_size,
        router="text-generation-router",
        version=__version__,
        sha=None,
        docker_label=None,
    )


@get("/metrics", summary="Prometheus metrics scrape endpoint", tags=["Text Generation Inference"],
     operation_id="metrics", response_description="Prometheus Metrics", media_type="text/plain")
async def metrics(telemetry: NamedDependency[Telemetry]) -> Response[str]:
    """TGI's metrics (names, types, labels, buckets) in Prometheus' text format."""
    return Response(telemetry.metrics.exposition().decode(), media_type=CONTENT_TYPE)


router = Router(
    path="/",
    route_handlers=[health, live, info, metrics],
    exception_handlers=tgi_exception_handlers(),
)
