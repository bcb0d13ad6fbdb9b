"""XeonEngine: continuous batching on the CPU with stock PyTorch.

The gateway's calls (``submit``, ``abort``) only put commands on a queue; one
daemon thread owns the model, the cache and the scheduler and runs the
toolkit's loop (:class:`~switchyard_engine.compute_loop.ComputeLoop`): take
commands, admit and abort at the step boundary, let the scheduler choose the
step's work (decodes, prefill chunks, newcomers; preempting when the paged
cache runs out), run one forward over the packed batch, emit one event per
sequence that produced a token, drop the finished ones. This module is the
engine's side of that loop: its scheduler, runner and cache behind the hooks.

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
import threading
import time
from collections.abc import Sequence as Seq

import torch
from switchyard_engine.compute_loop import ComputeLoop, Step
from switchyard_engine.lora.bank import AdapterBank
from switchyard_engine.sampling import SampledToken
from switchyard_spec import (
    AdapterError,
    EngineConfig,
    EngineRequest,
    EngineStartError,
    EventSink,
    ModelInfo,
    QuantizationMethod,
    SamplingParams,
    StoppingParams,
    TokenEvent,
    WarmupReport,
)

from switchyard_xeon import assembly, machine, quantized
from switchyard_xeon.admission import Admission
from switchyard_xeon.cpu_share import CpuShare
from switchyard_xeon.events import record_results
from switchyard_xeon.ipex_support import Acceleration
from switchyard_xeon.lora import XeonAdapters
from switchyard_xeon.runner import ModelRunner
from switchyard_xeon.scheduler import Scheduler
from switchyard_xeon.sequence import Sequence
from switchyard_xeon.stats import CacheStats, cache_stats, engine_stats

logger = logging.getLogger("switchyard.xeon")


class XeonEngine(ComputeLoop[Sequence]):
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

    thread_name = "switchyard-xeon"
    log = logger

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._runner: ModelRunner | None = None
        self._scheduler: Scheduler | None = None
        self._admission: Admission | None = None
        self._batch: list[Sequence] = []
        """The last step's sequences: an empty one lets the loop block on its inbox."""
        self.acceleration: Acceleration | None = None
        """What :func:`~switchyard_xeon.ipex_support.detect_acceleration` found at start."""
        self.placement: machine.CpuPlacement | None = None
        """The CPUs (NUMA node) chosen at start; see :func:`machine.choose_cpus`."""
        self._cache_stats = CacheStats()
        self._quantization: QuantizationMethod | None = None
        self._adapters: XeonAdapters | None = None
        self._share: CpuShare | None = None

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
        return self._start_loop()

    def _load(self) -> ModelInfo:
        """On the compute thread: place it, load and pack the model, size the cache
        (:mod:`~switchyard_xeon.assembly`)."""
        placed = assembly.place_compute_thread(self.config)
        self.placement, self.acceleration = placed.placement, placed.acceleration
        assembly.bind_compute_thread(placed)
        self._share = (CpuShare(placed.placement.cpus, placed.threads) if placed.share
                       else None)
        parts = assembly.assemble(self.config, self._quantization, placed)
        self.info = parts.info
        self._runner, self._scheduler, self._admission = (
            parts.runner, parts.scheduler, parts.admission)
        self._adapters = parts.adapters
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
        if self._runner is not None:  # before reporting warm: see GrammarRows.prepare
            self._runner.grammar_rows.prepare(self.info.vocab_size, logger)
        blocks = self._scheduler.blocks
        return WarmupReport(seconds=seconds,
                            max_batch_total_tokens=blocks.num_blocks * blocks.block_size,
                            max_batch_size=self._scheduler.limits.max_batch_size)

    def shutdown(self) -> None:
        """Stop the loop; sequences still live end with ``ABORTED``."""
        super().shutdown()
        self._runner = None

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT folder ``path`` as ``name`` (read and checked on the caller's
        thread; nothing changes if it fails). See :mod:`switchyard_xeon.lora`."""
        self._bank_or_refuse(name).register(name, path)
        self._wake()  # an idle loop publishes its stats again (the adapters they name)
        logger.info("lora: loaded adapter %s from %s", name, path)

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name`` to new requests; running ones finish with it."""
        self._bank_or_refuse(name).unregister(name)
        self._wake()
        logger.info("lora: unloaded adapter %s", name)

    def _bank_or_refuse(self, name: str) -> AdapterBank:
        if self._adapters is None:
            raise AdapterError(f"adapter {name!r}: this model does not serve LoRA adapters on "
                               "the xeon engine (it needs the hand-written Llama-family "
                               "decoder, and a started engine)")
        return self._adapters.bank

    def cache_stats(self) -> CacheStats:
        """KV-cache usage, prefix-cache hits and preemptions after the last step (non-blocking)."""
        return self._cache_stats

    # ------------------------------------------------- the loop's hooks
    def _build(self, request: EngineRequest, sink: EventSink) -> tuple[Sequence | None, str]:
        assert self._admission is not None
        return self._admission.build(request, sink)

    def _start_grammar(self, seq: Sequence) -> None:
        if self._runner is not None:
            self._runner.grammar_rows.start(seq)

    def _queue(self, seq: Sequence, front: bool) -> None:
        assert self._scheduler is not None
        self._scheduler.add(seq, front=front)

    def _find(self, request_id: str) -> Sequence | None:
        return self._scheduler.find(request_id) if self._scheduler is not None else None

    def _live(self) -> list[Sequence]:
        sched = self._scheduler
        return [*sched.running, *sched.waiting] if sched is not None else []

    def _drop(self, seq: Sequence) -> None:
        assert self._scheduler is not None
        self._scheduler.finish(seq)

    def _idle(self) -> bool:
        return not self._batch

    def _next_step(self) -> Step[Sequence] | None:
        assert self._scheduler is not None and self._runner is not None
        if self._share is not None:
            self._follow_cpu_share(self._share)
        batch = self._batch = self._scheduler.schedule()
        if not batch:
            return None
        # Counted before the step moves the sequences on: decodes feed their newest token.
        decodes = sum(1 for s in batch if s.generated and s.remaining == 1)
        prefill = sum(s.num_scheduled for s in batch) - decodes
        runner = self._runner
        return Step(seqs=batch, run=lambda: runner.step(batch),
                    method="decode" if not prefill else "prefill" if not decodes else "mixed",
                    prefill_tokens=prefill, decode_tokens=decodes)

    def _follow_cpu_share(self, share: CpuShare) -> None:
        """Set the torch threads to what other processes leave of the engine's CPUs."""
        threads = share.poll()
        if threads is not None:
            torch.set_num_threads(threads)  # this is the compute thread: its OpenMP team
            logger.info("xeon: %d of %d torch threads: other processes used %.1f of CPUs %s",
                        threads, share.limit, share.others,
                        machine.format_cpulist(share.cpus))

    def _record(self, step: Step[Sequence], results: Seq[SampledToken | None]) -> None:
        assert self._scheduler is not None
        record_results(self._scheduler, step.seqs, results)

    def _usage(self) -> tuple[int, int, int]:
        assert self._scheduler is not None
        blocks = self._scheduler.blocks
        return (len(self._scheduler.waiting), blocks.num_used_blocks * blocks.block_size,
                blocks.num_blocks * blocks.block_size)

    def _publish_stats(self) -> None:
        assert self._scheduler is not None
        self._stats = engine_stats(self._scheduler, self._steps,
                                   self._adapters.bank if self._adapters is not None else None)
        self._cache_stats = cache_stats(self._scheduler)
