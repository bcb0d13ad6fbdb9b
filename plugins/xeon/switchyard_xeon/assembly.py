"""Start-up on the compute thread, in order: place it, choose the precision and the path,
load the model, fit it to the path, pack it, size the cache, build the parts that serve it.

:func:`place_compute_thread` picks the CPUs and the thread count and
:func:`bind_compute_thread` applies them, before the first parallel region;
:func:`assemble` then reads the watermark settings, chooses the dtypes
(:func:`choose_precision`) and the forward path (:func:`choose_model_path`,
before any weight loads: a model class that does not know the engine's
attention name fails inside transformers when given it), loads the model
(:func:`load_model`), settles its path on the loaded modules
(:func:`settle_path`: attention sinks, ALiBi), groups experts, calibrates and
converts FP8 linears (:func:`convert_layers`), packs the linears and picks the
forward pass and kernels (:func:`fast_path`), and sizes the KV cache from
the limits. Every choice is logged. :class:`~switchyard_xeon.engine.XeonEngine`
runs the loop over the :class:`Assembled` parts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
from switchyard_engine.loading import LoadedModel, load_causal_lm, resolve_dtype
from switchyard_engine.watermark import WatermarkConfig
from switchyard_spec import (
    ActivationStatistics,
    EngineConfig,
    EngineStartError,
    ModelInfo,
    QuantizationMethod,
)

from switchyard_xeon import (
    alibi_attention,
    attention,
    draft_model,
    fp8_linears,
    machine,
    quant_dtype,
    quantized,
    vision,
)
from switchyard_xeon import options as read_options
from switchyard_xeon.admission import Admission, max_total_reason, resolve_limits
from switchyard_xeon.block_manager import BlockManager
from switchyard_xeon.decoder import (
    LlamaFamilyDecoder,
    PackedForward,
    TransformersForward,
    decoder_unsupported,
)
from switchyard_xeon.fallback import FallbackRunner
from switchyard_xeon.gemm_rows import choose_crossover
from switchyard_xeon.ipex_support import Acceleration, detect_acceleration
from switchyard_xeon.kernels import PagedDecodeFn, load_kernels
from switchyard_xeon.kernels.reference import TorchFusedOps
from switchyard_xeon.kv_cache import PagedKVCache, cache_shape
from switchyard_xeon.linears import PanelLinear, pack_linears, weight_memory
from switchyard_xeon.lora import XeonAdapters, build_adapters
from switchyard_xeon.model_paths import (
    ForwardPath,
    choose_path,
    loaded_model_unsupported,
    use_default_attention,
)
from switchyard_xeon.moe import MOE_CHOICES, group_experts
from switchyard_xeon.runner import ModelRunner, check_supported
from switchyard_xeon.scheduler import Scheduler
from switchyard_xeon.speculation import Drafter, SpeculationConfig

logger = logging.getLogger("switchyard.xeon")

LINEARS = ("packed", "panel", "onednn", "stock")
"""Values of the ``linears`` engine option; the first is the default."""

FORWARDS = ("auto", "decoder", "transformers", "fallback")
"""Values of the ``forward`` engine option; ``fallback`` runs any model on the fallback path."""


@dataclass(frozen=True)
class ComputeThread:
    """Where the compute thread runs and with how many torch threads."""

    cpu: machine.CpuInfo
    placement: machine.CpuPlacement
    acceleration: Acceleration
    threads: int
    bind: bool
    """Pin the thread to ``placement.cpus`` (multi-node machines, threads within the node)."""
    why: str = ""
    """Where ``threads`` came from (the cores, a cgroup quota, the option), for the log."""
    share: bool = False
    """Lower the thread count while other processes use the engine's CPUs
    (:class:`~switchyard_xeon.cpu_share.CpuShare`)."""
    keep_freed: bool = True
    """Keep freed activation buffers for reuse (:func:`~switchyard_xeon.machine.keep_freed_memory`)."""


@dataclass(frozen=True)
class Precision:
    """The dtypes the model loads, computes and caches in."""

    dtype: torch.dtype
    """What the model loads in and its activations are (fp32 under bf16 dot products)."""
    cache_dtype: torch.dtype
    """The paged KV cache's dtype."""
    bf16_dot: bool
    """bf16 matmuls on the AVX512_BF16 dot-product panels over fp32 activations."""
    fp8: bool
    """``--quantize`` runs on FP8 PyTorch linears (:mod:`switchyard_xeon.fp8_linears`)."""
    w8a8: bool
    """``--quantize`` runs on the native W8A8 panels."""


@dataclass(frozen=True)
class Assembled:
    """What start-up hands the engine: the loaded model's parts that serve it."""

    info: ModelInfo
    runner: ModelRunner
    scheduler: Scheduler
    admission: Admission
    adapters: XeonAdapters | None = None


def place_compute_thread(config: EngineConfig) -> ComputeThread:
    """Read the CPU, choose its NUMA node and the thread count, detect IPEX.

    EngineStartError if the ``num_threads`` option is not an integer.
    """
    cpu = machine.read_cpu_info()
    placement = machine.choose_cpus()
    budget, why = machine.thread_budget(placement, machine.cgroup_cpu_limit())
    try:
        given = int(config.options.get("num_threads", 0) or 0)
    except ValueError:
        raise EngineStartError("xeon option num_threads must be an integer") from None
    threads, why = (given, "num_threads option") if given > 0 else (budget, why)
    # Pin only on multi-node machines, and only when the threads fit the node's cores:
    # more threads pinned to one node would share its cores while other nodes sit idle.
    bind = placement.should_bind and threads <= placement.physical_cores
    # A count the operator gave is kept; the default follows what other processes leave.
    share = (read_options.flag(config.options, "share_cpus", True) and given <= 0
             and threads > 1)
    keep = read_options.flag(config.options, "keep_freed_memory", True)
    return ComputeThread(cpu, placement, detect_acceleration(), threads, bind, why, share, keep)


def bind_compute_thread(placed: ComputeThread) -> None:
    """On the compute thread: pin it where chosen, set its torch threads, log the choice."""
    placement, threads, bind = placed.placement, placed.threads, placed.bind
    if bind:
        # Before the first parallel region: OpenMP workers inherit this thread's mask.
        try:
            os.sched_setaffinity(0, placement.cpus)
        except OSError as exc:  # e.g. the cgroup's cpuset changed: run unbound
            logger.warning("could not bind the compute thread to CPUs %s: %s",
                           machine.format_cpulist(placement.cpus), exc)
    # Intra-op thread settings are per thread for OpenMP: this is the compute thread.
    torch.set_num_threads(threads)
    if placed.keep_freed:
        kept = machine.keep_freed_memory()
        if kept:
            logger.info("xeon: memory: %s", kept)
    logger.info("xeon: %s: %d torch thread%s (%s%s) on %s%s; kernels: %s",
                placed.cpu.describe(), threads, "" if threads == 1 else "s", placed.why,
                "; fewer while other processes use these CPUs" if placed.share else "",
                placement.describe(), ", compute thread bound to them" if bind else "",
                placed.acceleration.describe())


def assemble(config: EngineConfig, method: QuantizationMethod | None,
             placed: ComputeThread) -> Assembled:
    """On the compute thread, after :func:`bind_compute_thread`: load the model, pack it,
    size the cache and build the runner, the scheduler and admission around them."""
    try:
        watermark = WatermarkConfig.from_env()
    except ValueError as exc:
        raise EngineStartError(str(exc)) from None
    method = serve_gguf_blocks(config, method, placed.cpu.flags)
    precision = choose_precision(config, method, placed.cpu.flags)
    dtype = precision.dtype
    kind, path = choose_model_path(config, method)
    loaded = load_model(config, method, precision, kind, path)
    path, alibi_forward = settle_path(loaded, kind, path)
    # The model's own cache holds what its attention computes.
    cache_dtype = precision.cache_dtype if path.paged else dtype
    statistics = convert_layers(loaded.model, config, method, precision)
    forward, kernel = fast_path(loaded.model, config.options, placed.cpu.flags,
                                precision.bf16_dot, None if precision.fp8 else method,
                                statistics, fallback=not path.paged)
    if alibi_forward is not None:  # transformers' forward would rebuild alibi and masks
        forward = alibi_forward
        logger.info("forward: the model's blocks with the engine's ALiBi attention "
                    "(switchyard_xeon/alibi_attention.py)")
    shape = cache_shape(loaded.model.config)
    limits, plan = resolve_limits(
        config, loaded.info, shape.bytes_per_token(cache_dtype),
        machine.available_memory_bytes(), placed.threads,
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
    # The prefill kernel comes with the decode one (attention=sdpa turns both off),
    # for fp32 activations (the fp32 and bf16-matmul modes) of the head sizes it has.
    prefill = load_kernels().prefill if (
        kernel is not None and dtype == torch.float32
        and shape.head_dim in attention.PREFILL_HEAD_DIMS) else None
    long_prefill = choose_long_prefill(config.options, loaded.model, precision,
                                       alibi=alibi_forward is not None)
    runner: ModelRunner
    if cache is None:
        fallback = vision.VisionRunner if kind is not None else FallbackRunner
        runner = fallback(loaded.model, blocks)
    else:
        logger.info("prefill attention: %s", (
            "SDPA per sequence" if prefill is None else "native paged kernel (C++)" + (
                f"; sequences of {long_prefill.pairs:,} query-key pairs or more take SDPA in "
                f"{str(long_prefill.dtype).removeprefix('torch.')}"
                if long_prefill is not None else "")))
        runner = (vision.PagedVisionRunner(forward, cache, blocks, loaded.model, kernel,
                                           prefill) if kind is not None
                  else ModelRunner(forward, cache, blocks, kernel, prefill, long_prefill))
    speculate = SpeculationConfig.from_options(config.options)
    if speculate.enabled and (cache is None or kind is not None):
        raise EngineStartError(
            f"engine option speculate={speculate.tokens}: speculative decoding runs on the "
            f"paged path of text models; this model runs on "
            f"{'the vision path' if kind is not None else 'transformers forward'}")
    drafter: Drafter | None = None
    draft_folder = config.options.get(draft_model.OPTION, "").strip()
    if draft_folder and not speculate.enabled:
        raise EngineStartError(f"engine option {draft_model.OPTION}={draft_folder} needs "
                               f"speculate=N (--speculate N), the drafts per step")
    if speculate.enabled:
        tiles = [m.row_tile for m in loaded.model.modules() if isinstance(m, PanelLinear)]
        if tiles:
            speculate = dataclasses.replace(speculate, verify_rows=min(tiles))
        if draft_folder:
            drafter = draft_model.DraftModel.load(Path(draft_folder), Path(config.model_path),
                                                  loaded.info.vocab_size)
        logger.info("speculation: %s drafts of up to %d tokens (%s), in steps of at most %d "
                    "sequences",
                    f"draft model {draft_folder}" if draft_folder else
                    f"n-gram (n {speculate.min_n}..{speculate.max_n})", speculate.tokens,
                    f"at most {speculate.verify_rows - 1} per step: the linear kernels' row "
                    f"tile" if tiles else "no row bound", speculate.max_batch)
    scheduler = Scheduler(limits, blocks, speculate, drafter)
    # LoRA adapters run on the hand-written decoder's layer loops (text models only).
    adapters = build_adapters(config, loaded.model,
                              forward if cache is not None and kind is None else None,
                              fp32_activations=precision.dtype == torch.float32,
                              bf16_dot=precision.bf16_dot)
    if adapters is not None:
        runner.adapters = adapters
        scheduler.gate = adapters.admit
    admission = Admission(limits, loaded.info.vocab_size, plan.capacity_tokens,
                          watermark, takes_images=loaded.info.takes_images, adapters=adapters)
    info = msgspec.structs.replace(
        loaded.info, max_total_tokens=limits.max_total_tokens,
        max_total_tokens_reason=max_total_reason(config, loaded.info, limits, plan))
    return Assembled(info, runner, scheduler, admission, adapters)


def serve_gguf_blocks(config: EngineConfig, method: QuantizationMethod | None,
                      cpu_flags: frozenset[str]) -> QuantizationMethod | None:
    """``method``, or None where it reads a GGUF folder's blocks (``config_quant_method``
    "gguf", which the gateway picks by itself) that the quantized panels cannot run here.

    No native kernels (a CPU without AVX2 + FMA), ``linears=stock`` or
    ``--dtype bfloat16`` without AVX512_BF16 would stop start-up for any
    weight-only method; such a folder holds every kept linear in float32
    too, the same values, so it serves those instead (logged), as it did
    before its blocks were kept.
    """
    if method is None or method.config_quant_method != "gguf":
        return method
    try:  # what choose_precision asks of a weight-only method
        quant_dtype.quantized_dtype(config, method, resolve_dtype(config.dtype, cpu_flags),
                                  bf16_dot_available(config.options),
                                  _option(config.options, "linears", LINEARS))
    except EngineStartError as exc:
        logger.info("xeon engine: --quantize %s: the GGUF blocks are served dequantized, from "
                    "the folder's float32 weights (the same values): %s", method.name,
                    str(exc).removeprefix("xeon engine: "))
        return None
    return method


def choose_precision(config: EngineConfig, method: QuantizationMethod | None,
                     cpu_flags: frozenset[str]) -> Precision:
    """The dtypes for ``--dtype`` and ``--quantize`` on this CPU and these kernels.

    EngineStartError where the method cannot run with the ``linears`` option or
    the dtype (the quantized module's checks).
    """
    dtype = resolve_dtype(config.dtype, cpu_flags)
    # bf16 where the kernels have AVX512_BF16 dot products: the linears are
    # bf16 matmuls on the engine's panels (bf16 weights and inputs, fp32 sums),
    # the KV cache is bf16, and everything else (norms, rotary, attention's
    # arithmetic, the residual stream) stays fp32, so the model loads in fp32
    # and its linears are rounded to bf16 as they are packed.
    # FP8 runs on its own PyTorch linears (fp8_linears), not the W8A8 panels.
    fp8 = fp8_linears.runs_fp8(method)
    w8a8 = method is not None and not fp8 and quantized.runs_w8a8(method)
    linears = _option(config.options, "linears", LINEARS)
    # FP8's linears take fp32 or bf16 inputs: the dtype asked for stands.
    if w8a8:
        if linears not in ("packed", "panel"):
            raise EngineStartError(f"xeon engine: --quantize {method.name} runs on the native "
                                   f"W8A8 panels, which linears={linears} rules out")
        dtype = quant_dtype.w8a8_dtype(config, method, dtype)
        if dtype == torch.bfloat16 and not bf16_dot_available(config.options):
            dtype = torch.float32  # the linears take fp32 inputs either way
    elif method is not None and not fp8:
        dtype = quant_dtype.quantized_dtype(config, method, dtype,
                                          bf16_dot_available(config.options), linears)
    bf16_dot = dtype == torch.bfloat16 and bf16_dot_available(config.options)
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
    return Precision(dtype, cache_dtype, bf16_dot, fp8, w8a8)


def bf16_dot_available(options: dict[str, str]) -> bool:
    """Whether bf16 runs on the bf16 dot-product panels: the kernels have them, linears allow."""
    linears = _option(options, "linears", LINEARS)
    return linears in ("packed", "panel") and load_kernels().bf16_dot


def choose_model_path(config: EngineConfig, method: QuantizationMethod | None,
                      ) -> tuple[vision.VisionArchitecture | None, ForwardPath]:
    """Whether the folder holds a vision-language model, and its path, before loading.

    Paged attention or the fallback is decided before loading: a model class
    that does not know the engine's attention name fails inside transformers
    when given it. A vision-language model (Llava-Next, Llava) runs its text
    model on the paged path and its images as input embeddings
    (:mod:`switchyard_xeon.vision`). EngineStartError for a quantized one.
    """
    kind = vision.vision_model(config.model_path)
    if kind is not None and method is not None:
        raise EngineStartError(f"xeon engine: --quantize {method.name} is not supported for "
                               f"{kind.class_name} (vision-language) models yet")
    forced = _option(config.options, "forward", FORWARDS) == "fallback"
    path = (vision.choose_vision_path(config.model_path, kind, forced)
            if kind is not None else choose_path(config.model_path,
                                                 forced_fallback=forced))
    return kind, path


def load_model(config: EngineConfig, method: QuantizationMethod | None, precision: Precision,
               kind: vision.VisionArchitecture | None, path: ForwardPath) -> LoadedModel:
    """Load the model in ``precision.dtype`` with the attention ``path`` needs.

    A checkpoint method's layers come quantized from the folder; under bf16 dot
    products the info says bfloat16, what the user asked for and what the
    matmuls compute in.
    """
    dtype = precision.dtype
    # ALiBi models load with their own attention; alibi_attention replaces it later.
    attn_name = attention.register() if path.paged and not path.alibi else None
    logger.info("loading %s as %s", config.model_path, str(dtype).removeprefix("torch."))
    if method is not None and method.load is not None:
        # A checkpoint method: its layers come quantized from the folder, the rest float.
        from switchyard_engine.checkpoint import load_quantized_causal_lm

        loaded, checkpoint = load_quantized_causal_lm(
            config.model_path, method, config.options,
            dtype=str(dtype).removeprefix("torch."), attn_implementation=attn_name)
        logger.info("--quantize %s: %s", method.name, checkpoint.source)
    elif kind is not None:
        loaded = vision.load_vision_lm(config.model_path, kind,
                                       str(dtype).removeprefix("torch."), attn_name)
    else:
        loaded = load_causal_lm(
            config.model_path,
            dtype=str(dtype).removeprefix("torch."),
            attn_implementation=attn_name,
        )
    if precision.bf16_dot:  # what the user asked for, and what the matmuls compute in
        loaded = dataclasses.replace(
            loaded, info=msgspec.structs.replace(loaded.info, dtype="bfloat16"))
    logger.info("loaded %s model in %.2fs", loaded.info.model_type, loaded.seconds)
    return loaded


def settle_path(loaded: LoadedModel, kind: vision.VisionArchitecture | None,
                path: ForwardPath) -> tuple[ForwardPath, alibi_attention.AlibiForward | None]:
    """The path as the loaded modules allow, with the ALiBi forward installed where it runs.

    What only the modules show (attention sinks) sends a paged model to the
    fallback, on transformers' default attention. Logs the path.
    """
    # What the paged path runs: a vision model's text model, as its causal LM class.
    causal = vision.text_causal_lm(loaded.model) if kind is not None else loaded.model
    if path.paged and (why := loaded_model_unsupported(causal)):
        path = ForwardPath(False, why)  # what only the modules show (attention sinks)
        use_default_attention(loaded.model)
    alibi_forward = alibi_attention.install(loaded.model) if path.alibi else None
    if path.paged:
        check_supported(causal)
    logger.info("path: %s; attention %s", path.describe(),
                "switchyard_xeon" if path.paged else loaded.model.config._attn_implementation)
    return path, alibi_forward


def convert_layers(model: torch.nn.Module, config: EngineConfig,
                   method: QuantizationMethod | None,
                   precision: Precision) -> dict[str, ActivationStatistics] | None:
    """Group experts, calibrate (W8A8, FP8) and turn the linears into FP8 ones (FP8).

    Returns the calibration statistics the packing of W8A8 linears takes (None
    without calibration).
    """
    # Mixture-of-experts layers as linears the packing takes (switchyard_xeon/moe.py).
    moe_report = group_experts(model, _option(config.options, "moe", MOE_CHOICES),
                               f"--quantize {method.name}" if method is not None else "")
    if moe_report.describe():
        logger.info("mixture of experts: %s", moe_report.describe())
    statistics = None
    if method is not None and method.calibration is not None and (precision.w8a8 or precision.fp8):
        from switchyard_engine.calibration import calibrate

        statistics, line = calibrate(model, config.model_path,
                                     method.calibration, config.options, method.name)
        logger.info("--quantize %s: %s", method.name, line)
    if precision.fp8:  # the linears become FP8 ones here; the packing finds none left
        logger.info("--quantize %s: %s", method.name, fp8_linears.pack_fp8_linears(
            model, method, statistics, config.options))
    return statistics


SDPA_PREFILL_PAIRS = 512 * 512
"""Query-key pairs from which a prefill sequence leaves the native kernel for SDPA
(:class:`~switchyard_xeon.attention.LongPrefill`): a 512-token prompt."""


def choose_long_prefill(options: dict[str, str], model: torch.nn.Module, precision: Precision,
                        alibi: bool) -> attention.LongPrefill | None:
    """Which prefill sequences take SDPA instead of the native kernel (option
    ``sdpa_prefill_pairs``, 0: none). Not for soft-capped or ALiBi attention, which
    SDPA cannot express and the kernel computes exactly."""
    pairs = int(read_options.number(options, "sdpa_prefill_pairs", int, SDPA_PREFILL_PAIRS, 0))
    softcap = getattr(getattr(model, "config", None), "attn_logit_softcapping", None)
    if not pairs or alibi or softcap:
        return None
    return attention.LongPrefill(pairs, torch.bfloat16 if precision.bf16_dot else torch.float32)


def fast_path(model: torch.nn.Module, options: dict[str, str], cpu_flags: frozenset[str],
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
    weights (where they are missing, the AVX2 + FMA panels do, in fp32
    math), and a W8A8 method's (quantized with the calibration
    ``statistics``) run on the W8A8 panels; ``panel``: the panel kernel for
    fp32 whatever the CPU; ``onednn``: oneDNN for fp32 and bf16 alike;
    ``stock``: fused but not packed), ``panel_storage`` (``auto``:
    panels of weights that hold only bf16 values, as a bf16 checkpoint
    loaded in fp32 does, are stored as bf16, exactly; ``float32``: never),
    ``gemm_rows`` (the row count from which the dot-product panels take
    AMX, measured here when unset: :mod:`switchyard_xeon.gemm_rows`),
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
    linears = _option(options, "linears", LINEARS)
    mode = _option(options, "attention", ("auto", "sdpa"))
    forward_mode = _option(options, "forward", FORWARDS)
    storage = _option(options, "panel_storage", ("auto", "float32"))
    status = load_kernels()
    # The fp32 panel kernel is AVX2/FMA code: on Intel's AVX-512 cores oneDNN
    # has twice its width. bf16 dot products beat both where the CPU has them.
    # The loaded level decides, so SWITCHYARD_XEON_ISA=avx2 runs as an AVX2 CPU does.
    avx2_only = status.variant == "avx2"
    w8a8 = quantization is not None and quantized.runs_w8a8(quantization)
    # Weight-only quantized weights without bf16 dot products run on the AVX2 + FMA panels.
    fma = quantization is not None and not bf16_dot and status.quant_fma
    report = pack_linears(model, pack=linears != "stock",
                          panels=status.fn is not None and (
                              bf16_dot or w8a8 or fma or linears == "panel"
                              or (linears == "packed" and avx2_only)),
                          narrow=storage == "auto", bf16_dot=bf16_dot,
                          quantization=quantization, statistics=statistics,
                          options=dict(options))
    logger.info("linears: %s", report.describe())
    logger.info("linear weights: %s", weight_memory(model))
    crossover = choose_crossover(model, options)
    if crossover is not None:
        logger.info("many-row linears: %s", crossover.describe())
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


def _option(options: dict[str, str], name: str, choices: tuple[str, ...]) -> str:
    """The engine option ``name`` (default: the first choice); EngineStartError if not a choice."""
    value = str(options.get(name, choices[0])).lower()
    if value not in choices:
        raise EngineStartError(
            f"xeon option {name} must be {' or '.join(choices)}, not {value!r}")
    return value
