"""The pooling engine: concurrent requests batched into padded forwards on one thread.

Requests queue from the event loop (`submit` returns at once). The loop takes
the first waiting request, waits a short window (`batch_window_ms`, 2 ms by
default) so that a burst of concurrent requests arrives whole, then takes
everything queued, sorts it by length and cuts it into forwards of at most
`max_batch_tokens` padded tokens (16,384 by default, TEI's default), so that
rows of like length share a forward and little is padded. Each forward is
one call into the model; its outputs go back to each request's callback.
Engine options: `max_batch_tokens`, `batch_window_ms`, `pack_linears` (true;
false keeps transformers' own linear layers).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from switchyard_spec import (
    EngineConfig,
    EngineStartError,
    EngineStats,
    PoolingDone,
    PoolingEngine,
    PoolingInfo,
    PoolingRequest,
    PoolingResult,
    PoolingTask,
    WarmupReport,
)

from switchyard_xeon.pooling.layout import LayoutError, read_layout
from switchyard_xeon.pooling.model import PooledModel, padded_tokens

log = logging.getLogger("switchyard.xeon.pooling")

DEFAULT_BATCH_TOKENS = 16384
DEFAULT_WINDOW_MS = 2.0
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Pending:
    request: PoolingRequest
    done: PoolingDone
    submitted: float


class XeonPoolingEngine(PoolingEngine):
    """Embedding and reranker models on the CPU; see the module docstring for batching."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        options = config.options
        try:
            self.max_batch_tokens = int(options.get("max_batch_tokens", DEFAULT_BATCH_TOKENS))
            self.window = float(options.get("batch_window_ms", DEFAULT_WINDOW_MS)) / 1000
            self.pack = options.get("pack_linears", "true").lower() not in ("0", "false", "no")
        except ValueError as exc:
            raise EngineStartError(f"pooling engine option: {exc}") from None
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._running = 0
        self._steps = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.model: PooledModel | None = None

    def start(self) -> PoolingInfo:
        """Load the folder's backbone and pooling, then start the batching thread."""
        try:
            layout = read_layout(Path(self.config.model_path))
        except LayoutError as exc:
            raise EngineStartError(str(exc)) from None
        dtype = _dtype(self.config.dtype)
        self.model = model = PooledModel(layout, dtype, pack=self.pack)
        log.info("pooling model: %s, %s, linears %s, batches of at most %d padded tokens",
                 "+".join(layout.modes) or "classifier", dtype, model.packing,
                 self.max_batch_tokens)
        self._thread = threading.Thread(target=self._loop, name="xeon-pooling", daemon=True)
        self._thread.start()
        return PoolingInfo(
            task=PoolingTask.RERANK if layout.reranker else PoolingTask.EMBED,
            model_type=model.model_type,
            dtype=str(dtype).removeprefix("torch."),
            device="cpu",
            vocab_size=int(model.config.vocab_size),
            max_position_embeddings=model.max_positions,
            dimensions=model.dimensions,
            hidden_size=model.hidden_size,
            pooling="classifier" if layout.reranker else "+".join(layout.modes),
        )

    def warmup(self) -> WarmupReport:
        """One short and one full-length forward, so the first requests pay no first-call costs."""
        if self.model is None:
            raise EngineStartError("warmup() called before start()")
        t0 = time.perf_counter()
        for length in (8, min(self.model.max_positions, 128)):
            self.model.forward([PoolingRequest(request_id="warmup", token_ids=(0,) * length)] * 2)
        return WarmupReport(seconds=time.perf_counter() - t0,
                            max_batch_total_tokens=self.max_batch_tokens, max_batch_size=0)

    def submit(self, request: PoolingRequest, done: PoolingDone) -> None:
        """Queue one input for the next forward."""
        self._queue.put(_Pending(request, done, time.perf_counter()))

    def stats(self) -> EngineStats:
        """Inputs waiting and in the running forward."""
        return EngineStats(running=self._running, waiting=self._queue.qsize(), steps=self._steps,
                           max_batch_total_tokens=self.max_batch_tokens)

    def healthy(self) -> bool:
        """Whether the batching thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self) -> None:
        """Stop the thread; whatever is still queued is answered with an error."""
        self._stop.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                _deliver(item, PoolingResult(request_id=item.request.request_id,
                                             error="the engine shut down"))

    def _loop(self) -> None:
        while not self._stop.is_set():
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            # A short window: concurrent clients' requests arrive a little apart.
            deadline = time.perf_counter() + self.window
            while True:
                remaining = deadline - time.perf_counter()
                try:
                    item = self._queue.get(timeout=remaining) if remaining > 0 \
                        else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._stop.set()
                    break
                batch.append(item)
            for chunk in self._chunks(batch):
                self._run(chunk)

    def _chunks(self, batch: list[_Pending]) -> list[list[_Pending]]:
        """Like lengths together, each forward within the padded-token budget."""
        batch.sort(key=lambda p: len(p.request.token_ids))
        chunks: list[list[_Pending]] = [[]]
        for item in batch:
            lengths = [len(p.request.token_ids) for p in chunks[-1]]
            if chunks[-1] and padded_tokens([*lengths, len(item.request.token_ids)]) \
                    > self.max_batch_tokens:
                chunks.append([])
            chunks[-1].append(item)
        return chunks

    def _run(self, chunk: list[_Pending]) -> None:
        assert self.model is not None
        self._running = len(chunk)
        start = time.perf_counter()
        try:
            outputs = self.model.forward([p.request for p in chunk])
        except Exception as exc:  # answered per request; the loop carries on
            log.exception("pooling forward failed")
            for p in chunk:
                _deliver(p, PoolingResult(request_id=p.request.request_id,
                                          error=f"{exc.__class__.__name__}: {exc}"))
            return
        finally:
            self._running = 0
            self._steps += 1
        seconds = time.perf_counter() - start
        for p, out in zip(chunk, outputs, strict=True):
            values = out.contiguous().numpy().astype("<f4", copy=False)
            _deliver(p, PoolingResult(request_id=p.request.request_id, values=values.tobytes(),
                                      shape=tuple(values.shape),
                                      queue_seconds=start - p.submitted,
                                      inference_seconds=seconds))


def _deliver(pending: _Pending, result: PoolingResult) -> None:
    """Hand a result to its callback; a callback that raises (its event loop closed at
    shutdown) must not end the loop that serves everyone else."""
    try:
        pending.done(result)
    except Exception:
        log.warning("a pooling result's callback failed", exc_info=True)


def _dtype(name: str) -> torch.dtype:
    """`auto` is bf16 where the CPU computes it natively, as for the generation engine."""
    if name == "auto":
        from switchyard_xeon.machine import read_cpu_info

        return torch.bfloat16 if read_cpu_info().has_bf16 else torch.float32
    if name not in _DTYPES:
        raise EngineStartError(f"pooling engine: dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]
