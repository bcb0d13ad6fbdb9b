"""GaudiEngine: static-shape bucketed continuous batching, as TGI serves on Gaudi.

The gateway's calls only put commands on a queue; one daemon thread loads the
model, warms it up and runs the toolkit's loop
(:class:`~switchyard_engine.compute_loop.ComputeLoop`): take commands
(submits, aborts), then either prefill newcomers (padded to a prefill bucket; they join the
running batch) or decode every running sequence one token (padded to a
decode bucket), as :mod:`~switchyard_gaudi.scheduler` decides. Every shape
the device runs is one of the warmup plan's, so after warmup nothing compiles.

Pieces, each in its own module: ``assembly`` (start-up order), ``settings`` (the seed's variables),
``limits`` and ``warmup_plan`` (limits, buckets, shapes, memory; pure),
``device`` (the only module touching Habana's software), ``kv_cache`` and
``rows`` (the static cache and who holds which row), ``attention`` and
``runner`` (the captured forward passes; ``vision`` for Llava-Next and Llava
1.5, whose prefill takes image features), ``scheduler`` (TGI's router
semantics), ``admission`` and ``profiler``; FP8, ``fp8_linears``
(``--quantize fp8``) and ``fp8`` (``QUANT_CONFIG``); sharded
(``--num-shard`` > 1), ``tensor_parallel`` (how many ranks, AutoTP),
``shard_group`` (the follower processes and the ops sent to them) and
``rank`` (a follower's main loop).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from switchyard_engine.compute_loop import ComputeLoop, Step
from switchyard_engine.events import emit_token, end
from switchyard_engine.sampling import SampledToken
from switchyard_spec import (
    EngineConfig,
    EngineRequest,
    EngineStartError,
    EngineStats,
    EventSink,
    ModelInfo,
    WarmupReport,
)

from switchyard_gaudi import fp8
from switchyard_gaudi.admission import Admission
from switchyard_gaudi.assembly import assemble, prepare
from switchyard_gaudi.device import Device
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

_OVERDUE = 0.0
"""A probe's queue start: the clock's origin, so QUEUE_THRESHOLD_MS finds it overdue."""


class GaudiEngine(ComputeLoop[GaudiSequence]):
    """A static-shape engine for one model on an HPU, or on the CPU (``device=cpu``).

    ``env`` replaces ``os.environ`` as the source of the seed's variables
    (tests pass their own). Nothing heavy happens until :meth:`start`.
    """

    thread_name = "switchyard-gaudi"
    log = logger

    def __init__(self, config: EngineConfig, env: dict[str, str] | None = None) -> None:
        super().__init__(config)
        self._env = env
        self.settings: GaudiSettings | None = None
        self.device: Device | None = None
        self.plan: WarmupPlan | None = None
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
        self.running: list[GaudiSequence] = []
        """Sequences holding a cache row, in prefill order (owned by the compute thread)."""
        self._warmed: set[Shape] = set()
        self.padding = {"prefill_real": 0, "prefill_padded": 0, "decode_real": 0,
                        "decode_padded": 0}
        """Tokens the steps computed for sequences, and all they computed (with padding)."""

    # ----------------------------------------------------------- lifecycle
    def start(self) -> ModelInfo:
        """Start the compute thread, which plans, loads the model and then runs the loop."""
        if self.config.lora_adapters:
            raise EngineStartError(lora_refusal(self.config.lora_adapters))
        return self._start_loop()

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

        def cancel() -> None:
            result.append(EngineStartError("engine shut down"))
            done.set()

        self._call_on_loop(lambda: self._warm(done, result), cancel)
        if not done.wait(timeout=3600) or not result:
            raise EngineStartError("gaudi warmup did not finish")
        if isinstance(result[0], BaseException):
            raise EngineStartError(f"gaudi warmup failed: {result[0]}") from result[0]
        if self._runner is not None and self.info is not None:
            # before reporting warm, as the xeon engine does: see GrammarRows.prepare
            self._runner.grammar_rows.prepare(self.info.vocab_size, logger)
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
        super().shutdown()
        self._runner = None

    def _loop_alive(self) -> bool:
        group = self._group
        return super()._loop_alive() and (group is None or group.failure is None)

    def follower_compiles(self) -> list[int]:
        """Sharded: graphs each of ranks 1 .. N-1 compiled so far (empty when unsharded)."""
        return self._group.report() if self._group is not None else []

    # ------------------------------------------------- the loop's hooks
    def _build(self, request: EngineRequest,
               sink: EventSink) -> tuple[GaudiSequence | None, str]:
        assert self._admission is not None
        return self._admission.build(request, sink)

    def _start_grammar(self, seq: GaudiSequence) -> None:
        if self._runner is not None:
            self._runner.grammar_rows.start(seq)

    def _queue(self, seq: GaudiSequence, front: bool) -> None:
        assert self._scheduler is not None
        if front:  # a probe: overdue on arrival, so the scheduler takes it first
            seq.queued_at = _OVERDUE
        self._scheduler.queue.push(seq)

    def _find(self, request_id: str) -> GaudiSequence | None:
        return next((s for s in self._live() if s.request_id == request_id), None)

    def _live(self) -> list[GaudiSequence]:
        return [*self.running, *self._scheduler.queue] if self._scheduler is not None else []

    def _drop(self, seq: GaudiSequence) -> None:
        """Take ``seq`` out of the queue or the running batch, freeing its cache row."""
        assert self._scheduler is not None and self._rows is not None
        if seq in self.running:
            self.running.remove(seq)
            self._rows.release(seq.row)  # type: ignore[arg-type]
            seq.row = None
        else:
            self._scheduler.queue.remove(seq)

    def _idle(self) -> bool:
        return not self.running and not (self._scheduler is not None and self._scheduler.queue)

    def _should_stop(self) -> bool:
        """Sharded: whether the group has failed (the watchdog saw a rank die); if so, fail."""
        if self._group is not None and self._group.failure is not None and self._failure is None:
            self._fail(f"sharded engine failed: {self._group.failure}")
        return self._failure is not None

    def _fatal(self, exc: Exception) -> str | None:
        # The ranks are out of step: nothing more can run.
        return f"sharded engine failed: {exc}" if isinstance(exc, ShardFailure) else None

    def _next_step(self) -> Step[GaudiSequence] | None:
        """One prefill or one decode step, as the scheduler decides."""
        assert self._scheduler is not None and self._rows is not None
        assert self._runner is not None
        prefill = self._scheduler.next_prefill(len(self.running))
        if prefill is not None:
            for seq in prefill.seqs:
                seq.row = self._rows.take()
                self.running.append(seq)
            seqs, shape = list(prefill.seqs), prefill.shape
        elif self.running:
            self._compact()
            shape = self._scheduler.grid.decode_shape(len(self.running))
            self._scheduler.decoded()
            seqs = list(self.running)
        else:
            return None
        self._note_shape(shape)
        forward = self._runner.prefill if shape.phase == "prefill" else self._runner.decode
        is_prefill = shape.phase == "prefill"
        return Step(seqs=seqs, run=lambda: forward(seqs, shape), method=shape.phase,
                    prefill_tokens=sum(s.prompt_len for s in seqs) if is_prefill else 0,
                    decode_tokens=0 if is_prefill else len(seqs), detail=shape)

    def _record(self, step: Step[GaudiSequence], results: Sequence[SampledToken | None]) -> None:
        for seq, token in zip(step.seqs, results, strict=True):
            assert token is not None  # every row of a static step samples
            if token.error is not None:  # this row could not be served (its grammar failed)
                self._drop(seq)
                end(seq, error=token.error)
            elif emit_token(seq, token) is not None:
                self._drop(seq)
        self._count_padding(step.seqs, step.detail)

    def _end_iteration(self) -> None:
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

    def _usage(self) -> tuple[int, int, int]:
        assert self._scheduler is not None and self.plan is not None
        limits = self.plan.limits
        return (len(self._scheduler.queue), sum(len(s.tokens) for s in self.running),
                limits.max_batch_size * limits.max_total_tokens)

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

    def _before_close(self) -> None:
        if self._profiler is not None:
            self._profiler.stop()
        fp8_model, self._fp8 = self._fp8, None
        fp8.finish(fp8_model)  # type: ignore[arg-type]

    def _after_close(self) -> None:
        if self._group is not None:  # the followers exit, and are reaped, before the thread ends
            self._group.stop()


def lora_refusal(adapters: dict[str, str]) -> str:
    """Why the Gaudi engine cannot serve ``adapters``: what it would need and does not have."""
    return (f"gaudi engine: LoRA adapters ({', '.join(sorted(adapters))}) are not served: the "
            "static-shape engine has no adapter slots per bucket, no fixed maximum rank compiled "
            "into its graphs and no grouped shrink/expand on the HPU; serve them with the xeon "
            "engine (--engine xeon) or merge the adapter into the weights")
