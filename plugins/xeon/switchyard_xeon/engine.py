"""XeonEngine: continuous batching on the CPU with stock PyTorch.

The gateway's calls (``submit``, ``abort``) only put commands on a queue; one
daemon thread owns the model, the cache and the scheduler and runs the loop:
take commands, admit and abort at the step boundary, run one forward over the
packed batch, emit one event per sequence, drop the finished ones.

Health: ``healthy()`` is cheap (the loop thread is alive and no liveness probe
has failed). After a forward step fails, the engine checks itself with a real
1-token generation that goes through the loop ahead of the queue;
``probe_liveness()`` runs that check and waits for it (see its docstring).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from switchyard.engine.loading import load_causal_lm, resolve_dtype
from switchyard.engine.watermark import WatermarkConfig
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
    StoppingParams,
    TokenEvent,
    TopToken,
    WarmupReport,
)

from switchyard_xeon import attention, machine
from switchyard_xeon.admission import Admission, resolve_limits
from switchyard_xeon.kv_cache import BLOCK_SIZE, KVCache, cache_shape
from switchyard_xeon.runner import ModelRunner, check_supported
from switchyard_xeon.scheduler import Scheduler, Sequence

logger = logging.getLogger("switchyard.xeon")

_IDLE_WAIT_S = 0.5
"""How long an idle loop sleeps before re-checking for shutdown."""
PROBE_TIMEOUT_S = 30.0
"""How long a probe started by :meth:`XeonEngine.healthy` may run before it counts as failed."""
_PROBE_PREFIX = "__probe__"


@dataclass(eq=False)
class _Probe:
    """One liveness probe in flight: a 1-token generation and its outcome."""

    request_id: str
    deadline: float
    """``time.monotonic()`` after which an unfinished probe counts as failed."""
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False


class XeonEngine(Engine):
    """A continuous-batching engine for one model on the CPU.

    ``config`` comes from the gateway; ``config.options`` may set
    ``num_threads`` (default: the physical cores available to the process).
    Nothing heavy happens until :meth:`start`.

    Beyond the :class:`Engine` interface it offers :meth:`probe_liveness`, a
    blocking health check with a real generation for callers that may wait
    (the gateway's ``/health`` runs it in a worker thread).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.info: ModelInfo | None = None
        self._inbox: queue.SimpleQueue[tuple[str, object, object]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._runner: ModelRunner | None = None
        self._scheduler: Scheduler | None = None
        self._admission: Admission | None = None
        self._steps = 0
        self._threads = 1
        self._stats = EngineStats(running=0, waiting=0)
        # Health state, shared by the loop and the health callers. Re-entrant,
        # because a refused probe submit calls the probe's sink on the caller's thread.
        self._health_lock = threading.RLock()
        self._step_failed = False
        """A forward step failed and none has succeeded since."""
        self._probe_failed = False
        """The last liveness probe failed or overran its deadline."""
        self._probe: _Probe | None = None
        self._probe_ids = itertools.count()

    # ----------------------------------------------------------- lifecycle
    def start(self) -> ModelInfo:
        """Load the model, size the cache for the machine and start the loop thread."""
        if self.config.quantize:
            raise EngineStartError(
                f"xeon engine: quantization {self.config.quantize!r} is not supported yet"
            )
        cpu = machine.read_cpu_info()
        try:
            threads = int(self.config.options.get("num_threads", 0) or cpu.physical_cores)
        except ValueError:
            raise EngineStartError("xeon option num_threads must be an integer") from None
        torch.set_num_threads(threads)
        logger.info("%s: torch uses %d threads", cpu.describe(), threads)

        try:
            watermark = WatermarkConfig.from_env()
        except ValueError as exc:
            raise EngineStartError(str(exc)) from None
        dtype = resolve_dtype(self.config.dtype, cpu.flags)
        logger.info("loading %s as %s", self.config.model_path, str(dtype).removeprefix("torch."))
        loaded = load_causal_lm(
            self.config.model_path,
            dtype=str(dtype).removeprefix("torch."),
            attn_implementation=attention.register(),
        )
        logger.info("loaded %s model in %.2fs", loaded.info.model_type, loaded.seconds)
        check_supported(loaded.model)
        shape = cache_shape(loaded.model.config)
        limits, total_tokens = resolve_limits(
            self.config, loaded.info, shape.bytes_per_token(dtype), machine.available_memory_bytes()
        )
        cache = KVCache(shape, dtype, num_blocks=total_tokens // BLOCK_SIZE)
        logger.info(
            "limits: batch %d, prefill %d tokens, sequence %d tokens, cache %d tokens (%.1f MiB max)",
            limits.max_batch_size, limits.max_batch_prefill_tokens, limits.max_total_tokens,
            cache.capacity_tokens, cache.capacity_tokens * cache.bytes_per_token() / 2**20,
        )
        self.info = loaded.info
        self._runner = ModelRunner(loaded.model, cache)
        self._scheduler = Scheduler(limits, cache)
        self._admission = Admission(limits, loaded.info.vocab_size, cache.capacity_tokens,
                                    watermark)
        self._threads = threads
        self._thread = threading.Thread(target=self._loop, name="switchyard-xeon", daemon=True)
        self._thread.start()
        return loaded.info

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
        return WarmupReport(seconds=seconds,
                            max_batch_total_tokens=self._scheduler.cache.capacity_tokens,
                            max_batch_size=self._scheduler.limits.max_batch_size)

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
        if not self._loop_alive():
            return False
        with self._health_lock:
            self._note_overdue_probe()
            if self._step_failed and self._probe is None:
                self._start_probe(PROBE_TIMEOUT_S)
            return not self._probe_failed

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
        if not self._loop_alive():
            return False
        with self._health_lock:
            self._note_overdue_probe()
            if not (force or self._step_failed or self._probe_failed):
                return True
            probe = self._probe if self._probe is not None else self._start_probe(timeout)
        probe.done.wait(timeout)
        with self._health_lock:
            # Decided under the lock: the probe may finish between the wait and here.
            if probe.done.is_set():
                return probe.ok
            self._probe_failed = True  # still unfinished: too slow counts as failed
            return False

    def _loop_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _note_overdue_probe(self) -> None:
        """Count a probe past its deadline as failed (the loop is stuck or starved)."""
        probe = self._probe
        if probe is not None and not probe.done.is_set() and time.monotonic() > probe.deadline:
            self._probe_failed = True

    def _start_probe(self, timeout: float) -> _Probe:
        """Submit a 1-token greedy generation that jumps the queue; caller holds the lock."""
        assert self.info is not None
        probe = _Probe(request_id=f"{_PROBE_PREFIX}{next(self._probe_ids)}",
                       deadline=time.monotonic() + timeout)
        self._probe = probe

        def sink(event: TokenEvent) -> None:
            if event.finish_reason is None and event.error is None:
                return
            ok = event.error is None and event.finish_reason in (
                FinishReason.LENGTH, FinishReason.EOS_TOKEN)
            with self._health_lock:
                probe.ok = ok
                self._probe_failed = not ok
                if self._probe is probe:
                    self._probe = None
                probe.done.set()
            if not ok:
                logger.warning("liveness probe failed: %s", event.error or event.finish_reason)

        request = EngineRequest(
            request_id=probe.request_id,
            prompt_token_ids=(self.info.eos_token_ids[0] if self.info.eos_token_ids else 0,),
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=1, ignore_eos=True),
            logprobs=False,
        )
        logger.info("liveness probe %s started", probe.request_id)
        self._enqueue("probe", request, sink)
        return probe

    # ------------------------------------------------------ gateway calls
    def submit(self, request: EngineRequest, sink: EventSink) -> None:
        """Queue a request for the loop; never blocks."""
        self._enqueue("submit", request, sink)

    def _enqueue(self, kind: str, request: EngineRequest, sink: EventSink) -> None:
        """Hand a request to the loop, or end it at once when the engine is shut down."""
        with self._lock:
            if not self._closed:
                self._inbox.put((kind, request, sink))
                return
        _deliver(sink, TokenEvent(request_id=request.request_id, token_id=-1,
                                  error="engine is shut down"))

    def abort(self, request_id: str) -> None:
        """Ask the loop to drop ``request_id`` at the next step boundary."""
        self._inbox.put(("abort", request_id, None))

    def stats(self) -> EngineStats:
        """The snapshot the loop left after its last step."""
        return self._stats

    # --------------------------------------------------------------- loop
    def _loop(self) -> None:
        assert self._scheduler is not None and self._runner is not None
        sched = self._scheduler
        # Intra-op thread settings are per thread for OpenMP: apply them where compute runs.
        torch.set_num_threads(self._threads)
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    self._take_commands(block=len(sched) == 0)
                    if self._stop.is_set():
                        break
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
        try:
            item = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
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
        if self._scheduler.find(request.request_id) is not None:
            _deliver(sink, TokenEvent(request_id=request.request_id, token_id=-1,
                                      error="request_id is already live"))
            return
        seq, error = self._admission.build(request, sink)
        if seq is None:
            _deliver(sink, TokenEvent(request_id=request.request_id, token_id=-1,
                                      prompt_tokens=len(request.prompt_token_ids), error=error))
            return
        self._scheduler.add(seq, front=front)

    def _abort(self, request_id: str) -> None:
        assert self._scheduler is not None
        seq = self._scheduler.find(request_id)
        if seq is not None:
            self._scheduler.finish(seq)
            self._emit(seq, -1, finish=FinishReason.ABORTED)

    def _run_step(self, batch: list[Sequence]) -> None:
        assert self._scheduler is not None and self._runner is not None
        try:
            results = self._runner.step(batch)
        except Exception as exc:  # one bad step must not take the engine down
            logger.exception("forward step over %d sequences failed", len(batch))
            with self._health_lock:
                self._step_failed = True
            for seq in batch:
                self._scheduler.finish(seq)
                self._emit(seq, -1, error=f"forward step failed: {type(exc).__name__}: {exc}")
            return
        self._steps += 1
        if self._step_failed or self._probe_failed:
            with self._health_lock:  # a step went through: the model runs again
                self._step_failed = self._probe_failed = False
        for seq, res in zip(batch, results, strict=True):
            seq.tokens.append(res.token_id)
            seq.sampler.record(res.token_id)
            finish = self._finish_reason(seq, res.token_id)
            if finish is not None:
                self._scheduler.finish(seq)
            prompt_logprobs: tuple[float, ...] = ()
            if seq.generated == 1 and seq.request.prompt_logprobs:
                prompt_logprobs = tuple(seq.prompt_logprobs)
                seq.prompt_logprobs = []  # delivered: do not hold them for the sequence's life
            self._emit(seq, res.token_id, res.logprob, res.top_tokens, finish=finish,
                       prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _finish_reason(seq: Sequence, token_id: int) -> FinishReason | None:
        stopping = seq.request.stopping
        if not seq.ignore_eos and token_id in stopping.eos_token_ids:
            return FinishReason.EOS_TOKEN
        if seq.generated >= stopping.max_new_tokens or len(seq.tokens) >= seq.max_length:
            return FinishReason.LENGTH
        return None

    def _emit(self, seq: Sequence, token_id: int, logprob: float = 0.0,
              top_tokens: tuple[TopToken, ...] = (), finish: FinishReason | None = None,
              error: str | None = None, prompt_logprobs: tuple[float, ...] = ()) -> None:
        event = TokenEvent(
            request_id=seq.request_id, token_id=token_id, logprob=logprob,
            top_tokens=top_tokens, finish_reason=finish, error=error,
            seed=seq.sampler.seed, prompt_tokens=seq.prompt_len,
            prompt_logprobs=prompt_logprobs,
        )
        _deliver(seq.sink, event)

    def _publish_stats(self) -> None:
        assert self._scheduler is not None
        sched = self._scheduler
        self._stats = EngineStats(
            running=len(sched.running), waiting=len(sched.waiting),
            batch_tokens=sum(s.num_cached for s in sched.running),
            max_batch_total_tokens=sched.cache.capacity_tokens, steps=self._steps,
        )

    def _close(self) -> None:
        """Refuse new work and end every live or queued sequence with ``ABORTED``."""
        with self._lock:
            self._closed = True
        sched = self._scheduler
        for seq in [*sched.running, *sched.waiting] if sched is not None else []:
            sched.finish(seq)  # type: ignore[union-attr]
            self._emit(seq, -1, finish=FinishReason.ABORTED)
        while not self._inbox.empty():
            kind, request, sink = self._inbox.get_nowait()
            if kind in ("submit", "probe"):
                _deliver(sink, TokenEvent(request_id=request.request_id, token_id=-1,  # type: ignore
                                          finish_reason=FinishReason.ABORTED))
        if sched is not None:
            self._publish_stats()


def _deliver(sink: EventSink, event: TokenEvent) -> None:
    """Call a sink; a failing sink is logged, never allowed to stop the loop."""
    try:
        sink(event)
    except Exception:
        logger.exception("event sink for %s raised", event.request_id)
