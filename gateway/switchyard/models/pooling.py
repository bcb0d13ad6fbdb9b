"""One served pooling model (embeddings or a reranker): its tokenizer, engine and limits.

`PoolingModel.run` hands a request's inputs to the engine at once, back to
back, so that they join one forward with those of concurrent requests, and
awaits their results, which the engine's thread posts to the event loop.
`load_pooling_model` is the start-up of such a model from a config entry or
the flags; `models.loader` calls it for a folder `is_pooling_folder` accepts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from switchyard_spec import (
    EngineConfig,
    EngineSpec,
    EngineStartError,
    PoolingEngine,
    PoolingInfo,
    PoolingRequest,
    PoolingResult,
    PoolingTask,
    WarmupReport,
)

from switchyard.errors import generation_error, validation_error
from switchyard.models.config import ModelEntry
from switchyard.models.pooling_folder import PoolingFolder, read_pooling_folder
from switchyard.models.served import Admission
from switchyard.plugins import PluginHost
from switchyard.text.pooling_inputs import Encoded, PoolingTokenizer

log = logging.getLogger("switchyard.models")

MAX_CLIENT_BATCH = 2048
"""Inputs one request may carry (OpenAI's limit); engine option `max_client_batch_size`."""
MAX_REQUEST_TOKENS = 300_000
"""Tokens one request may carry, summed over its inputs (OpenAI's limit)."""
_ids = itertools.count()


@dataclass(frozen=True)
class Pooled:
    """A request's outputs: one float32 array per input, in order, and what they took."""

    arrays: list[np.ndarray]
    tokens: int
    queue_seconds: float
    inference_seconds: float


@dataclass
class PoolingModel:
    """An embedding or reranker model served by a local pooling engine."""

    name: str
    model_id: str
    aliases: frozenset[str]
    engine: PoolingEngine
    engine_spec: EngineSpec
    info: PoolingInfo
    folder: PoolingFolder
    tokenizer: PoolingTokenizer
    admission: Admission
    warmup: WarmupReport
    max_client_batch: int = MAX_CLIENT_BATCH

    @property
    def task(self) -> PoolingTask:
        """Embeddings or reranking."""
        return self.info.task

    @property
    def routes(self) -> str:
        """The routes that serve this model, for error messages."""
        if self.task is PoolingTask.RERANK:
            return "reranking (/rerank, /v1/rerank)"
        return "embeddings (/v1/embeddings, /embed, /embed_all, /similarity)"

    def check_count(self, count: int, param: str) -> None:
        """At least one input and at most the model's client batch size."""
        if count == 0:
            raise validation_error(f"`{param}` cannot be empty", param=param)
        if count > self.max_client_batch:
            raise validation_error(f"`{param}` has {count} items, more than the limit of "
                                   f"{self.max_client_batch}", param=param)

    async def run(self, inputs: Sequence[Encoded], all_tokens: bool = False) -> Pooled:
        """Pool every input (one forward with whatever else is queued)."""
        total = sum(len(e.ids) for e in inputs)
        if total > MAX_REQUEST_TOKENS:
            raise validation_error(f"the request has {total} tokens, more than "
                                   f"{MAX_REQUEST_TOKENS}")
        self.admission.acquire()
        try:
            loop = asyncio.get_running_loop()
            futures = [loop.create_future() for _ in inputs]

            def deliver(future: asyncio.Future[PoolingResult], result: PoolingResult) -> None:
                if not future.done():
                    future.set_result(result)

            for future, encoded in zip(futures, inputs, strict=True):
                request = PoolingRequest(request_id=f"pool-{next(_ids)}", token_ids=encoded.ids,
                                         token_type_ids=encoded.type_ids, all_tokens=all_tokens)
                self.engine.submit(request, lambda r, f=future: loop.call_soon_threadsafe(
                    deliver, f, r))
            results = await asyncio.gather(*futures)
        finally:
            self.admission.release()
        arrays = []
        for result in results:
            if result.error is not None:
                raise generation_error(result.error)
            arrays.append(np.frombuffer(result.values, dtype="<f4").reshape(result.shape))
        return Pooled(arrays=arrays, tokens=total,
                      queue_seconds=max(r.queue_seconds for r in results),
                      inference_seconds=max(r.inference_seconds for r in results))


def load_pooling_model(entry: ModelEntry, plugins: PluginHost, model_id: str,
                       path: Path) -> PoolingModel:
    """Build, load and warm up a pooling model. Blocking: call off the event loop."""
    t0 = time.perf_counter()
    spec = plugins.select_engine(entry.engine)
    if spec.pooling_factory is None:
        raise EngineStartError(f"model {model_id!r} is an embedding or reranker model, and "
                               f"engine {spec.name!r} serves generation only")
    if entry.engine_process:
        raise EngineStartError(f"model {model_id!r}: engine_process is not supported for "
                               "embedding and reranker models (their engine runs in the "
                               "server's process)")
    if entry.quantize is not None:
        raise EngineStartError(f"model {model_id!r}: --quantize is not supported for "
                               "embedding and reranker models")
    folder = read_pooling_folder(path)
    engine = spec.pooling_factory(EngineConfig(model_path=str(path), dtype=entry.dtype,
                                               options=dict(entry.engine_options)))
    info = engine.start()
    try:
        limit = min(v for v in (info.max_position_embeddings, folder.max_seq_length,
                                entry.max_input_tokens or None) if v)
        tokenizer = PoolingTokenizer(folder.backbone, limit, info.vocab_size)
        report = engine.warmup()
        batch = int(entry.engine_options.get("max_client_batch_size", MAX_CLIENT_BATCH))
    except BaseException:
        engine.shutdown()
        raise
    name = entry.served_model_name or model_id
    log.info("model %s: %s model (%s pooling, %d dimensions, %s) on engine %s, "
             "max_input_tokens=%d, ready after %.1fs", model_id, info.task.value, info.pooling,
             info.dimensions, info.dtype, spec.name, limit, time.perf_counter() - t0)
    return PoolingModel(name=name, model_id=model_id, aliases=frozenset(entry.aliases) - {name},
                        engine=engine, engine_spec=spec, info=info, folder=folder,
                        tokenizer=tokenizer, warmup=report, max_client_batch=batch,
                        admission=Admission(limit=entry.max_concurrent_requests))
