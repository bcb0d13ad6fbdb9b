"""`EngineProcess`: the `Engine` the gateway holds for an engine that runs in its own process.

It spawns ``python -m switchyard.engine_process.child`` with one end of a
socket pair, and relays the engine contract over it (`wire`): `start` and
`warmup` are calls that wait for their answer; `submit` and `abort` are
writes that return at once; events come back on this side's reader thread,
a step's events in one frame, and go to each request's sink on that thread,
as an in-process engine's compute thread would hand them over. `stats` is the
load the process last pushed (no round trip per scrape); `healthy` is the
process being up and serving, and the engine's own answer, polled at most
once a second without waiting.

When the process dies (a crash, the OOM killer, `kill -9`), every sequence in
flight ends at once with an error naming the model and the signal, the model
reports unhealthy, one line is logged, and a new process is started after a
back-off (1 s, doubling up to 30 s; reset after a minute of serving); the
model serves again once it is warm. `shutdown` asks the process to shut its
engine down and exit, and kills it if it does not. The process exits by
itself when the gateway does, however it ends: it reads end of file on the pipe.
"""

from __future__ import annotations

import itertools
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import msgspec

import switchyard_spec
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
    ToParent,
    Warmed,
    Warmup,
)
from switchyard_spec import (
    Engine,
    EngineConfig,
    EngineRequest,
    EngineStartError,
    EngineStats,
    EventSink,
    FinishReason,
    ModelInfo,
    StepObserver,
    TokenEvent,
    WarmupReport,
)

log = logging.getLogger("switchyard.engine_process")

CHILD_MODULE = "switchyard.engine_process.child"
RESTART_BACKOFF_S = (1.0, 30.0)
"""First and longest wait before restarting a process that died; it doubles per failure."""
STABLE_AFTER_S = 60.0
"""A process that served this long resets the back-off."""
HEALTH_POLL_S = 1.0
"""`healthy()` asks the process for its engine's answer at most this often."""
SHUTDOWN_TIMEOUT_S = 90.0
"""How long `shutdown` waits for the engine to stop before killing its process."""

_calls = itertools.count(1)


class _Child:
    """One engine process: its handle, its pipe, the calls awaiting an answer."""

    def __init__(self, proc: subprocess.Popen[bytes], conn: Connection) -> None:
        self.proc = proc
        self.conn = conn
        self.pid = proc.pid
        self.alive = True
        self.started_at = time.monotonic()
        self.exit: str = "is running"
        self.pending: dict[int, list[object]] = {}
        """Call id -> [threading.Event, answer]; the answer stays None if the process died."""


class EngineProcess(Engine):
    """An engine run by a plugin in a child process, behind the engine contract."""

    def __init__(self, engine: str, config: EngineConfig, *, model: str,
                 cpus: tuple[int, ...] | None = None, restart: bool = True,
                 backoff_s: tuple[float, float] = RESTART_BACKOFF_S) -> None:
        """`engine`: the `EngineSpec.name` to build there; `model`: the served name, for logs."""
        self.engine_name = engine
        self.model = model
        self.cpus = cpus
        # The quantization method holds functions: the process looks it up by name.
        self._config = msgspec.structs.replace(config, quantization=None)
        self._restart = restart
        self._backoff = backoff_s
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._sinks: dict[str, EventSink] = {}
        self._observer: StepObserver | None = None
        self._stats = EngineStats(running=0, waiting=0)
        self._ready = False
        self._down: str = "its engine process is starting"
        self._closing = threading.Event()
        self._restarter: threading.Thread | None = None
        self._failures = 0
        self._health_ok = True
        self._health_asked = 0.0
        self.info: ModelInfo | None = None
        self.restarts = 0
        """Processes started after the first one died."""

    # ----------------------------------------------------------- lifecycle
    @property
    def pid(self) -> int | None:
        """The current engine process's id (None before `start`)."""
        child = self._child
        return child.pid if child is not None else None

    def start(self) -> ModelInfo:
        """Start the process, and in it the engine; its `EngineStartError` is raised here."""
        self.info = self._start_child()
        return self.info

    def warmup(self) -> WarmupReport:
        """Warm the engine up in its process; the model serves from here on."""
        report = self._warmup_child()
        return report

    def shutdown(self) -> None:
        """Shut the engine down in its process and wait for the process to exit."""
        self._closing.set()
        with self._lock:
            child, serving = self._child, self._ready
            self._ready = False
            self._down = "the server is shutting down"
        if child is not None and child.alive:
            if serving:
                try:
                    self._call(child, Shutdown(call=next(_calls)), SHUTDOWN_TIMEOUT_S)
                except Exception as exc:  # stopped by force below
                    log.warning("model %s: engine process %d did not shut down cleanly: %s",
                                self.model, child.pid, exc)
            else:  # still starting (a restart): nothing in it is worth waiting for
                _terminate(child.proc)
            _reap(child.proc, 10.0)
        restarter = self._restarter
        if restarter is not None and restarter is not threading.current_thread():
            restarter.join(timeout=30.0)
        late = self._child  # one a restart started meanwhile
        if late is not None and late is not child and late.alive:
            _terminate(late.proc)
            _reap(late.proc, 10.0)
        log.info("model %s: engine process stopped", self.model)

    # -------------------------------------------------------------- health
    def unavailable(self) -> str | None:
        """Why the model cannot take requests now (its process is down or restarting), or None."""
        return None if self._ready else self._down

    def healthy(self) -> bool:
        """The process serves and its engine last said it is healthy (never waits)."""
        child = self._child
        if not self._ready or child is None:
            return False
        now = time.monotonic()
        if now - self._health_asked >= HEALTH_POLL_S:
            self._health_asked = now
            try:
                child.conn.send(CheckHealth())
            except OSError:
                return False
        return self._health_ok

    def probe_liveness(self, timeout: float = 30.0) -> bool:
        """The engine's own liveness probe, run in its process; False while it is down."""
        child = self._child
        if not self._ready or child is None:
            return False
        try:
            answer = self._call(child, Probe(call=next(_calls), timeout=timeout), timeout + 5.0)
        except Exception:
            return False
        self._health_ok = bool(answer.ok)  # type: ignore[attr-defined]
        return self._health_ok

    def load_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter in the engine's process; a restarted process loads it again."""
        self._adapter_call(name, path)
        adapters = {**self._config.lora_adapters, name: path}
        self._config = msgspec.structs.replace(self._config, lora_adapters=adapters)

    def unload_adapter(self, name: str) -> None:
        """Unload a LoRA adapter in the engine's process (and from its restarts)."""
        adapters = {k: v for k, v in self._config.lora_adapters.items() if k != name}
        self._config = msgspec.structs.replace(self._config, lora_adapters=adapters)
        self._adapter_call(name, None)

    def _adapter_call(self, name: str, path: str | None) -> None:
        child = self._child
        if not self._ready or child is None:
            raise switchyard_spec.AdapterError(
                f"adapter {name!r}: the engine process of model {self.model} is not running")
        self._call(child, AdapterCall(call=next(_calls), name=name, path=path), 300.0)

    # ------------------------------------------------------ gateway calls
    def submit(self, request: EngineRequest, sink: EventSink) -> None:
        """Send the request to the process (a write of one frame); never waits for it."""
        with self._lock:
            child = self._child
            if self._ready and child is not None:
                self._sinks[request.request_id] = sink
            else:
                child = None
                down = self._down
        if child is None:
            _deliver(sink, TokenEvent(request_id=request.request_id, token_id=-1,
                                      error=f"model `{self.model}` is not available: {down}"))
            return
        try:
            child.conn.send(Submit(request=request))
        except OSError:
            with self._lock:
                owned = self._sinks.pop(request.request_id, None)
            if owned is not None:  # else the exit handler ended it already
                _deliver(sink, TokenEvent(request_id=request.request_id, token_id=-1,
                                          error=f"the engine process of model `{self.model}` "
                                                "is gone"))

    def abort(self, request_id: str) -> None:
        """Ask the process to drop the sequence (its ``ABORTED`` event comes back as usual)."""
        child = self._child
        if child is not None and request_id in self._sinks:
            try:
                child.conn.send(Abort(request_id=request_id))
            except OSError:
                pass

    def stats(self) -> EngineStats:
        """The load the process pushed last (with every step's events, and once it went quiet)."""
        return self._stats

    def set_step_observer(self, observer: StepObserver | None) -> None:
        """Receive the engine's step reports; they arrive with each step's events."""
        self._observer = observer

    # ------------------------------------------------------------- process
    def _spawn(self) -> _Child:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", CHILD_MODULE, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        child = _Child(proc, Connection(ours, ToParent))
        threading.Thread(target=self._read, args=(child,), daemon=True,
                         name=f"switchyard-engine-{proc.pid}").start()
        log.info("model %s: engine process %d started (engine %s)", self.model, proc.pid,
                 self.engine_name)
        return child

    def _start_child(self) -> ModelInfo:
        if self._closing.is_set():
            raise EngineStartError(f"model {self.model}: the server is shutting down")
        child = self._spawn()
        with self._lock:
            self._child = child
        if self._closing.is_set():  # `shutdown` came while it started
            _terminate(child.proc)
            raise EngineStartError(f"model {self.model}: the server is shutting down")
        level, json_logs = _log_settings()
        answer = self._call(child, Start(
            call=next(_calls), engine=self.engine_name, config=self._config, model=self.model,
            cpus=self.cpus, log_level=level, json_logs=json_logs))
        return answer.info  # type: ignore[attr-defined]

    def _warmup_child(self) -> WarmupReport:
        child = self._child
        if child is None:
            raise EngineStartError("warmup() called before start()")
        answer = self._call(child, Warmup(call=next(_calls)))
        with self._lock:
            if child is self._child and child.alive and not self._closing.is_set():
                self._ready = True
                self._health_ok = True
        return answer.report  # type: ignore[attr-defined]

    def _call(self, child: _Child, message: msgspec.Struct, timeout: float | None = None
              ) -> msgspec.Struct:
        """Send a call and wait for its answer; EngineStartError if the process dies first."""
        slot: list[object] = [threading.Event(), None]
        call = message.call  # type: ignore[attr-defined]
        with self._lock:
            if not child.alive:
                raise EngineStartError(f"the engine process of model {self.model} {child.exit}")
            child.pending[call] = slot
        try:
            child.conn.send(message)
        except OSError:
            pass  # the reader sees end of file and fails the call
        if not slot[0].wait(timeout):  # type: ignore[attr-defined]
            child.pending.pop(call, None)
            raise TimeoutError(f"engine process {child.pid} did not answer in {timeout:.0f}s")
        answer = slot[1]
        if answer is None:
            raise EngineStartError(f"the engine process of model {self.model} {child.exit}")
        if isinstance(answer, Failed):
            raise _error(answer)
        return answer  # type: ignore[return-value]

    def _read(self, child: _Child) -> None:
        """The reader thread of one process: dispatch its frames until end of file."""
        conn = child.conn
        while True:
            try:
                message = conn.recv()
            except Exception:
                log.exception("model %s: unreadable frame from engine process %d", self.model,
                              child.pid)
                message = None
            if message is None:
                break
            kind = type(message)
            if kind is Events:
                self._deliver(message)  # type: ignore[arg-type]
            elif kind is Stats:
                self._stats = message.stats  # type: ignore[attr-defined]
            elif kind is Health:
                self._health_ok = message.ok  # type: ignore[attr-defined]
            elif kind in (Started, Warmed, Failed, Probed, Closed, AdapterDone):
                slot = child.pending.pop(message.call, None)  # type: ignore[attr-defined]
                if slot is not None:
                    slot[1] = message
                    slot[0].set()  # type: ignore[attr-defined]
        self._exited(child)

    def _deliver(self, message: Events) -> None:
        sinks = self._sinks
        for event in message.events:
            if event.finish_reason is not None or event.error is not None:
                sink = sinks.pop(event.request_id, None)
            else:
                sink = sinks.get(event.request_id)
            if sink is not None:
                _deliver(sink, event)
        observer = self._observer
        if observer is not None:
            for report in message.steps:
                try:
                    observer(report)
                except Exception:
                    log.debug("step observer raised", exc_info=True)
        if message.stats is not None:
            self._stats = message.stats

    def _exited(self, child: _Child) -> None:
        """The pipe closed: reap the process, end its sequences, restart it if it was serving."""
        child.exit = _describe_exit(_reap(child.proc, 5.0))
        with self._lock:
            child.alive = False
            pending = list(child.pending.values())
            child.pending.clear()
            current = child is self._child
            was_serving = current and self._ready
            sinks: dict[str, EventSink] = {}
            if current:
                self._ready = False
                sinks, self._sinks = self._sinks, {}
                if not self._closing.is_set():
                    self._down = f"its engine process {child.pid} {child.exit}; restarting it"
        child.conn.close()
        for slot in pending:
            slot[0].set()  # type: ignore[attr-defined]
        closing = self._closing.is_set()
        for request_id, sink in sinks.items():
            if closing:
                _deliver(sink, TokenEvent(request_id=request_id, token_id=-1,
                                          finish_reason=FinishReason.ABORTED))
            else:
                _deliver(sink, TokenEvent(
                    request_id=request_id, token_id=-1,
                    error=f"the engine process of model `{self.model}` {child.exit} while "
                          "generating; the model is restarting"))
        last = self._stats
        self._stats = EngineStats(running=0, waiting=0,
                                  max_batch_total_tokens=last.max_batch_total_tokens,
                                  kv_block_size=last.kv_block_size,
                                  kv_blocks_total=last.kv_blocks_total, steps=last.steps,
                                  max_lora=last.max_lora)  # restarted with its adapters
        if closing or not was_serving:
            return
        if time.monotonic() - child.started_at >= STABLE_AFTER_S:
            self._failures = 0
        delay = min(self._backoff[0] * 2 ** self._failures, self._backoff[1])
        self._failures += 1
        if not self._restart:
            log.error("model %s: engine process %d %s; %d requests in flight failed; "
                      "not restarted", self.model, child.pid, child.exit, len(sinks))
            return
        log.error("model %s: engine process %d %s; %d requests in flight failed; restarting "
                  "in %.0fs", self.model, child.pid, child.exit, len(sinks), delay)
        self._restarter = threading.Thread(target=self._restart_loop, args=(delay,),
                                           daemon=True, name=f"switchyard-restart-{self.model}")
        self._restarter.start()

    def _restart_loop(self, delay: float) -> None:
        while not self._closing.wait(delay):
            began = time.monotonic()
            try:
                self._start_child()
                self._warmup_child()
            except Exception as exc:
                child = self._child
                if child is not None and child.alive:
                    _terminate(child.proc)
                if self._closing.is_set():
                    return
                delay = min(self._backoff[0] * 2 ** self._failures, self._backoff[1])
                self._failures += 1
                log.error("model %s: restarting its engine process failed: %s; next try in "
                          "%.0fs", self.model, exc, delay)
                continue
            if self._ready:
                self.restarts += 1
                log.info("model %s: engine process %s restarted, warm after %.1fs; serving "
                         "again", self.model, self.pid, time.monotonic() - began)
            return


def _deliver(sink: EventSink, event: TokenEvent) -> None:
    try:
        sink(event)
    except Exception:  # a sink must not raise; the reader thread must not die of one
        log.exception("event sink raised")


def _error(answer: Failed) -> Exception:
    """The exception a call raised in the process, as its contract type where it is one."""
    kind = getattr(switchyard_spec, answer.error_type, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind(answer.message)
    return EngineStartError(f"{answer.error_type}: {answer.message}")


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.kill()
    except OSError:
        pass


def _reap(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Wait for the process to exit, killing it after ``timeout``; its return code."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _terminate(proc)
        try:
            return proc.wait(5.0)
        except subprocess.TimeoutExpired:
            return None


def _log_settings() -> tuple[str, bool]:
    """The gateway's log level and whether it logs JSON lines, for the process to follow."""
    from switchyard.telemetry.logs import JsonFormatter

    root = logging.getLogger()
    level = logging.getLevelName(root.getEffectiveLevel()).lower()
    if level not in ("debug", "info", "warning", "error"):
        level = "info"
    json_logs = any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    return level, json_logs
