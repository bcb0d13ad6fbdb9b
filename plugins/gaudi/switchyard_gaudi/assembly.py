"""Start-up, in the order that lets a bad configuration fail before any weight loads.

:func:`prepare` reads the environment and the options, opens the device,
reads the model's sizes from its folder and plans warmup (refusing what does
not fit); only then does :func:`assemble` load the weights (with
``--quantize fp8``: calibrate and quantize them, :mod:`~switchyard_gaudi.fp8_linears`)
and build the cache, the runner, the scheduler and admission around them. A vision-language
folder (Llava-Next, Llava 1.5) loads with transformers' Llava class and gets
the :class:`~switchyard_gaudi.vision.VisionRunner`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch
from switchyard_engine.image_features import ARCHITECTURES, load_vision_lm, vision_architecture
from switchyard_engine.loading import checked_config, dtype_name, load_causal_lm, resolve_dtype
from switchyard_engine.watermark import WatermarkConfig
from switchyard_spec import EngineConfig, EngineStartError, ModelInfo

from switchyard_gaudi import attention, fp8, fp8_linears, tensor_parallel
from switchyard_gaudi.admission import Admission
from switchyard_gaudi.device import HPU, Device, open_device
from switchyard_gaudi.kv_cache import StaticKVCache
from switchyard_gaudi.limits import EngineOptions, max_total_reason, resolve_plan
from switchyard_gaudi.model_dims import (
    DTYPE_BYTES,
    ModelDims,
    read_model_dims,
    safetensors_shapes,
)
from switchyard_gaudi.rows import RowTable
from switchyard_gaudi.runner import StaticRunner
from switchyard_gaudi.scheduler import Policy, Scheduler, WaitingQueue
from switchyard_gaudi.settings import GaudiSettings, inapplicable
from switchyard_gaudi.vision import VisionRunner
from switchyard_gaudi.warmup_plan import BucketSettings, Memory, WarmupPlan

if TYPE_CHECKING:
    from switchyard_quant.fp8_inc import Fp8Model, Fp8Plan

    from switchyard_gaudi.shard_group import ShardGroup

logger = logging.getLogger("switchyard.gaudi")

SUPPORTED_MODELS = ("llama", "mistral", "qwen2", "phi3")
"""Model types tested against transformers' ``generate`` on this engine."""
VISION_MODELS = tuple(ARCHITECTURES)
"""Vision-language model types served with images, whose text model is one of the above."""
GRAPH_MEMORY_FRACTION = 0.1
"""Share of usable HPU memory kept for HPU graphs (TGI's ``TGI_GRAPH_RESERVED_MEM``)."""


@dataclass(frozen=True)
class Prepared:
    """Everything decided before the weights load."""

    settings: GaudiSettings
    options: EngineOptions
    device: Device
    dims: ModelDims
    dtype: torch.dtype
    plan: WarmupPlan
    fp8: Fp8Plan | None = None
    """``QUANT_CONFIG``, read and checked for the device (None: not set)."""
    ranks: int = 1
    """Tensor-parallel ranks (``--num-shard``); the plan is one rank's."""


@dataclass(frozen=True)
class Parts:
    """The engine's working parts, around the loaded model."""

    info: ModelInfo
    cache: StaticKVCache
    rows: RowTable
    runner: StaticRunner
    scheduler: Scheduler
    admission: Admission
    fp8: Fp8Model | None = None
    """The model as INC prepared (MEASURE) or converted (QUANTIZE) it, under ``QUANT_CONFIG``."""


def serving_dtype(requested: str, device_kind: str) -> torch.dtype:
    """``--dtype``: "auto" is bfloat16 on an HPU, and on a CPU whatever the toolkit picks."""
    if device_kind == HPU and requested == "auto":
        return torch.bfloat16
    return resolve_dtype(requested)


def memory_for(device_kind: str, graphs: bool, free: int, ranks: int = 1) -> Memory:
    """The memory one rank's plan is checked against, with graph room on an HPU.

    ``free`` bytes: each HPU's own; on the CPU device all ranks share the
    host's memory, so each plans for ``free / ranks``.
    """
    return Memory(free=free if device_kind == HPU else free // ranks,
                  graph_fraction=GRAPH_MEMORY_FRACTION if device_kind == HPU and graphs else 0.0)


def check_model(dims: ModelDims, config: EngineConfig, settings: GaudiSettings) -> None:
    """Refuse, before anything loads, a model type the engine does not serve, and what a
    vision-language model cannot be served with (sharding, ``QUANT_CONFIG``, ``--quantize``)."""
    if not dims.takes_images:
        if dims.model_type not in SUPPORTED_MODELS:
            raise EngineStartError(
                f"gaudi engine: model type {dims.model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODELS)}, and {', '.join(VISION_MODELS)} with images)")
        return
    name = f"{dims.model_type} (a vision-language model)"
    if dims.text_model_type not in SUPPORTED_MODELS:
        raise EngineStartError(
            f"gaudi engine: {name}'s text model type {dims.text_model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODELS)})")
    if config.num_shard != 1:
        raise EngineStartError(
            f"gaudi engine: {name} cannot be sharded: multi-card Llava inference is not "
            "supported (as in tgi-gaudi); serve it with --num-shard 1")
    if settings.quant_config:
        raise EngineStartError(
            f"gaudi engine: QUANT_CONFIG (FP8) is not supported for {name}: the measurement "
            "runs text prompts, so the vision tower and projector would have no statistics; "
            "serve it in bf16")
    if config.quantize:
        raise EngineStartError(
            f"gaudi engine: --quantize {config.quantize} is not supported for {name}: "
            "calibration runs text prompts, so the vision tower and projector would have no "
            "statistics; serve it in bf16")


CALIBRATION_CACHE = "calibration_cache"
"""The toolkit's option naming the calibration cache folder (switchyard_engine.calibration)."""


def engine_options(config: EngineConfig) -> dict[str, str]:
    """``config.options`` less those a calibrated ``--quantize`` method and the toolkit read."""
    method = config.quantization
    if method is None or method.calibration is None:
        return dict(config.options)
    theirs = {*method.calibration.options, CALIBRATION_CACHE}
    return {k: v for k, v in config.options.items() if k not in theirs}


def check_quantize(config: EngineConfig, settings: GaudiSettings) -> None:
    """Refuse a ``--quantize`` this engine cannot run, before anything loads.

    It runs ``fp8-e4m3-per-tensor`` (``--quantize fp8``), and not together
    with ``QUANT_CONFIG`` (two FP8 flows over one model). Whether the device
    has the format's FP8 range is :meth:`Device.fp8_problem`'s to say.
    """
    if not config.quantize:
        return
    label = f"gaudi engine: --quantize {config.quantize}"
    if config.quantization is None:
        raise EngineStartError(f"{label}: the method was not handed to the engine "
                               "(EngineConfig.quantization is None)")
    if not fp8_linears.runs_fp8(config.quantization):
        formats = ", ".join(f.name for f in config.quantization.formats)
        raise EngineStartError(f"{label} produces {formats} weights, which the engine has no "
                               "kernels for; it runs fp8-e4m3-per-tensor (--quantize fp8)")
    if settings.quant_config:
        raise EngineStartError(
            f"{label} and QUANT_CONFIG={settings.quant_config} both ask for FP8: use one, the "
            "contract's method (calibrated by switchyard) or Intel Neural Compressor's config")


def quantize_fp8(config: EngineConfig, model: torch.nn.Module, device: Device) -> None:
    """``--quantize fp8``: calibrate ``model`` through the toolkit, then make its linears FP8."""
    from switchyard_engine.calibration import calibrate

    method = config.quantization
    assert method is not None and method.calibration is not None
    statistics, line = calibrate(model, config.model_path, method.calibration, config.options,
                                 method.name)
    logger.info("gaudi: --quantize %s: %s", method.name, line)
    logger.info("gaudi: --quantize %s: %s", method.name, fp8_linears.quantize_linears(
        model, method, statistics, config.options, device))


def prepare(config: EngineConfig, env: dict[str, str] | None) -> Prepared:
    """Settings, options, device, model sizes, warmup plan; EngineStartError if unservable."""
    settings = GaudiSettings.from_env(env)
    check_quantize(config, settings)
    options = EngineOptions.parse(engine_options(config))
    device = open_device(
        options.device, graphs=settings.enable_hpu_graph, lazy=settings.pt_hpu_lazy_mode,
        cpu_compile=options.cpu_compile, fused_attention=settings.use_flash_attention,
        recompute=settings.flash_attention_recompute)
    for note in inapplicable(settings, device.kind):
        logger.warning("gaudi: %s", note)
    problem = device.fp8_problem() if config.quantize else None
    if problem is not None:
        raise EngineStartError(f"gaudi engine: --quantize {config.quantize}: {problem}")
    if vision_architecture(config.model_path) is None:
        # The toolkit's refusals first: an encoder, a weight file cut short, not a causal LM.
        checked_config(Path(config.model_path))
    dims = read_model_dims(config.model_path)
    check_model(dims, config, settings)
    if config.quantize:  # the linears' weights held at one byte each
        held, added = fp8_linears.fp8_weight_elements(safetensors_shapes(config.model_path),
                                                      dims.tied_embeddings)
        dims = replace(dims, parameters=dims.parameters + added, fp8_parameters=held)
    dtype = serving_dtype(config.dtype, device.kind)
    fp8_plan = None
    if settings.quant_config:  # before any weight loads: a bad config or missing stats stop here
        fp8_plan = fp8.read_plan(settings.quant_config, device.kind, dtype_name(dtype))
        settings = fp8.measuring_settings(settings, fp8_plan)
        device.graphs = settings.enable_hpu_graph  # MEASURE runs eagerly
        dims = fp8.fp8_dims(dims, config.model_path, fp8_plan)
    ranks = tensor_parallel.resolve_ranks(config.num_shard, device, dims, os.environ)
    if ranks > 1 and fp8_plan is not None:
        raise EngineStartError("gaudi engine: QUANT_CONFIG (FP8) with --num-shard above 1 is "
                               "not implemented; serve FP8 on one card, or shard in bf16")
    if ranks > 1 and config.quantize:
        raise EngineStartError(f"gaudi engine: --quantize {config.quantize} with --num-shard "
                               "above 1 is not implemented (the ranks' linears are not "
                               "quantized); serve FP8 on one card, or shard in bf16")
    memory = memory_for(device.kind, device.graphs,
                        options.device_memory or device.free_memory(), ranks)
    plan = resolve_plan(config, options, dims.per_rank(ranks),
                        BucketSettings.from_settings(settings, dims.takes_images),
                        DTYPE_BYTES[dtype_name(dtype)], memory)
    logger.info("gaudi: %s; graphs: %s%s", device.kind, device.describe(),
                f"; {ranks} ranks (tensor parallel), the plan is per rank" if ranks > 1 else "")
    for line in plan.describe().splitlines():
        logger.info("gaudi plan: %s", line)
    return Prepared(settings, options, device, dims, dtype, plan, fp8_plan, ranks)


def assemble(config: EngineConfig, p: Prepared, group: ShardGroup | None = None) -> Parts:
    """Load the weights onto the device and build the parts that serve them.

    Sharded (``p.ranks`` > 1), this is rank 0: the model is split with AutoTP
    as the followers split theirs, and the runner sends its ops to ``group``.
    """
    if p.options.num_threads:
        torch.set_num_threads(p.options.num_threads)
    try:
        watermark = WatermarkConfig.from_env()
    except ValueError as exc:
        raise EngineStartError(str(exc)) from None
    arch = vision_architecture(config.model_path) if p.dims.takes_images else None
    if arch is not None:  # the engine's attention for its text model; the tower keeps its own
        loaded = load_vision_lm(config.model_path, arch, p.dtype, p.device.kind,
                                text_attention=attention.register())
    else:  # sharded, each rank loads on the host; AutoTP moves only its slices to the device
        # --quantize calibrates on the host (the toolkit feeds host tensors), then moves.
        on_host = p.ranks > 1 or bool(config.quantize)
        loaded = load_causal_lm(config.model_path, dtype=dtype_name(p.dtype),
                                device="cpu" if on_host else p.device.kind,
                                attn_implementation=attention.register())
        if config.quantize:
            quantize_fp8(config, loaded.model, p.device)
            loaded.model.to(p.device.torch_device)
    # INC patches the linear layers in place, before the step functions are captured.
    fp8_model = fp8.convert(loaded.model, p.fp8) if p.fp8 is not None else None
    model = tensor_parallel.shard_model(loaded.model, p.device, p.ranks, p.dtype) \
        if p.ranks > 1 else loaded.model
    limits, grid = p.plan.limits, p.plan.grid
    info = msgspec.structs.replace(
        loaded.info, device=p.device.kind, max_total_tokens=limits.max_total_tokens,
        max_total_tokens_reason=max_total_reason(config, p.dims))
    # One row per decode row of the largest decode bucket: padding rows write to free rows.
    cache = StaticKVCache(p.dims.num_layers, grid.decode_batch.limit,
                          p.dims.num_kv_heads // p.ranks,
                          limits.max_total_tokens, p.dims.head_dim, p.dtype,
                          p.device.torch_device)
    logger.info("gaudi: KV cache %d rows x %d tokens, %.1f MiB", cache.rows, cache.length,
                cache.nbytes / 2**20)
    runner: StaticRunner
    if arch is not None:
        runner = VisionRunner(model, cache, p.device, len(p.plan.shapes),
                              capture_prefill=not p.settings.limit_hpu_graph,
                              model_folder=config.model_path)
    else:
        runner = StaticRunner(model, cache, p.device, len(p.plan.shapes),
                              capture_prefill=not p.settings.limit_hpu_graph, group=group,
                              model_folder=config.model_path)
    scheduler = Scheduler(grid, Policy(limits.max_batch_size, p.options.max_waiting_tokens,
                                       p.options.waiting_served_ratio),
                          WaitingQueue(p.settings.queue_threshold_ms))
    admission = Admission(limits, loaded.info.vocab_size, p.settings.ignore_eos_token, watermark,
                          takes_images=loaded.info.takes_images)
    return Parts(info, cache, RowTable(limits.max_batch_size), runner, scheduler,
                 admission, fp8_model)
