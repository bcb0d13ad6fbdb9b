"""Graceful drain: what `switchyard serve` does between SIGTERM and exit.

Kubernetes (and any orchestrator that stops a container with SIGTERM) needs
the server to leave its load balancer before it stops serving, and to finish
what it has started. On SIGTERM:

1. readiness (`/health`, `/ping`, `GET /`) answers 503 at once, so the load
   balancer or endpoint picker stops sending new requests;
2. a generation request that still arrives gets 503 `unhealthy` (in the
   route's API format), while the port stays open so that it gets an answer
   rather than a refused connection;
3. requests already in flight, streams included, run to their end;
4. when none is left, or `--drain-timeout` seconds after the signal, uvicorn
   shuts down as usual (a stream still running then is cut after a few more
   seconds) and the process exits.

Liveness (`/live`) stays 200 until the process exits. A second SIGTERM, or
SIGINT (Ctrl-C, which does not drain), stops at once; `--drain-timeout 0`
turns draining off.

The drain is uvicorn's own shutdown, started later: `DrainingServer` catches
the first SIGTERM instead of setting uvicorn's `should_exit`, and sets it from
uvicorn's once-per-100-ms tick when the count of requests in flight (kept by
`in_flight_counter`) reaches zero or the timeout passes.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Receive, Scope, Send

    from switchyard.state import Gateway

log = logging.getLogger("switchyard")

UNCOUNTED_PATHS = frozenset({"/health", "/ping", "/live", "/metrics"})
"""Probes and scrapes: not requests a drain waits for (`GET /` is readiness too)."""

SHUTDOWN_GRACE_SECONDS = 3.0
"""After the drain, how long uvicorn waits for connections still open before cancelling them."""


def in_flight_counter(gateway: Gateway) -> Callable[[ASGIApp], ASGIApp]:
    """A Litestar middleware factory that keeps `gateway.in_flight` (HTTP requests in
    progress, probes and scrapes excepted); a stream counts until its last byte is sent."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def count(scope: Scope, receive: Receive, send: Send) -> None:
            path = scope.get("path", "")
            if scope["type"] != "http" or path in UNCOUNTED_PATHS or (
                    path == "/" and scope.get("method") != "POST"):
                await app(scope, receive, send)
                return
            gateway.in_flight += 1  # one event loop: no lock needed
            try:
                await app(scope, receive, send)
            finally:
                gateway.in_flight -= 1

        return count

    return middleware


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with the first SIGTERM starting a drain instead of the shutdown."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, drain_timeout: float) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.drain_timeout = drain_timeout
        self.drain_started: float | None = None
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (main thread): flag the drain, and leave the rest to `on_tick`."""
        if (sig == signal.SIGTERM and self.drain_timeout > 0 and self.drain_started is None
                and not self.should_exit):
            # Re-raised after shutdown by uvicorn, so the exit status still says SIGTERM.
            self._captured_signals.append(sig)
            self.gateway.draining = True
            self.drain_started = time.monotonic()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """Every 100 ms: end a drain whose requests are done or whose time is up."""
        if self.drain_started is not None and not self.should_exit:
            in_flight = self.gateway.in_flight
            if not self._announced:
                self._announced = True
                log.info("SIGTERM: draining; readiness is 503, %d requests in flight, "
                         "waiting up to %gs", in_flight, self.drain_timeout)
            if in_flight == 0:
                log.info("drained in %.1fs; shutting down",
                         time.monotonic() - self.drain_started)
                self.should_exit = True
            elif time.monotonic() - self.drain_started >= self.drain_timeout:
                log.warning("drain timeout (%gs): shutting down with %d requests in flight",
                            self.drain_timeout, in_flight)
                self.should_exit = True
        return await super().on_tick(counter)


def run(app: ASGIApp, gateway: Gateway, *, host: str, port: int, log_level: str,
        drain_timeout: float) -> None:
    """Serve `app` until a signal stops it, draining on SIGTERM (what `uvicorn.run` does,
    with `DrainingServer`)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=log_level == "debug",
        # None: uvicorn's loggers go through the configuration `telemetry.logs` installed.
        log_config=None, timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS)
    server = DrainingServer(config, gateway, drain_timeout)
    server.run()
    if not server.started:
        sys.exit(3)  # uvicorn's STARTUP_FAILURE: the port could not be bound
