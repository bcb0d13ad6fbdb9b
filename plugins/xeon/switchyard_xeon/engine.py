"""XeonEngine: continuous batching on the CPU with stock PyTorch.

The gateway's calls (``submit``, ``abort``) only put commands on a queue; one
daemon thread owns the model, the cache and the scheduler and runs the loop:
take commands, admit and abort at the step boundary, let the scheduler choose
the step's work (decodes, prefill chunks, newcomers; preempting when the paged
cache runs out), run one forward over the packed batch, emit one event per
sequence that produced a token, drop the finished ones.

Pieces, each in its own module: ``assembly`` (start-up on the compute
thread: placement, dtypes, path, loading, packing, cache, runner),
``admission`` (limits, cache size, requests into sequences), ``scheduler``
and ``block_manager`` (pure: who runs, which cache blocks they hold),
``kv_cache`` and ``attention`` (paged storage and the attention over it),
``runner`` (one forward pass and sampling), ``events`` and ``stats`` (what
goes back to the gateway).

Health (:mod:`switchyard_xeon.health`): ``healthy()`` is cheap (the loop
thread is alive and no liveness probe has failed). After a forward step fails,
the engine checks itself with a real 1-token generation that goes through the
loop ahead of the queue; ``probe_liveness()`` runs that check and waits for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import msgspec
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
    QuantizationMethod,
    SamplingParams,
    StepObserver,
    StepReport,
    StoppingParams,
    TokenEvent,
    WarmupReport,
)

from switchyard_xeon import assembly, machine, quantized
from switchyard_xeon.admission import Admission
from switchyard_xeon.events import emit, record_results
from switchyard_xeon.ipex_support import Acceleration
from switchyard_xeon.runner import ModelRunner
from switchyard_xeon.scheduler import Scheduler
from switchyard_xeon.sequence import Sequence
from switchyard_xeon.stats import CacheStats, cache_stats, engine_stats

logger = logging.getLogger("switchyard.xeon")

_IDLE_WAIT_S = 0.5
"""How long an idle loop sleeps before re-checking for shutdown."""


class _QueueClock:
    """A submitted sequence's sink that puts its queue time on its first event.

    Queue time (the contract's ``TokenEvent.queue_seconds``, TGI's) runs from
    ``submit`` until the first forward step the sequence is in; the loop sets
    ``started`` when that step begins.
    """

    __slots__ = ("first", "sink", "started", "submitted")

    def __init__(self, sink: EventSink) -> None:
        self.sink = sink
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.first = True

    def __call__(self, event: TokenEvent) -> None:
        if self.first:
            self.first = False
            started = self.started if self.started is not None else time.perf_counter()
            event = msgspec.structs.replace(event, queue_seconds=started - self.submitted)
        self.sink(event)


class XeonEngine(Engine):
    """A continuous-batching engine for one model on the CPU.

    ``config`` comes from the gateway. ``config.options`` may set
    ``num_threads`` (default: the physical cores of the first NUMA node the
    process may use; see :func:`~switchyard_xeon.machine.choose_cpus`),
    and the cache and scheduling options read by
    :func:`~switchyard_xeon.admission.resolve_limits`: ``block_size``,
    ``prefix_caching``, ``max_waiting_tokens`` and ``waiting_served_ratio``.
    Nothing heavy happens until :meth:`start`.

    Beyond the :class:`Engine` interface it offers :meth:`probe_liveness`, a
    blocking health check with a real generation for callers that may wait
    (the gateway's ``/health`` runs it in a worker thread).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.info: ModelInfo | None = None
        self._inbox: queue.SimpleQueue[tuple[str, object, object]] = queue.SimpleQueue()
        self._compiling: CompileHold[Sequence] = CompileHold()
        """Constrained sequences whose grammar is still compiling (owned by the loop)."""
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._runner: ModelRunner | None = None
        self._scheduler: Scheduler | None = None
        self._admission: Admission | None = None
        self._steps = 0
        self.acceleration: Acceleration | None = None
        """What :func:`~switchyard_xeon.ipex_support.detect_acceleration` found at start."""
        self.placement: machine.CpuPlacement | None = None
        """The CPUs (NUMA node) chosen at start; see :func:`machine.choose_cpus`."""
        self._stats = EngineStats(running=0, waiting=0)
        self._cache_stats = CacheStats()
        self._liveness = Liveness(self._loop_alive, self._submit_probe)
        self._observer: StepObserver | None = None
        self._quantization: QuantizationMethod | None = None

    # ----------------------------------------------------------- lifecycle
    def start(self) -> ModelInfo:
        """Start the compute thread, which loads the model, sizes the cache and runs the loop.

        Loading happens on that thread too, because OpenMP keeps one pool of
        workers per thread that runs parallel regions: had this thread
        loaded and packed the weights, its idle pool would count against the
        cores, and libgomp, seeing more threads than cores, makes every pool
        sleep between regions instead of spinning. One pool measured
        9.6-10.7 ms for a batch-1 decode step's matmuls against 14.8-15.7
        with two (135M shape, 2 cores, bf16 dot panels;
        ``benchmarks/kernels/omp_pools.py``).
        """
        if self.config.num_shard != 1:
            # One process, one OpenMP pool: tensor parallelism over sockets is not built here.
            raise EngineStartError(
                f"xeon engine: --num-shard {self.config.num_shard or 'all'} is not supported; it "
                "serves a model on one process (drop --sharded/--num-shard)")
        self._quantization = quantized.check_method(self.config)
        self._thread, info = start_compute_thread("switchyard-xeon", self._load, self._loop)
        return info

    def _load(self) -> ModelInfo:
        """On the compute thread: place it, load and pack the model, size the cache
        (:mod:`~switchyard_xeon.assembly`)."""
        placed = assembly.place_compute_thread(self.config)
        self.placement, self.acceleration = placed.placement, placed.acceleration
        assembly.bind_compute_thread(placed)
        parts = assembly.assemble(self.config, self._quantization, placed)
        self.info = parts.info
        self._runner, self._scheduler, self._admission = (
            parts.runner, parts.scheduler, parts.admission)
        return parts.info

    def warmup(self) -> WarmupReport:
        """Push one small request (prefill and decode) through the loop and wait for it."""
        if self._scheduler is None or self.info is None:
            raise EngineStartError("warmup() called before start()")
        begin = time.perf_counter()
        done = threading.Event()
        events: list[TokenEvent] = []

        def sink(event: TokenEvent) -> None:
            events.append(event)
            if event.finish_reason is not None or event.error is not None:
                done.set()

        prompt = tuple(i % self.info.vocab_size for i in range(1, 17))
        request = EngineRequest(
            request_id=f"__warmup__{id(self)}",
            prompt_token_ids=prompt[: max(1, self._scheduler.limits.max_total_tokens - 4)],
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=4, ignore_eos=True),
        )
        logger.info("warmup: prefill %d tokens, decode 3", len(request.prompt_token_ids))
        self.submit(request, sink)
        if not done.wait(timeout=600) or events[-1].error:
            error = events[-1].error if events else "timed out"
            raise EngineStartError(f"xeon warmup failed: {error}")
        seconds = time.perf_counter() - begin
        logger.info("warmup done in %.2fs", seconds)
        self._wrap_tokenizer()
        blocks = self._scheduler.blocks
        return WarmupReport(seconds=seconds,
                            max_batch_total_tokens=blocks.num_blocks * blocks.block_size,
                            max_batch_size=self._scheduler.limits.max_batch_size)

    def _wrap_tokenizer(self) -> None:
        """Wrap the tokenizer for constrained decoding before the engine reports warm.

        Otherwise a model's first constrained request waits for the wrap, and
        done in the background after warmup it takes CPU from the first
        requests served. A failure is logged here and reported by the first
        constrained request, not fatal: unconstrained requests need no wrap.
        """
        wrap = self._runner.prepare_grammar(self.info.vocab_size) if self._runner else None
        if wrap is None:
            return
        begin = time.perf_counter()
        try:
            wrap.result(timeout=300)
        except Exception as exc:  # noqa: BLE001 - reported again by the first constrained request
            logger.warning("constrained decoding: the tokenizer's wrap failed (%s)", exc)
            return
        logger.info("constrained decoding: tokenizer wrapped in %.2fs",
                    time.perf_counter() - begin)

    def shutdown(self) -> None:
        """Stop the loop; sequences still live end with ``ABORTED``."""
        self._stop.set()
        self._inbox.put(("wake", None, None))
        if self._thread is not None:
            self._thread.join(timeout=60)
        else:
            self._close()
        self._runner = None
        logger.info("xeon engine shut down")

    # -------------------------------------------------------------- health
    def healthy(self) -> bool:
        """Cheap and non-blocking: the loop is alive and no liveness probe has failed.

        After a forward step fails (and until one succeeds), each call starts
        a liveness probe in the background if none is running; its outcome
        shows in the answers of later calls. A probe that has not finished by
        its deadline counts as failed.
        """
        return self._liveness.healthy()

    def probe_liveness(self, timeout: float = PROBE_TIMEOUT_S, force: bool = False) -> bool:
        """Whether the engine can still generate; blocks up to ``timeout`` seconds.

        While every step since the last check has succeeded this answers at
        once, like :meth:`healthy`. After a failed forward step (or a failed
        probe), or with ``force``, it runs a real 1-token generation through
        the compute loop, ahead of queued requests, and returns whether it
        produced a token in time. Callers on an event loop should run it in a
        worker thread (``await asyncio.to_thread(engine.probe_liveness, 5.0)``).
        Concurrent callers share one probe.
        """
        return self._liveness.probe(timeout, force)

    def _loop_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _submit_probe(self, request_id: str, sink: EventSink) -> None:
        """Queue a 1-token greedy generation that jumps the queue."""
        assert self.info is not None
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=(self.info.eos_token_ids[0] if self.info.eos_token_ids else 0,),
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=1, ignore_eos=True),
            logprobs=False,
        )
        self._enqueue("probe", request, sink)

    # ------------------------------------------------------ gateway calls
    def submit(self, request: EngineRequest, sink: EventSink) -> None:
        """Queue a request for the loop; never blocks."""
        self._enqueue("submit", request, _QueueClock(sink))

    def set_step_observer(self, observer: StepObserver | None) -> None:
        """Report every forward step (method, sizes, time, queue, cache) to ``observer``."""
        self._observer = observer

    def _enqueue(self, kind: str, request: EngineRequest, sink: EventSink) -> None:
        """Hand a request to the loop, or end it at once when the engine is shut down."""
        with self._lock:
            if not self._closed:
                self._inbox.put((kind, request, sink))
                return
        deliver(sink, TokenEvent(request_id=request.request_id, token_id=-1,
                                  error="engine is shut down"))

    def abort(self, request_id: str) -> None:
        """Ask the loop to drop ``request_id`` at the next step boundary."""
        self._inbox.put(("abort", request_id, None))

    def stats(self) -> EngineStats:
        """The snapshot the loop left after its last step (see :func:`stats.engine_stats`)."""
        return self._stats

    def cache_stats(self) -> CacheStats:
        """KV-cache usage, prefix-cache hits and preemptions after the last step (non-blocking)."""
        return self._cache_stats

    # --------------------------------------------------------------- loop
    def _loop(self) -> None:
        assert self._scheduler is not None and self._runner is not None
        sched = self._scheduler
        batch: list[Sequence] = []
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    # Wait for commands only when the last step found nothing to do.
                    self._take_commands(block=not batch)
                    if self._stop.is_set():
                        break
                    for ready in self._compiling.release():
                        sched.add(ready)
                    batch = sched.schedule()
                    if batch:
                        self._run_step(batch)
                    self._publish_stats()
        except BaseException:
            logger.exception("xeon engine loop crashed")
            raise
        finally:
            self._close()

    def _take_commands(self, block: bool) -> None:
        """Apply queued submits and aborts in the order they were made."""
        wait = self._compiling.idle_wait(_IDLE_WAIT_S)
        try:
            item = self._inbox.get(timeout=wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload, sink = item
            if kind in ("submit", "probe"):
                self._admit(payload, sink, front=kind == "probe")  # type: ignore[arg-type]
            elif kind == "abort":
                self._abort(str(payload))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, request: EngineRequest, sink: EventSink, front: bool = False) -> None:
        assert self._scheduler is not None and self._admission is not None
        if self._scheduler.find(request.request_id) is not None or any(
                s.request_id == request.request_id for s in self._compiling):
            deliver(sink, TokenEvent(request_id=request.request_id, token_id=-1,
                                      error="request_id is already live"))
            return
        seq, error = self._admission.build(request, sink)
        if seq is None:
            deliver(sink, TokenEvent(request_id=request.request_id, token_id=-1,
                                      prompt_tokens=len(request.prompt_token_ids), error=error))
            return
        if request.constraint is not None and self._runner is not None:
            self._runner.start_grammar(seq)  # compiles in the worker from now on
            if self._compiling.hold(seq):
                return
        self._scheduler.add(seq, front=front)

    def _abort(self, request_id: str) -> None:
        assert self._scheduler is not None
        held = next((s for s in self._compiling if s.request_id == request_id), None)
        if held is not None and self._compiling.remove(held):
            emit(held, -1, finish=FinishReason.ABORTED)
            return
        seq = self._scheduler.find(request_id)
        if seq is not None:
            self._scheduler.finish(seq)
            emit(seq, -1, finish=FinishReason.ABORTED)

    def _run_step(self, batch: list[Sequence]) -> None:
        assert self._scheduler is not None and self._runner is not None
        begin = time.perf_counter()
        for seq in batch:  # a sequence's first step ends its queue time
            if type(seq.sink) is _QueueClock and seq.sink.started is None:
                seq.sink.started = begin
        # Counted before the step moves the sequences on: decodes feed their newest token.
        decodes = sum(1 for s in batch if s.generated and s.remaining == 1)
        fed = sum(s.num_scheduled for s in batch)
        try:
            results = self._runner.step(batch)
        except Exception as exc:  # one bad step must not take the engine down
            logger.exception("forward step over %d sequences failed", len(batch))
            self._report_step(batch, fed - decodes, decodes, time.perf_counter() - begin, False)
            self._liveness.step_failed()
            for seq in batch:
                self._scheduler.finish(seq)
                emit(seq, -1, error=f"forward step failed: {type(exc).__name__}: {exc}")
            return
        seconds = time.perf_counter() - begin
        self._steps += 1
        self._liveness.step_succeeded()
        record_results(self._scheduler, batch, results)
        self._report_step(batch, fed - decodes, decodes, seconds, True)

    def _report_step(self, batch: list[Sequence], prefill: int, decodes: int, seconds: float,
                     ok: bool) -> None:
        """Hand the step's ``StepReport`` to the observer, if one is installed."""
        observer, sched = self._observer, self._scheduler
        if observer is None or sched is None:
            return
        method = "decode" if not prefill else "prefill" if not decodes else "mixed"
        blocks = sched.blocks
        try:
            observer(StepReport(
                method=method, batch_size=len(batch), prefill_tokens=prefill,
                decode_tokens=decodes, seconds=seconds, ok=ok, queue_size=len(sched.waiting),
                kv_tokens_used=blocks.num_used_blocks * blocks.block_size,
                kv_tokens_total=blocks.num_blocks * blocks.block_size))
        except Exception:  # the contract says observers do not raise; the loop must not die
            logger.exception("step observer raised")

    def _publish_stats(self) -> None:
        assert self._scheduler is not None
        self._stats = engine_stats(self._scheduler, self._steps)
        self._cache_stats = cache_stats(self._scheduler)

    def _close(self) -> None:
        """Refuse new work and end every live or queued sequence with ``ABORTED``."""
        with self._lock:
            self._closed = True
        sched = self._scheduler
        for seq in [*sched.running, *sched.waiting] if sched is not None else []:
            sched.finish(seq)  # type: ignore[union-attr]
            emit(seq, -1, finish=FinishReason.ABORTED)
        for seq in self._compiling:
            self._compiling.remove(seq)
            emit(seq, -1, finish=FinishReason.ABORTED)
        while not self._inbox.empty():
            kind, request, sink = self._inbox.get_nowait()
            if kind in ("submit", "probe"):
                deliver(sink, TokenEvent(request_id=request.request_id, token_id=-1,  # type: ignore
                                          finish_reason=FinishReason.ABORTED))
        if sched is not None:
            self._publish_stats()
