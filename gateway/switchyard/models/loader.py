"""Start-up of one model: find its files, pick its engine, load, warm up.

The order is the one DESIGN.md fixes: plugins are loaded (by the caller),
the engine is built, weights are loaded, warmup runs, and only then does the
model join the registry and the server report ready.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from switchyard.engine_process import EngineProcess, parse_cpus
from switchyard.models.config import ModelEntry
from switchyard.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from switchyard.models.gguf import ensure_gguf_model, find_gguf
from switchyard.models.lora import resolve_adapter_source
from switchyard.models.pooling import PoolingModel, load_pooling_model
from switchyard.models.pooling_folder import is_pooling_folder
from switchyard.models.random_model import RANDOM_MODEL_NAME, ensure_random_model
from switchyard.models.served import Admission, ServedModel
from switchyard.plugins import PluginHost
from switchyard.settings import resolve_num_shard, resolve_token_limits
from switchyard.text import load_tokenizer
from switchyard_spec import Engine, EngineConfig, EngineStartError, StepObserver

log = logging.getLogger("switchyard.models")


def resolve_model_path(model_id: str | None, revision: str | None = None,
                       gguf_file: str | None = None) -> tuple[str, Path]:
    """Map a model id to (served id, local folder of config.json and safetensors).

    None is the default model (prepared into the model cache on first use),
    and the built-in names are the default and the random-weight model; an
    existing folder is used as is; a GGUF file, or a folder of one (picked by
    `gguf_file` among several), is converted once into a cached folder
    (`switchyard.models.gguf`); any other id is looked up in the local
    Hugging Face cache (no download: the server must start offline).
    """
    if model_id is None and gguf_file is not None:
        raise EngineStartError("--gguf-file names a file in the folder --model-id gives: "
                               "pass --model-id too")
    if model_id is None or model_id == DEFAULT_MODEL_NAME:
        return DEFAULT_MODEL_NAME, ensure_default_model()
    if model_id == RANDOM_MODEL_NAME:
        return RANDOM_MODEL_NAME, ensure_random_model()
    if os.path.exists(model_id):
        gguf = find_gguf(model_id, gguf_file)
        return model_id, ensure_gguf_model(gguf) if gguf is not None else Path(model_id)
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(model_id, revision=revision, local_files_only=True)
    except Exception as exc:  # the hub client raises several types for "not cached"
        raise EngineStartError(
            f"model {model_id!r} is neither a local folder or file nor in the Hugging Face "
            f"cache ({exc.__class__.__name__}); download it first, e.g. `hf download {model_id}`"
        ) from exc
    gguf = find_gguf(folder, gguf_file)
    return model_id, ensure_gguf_model(gguf) if gguf is not None else Path(folder)


ObserverFactory = Callable[[str, str], StepObserver | None]
"""Given (served model name, engine name), the step observer to install, if any."""


def load_model(
    entry: ModelEntry, plugins: PluginHost, step_observer: ObserverFactory | None = None
) -> ServedModel | PoolingModel:
    """Build, load and warm up the model `entry` describes. Blocking: call off the event loop.

    `step_observer` (the gateway's metrics) is installed on the engine before
    warmup, as the engine contract asks. An engine that started and then
    failed is shut down before the error propagates, so that a server with
    other models does not keep its thread and memory.
    """
    t0 = time.perf_counter()
    model_id, path = resolve_model_path(entry.model_id, entry.revision, entry.gguf_file)
    log.info("model %s: files at %s (found or prepared in %.1fs)", model_id, path,
             time.perf_counter() - t0)
    if is_pooling_folder(path):  # an embedding model or a reranker: its own engine interface
        return load_pooling_model(entry, plugins, model_id, path)
    tokenizer = load_tokenizer(path)
    log.info("model %s: tokenizer loaded after %.1fs", model_id, time.perf_counter() - t0)
    spec = plugins.select_engine(entry.engine)
    # Before the engine exists: a --quantize it cannot run stops here, naming what it can.
    # A quantized checkpoint (config.json's quantization_config) picks its reader; so do the
    # GGUF blocks a converted GGUF folder keeps, where the engine runs their format.
    quantize = plugins.detect_quantization(entry.quantize, path, spec)
    quantization = plugins.resolve_quantization(quantize, spec)
    name = entry.served_model_name or model_id
    adapters = {n: resolve_adapter_source(n, src) for n, src in entry.lora_adapters.items()}
    config = EngineConfig(
        model_path=str(path),
        dtype=entry.dtype,
        max_total_tokens=entry.max_total_tokens,
        max_input_tokens=entry.max_input_tokens,
        num_shard=resolve_num_shard(entry),
        max_batch_size=entry.max_batch_size,
        max_batch_prefill_tokens=entry.max_batch_prefill_tokens,
        max_batch_total_tokens=entry.max_batch_total_tokens,
        quantize=quantize,
        quantization=quantization,
        lora_adapters=adapters,
        max_loras=entry.max_loras,
        max_lora_rank=entry.max_lora_rank,
        options={
            "max_waiting_tokens": str(entry.max_waiting_tokens),
            "waiting_served_ratio": str(entry.waiting_served_ratio),
            **entry.engine_options,
        },
    )
    if entry.engine_process:
        # The same engine, built by the same plugin, in a process of its own.
        engine: Engine = EngineProcess(
            spec.name, config, model=name,
            cpus=parse_cpus(entry.cpus) if entry.cpus is not None else None)
        log.info("model %s: engine %s in its own process%s", model_id, spec.name,
                 f", pinned to CPUs {entry.cpus}" if entry.cpus is not None else "")
    else:
        engine = spec.factory(config)
    log.info("model %s: loading weights with engine %s", model_id, spec.name)
    info = engine.start()
    try:
        limits = resolve_token_limits(entry, info.max_position_embeddings,
                                      info.max_total_tokens, info.max_total_tokens_reason)
        log.info(
            "model %s: %s on %s, max_input_tokens=%d max_total_tokens=%d (%s)",
            model_id, info.dtype, info.device, limits.max_input_tokens, limits.max_total_tokens,
            limits.source,
        )
        observer = step_observer(name, spec.name) if step_observer is not None else None
        if observer is not None:
            engine.set_step_observer(observer)
        log.info("model %s: warming up", model_id)
        report = engine.warmup()
        vision = None
        if info.takes_images:  # the gateway prepares images with the folder's own processor
            from switchyard.media.processor import load_vision_processor

            vision = load_vision_processor(path)
    except BaseException:
        engine.shutdown()
        raise
    log.info("model %s: warm in %.1fs; ready after %.1fs", model_id, report.seconds,
             time.perf_counter() - t0)
    aliases = frozenset(entry.aliases) - {name}
    return ServedModel(
        name=name,
        model_id=model_id,
        tokenizer=tokenizer,
        engine=engine,
        engine_spec=spec,
        info=info,
        limits=limits,
        admission=Admission(limit=entry.max_concurrent_requests),
        aliases=aliases,
        warmup=report,
        vision=vision,
        adapters=adapters,
    )

