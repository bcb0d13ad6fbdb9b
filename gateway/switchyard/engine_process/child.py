"""The engine process: ``python -m switchyard.engine_process.child FD``.

Started by `EngineProcess` with one end of a socket pair as file descriptor
FD. The first message (`wire.Start`) says which engine to build, for which
model and with which `EngineConfig`; the process pins itself to the CPUs it is
given, builds the engine through the plugin manager as the in-process loader
does (`PluginHost.select_engine`, `resolve_quantization`, the engine spec's
factory), starts it, and then serves the gateway's calls until `Shutdown` or
until the pipe reaches end of file: the gateway exited, killed or not, and
this process follows it within a few seconds.

Token events leave in batches: the engine's sink only appends to the outbox,
and the step observer, which engines call right after a step's events, sends
them with the step's report and the engine's load in one frame. Events that
come without a step (an abort's ``ABORTED``, an admission error) are sent by
the outbox's thread once the engine has been quiet for half a millisecond.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time

import msgspec

from switchyard.engine_process.wire import (
    Abort,
    AdapterCall,
    AdapterDone,
    CheckHealth,
    Closed,
    Connection,
    Events,
    Failed,
    Health,
    Probe,
    Probed,
    Shutdown,
    Start,
    Started,
    Stats,
    Submit,
    ToChild,
    Warmed,
    Warmup,
)
from switchyard_spec import Engine, EngineStats, StepReport, TokenEvent

log = logging.getLogger("switchyard.engine_process")

FLUSH_QUIET_S = 0.0005
"""Events without a step report leave once the engine has emitted nothing for this long."""
FLUSH_MAX_WAIT_S = 0.005
"""... or at the latest this long after the first of them."""
STATS_QUIET_S = 0.1
"""After the last frame of a busy period, the engine's load is sent once more this much later
(the last step's frame carries the load from before that step's sequences finished)."""
PARENT_GONE_SHUTDOWN_S = 5.0
"""How long a process whose gateway is gone gives its engine to shut down before exiting."""


class Outbox:
    """The engine's events on their way to the gateway, one frame per engine step."""

    def __init__(self, conn: Connection, engine: Engine) -> None:
        self._conn = conn
        self._engine = engine
        self._cond = threading.Condition(threading.Lock())
        self._events: list[TokenEvent] = []
        self._steps: list[StepReport] = []
        self._write = threading.Lock()
        """Held from taking a batch to writing it, so frames leave in the order events came."""
        self._stats_due = False
        self._last_stats: EngineStats | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="switchyard-outbox", daemon=True)
        self._thread.start()

    def sink(self, event: TokenEvent) -> None:
        """The `EventSink` of every request: called on the engine's thread, never blocks long."""
        with self._cond:
            self._events.append(event)
            if len(self._events) == 1 and not self._steps:
                self._cond.notify()

    def observe(self, report: StepReport) -> None:
        """The engine's `StepObserver`: the step is over, so its events leave now."""
        with self._cond:
            self._steps.append(report)
        self.flush()

    def flush(self) -> None:
        """Send what is pending, with the engine's current load, as one frame."""
        with self._write:
            with self._cond:
                events, steps = self._events, self._steps
                if not events and not steps:
                    return
                self._events, self._steps = [], []
                self._stats_due = True
            stats = self._stats()
            self._last_stats = stats
            self._send(Events(events=events, steps=steps, stats=stats))

    def close(self) -> None:
        """Send what is left and stop the outbox's thread."""
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                pending = bool(self._events or self._steps)
                if not pending and not self._closed:
                    self._cond.wait(STATS_QUIET_S if self._stats_due else None)
                    pending = bool(self._events or self._steps)
                if self._closed:
                    return
                trailing = not pending and self._stats_due
                if trailing:
                    self._stats_due = False
            if pending:
                self._settle()
                self.flush()
            elif trailing:
                with self._write:
                    stats = self._stats()
                    if stats is not None and stats != self._last_stats:
                        self._last_stats = stats
                        self._send(Stats(stats=stats))

    def _settle(self) -> None:
        """Wait until the engine stops emitting (or its step observer has sent the batch)."""
        deadline = time.monotonic() + FLUSH_MAX_WAIT_S
        with self._cond:
            seen = -1
            while (self._events or self._steps) and len(self._events) != seen \
                    and time.monotonic() < deadline:
                seen = len(self._events)
                self._cond.wait(FLUSH_QUIET_S)

    def _stats(self) -> EngineStats | None:
        try:
            return self._engine.stats()
        except Exception:  # the load is a gauge: a failure must not lose the events
            log.debug("engine stats failed", exc_info=True)
            return None

    def _send(self, message: msgspec.Struct) -> None:
        try:
            self._conn.send(message)
        except OSError:  # the gateway is gone: the main thread sees end of file and exits
            pass


def main(argv: list[str] | None = None) -> int:
    """Serve one engine for the gateway on the socket whose descriptor is ``argv[0]``."""
    args = sys.argv[1:] if argv is None else argv
    # Ctrl-C in a terminal, `timeout`, or systemd's stop signal the whole process group or
    # cgroup: the gateway decides when the engine stops (after draining the requests in
    # flight it sends Shutdown), and this process exits when the pipe closes in any case.
    # (A handler, not SIG_IGN: processes the engine starts itself get the default back.)
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, _left_to_the_gateway)
    conn = Connection(socket.socket(fileno=int(args[0])), ToChild)
    first = conn.recv()
    if not isinstance(first, Start):
        return 2
    pinned: str | None = None
    if first.cpus:
        # First, so that every thread made from here on (OpenMP's pool too) inherits the mask.
        try:
            os.sched_setaffinity(0, first.cpus)
        except (OSError, ValueError) as exc:
            pinned = f"cannot pin the engine process to CPUs {list(first.cpus)}: {exc}"
    from switchyard.telemetry.logs import configure_logging

    configure_logging(first.log_level, first.json_logs)
    engine: Engine | None = None
    try:
        if pinned is not None:
            from switchyard_spec import EngineStartError

            raise EngineStartError(pinned)
        log.info("engine process %d for model %s: engine %s%s", os.getpid(), first.model,
                 first.engine, f", pinned to CPUs {_cpulist(first.cpus)}" if first.cpus else "")
        engine = _build(first)
        outbox = Outbox(conn, engine)
        info = engine.start()
        engine.set_step_observer(outbox.observe)
    except BaseException as exc:
        log.exception("engine process %d: model %s could not start", os.getpid(), first.model)
        _reply(conn, Failed(call=first.call, error_type=type(exc).__name__, message=str(exc)))
        return 1
    _reply(conn, Started(call=first.call, info=info))
    return _serve(conn, engine, outbox)


def _left_to_the_gateway(signum: int, frame: object) -> None:
    log.info("engine process %d: %s ignored; the gateway stops this process",
             os.getpid(), signal.Signals(signum).name)


def _build(start: Start) -> Engine:
    """The engine, built as `switchyard.models.loader` builds one in the gateway's process."""
    from switchyard.plugins import PluginHost

    plugins = PluginHost.from_entry_points()
    spec = plugins.select_engine(start.engine)
    quantization = plugins.resolve_quantization(start.config.quantize, spec)
    return spec.factory(msgspec.structs.replace(start.config, quantization=quantization))


def _serve(conn: Connection, engine: Engine, outbox: Outbox) -> int:
    """Apply the gateway's calls in order until Shutdown or end of file."""
    sink = outbox.sink
    while True:
        try:
            message = conn.recv()
        except (OSError, ValueError, msgspec.DecodeError):
            log.exception("engine process %d: unreadable message from the gateway", os.getpid())
            message = None
        kind = type(message)
        if kind is Submit:
            engine.submit(message.request, sink)  # type: ignore[union-attr]
        elif kind is Abort:
            engine.abort(message.request_id)  # type: ignore[union-attr]
        elif kind is CheckHealth:
            _reply(conn, Health(ok=_healthy(engine)))
        elif kind is AdapterCall:  # a folder read: off the loop that relays submits
            threading.Thread(target=_adapter, args=(conn, engine, message), daemon=True,
                             name="switchyard-adapter").start()
        elif kind is Probe:
            threading.Thread(target=_probe, args=(conn, engine, message), daemon=True,
                             name="switchyard-probe").start()
        elif kind is Warmup:
            try:
                _reply(conn, Warmed(call=message.call, report=engine.warmup()))  # type: ignore
            except BaseException as exc:
                log.exception("engine process %d: warmup failed", os.getpid())
                _reply(conn, Failed(call=message.call,  # type: ignore[union-attr]
                                    error_type=type(exc).__name__, message=str(exc)))
        elif kind is Shutdown:
            engine.shutdown()
            outbox.close()
            _reply(conn, Closed(call=message.call))  # type: ignore[union-attr]
            return 0
        elif message is None:
            log.warning("engine process %d: the gateway closed the pipe; shutting down",
                        os.getpid())
            stopper = threading.Thread(target=engine.shutdown, daemon=True)
            stopper.start()
            stopper.join(PARENT_GONE_SHUTDOWN_S)
            return 0


def _probe(conn: Connection, engine: Engine, message: Probe) -> None:
    try:
        ok = bool(engine.probe_liveness(message.timeout))
    except Exception:
        log.exception("engine process %d: liveness probe raised", os.getpid())
        ok = False
    _reply(conn, Probed(call=message.call, ok=ok))


def _adapter(conn: Connection, engine: Engine, message: AdapterCall) -> None:
    try:
        if message.path is None:
            engine.unload_adapter(message.name)
        else:
            engine.load_adapter(message.name, message.path)
    except Exception as exc:  # noqa: BLE001 - AdapterError and kin, re-raised by name there
        _reply(conn, Failed(call=message.call, error_type=type(exc).__name__, message=str(exc)))
        return
    _reply(conn, AdapterDone(call=message.call))


def _healthy(engine: Engine) -> bool:
    try:
        return bool(engine.healthy())
    except Exception:
        return False


def _reply(conn: Connection, message: msgspec.Struct) -> None:
    try:
        conn.send(message)
    except OSError:
        pass


def _cpulist(cpus: tuple[int, ...] | None) -> str:
    return ",".join(map(str, cpus or ()))


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Engine threads are daemons, but a library's non-daemon thread must not keep the
    # process alive after the gateway let it go.
    os._exit(code)
