"""The compute loop every engine runs: one inbox, one admission prelude, one step runner.

The gateway's calls (``submit``, ``abort``) only put commands on the inbox;
one daemon thread owns the model and runs the loop, and every engine's loop
is this one:

1. take the commands (submits, probes, aborts, calls) in the order they
   were made: admission checks the request id, builds the sequence
   (:meth:`ComputeLoop._build`), starts its grammar and holds it while the
   grammar compiles (:class:`~switchyard_engine.compile_hold.CompileHold`);
2. move the sequences whose grammar has settled to the engine's queue;
3. ask the engine what runs next (:meth:`ComputeLoop._next_step`), run it,
   and hand the results back to the engine (:meth:`ComputeLoop._record`),
   which sends the events through :mod:`switchyard_engine.events`;
4. publish the stats the gateway reads without locking.

A step that raises fails its own sequences and no others, and arms the
liveness probe (:class:`~switchyard_engine.liveness.Liveness`); an error the
engine calls fatal (:meth:`ComputeLoop._fatal`) fails every sequence and
stops the loop. When the loop ends, for whatever reason, every sequence still
live or queued ends with ``ABORTED`` (or the fatal error), exactly once.

An engine subclasses :class:`ComputeLoop` and supplies its scheduling side,
the methods marked "engine hook" below: in the spirit of vLLM's scheduler
interface, the engine says what runs next and the loop runs it.
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from switchyard_spec import (
    Engine,
    EngineConfig,
    EngineRequest,
    EngineStats,
    EventSink,
    FinishReason,
    ModelInfo,
    SamplingParams,
    StepObserver,
    StepReport,
    StoppingParams,
)

from switchyard_engine.compile_hold import CompileHold
from switchyard_engine.events import end, refuse
from switchyard_engine.lifecycle import start_compute_thread
from switchyard_engine.liveness import PROBE_TIMEOUT_S, Liveness
from switchyard_engine.sampling import SampledToken
from switchyard_engine.sequence import BaseSequence

S = TypeVar("S", bound=BaseSequence)

IDLE_WAIT_S = 0.5
"""How long an idle loop blocks on its inbox before it looks at the stop flag again."""


@dataclass(frozen=True)
class Command:
    """One entry of the inbox: what the gateway (or the engine itself) asked for."""

    kind: str
    """``submit``, ``probe`` (a liveness check: queued ahead of the rest), ``abort``,
    ``call`` (run ``payload`` on the compute thread) or ``wake``."""
    payload: Any = None
    """The request, the request id, or the callable."""
    sink: Any = None
    """Where the request's events go; for ``call``, what to run if the loop ends first."""
    at: float = 0.0
    """``time.monotonic()`` when it was asked for: a request's queue time starts here."""


@dataclass
class Step(Generic[S]):
    """What the engine chose to run next: one forward pass over ``seqs``."""

    seqs: list[S]
    run: Callable[[], Sequence[SampledToken | None]]
    """The forward pass and sampling; one result per sequence (None: no token yet)."""
    method: str
    """``prefill``, ``decode`` or ``mixed`` (the step report's name)."""
    prefill_tokens: int
    decode_tokens: int
    detail: Any = None
    """Whatever the engine needs again when it records the results (a shape, ...)."""


class ComputeLoop(Engine, Generic[S]):
    """An :class:`~switchyard_spec.Engine` whose requests go through the shared loop.

    The subclass implements ``start`` (calling :meth:`_start_loop`) and
    ``warmup``, and the engine hooks; everything the gateway calls besides
    those is here.
    """

    thread_name = "switchyard-engine"
    """The compute thread's name."""
    log = logging.getLogger("switchyard.engine")

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.info: ModelInfo | None = None
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._compiling: CompileHold[S] = CompileHold()
        """Constrained sequences whose grammar is still compiling (owned by the loop)."""
        self._failure: str | None = None
        """Why the engine stopped serving (a fatal step error); None while it serves."""
        self._steps = 0
        self._stats = EngineStats(running=0, waiting=0)
        self._liveness = Liveness(self._loop_alive, self._submit_probe)
        self._observer: StepObserver | None = None

    # ------------------------------------------------------ engine hooks
    @abc.abstractmethod
    def _load(self) -> ModelInfo:
        """Engine hook, on the compute thread before the loop: load the model and
        everything the loop needs; sets ``self.info``."""

    @abc.abstractmethod
    def _build(self, request: EngineRequest, sink: EventSink) -> tuple[S | None, str]:
        """Engine hook: the sequence for ``request``, or None and why it cannot be served."""

    @abc.abstractmethod
    def _start_grammar(self, seq: S) -> None:
        """Engine hook: start compiling a constrained ``seq``'s grammar (see
        :class:`~switchyard_engine.grammar.GrammarRows`)."""

    @abc.abstractmethod
    def _queue(self, seq: S, front: bool) -> None:
        """Engine hook: make ``seq`` wait for a step; ``front``: ahead of everything (a probe)."""

    @abc.abstractmethod
    def _find(self, request_id: str) -> S | None:
        """Engine hook: the queued or running sequence of ``request_id``, if any."""

    @abc.abstractmethod
    def _live(self) -> list[S]:
        """Engine hook: every queued and running sequence ([] before the model loaded)."""

    @abc.abstractmethod
    def _drop(self, seq: S) -> None:
        """Engine hook: take ``seq`` out of the queue or the batch and free its cache."""

    @abc.abstractmethod
    def _idle(self) -> bool:
        """Engine hook: whether the loop may block on the inbox (nothing to run)."""

    @abc.abstractmethod
    def _next_step(self) -> Step[S] | None:
        """Engine hook: what runs next, or None."""

    @abc.abstractmethod
    def _record(self, step: Step[S], results: Sequence[SampledToken | None]) -> None:
        """Engine hook: after a successful step, commit it and emit each sequence's token
        (:func:`~switchyard_engine.events.emit_token`), dropping those that finished."""

    @abc.abstractmethod
    def _usage(self) -> tuple[int, int, int]:
        """Engine hook: (waiting sequences, KV-cache tokens in use, KV-cache tokens in all)."""

    @abc.abstractmethod
    def _publish_stats(self) -> None:
        """Engine hook: store the ``EngineStats`` snapshot :meth:`stats` returns."""

    def _fatal(self, exc: Exception) -> str | None:
        """Engine hook: why ``exc`` from a step means the engine cannot go on, or None
        (the default) when it fails only that step's sequences."""
        return None

    def _should_stop(self) -> bool:
        """Engine hook: checked every iteration; True stops the loop (after :meth:`_fail`)."""
        return False

    def _end_iteration(self) -> None:
        """Engine hook: after each iteration's step (a profiler's tick)."""

    def _before_close(self) -> None:
        """Engine hook: the loop is ending; sequences are still live."""

    def _after_close(self) -> None:
        """Engine hook: the loop has ended every sequence."""

    # ----------------------------------------------------------- lifecycle
    def _start_loop(self) -> ModelInfo:
        """Start the compute thread: it runs :meth:`_load`, then the loop. Blocks until
        the model has loaded; a failed load raises here."""
        self._thread, info = start_compute_thread(self.thread_name, self._load, self._loop)
        return info

    def shutdown(self) -> None:
        """Stop the loop; sequences still live end with ``ABORTED``."""
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=60)
        else:
            self._close()
        self.log.info("%s shut down", self.thread_name)

    def healthy(self) -> bool:
        """Cheap and non-blocking: the loop is alive, serving, and no liveness probe has
        failed. After a failed step each call starts a probe in the background if none
        is running; its outcome shows in later answers."""
        return self._loop_alive() and self._liveness.healthy()

    def probe_liveness(self, timeout: float = PROBE_TIMEOUT_S, force: bool = False) -> bool:
        """Whether the engine can still generate; blocks up to ``timeout`` seconds.

        While every step since the last check has succeeded this answers at once.
        After a failed step (or a failed probe), or with ``force``, it runs a real
        1-token generation through the loop, ahead of queued requests. Callers on an
        event loop run it in a worker thread. Concurrent callers share one probe.
        """
        return self._loop_alive() and self._liveness.probe(timeout, force)

    def _loop_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._failure is None

    def _submit_probe(self, request_id: str, sink: EventSink) -> None:
        """Queue a greedy 1-token generation that goes ahead of the queue."""
        assert self.info is not None
        prompt = (self.info.eos_token_ids[0] if self.info.eos_token_ids else 0,)
        request = EngineRequest(request_id=request_id, prompt_token_ids=prompt,
                                sampling=SamplingParams(), logprobs=False,
                                stopping=StoppingParams(max_new_tokens=1, ignore_eos=True))
        self._put(Command("probe", request, sink, time.monotonic()))

    # ------------------------------------------------------ gateway calls
    def submit(self, request: EngineRequest, sink: EventSink) -> None:
        """Queue a request for the loop; never blocks."""
        self._put(Command("submit", request, sink, time.monotonic()))

    def abort(self, request_id: str) -> None:
        """Ask the loop to drop ``request_id`` at the next step boundary."""
        self._inbox.put(Command("abort", request_id))

    def stats(self) -> EngineStats:
        """The snapshot the loop left after its last step."""
        return self._stats

    def set_step_observer(self, observer: StepObserver | None) -> None:
        """Report every forward step (method, sizes, time, queue, cache) to ``observer``."""
        self._observer = observer

    def _call_on_loop(self, fn: Callable[[], None], cancel: Callable[[], None]) -> None:
        """Run ``fn`` on the compute thread between steps; ``cancel`` if the loop ends first."""
        with self._lock:
            if not self._closed:
                self._inbox.put(Command("call", fn, cancel))
                return
        cancel()

    def _wake(self) -> None:
        """Wake a loop blocked on its inbox (to stop, or to notice a failure)."""
        self._inbox.put(Command("wake"))

    def _put(self, command: Command) -> None:
        """Hand a request to the loop, or end it at once when the engine is shut down."""
        with self._lock:
            if not self._closed:
                self._inbox.put(command)
                return
        refuse(command.payload, command.sink, self._failure or "engine is shut down")

    # --------------------------------------------------------------- loop
    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    self._take_commands(block=self._idle())
                    if self._stop.is_set() or self._should_stop():
                        break
                    for ready in self._compiling.release():
                        self._queue(ready, front=False)
                    step = self._next_step()
                    if step is not None:
                        self._run_step(step)
                    self._end_iteration()
                    self._publish_stats()
                    if self._failure is not None:
                        break
        except BaseException:
            self.log.exception("%s: the compute loop crashed", self.thread_name)
            raise
        finally:
            self._close()

    def _take_commands(self, block: bool) -> None:
        """Apply the queued commands in the order they were made."""
        wait = self._compiling.idle_wait(IDLE_WAIT_S)
        try:
            command = self._inbox.get(timeout=wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if command.kind in ("submit", "probe"):
                self._admit(command)
            elif command.kind == "abort":
                self._abort(str(command.payload))
            elif command.kind == "call":
                command.payload()
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, command: Command) -> None:
        """The admission prelude: one live sequence per request id, the engine's checks,
        the grammar's compile started (and the sequence held while it runs)."""
        request: EngineRequest = command.payload
        if self._find(request.request_id) is not None or any(
                s.request_id == request.request_id for s in self._compiling):
            refuse(request, command.sink, "request_id is already live", command.at)
            return
        seq, error = self._build(request, command.sink)
        if seq is None:
            refuse(request, command.sink, error, command.at)
            return
        seq.queued_at = command.at
        if request.constraint is not None:
            self._start_grammar(seq)  # compiles in the worker from now on
            if self._compiling.hold(seq):
                return
        self._queue(seq, front=command.kind == "probe")

    def _discard(self, seq: S) -> None:
        """Take ``seq`` out of wherever it is: the compile hold, the queue or the batch."""
        if not self._compiling.remove(seq):
            self._drop(seq)

    def _abort(self, request_id: str) -> None:
        seq = next((s for s in self._compiling if s.request_id == request_id), None)
        seq = seq or self._find(request_id)
        if seq is not None:
            self._discard(seq)
            end(seq, finish=FinishReason.ABORTED)

    def _run_step(self, step: Step[S]) -> None:
        """Run one step; its failure fails its own sequences (or, when fatal, all)."""
        begin = time.monotonic()
        for seq in step.seqs:  # a sequence's first step ends its queue time
            if seq.started_at is None:
                seq.started_at = begin
        try:
            results = step.run()
        except Exception as exc:  # one bad step must not take the engine down
            reason = self._fatal(exc)
            if reason is not None:
                self._fail(reason)
                return
            self.log.exception("%s step over %d sequences failed", step.method, len(step.seqs))
            for seq in step.seqs:
                self._discard(seq)
                end(seq, error=f"forward step failed: {type(exc).__name__}: {exc}")
            self._liveness.step_failed()
            self._report(step, time.monotonic() - begin, ok=False)
            return
        self._liveness.step_succeeded()
        self._steps += 1
        self._record(step, results)
        self._report(step, time.monotonic() - begin, ok=True)

    def _fail(self, reason: str) -> None:
        """The engine cannot go on: end every sequence with ``reason``; the loop then stops."""
        if self._failure is None:
            self._failure = reason
            self.log.error("%s stops serving (%s), failing %d sequences", self.thread_name,
                           reason, len(self._live()) + len(self._compiling))
        for seq in [*self._live(), *self._compiling]:
            self._discard(seq)
            end(seq, error=self._failure)

    def _report(self, step: Step[S], seconds: float, ok: bool) -> None:
        """Hand the step's ``StepReport`` to the observer, if one is installed."""
        observer = self._observer
        if observer is None:
            return
        waiting, used, total = self._usage()
        try:
            observer(StepReport(
                method=step.method, batch_size=len(step.seqs),
                prefill_tokens=step.prefill_tokens, decode_tokens=step.decode_tokens,
                seconds=seconds, ok=ok, queue_size=waiting, kv_tokens_used=used,
                kv_tokens_total=total))
        except Exception:  # observers must not raise; the loop must not die if one does
            self.log.exception("step observer raised")

    def _close(self) -> None:
        """Refuse new work and end every live, held or queued request exactly once."""
        with self._lock:
            self._closed = True
        self._before_close()
        for seq in [*self._live(), *self._compiling]:
            self._discard(seq)
            end(seq, finish=FinishReason.ABORTED)
        while not self._inbox.empty():
            command = self._inbox.get_nowait()
            if command.kind in ("submit", "probe"):
                refuse(command.payload, command.sink, self._failure,
                       finish=None if self._failure else FinishReason.ABORTED)
            elif command.kind == "call":
                command.sink()
        self._after_close()
        if self.info is not None:
            self._publish_stats()
