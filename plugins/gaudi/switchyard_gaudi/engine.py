"""GaudiEngine: static-shape bucketed continuous batching, as TGI serves on Gaudi.

The gateway's calls only put commands on a queue; one daemon thread loads the
model, warms it up and runs the loop: take commands (submits, aborts),
then either prefill newcomers (padded to a prefill bucket; they join the
running batch) or decode every running sequence one token (padded to a
decode bucket), as :mod:`~switchyard_gaudi.scheduler` decides. Every shape
the device runs is one of the warmup plan's, so after warmup nothing compiles.

Pieces, each in its own module: ``assembly`` (start-up order), ``settings`` (the seed's variables),
``limits`` and ``warmup_plan`` (limits, buckets, shapes, memory; pure),
``device`` (the only module touching Habana's software), ``kv_cache`` and
``rows`` (the static cache and who holds which row), ``attention`` and
``runner`` (the captured forward passes; ``vision`` for Llava-Next and Llava
1.5, whose prefill takes image features), ``scheduler`` (TGI's router
semantics), ``admission``, ``events`` and ``profiler``; FP8, ``fp8_linears``
(``--quantize fp8``) and ``fp8`` (``QUANT_CONFIG``); sharded
(``--num-shard`` > 1), ``tensor_parallel`` (how many ranks, AutoTP),
``shard_group`` (the follower processes and the ops sent to them) and
``rank`` (a follower's main loop).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

import torch

from switchyard_engine.compile_hold import CompileHold
from switchyard_engine.lifecycle import deliver, start_compute_thread
from switchyard_engine.liveness import PROBE_TIMEOUT_S, Liveness
from switchyard_spec import (
    Engine,
    EngineConfig,
    EngineRequest,
    EngineStartError,
    EngineStats,
    EventSink,
    FinishReason,
    ModelInfo,
    SamplingParams,
    StepObserver,
    StepReport,
    StoppingParams,
    TokenEvent,
    WarmupReport,
)

from switchyard_gaudi import fp8
from switchyard_gaudi.admission import Admission
from switchyard_gaudi.assembly import assemble, prepare
from switchyard_gaudi.device import Device
from switchyard_gaudi.events import end, record
from switchyard_gaudi.kv_cache import StaticKVCache
from switchyard_gaudi.profiler import StepProfiler
from switchyard_gaudi.rows import RowTable
from switchyard_gaudi.runner import StaticRunner
from switchyard_gaudi.scheduler import Scheduler
from switchyard_gaudi.sequence import GaudiSequence
from switchyard_gaudi.shard_group import ShardFailure, ShardGroup
from switchyard_gaudi.settings import GaudiSettings
from switchyard_gaudi.warmup import run_warmup
from switchyard_gaudi.warmup_plan import Shape, WarmupPlan

logger = logging.getLogger("switchyard.gaudi")

_IDLE_WAIT_S = 0.5
_OVERDUE = 0.0
"""A probe's queue time: the clock's origin, so QUEUE_THRESHOLD_MS finds it overdue."""


class GaudiEngine(Engine):
    """A static-shape engine for one model on an HPU, or on the CPU (``device=cpu``).

    ``env`` replaces ``os.environ`` as the source of the seed's variables
    (tests pass their own). Nothing heavy happens until :meth:`start`.
    """

    def __init__(self, config: EngineConfig, env: dict[str, str] | None = None) -> None:
        self.config = config
        self._env = env
        self.settings: GaudiSettings | None = None
        self.device: Device | None = None
        self.plan: WarmupPlan | None = None
        self.info: ModelInfo | None = None
        self._inbox: queue.SimpleQueue[tuple[str, object, object, float]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._runner: StaticRunner | None = None
        self._scheduler: Scheduler | None = None
        self._admission: Admission | None = None
        self._rows: RowTable | None = None
        self._cache: StaticKVCache | None = None
        self._profiler: StepProfiler | None = None
        self._fp8: object | None = None
        """``QUANT_CONFIG``'s INC model: MEASURE writes its statistics at shutdown."""
        self._group: ShardGroup | None = None
        """Sharded (``--num-shard`` > 1): ranks 1 .. N-1, which follow this thread's ops."""
        self._failure: str | None = None
        """Why the engine stopped serving (a rank died); None while it serves."""
        self.running: list[GaudiSequence] = []
        self._compiling: CompileHold[GaudiSequence] = CompileHold()
        """Constrained sequences whose grammar is still compiling (owned by the compute thread)."""
        """Sequences holding a cache row, in prefill order (owned by the compute thread)."""
        self._warmed: set[Shape] = set()
        self._steps = 0
        self._stats = EngineStats(running=0, waiting=0)
        self._liveness = Liveness(self._loop_alive, self._submit_probe)
        self._observer: StepObserver | None = None
        self.padding = {"prefill_real": 0, "prefill_padded": 0, "decode_real": 0,
                        "decode_padded": 0}
        """Tokens the steps computed for sequences, and all they computed (with padding)."""

    # ----------------------------------------------------------- lifecycle
    def start(self) -> ModelInfo:
        """Start the compute thread, which plans, loads the model and then runs the loop."""
        self._thread, info = start_compute_thread("switchyard-gaudi", self._load, self._loop)
        return info

    def _load(self) -> ModelInfo:
        """On the compute thread: plan (before any weight loads), then load and assemble."""
        prepared = prepare(self.config, self._env)
        self.settings, self.device, self.plan = prepared.settings, prepared.device, prepared.plan
        group = None
        if prepared.ranks > 1:  # the followers load their copies while this rank loads its own
            group = ShardGroup.launch(self.config, prepared.ranks, prepared.device,
                                      prepared.settings, prepared.options, prepared.dims,
                                      prepared.dtype, prepared.plan, on_failure=self._wake)
        try:
            parts = assemble(self.config, prepared, group)
            if group is not None:
                group.wait_ready()
        except BaseException:
            if group is not None:
                group.stop(graceful=False)
            raise
        self._group = group
        self._cache, self._rows, self._runner = parts.cache, parts.rows, parts.runner
        self._scheduler, self._admission = parts.scheduler, parts.admission
        self._fp8 = parts.fp8
        self.info = parts.info
        return parts.info

    def warmup(self) -> WarmupReport:
        """Run every planned shape (unless ``WARMUP_ENABLED=false``) on the compute thread."""
        if self.plan is None or self.settings is None:
            raise EngineStartError("warmup() called before start()")
        done = threading.Event()
        result: list[float | BaseException] = []
        self._enqueue_internal("warmup", (done, result))
        if not done.wait(timeout=3600) or not result:
            raise EngineStartError("gaudi warmup did not finish")
        if isinstance(result[0], BaseException):
            raise EngineStartError(f"gaudi warmup failed: {result[0]}") from result[0]
        limits = self.plan.limits
        return WarmupReport(seconds=result[0],
                            max_batch_total_tokens=limits.max_batch_size * limits.max_total_tokens,
                            max_batch_size=limits.max_batch_size)

    def _warm(self, done: threading.Event, result: list[float | BaseException]) -> None:
        """On the compute thread: warm every shape of the plan, then start the profiler."""
        assert self.plan is not None and self._runner is not None and self.settings is not None
        try:
            seconds = run_warmup(self.plan, self._runner, self.device, self.settings.warmup_enabled)
            if self.settings.warmup_enabled:
                self._warmed.update(self.plan.shapes)
            self._profiler = StepProfiler(self.settings, self.device)  # type: ignore[arg-type]
            result.append(seconds)
        except Exception as exc:  # handed to warmup()'s caller
            logger.exception("gaudi warmup failed")
            result.append(exc)
        done.set()

    @property
    def compiles(self) -> int:
        """Graphs compiled so far: constant after warmup when serving meets only planned shapes."""
        return self.device.compiles if self.device is not None else 0

    def shutdown(self) -> None:
        """Stop the loop; sequences still live end with ``ABORTED``."""
        self._stop.set()
        self._inbox.put(("wake", None, None, 0.0))
        if self._thread is not None:
            self._thread.join(timeout=60)
        else:
            self._close()
        self._runner = None
        logger.info("gaudi engine shut down")

    def healthy(self) -> bool:
        """Cheap: the loop is alive (sharded: every rank with it) and no liveness probe failed.

        After a failed forward step it starts a real 1-token probe in the
        background (the toolkit's :class:`~switchyard_engine.liveness.Liveness`),
        whose outcome shows in later answers.
        """
        return self._loop_alive() and self._liveness.healthy()

    def probe_liveness(self, timeout: float = PROBE_TIMEOUT_S, force: bool = False) -> bool:
        """Whether the engine can still generate: after a failed step (or with ``force``) a
        real 1-token generation, ahead of the queue; blocks up to ``timeout`` seconds."""
        return self._loop_alive() and self._liveness.probe(timeout, force)

    def _loop_alive(self) -> bool:
        group = self._group
        return self._thread is not None and self._thread.is_alive() and \
            self._failure is None and (group is None or group.failure is None)

    def _submit_probe(self, request_id: str, sink: EventSink) -> None:
        """Queue a greedy 1-token generation that is overdue on arrival, so it goes first."""
        assert self.info is not None
        prompt = (self.info.eos_token_ids[0] if self.info.eos_token_ids else 0,)
        request = EngineRequest(request_id=request_id, prompt_token_ids=prompt,
                                sampling=SamplingParams(),
                                stopping=StoppingParams(max_new_tokens=1, ignore_eos=True))
        self._inbox.put(("submit", request, sink, _OVERDUE))

    def follower_compiles(self) -> list[int]:
        """Sharded: graphs each of ranks 1 .. N-1 compiled so far (empty when unsharded)."""
        return self._group.report() if self._group is not None else []

    def _wake(self) -> None:
        """Wake the loop (a rank failed: it ends every sequence and stops)."""
        self._inbox.put(("wake", None, None, 0.0))

    # ------------------------------------------------------ gateway calls
    def submit(self, request: EngineRequest, sink: EventSink) -> None:
        """Queue a request for the loop; never blocks."""
        with self._lock:
            if not self._closed:
                self._inbox.put(("submit", request, sink, time.monotonic()))
                return
        deliver(sink, TokenEvent(request_id=request.request_id, token_id=-1,
                                 error=self._failure or "engine is shut down"))

    def abort(self, request_id: str) -> None:
        """Ask the loop to drop ``request_id`` at the next step boundary."""
        self._inbox.put(("abort", request_id, None, 0.0))

    def stats(self) -> EngineStats:
        """The snapshot the loop left after its last step."""
        return self._stats

    def set_step_observer(self, observer: StepObserver | None) -> None:
        """Report every forward step to ``observer``."""
        self._observer = observer

    def _enqueue_internal(self, kind: str, payload: object) -> None:
        self._inbox.put((kind, payload, None, 0.0))

    # --------------------------------------------------------------- loop
    def _loop(self) -> None:
        assert self._scheduler is not None
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    idle = not self.running and not self._scheduler.queue
                    self._take_commands(block=idle)
                    if self._stop.is_set() or self._shards_failed():
                        break
                    for ready in self._compiling.release():
                        self._scheduler.queue.push(ready)
                    self._step()
                    self._publish_stats()
                    if self._failure is not None:
                        break
        except BaseException:
            logger.exception("gaudi engine loop crashed")
            raise
        finally:
            self._close()

    def _take_commands(self, block: bool) -> None:
        """Apply queued commands in the order they were made."""
        wait = self._compiling.idle_wait(_IDLE_WAIT_S)
        try:
            item = self._inbox.get(timeout=wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload, sink, at = item
            if kind == "submit":
                self._admit(payload, sink, at)  # type: ignore[arg-type]
            elif kind == "abort":
                self._abort(str(payload))
            elif kind == "warmup":
                self._warm(*payload)  # type: ignore[misc]
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _shards_failed(self) -> bool:
        """Sharded: whether the group has failed (the watchdog saw a rank die); if so, fail."""
        if self._group is not None and self._group.failure is not None and self._failure is None:
            self._fail(self._group.failure)
        return self._failure is not None

    def _fail(self, reason: str) -> None:
        """The ranks cannot go on: end every sequence with the error; the loop then stops."""
        assert self._scheduler is not None
        if self._failure is None:
            self._failure = f"sharded engine failed: {reason}"
            logger.error("gaudi: engine stops serving, failing %d sequences",
                         len(self.running) + len(self._scheduler.queue))
        for seq in [*self.running, *self._scheduler.queue, *self._compiling]:
            self._drop(seq)
            end(seq, error=self._failure)

    def _find(self, request_id: str) -> GaudiSequence | None:
        assert self._scheduler is not None
        for seq in (*self.running, *self._scheduler.queue, *self._compiling):
            if seq.request_id == request_id:
                return seq
        return None

    def _admit(self, request: EngineRequest, sink: EventSink, queued_at: float) -> None:
        assert self._scheduler is not None and self._admission is not None
        if self._find(request.request_id) is not None:
            deliver(sink, TokenEvent(request_id=request.request_id, token_id=-1,
                                     error="request_id is already live"))
            return
        seq, error = self._admission.build(request, sink, queued_at)
        if seq is None:
            deliver(sink, TokenEvent(request_id=request.request_id, token_id=-1,
                                     prompt_tokens=len(request.prompt_token_ids), error=error))
            return
        if request.constraint is not None and self._runner is not None:
            self._runner.start_grammar(seq)  # compiles in the worker from now on
            if self._compiling.hold(seq):
                return
        self._scheduler.queue.push(seq)

    def _abort(self, request_id: str) -> None:
        seq = self._find(request_id)
        if seq is not None:
            self._drop(seq)
            end(seq, finish=FinishReason.ABORTED)

    def _drop(self, seq: GaudiSequence) -> None:
        """Take ``seq`` out of the queue or the running batch, freeing its cache row."""
        assert self._scheduler is not None and self._rows is not None
        if seq in self.running:
            self.running.remove(seq)
            self._rows.release(seq.row)  # type: ignore[arg-type]
            seq.row = None
        elif not self._compiling.remove(seq):
            self._scheduler.queue.remove(seq)

    def _step(self) -> None:
        """One prefill or one decode step, as the scheduler decides."""
        assert self._scheduler is not None and self._rows is not None
        prefill = self._scheduler.next_prefill(len(self.running))
        if prefill is not None:
            for seq in prefill.seqs:
                seq.row = self._rows.take()
                self.running.append(seq)
            self._run(prefill.seqs, prefill.shape)
        elif self.running:
            self._compact()
            shape = self._scheduler.grid.decode_shape(len(self.running))
            self._scheduler.decoded()
            self._run(list(self.running), shape)
        if self._profiler is not None:
            self._profiler.step()

    def _compact(self) -> None:
        """Move live rows below the decode bucket of the live count (after sequences left)."""
        assert self._rows is not None and self._cache is not None and self._scheduler is not None
        bound = self._scheduler.grid.decode_batch.round_up(len(self.running))
        moves = dict(self._rows.compact(bound))
        for seq in self.running:
            if seq.row in moves:
                self._runner.move_row(seq.row, moves[seq.row], seq.cached)  # type: ignore
                seq.row = moves[seq.row]
        if moves and self.device is not None:
            self.device.mark_step()

    def _run(self, seqs: list[GaudiSequence], shape: Shape) -> None:
        """Run one step of ``shape`` over ``seqs``; emit, finish, or fail them."""
        assert self._runner is not None
        self._note_shape(shape)
        begin = time.monotonic()
        prefill = shape.phase == "prefill"
        for seq in seqs:
            if seq.started_at is None:
                seq.started_at = begin
        try:
            sampled = (self._runner.prefill if prefill else self._runner.decode)(seqs, shape)
        except ShardFailure as exc:  # the ranks are out of step: nothing more can run
            self._fail(str(exc))
            return
        except Exception as exc:  # one bad step must not take the engine down
            logger.exception("gaudi %s step over %d sequences failed", shape, len(seqs))
            for seq in seqs:
                self._drop(seq)
                end(seq, error=f"forward step failed: {type(exc).__name__}: {exc}")
            self._liveness.step_failed()
            self._report(seqs, shape, time.monotonic() - begin, ok=False)
            return
        self._liveness.step_succeeded()
        self._steps += 1
        for seq, token in zip(seqs, sampled, strict=True):
            if token.error is not None:  # this row could not be served (its grammar failed)
                self._drop(seq)
                end(seq, error=token.error)
            elif record(seq, token) is not None:
                self._drop(seq)
        self._count_padding(seqs, shape)
        self._report(seqs, shape, time.monotonic() - begin, ok=True)

    def _note_shape(self, shape: Shape) -> None:
        """Log, once per shape, a step whose shape warmup did not run (it compiles now)."""
        if shape in self._warmed:
            return
        self._warmed.add(shape)
        assert self.plan is not None and self.settings is not None
        if shape not in self.plan.shapes:
            logger.error("gaudi: shape %s is not in the warmup plan; it compiles now (%s)",
                         shape, self.plan.uncovered(shape))
        elif self.settings.warmup_enabled:
            logger.warning("gaudi: shape %s was not warmed up; it compiles now", shape)
        else:
            logger.info("gaudi: shape %s compiles on first use (WARMUP_ENABLED=false)", shape)

    def _count_padding(self, seqs: Sequence[GaudiSequence], shape: Shape) -> None:
        if shape.phase == "prefill":
            self.padding["prefill_real"] += sum(s.prompt_len for s in seqs)
            self.padding["prefill_padded"] += shape.batch * shape.length
        else:
            self.padding["decode_real"] += len(seqs)
            self.padding["decode_padded"] += shape.batch

    def _report(self, seqs: list[GaudiSequence], shape: Shape, seconds: float, ok: bool) -> None:
        """Hand the step's ``StepReport`` to the observer, if one is installed."""
        observer, sched = self._observer, self._scheduler
        if observer is None or sched is None or self.plan is None:
            return
        prefill = shape.phase == "prefill"
        limits = self.plan.limits
        try:
            observer(StepReport(
                method=shape.phase, batch_size=len(seqs),
                prefill_tokens=sum(s.prompt_len for s in seqs) if prefill else 0,
                decode_tokens=0 if prefill else len(seqs), seconds=seconds, ok=ok,
                queue_size=len(sched.queue),
                kv_tokens_used=sum(len(s.tokens) for s in self.running),
                kv_tokens_total=limits.max_batch_size * limits.max_total_tokens))
        except Exception:  # observers must not raise; the loop must not die if one does
            logger.exception("step observer raised")

    def _publish_stats(self) -> None:
        assert self._scheduler is not None and self.plan is not None
        limits = self.plan.limits
        self._stats = EngineStats(
            running=len(self.running), waiting=len(self._scheduler.queue),
            batch_tokens=sum(len(s.tokens) for s in self.running),
            max_batch_total_tokens=limits.max_batch_size * limits.max_total_tokens,
            steps=self._steps,
            # The static cache in blocks: a row of max_total_tokens per sequence slot.
            kv_block_size=limits.max_total_tokens, kv_blocks_total=limits.max_batch_size,
            kv_blocks_used=len(self.running))

    def _close(self) -> None:
        """Refuse new work and end every live or queued sequence with ``ABORTED``."""
        with self._lock:
            self._closed = True
        if self._profiler is not None:
            self._profiler.stop()
        fp8_model, self._fp8 = self._fp8, None
        fp8.finish(fp8_model)  # type: ignore[arg-type]
        if self._scheduler is not None:
            for seq in [*self.running, *self._scheduler.queue, *self._compiling]:
                self._drop(seq)
                end(seq, finish=FinishReason.ABORTED)
        while not self._inbox.empty():
            kind, payload, sink, _ = self._inbox.get_nowait()
            if kind == "submit" and self._failure is not None:
                deliver(sink, TokenEvent(request_id=payload.request_id,  # type: ignore
                                         token_id=-1, error=self._failure))
            elif kind == "submit":
                deliver(sink, TokenEvent(request_id=payload.request_id,  # type: ignore
                                         token_id=-1, finish_reason=FinishReason.ABORTED))
            elif kind == "warmup":
                payload[1].append(EngineStartError("engine shut down"))  # type: ignore
                payload[0].set()  # type: ignore
        if self._group is not None:  # the followers exit, and are reaped, before the thread ends
            self._group.stop()
        if self._scheduler is not None and self.plan is not None:
            self._publish_stats()
