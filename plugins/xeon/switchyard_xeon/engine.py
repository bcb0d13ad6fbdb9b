"""XeonEngine: continuous batching on the CPU with stock PyTorch.

The gateway's calls (``submit``, ``abort``) only put commands on a queue; one
daemon thread owns the model, the cache and the scheduler and runs the loop:
take commands, admit and abort at the step boundary, let the scheduler choose
the step's work (decodes, prefill chunks, newcomers; preempting when the paged
cache runs out), run one forward over the packed batch, emit one event per
sequence that produced a token, drop the finished ones.

Pieces, each in its own module: ``admission`` (limits, cache size, requests
into sequences), ``scheduler`` and ``block_manager`` (pure: who runs, which
cache blocks they hold), ``kv_cache`` and ``attention`` (paged storage and the
attention over it), ``runner`` (one forward pass and sampling), ``events`` and
``stats`` (what goes back to the gateway).

Health (:mod:`switchyard_xeon.health`): ``healthy()`` is cheap (the loop
thread is alive and no liveness probe has failed). After a forward step fails,
the engine checks itself with a real 1-token generation that goes through the
loop ahead of the queue; ``probe_liveness()`` runs that check and waits for it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time

import msgspec
import torch

from switchyard.engine.compile_hold import CompileHold
from switchyard.engine.lifecycle import deliver, start_compute_thread
from switchyard.engine.liveness import PROBE_TIMEOUT_S, Liveness
from switchyard.engine.loading import load_causal_lm, resolve_dtype
from switchyard.engine.watermark import WatermarkConfig
from switchyard_spec import (
    ActivationStatistics,
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

from switchyard_xeon import alibi_attention, attention, fp8_linears, machine, quantized, vision
from switchyard_xeon.admission import Admission, resolve_limits
from switchyard_xeon.block_manager import BlockManager
from switchyard_xeon.decoder import (
    LlamaFamilyDecoder,
    PackedForward,
    TransformersForward,
    decoder_unsupported,
)
from switchyard_xeon.events import emit, record_results
from switchyard_xeon.fallback import FallbackRunner
from switchyard_xeon.ipex_support import Acceleration, detect_acceleration
from switchyard_xeon.kernels import PagedDecodeFn, load_kernels
from switchyard_xeon.kernels.reference import TorchFusedOps
from switchyard_xeon.kv_cache import PagedKVCache, cache_shape
from switchyard_xeon.linears import pack_linears
from switchyard_xeon.moe import MOE_CHOICES, group_experts
from switchyard_xeon.model_paths import (
    ForwardPath,
    choose_path,
    loaded_model_unsupported,
    use_default_attention,
)
from switchyard_xeon.runner import ModelRunner, check_supported
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

    __slots__ = ("sink", "submitted", "started", "first")

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
        """On the compute thread: place it, load and pack the model, size the cache."""
        cpu = machine.read_cpu_info()
        placement = machine.choose_cpus()
        try:
            threads = int(self.config.options.get("num_threads", 0) or placement.physical_cores)
        except ValueError:
            raise EngineStartError("xeon option num_threads must be an integer") from None
        # Pin only on multi-node machines, and only when the threads fit the node's cores:
        # more threads pinned to one node would share its cores while other nodes sit idle.
        bind = placement.should_bind and threads <= placement.physical_cores
        self.placement, self.acceleration = placement, detect_acceleration()
        if bind:
            # Before the first parallel region: OpenMP workers inherit this thread's mask.
            try:
                os.sched_setaffinity(0, placement.cpus)
            except OSError as exc:  # e.g. the cgroup's cpuset changed: run unbound
                logger.warning("could not bind the compute thread to CPUs %s: %s",
                               machine.format_cpulist(placement.cpus), exc)
        # Intra-op thread settings are per thread for OpenMP: this is the compute thread.
        torch.set_num_threads(threads)
        logger.info("xeon: %s: %d torch thread%s on %s%s; kernels: %s", cpu.describe(), threads,
                    "" if threads == 1 else "s", placement.describe(),
                    ", compute thread bound to them" if bind else "", self.acceleration.describe())

        try:
            watermark = WatermarkConfig.from_env()
        except ValueError as exc:
            raise EngineStartError(str(exc)) from None
        dtype = resolve_dtype(self.config.dtype, cpu.flags)
        # bf16 where the kernels have AVX512_BF16 dot products: the linears are
        # bf16 matmuls on the engine's panels (bf16 weights and inputs, fp32 sums),
        # the KV cache is bf16, and everything else (norms, rotary, attention's
        # arithmetic, the residual stream) stays fp32, so the model loads in fp32
        # and its linears are rounded to bf16 as they are packed.
        method = self._quantization
        # FP8 runs on its own PyTorch linears (fp8_linears), not the W8A8 panels.
        fp8 = fp8_linears.runs_fp8(method)
        w8a8 = method is not None and not fp8 and quantized.runs_w8a8(method)
        linears = _option(self.config.options, "linears", LINEARS)
        if fp8:
            pass  # any dtype: the linears take fp32 or bf16 inputs, the cache keeps the dtype
        elif w8a8:
            if linears not in ("packed", "panel"):
                raise EngineStartError(f"xeon engine: --quantize {method.name} runs on the native "
                                       f"W8A8 panels, which linears={linears} rules out")
            dtype = quantized.w8a8_dtype(self.config, method, dtype)
            if dtype == torch.bfloat16 and not self._bf16_dot_available():
                dtype = torch.float32  # the linears take fp32 inputs either way
        elif method is not None:
            dtype = quantized.quantized_dtype(self.config, method, dtype,
                                              self._bf16_dot_available(), linears)
        bf16_dot = dtype == torch.bfloat16 and self._bf16_dot_available()
        cache_dtype = dtype
        if bf16_dot and (w8a8 or fp8):
            dtype = torch.float32
            logger.info("bfloat16: a bf16 KV cache and fp32 activations; the linears are %s "
                        "(--quantize %s)", "FP8" if fp8 else "W8A8", method.name)
        elif bf16_dot:
            dtype = torch.float32
            logger.info("bfloat16: bf16 matmuls on the AVX512_BF16 panel kernel%s and a bf16 KV "
                        "cache, fp32 activations",
                        f" over quantized weights (--quantize {method.name})" if method else "")
        # Paged attention or the fallback, decided before loading: a model class that does not
        # know the engine's attention name fails inside transformers when given it.
        # A vision-language model (Llava-Next, Llava) runs its text model on the paged path
        # and its images as input embeddings (switchyard_xeon/vision.py).
        kind = vision.vision_model(self.config.model_path)
        if kind is not None and method is not None:
            raise EngineStartError(f"xeon engine: --quantize {method.name} is not supported for "
                                   f"{kind.class_name} (vision-language) models yet")
        forced = _option(self.config.options, "forward", FORWARDS) == "fallback"
        path = (vision.choose_vision_path(self.config.model_path, kind, forced)
                if kind is not None else choose_path(self.config.model_path,
                                                     forced_fallback=forced))
        # ALiBi models load with their own attention; alibi_attention replaces it below.
        attn_name = attention.register() if path.paged and not path.alibi else None
        logger.info("loading %s as %s", self.config.model_path, str(dtype).removeprefix("torch."))
        if method is not None and method.load is not None:
            # A checkpoint method: its layers come quantized from the folder, the rest float.
            from switchyard.engine.checkpoint import load_quantized_causal_lm

            loaded, checkpoint = load_quantized_causal_lm(
                self.config.model_path, method, self.config.options,
                dtype=str(dtype).removeprefix("torch."), attn_implementation=attn_name)
            logger.info("--quantize %s: %s", method.name, checkpoint.source)
        elif kind is not None:
            loaded = vision.load_vision_lm(self.config.model_path, kind,
                                           str(dtype).removeprefix("torch."), attn_name)
        else:
            loaded = load_causal_lm(
                self.config.model_path,
                dtype=str(dtype).removeprefix("torch."),
                attn_implementation=attn_name,
            )
        if bf16_dot:  # what the user asked for, and what the matmuls compute in
            loaded = dataclasses.replace(
                loaded, info=msgspec.structs.replace(loaded.info, dtype="bfloat16"))
        logger.info("loaded %s model in %.2fs", loaded.info.model_type, loaded.seconds)
        # What the paged path runs: a vision model's text model, as its causal LM class.
        causal = vision.text_causal_lm(loaded.model) if kind is not None else loaded.model
        if path.paged and (why := loaded_model_unsupported(causal)):
            path = ForwardPath(False, why)  # what only the modules show (attention sinks)
            use_default_attention(loaded.model)
        alibi_forward = alibi_attention.install(loaded.model) if path.alibi else None
        if path.paged:
            check_supported(causal)
        else:
            cache_dtype = dtype  # the model's own cache holds what its attention computes
        logger.info("path: %s; attention %s", path.describe(),
                    "switchyard_xeon" if path.paged else loaded.model.config._attn_implementation)
        # Mixture-of-experts layers as linears the packing below takes (switchyard_xeon/moe.py).
        moe_report = group_experts(loaded.model, _option(self.config.options, "moe", MOE_CHOICES),
                                   f"--quantize {method.name}" if method is not None else "")
        if moe_report.describe():
            logger.info("mixture of experts: %s", moe_report.describe())
        statistics = None
        if method is not None and method.calibration is not None and (w8a8 or fp8):
            from switchyard.engine.calibration import calibrate

            statistics, line = calibrate(loaded.model, self.config.model_path,
                                         method.calibration, self.config.options, method.name)
            logger.info("--quantize %s: %s", method.name, line)
        if fp8:  # the linears become FP8 ones here; the packing below finds none left
            logger.info("--quantize %s: %s", method.name, fp8_linears.pack_fp8_linears(
                loaded.model, method, statistics, self.config.options))
        forward, kernel = self._fast_path(loaded.model, cpu.flags, bf16_dot,
                                          None if fp8 else method, statistics,
                                          fallback=not path.paged)
        if alibi_forward is not None:  # transformers' forward would rebuild alibi and masks
            forward = alibi_forward
            logger.info("forward: the model's blocks with the engine's ALiBi attention "
                        "(switchyard_xeon/alibi_attention.py)")
        shape = cache_shape(loaded.model.config)
        limits, plan = resolve_limits(
            self.config, loaded.info, shape.bytes_per_token(cache_dtype),
            machine.available_memory_bytes(), threads,
        )
        if not path.paged:  # the blocks only count the per-sequence caches' tokens
            plan = dataclasses.replace(plan, prefix_caching=False)
        cache = (PagedKVCache(shape, cache_dtype, plan.num_blocks, plan.block_size)
                 if path.paged else None)
        blocks = BlockManager(plan.num_blocks, plan.block_size, plan.prefix_caching)
        logger.info(
            "kv cache: %d blocks x %d tokens = %d tokens, %.1f MiB of %s (%s); prefix caching %s",
            plan.num_blocks, plan.block_size, plan.capacity_tokens,
            plan.capacity_tokens * shape.bytes_per_token(cache_dtype) / 2**20,
            str(cache_dtype).removeprefix("torch."), plan.source,
            "on" if plan.prefix_caching else "off",
        )
        logger.info(
            "limits: batch %d, prefill %d tokens per step, sequence %d tokens, "
            "waiting_served_ratio %g, max_waiting_tokens %d",
            limits.max_batch_size, limits.max_batch_prefill_tokens, limits.max_total_tokens,
            limits.waiting_served_ratio, limits.max_waiting_tokens,
        )
        self.info = loaded.info
        # The prefill kernel comes with the decode one (attention=sdpa turns both off),
        # for fp32 activations (the fp32 and bf16-matmul modes) of the head sizes it has.
        prefill = load_kernels().prefill if (
            kernel is not None and dtype == torch.float32
            and shape.head_dim in attention.PREFILL_HEAD_DIMS) else None
        if cache is None:
            runner = vision.VisionRunner if kind is not None else FallbackRunner
            self._runner = runner(loaded.model, blocks)
        else:
            logger.info("prefill attention: %s", "native paged kernel (C++)"
                        if prefill is not None else "SDPA per sequence")
            self._runner = (vision.PagedVisionRunner(forward, cache, blocks, loaded.model, kernel,
                                                     prefill) if kind is not None
                            else ModelRunner(forward, cache, blocks, kernel, prefill))
        self._scheduler = Scheduler(limits, blocks)
        self._admission = Admission(limits, loaded.info.vocab_size, plan.capacity_tokens,
                                    watermark, takes_images=loaded.info.takes_images)
        return loaded.info

    def _bf16_dot_available(self) -> bool:
        """Whether bf16 runs on the bf16 dot-product panels: the kernels have them, linears allow."""
        linears = _option(self.config.options, "linears", LINEARS)
        return linears in ("packed", "panel") and load_kernels().bf16_dot

    def _fast_path(self, model: torch.nn.Module, cpu_flags: frozenset[str],
                   bf16_dot: bool = False, quantization: QuantizationMethod | None = None,
                   statistics: dict[str, ActivationStatistics] | None = None,
                   fallback: bool = False) -> tuple[PackedForward, PagedDecodeFn | None]:
        """Choose the forward pass, pack the linears and load the kernels, as the options allow.

        Options: ``linears`` (``packed``, the default: bf16 on the native
        bf16 dot-product panels where the CPU has AVX512_BF16 (``bf16_dot``:
        the model was loaded in fp32 for them), fp32 on the native panel
        kernel where the CPU has AVX2 but not AVX-512, which is where it was
        measured to win, others on oneDNN; with a ``quantization`` method
        (``--quantize``) those dot-product panels hold its int8 or uint4
        weights, and a W8A8 method's (quantized with the calibration
        ``statistics``) run on the W8A8 panels; ``panel``: the panel kernel for
        fp32 whatever the CPU; ``onednn``: oneDNN for fp32 and bf16 alike;
        ``stock``: fused but not packed), ``panel_storage`` (``auto``:
        panels of weights that hold only bf16 values, as a bf16 checkpoint
        loaded in fp32 does, are stored as bf16, exactly; ``float32``: never),
        ``attention`` (``auto``: the native kernel when it builds; ``sdpa``:
        never) and ``forward`` (``auto``: the hand-written decoder for
        the Llama family, its decode steps in one native call where its pieces
        are native, transformers' forward for other architectures;
        ``decoder``: the same with the layer loop always in Python;
        ``transformers``: always transformers' forward; ``fallback``: the fallback
        path, :mod:`switchyard_xeon.fallback`, for any model). Logs each choice; returns
        the forward pass and the decode kernel (None for the portable path). With
        ``fallback`` (the model takes the fallback path) it only packs the linears
        and returns (None, None).
        """
        options = self.config.options
        linears = _option(options, "linears", LINEARS)
        mode = _option(options, "attention", ("auto", "sdpa"))
        forward_mode = _option(options, "forward", FORWARDS)
        storage = _option(options, "panel_storage", ("auto", "float32"))
        status = load_kernels()
        # The fp32 panel kernel is AVX2/FMA code: on Intel's AVX-512 cores oneDNN
        # has twice its width. bf16 dot products beat both where the CPU has them.
        avx2_only = {"avx2", "fma"} <= cpu_flags and "avx512f" not in cpu_flags
        w8a8 = quantization is not None and quantized.runs_w8a8(quantization)
        report = pack_linears(model, pack=linears != "stock",
                              panels=status.fn is not None and (
                                  bf16_dot or w8a8 or linears == "panel"
                                  or (linears == "packed" and avx2_only)),
                              narrow=storage == "auto", bf16_dot=bf16_dot,
                              quantization=quantization, statistics=statistics,
                              options=dict(options))
        logger.info("linears: %s", report.describe())
        if fallback:  # the model's own forward and attention: nothing more to choose
            return None, None  # type: ignore[return-value]
        if vision.is_vision_lm(model):  # its text model runs the packed steps (all packed now)
            model = vision.text_causal_lm(model)
        if mode == "sdpa":
            logger.info("decode attention: SDPA per sequence (attention=sdpa)")
        else:
            logger.info("decode attention: %s", status.reason if status.fn else
                        f"SDPA per sequence; {status.reason}")
        kernel = status.fn if mode == "auto" else None
        why = "forward=transformers" if forward_mode == "transformers" else decoder_unsupported(model)
        if why:
            logger.info("forward: transformers' (%s)", why)
            return TransformersForward(model), kernel
        ops = status.fused or TorchFusedOps()
        decoder = LlamaFamilyDecoder(model, ops, native_loop=forward_mode == "auto")
        logger.info("forward: hand-written Llama-family decoder, %s%s",
                    "native fused ops (C++)" if status.fused else "PyTorch ops (no native kernels)",
                    "; decode steps run every layer in one native call"
                    if decoder.native is not None and kernel is not None else "")
        return decoder, kernel

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
        blocks = self._scheduler.blocks
        return WarmupReport(seconds=seconds,
                            max_batch_total_tokens=blocks.num_blocks * blocks.block_size,
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


LINEARS = ("packed", "panel", "onednn", "stock")
"""Values of the ``linears`` engine option; the first is the default."""

FORWARDS = ("auto", "decoder", "transformers", "fallback")
"""Values of the ``forward`` engine option; ``fallback`` runs any model on the fallback path."""


def _option(options: dict[str, str], name: str, choices: tuple[str, ...]) -> str:
    """The engine option ``name`` (default: the first choice); EngineStartError if not a choice."""
    value = str(options.get(name, choices[0])).lower()
    if value not in choices:
        raise EngineStartError(
            f"xeon option {name} must be {' or '.join(choices)}, not {value!r}")
    return value
