"""Native CPU kernels of the Xeon engine, built on first use for the machine that runs them.

Twelve sources and two headers, one library per ISA level, registered as ``switchyard_xeon::*`` torch operators:

- ``paged_attention.cpp``: :data:`PagedDecodeFn`, decode attention that walks
  the block tables of the paged cache in place;
- ``paged_prefill.cpp``: :data:`PagedPrefillFn`, causal attention of prefill
  rows over the same cache (AVX-512 builds; elsewhere prefill takes SDPA);
- ``fused_ops.cpp``: the fused steps of a Llama-family layer the hand-written
  decoder (:mod:`switchyard_xeon.decoder`) calls (:class:`FusedOps`);
- ``panel_gemm.cpp``: fp32 linears over weights packed in panels of 16 output
  features, stored as fp32 or bf16 (:class:`~switchyard_xeon.linears.PanelLinear`);
- ``panel_dot_bf16.cpp``: bf16 linears (bf16 weights and inputs, fp32 sums)
  on CPUs with AVX512_BF16, the same panels in the k-pair order of its
  dot-product instruction, and the same over int8 weights with per-feature
  scales (``--quantize int8``, :mod:`switchyard_xeon.quantized`); calls of
  many rows on AMX tiles over the same panels where the CPU has AMX
  (:mod:`~switchyard_xeon.gemm_rows` measures from how many);
- ``panel_dot_uint4.cpp``: the same dot products over uint4 weights with a
  scale and zero point per group along K (``--quantize int4``);
- ``panel_w8a8.cpp``: W8A8 linears (``--quantize smoothquant``): int8
  activations quantized per call, int32 sums on AMX, AVX512-VNNI, AVX2 or
  scalar code, whichever the build and the CPU have;
- ``panel_quant_fma.cpp``: the same weight-only formats (int8, uint4) and
  FP8 E4M3 in fp32 math on AVX2 + FMA, for CPUs without AVX512_BF16;
- ``decode_layers.cpp``: all decoder layers of a decode step in one call, the
  same kernels chained from C++ (``ops.h`` declares them), LoRA deltas included;
- ``lora.cpp``: each row's LoRA adapter over a projection, rows grouped by
  adapter (:mod:`switchyard_xeon.native_lora`);
- ``token_mask.cpp``: :class:`TokenMaskFn`, constrained rows' grammar
  bitmasks written onto fp32 logits as -inf in one pass (AVX-512 masked
  stores; a bit loop elsewhere);
- ``build_info.cpp``: the library's ISA level and the hash of its sources.

They are compiled when the package is built (``setup.py``), not when it
serves: once per ISA level of :mod:`~switchyard_xeon.isa` (AVX2 + FMA,
AVX-512 with VNNI, AVX512_BF16 with AMX), each level a library of its own.
:func:`load_kernels` reads the CPU's features, opens the best library this CPU
can run (``SWITCHYARD_XEON_ISA`` caps it), and never invokes a compiler: a
missing, unreadable or stale library (built from other sources than those
beside it) is reported and the engine serves on the PyTorch path instead.

Without kernels (a CPU below AVX2, a library that is missing or refused)
:func:`load_kernels` returns none with the reason: attention takes the portable
SDPA path and the decoder the PyTorch ops of
:class:`~switchyard_xeon.kernels.reference.TorchFusedOps`.
The built kernels are checked against those paths (:mod:`~switchyard_xeon.kernels.checks`)
before they are trusted.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from switchyard_xeon import isa

logger = logging.getLogger("switchyard.xeon")

_FOLDER = Path(__file__).resolve().parent
REBUILD = "pip install --no-build-isolation -e plugins/xeon (make kernels)"
"""How a source checkout rebuilds the libraries, for the messages that need it."""
LIBRARY_ENV = "SWITCHYARD_XEON_LIBRARY"
"""A library built elsewhere from these sources, opened instead of the chosen level's
(``benchmarks/kernels/build_native.py`` makes a ``-march=native`` one, to compare)."""


class PagedDecodeFn(Protocol):
    """Paged decode attention (``paged_attention.cpp``, or its reference in PyTorch)."""

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 window: int, softcap: float = 0.0,
                 alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        """``q`` [B, H, D] over each row's first ``context_lens[b]`` cached tokens -> [B, H, D].

        ``block_tables`` int32 [B, n], ``context_lens`` int32 [B]; ``window`` 0
        means no sliding window; ``softcap`` > 0 soft-caps the scaled scores
        (``softcap * tanh(s / softcap)``); ``alibi_slopes`` (fp32 [H]) adds
        ``slope[h] * (j - i)`` for key position ``j`` and query position ``i``.
        """
        ...


class PagedPrefillFn(Protocol):
    """Paged prefill attention (``paged_prefill.cpp``, or its reference in PyTorch)."""

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                 query_starts: torch.Tensor, query_lens: torch.Tensor, scale: float,
                 window: int, softcap: float = 0.0,
                 alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        """``q`` fp32 [T, H, D] -> [T, H, D]: sequence ``s``'s rows attend causally over its cache.

        ``block_tables`` int32 [S, n], ``context_lens``, ``query_starts`` and
        ``query_lens`` int32 [S]; the rows include their own keys (see
        :func:`~switchyard_xeon.kernels.reference.paged_prefill_reference`);
        ``window``, ``softcap`` and ``alibi_slopes`` as :class:`PagedDecodeFn`
        takes them.
        """
        ...


class FusedOps(Protocol):
    """The fused steps of a Llama-family decoder layer, on row-major [tokens, n] tensors.

    Implemented natively (``fused_ops.cpp``) and in PyTorch
    (:class:`~switchyard_xeon.kernels.reference.TorchFusedOps`); both follow
    transformers' op order and rounding.
    """

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """A new tensor: ``weight * x * rsqrt(mean(x^2) + eps)`` per row (RMSNorm)."""
        ...

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> None:
        """In place: ``residual += x``, then ``x = rms_norm(residual, weight, eps)``."""
        ...

    def rotary_store_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                      heads: int, kv_heads: int) -> None:
        """Rotate ``qkv``'s query and key heads in place; store its keys and values.

        ``qkv`` is [T, (heads + 2 kv_heads) * head_dim] (queries, keys, values);
        ``cos``/``sin`` are [T, R] from the model's rotary module (the first R
        dims of each head rotate, transformers' rotate-half convention); token
        ``t``'s key and value go to slot ``slots[t]`` (int64) of the
        [kv_heads, blocks, block_size, head_dim] pools.
        """
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """A new [T, n] tensor ``silu(x[:, :n]) * x[:, n:]`` for ``x`` [T, 2n]."""
        ...


class TokenMaskFn(Protocol):
    """Grammar bitmasks onto logits, as :func:`switchyard_engine.grammar.mask_logits` defines it."""

    def __call__(self, logits: torch.Tensor, words: torch.Tensor,
                 index: torch.Tensor) -> list[int]:
        """Set ``logits[index[j], t]`` to -inf wherever bit ``t`` of ``words[j]`` is 0, in
        place; rows allowing no token are left alone and their positions returned."""
        ...


def native_token_mask(logits: torch.Tensor, words: torch.Tensor, index: torch.Tensor) -> list[int]:
    """:class:`TokenMaskFn` on ``token_mask.cpp`` for fp32 logits rows with unit stride;
    other logits take :func:`switchyard_engine.grammar.mask_logits`."""
    if logits.dtype != torch.float32 or logits.stride(-1) != 1 or logits.dim() != 2:
        from switchyard_engine.grammar import mask_logits

        return mask_logits(logits, words, index)
    dead = torch.ops.switchyard_xeon.mask_logits_.default(
        logits, words.contiguous(), index.to(torch.long))
    return dead.nonzero().flatten().tolist()


class NativeFusedOps:
    """:class:`FusedOps` backed by the operators ``fused_ops.cpp`` registers."""

    def __init__(self) -> None:
        ops = torch.ops.switchyard_xeon
        # The overloads themselves: calling the packet resolves the overload on every call.
        self.rms_norm = ops.rms_norm.default
        self.add_rms_norm_ = ops.add_rms_norm_.default
        self.rotary_store_ = ops.rotary_store_.default
        self.silu_and_mul = ops.silu_and_mul.default


@dataclass(frozen=True)
class KernelStatus:
    """Which native kernels are in use, and why (for the start-up log)."""

    fn: PagedDecodeFn | None
    reason: str
    fused: FusedOps | None = None
    prefill: PagedPrefillFn | None = None
    """Paged prefill attention (AVX-512 builds, head_dim 64 or 128), checked; None elsewhere."""
    bf16_dot: bool = False
    """The dot-product panels (bf16 and int8 weights) exist (built for a CPU with
    AVX512_BF16) and passed their check."""
    bf16_amx: bool = False
    """Those panels run calls of many rows on AMX (tdpbf16ps over the same panels):
    the CPU has AMX-BF16 and the kernel granted the tiles; checked on both paths."""
    uint4_dot: bool = False
    """The uint4 dot-product panels exist (the same build) and passed their check."""
    quant_fma: bool = False
    """The AVX2 + FMA panels over int8, uint4 and FP8 weights (fp32 math) exist and
    passed their check."""
    w8a8: str = ""
    """The W8A8 int8 panels' paths in this process (e.g. "amx (tdpbusd) from 32 rows,
    avx512-vnni (vpdpbusd) below"), checked; '' when they are missing or failed."""
    token_mask: TokenMaskFn | None = None
    """Grammar bitmasks onto fp32 logits in one pass (``token_mask.cpp``), checked."""
    lora: bool = False
    """The grouped LoRA product (``lora.cpp``, inside ``decode_layers`` too) passed its check."""
    variant: str = isa.NONE
    """The ISA level of the library in use (:data:`~switchyard_xeon.isa.VARIANTS`),
    or ``none``."""


_lock = threading.Lock()
_status: KernelStatus | None = None


def load_kernels() -> KernelStatus:
    """Open the library for this CPU and check its kernels; never raises, never compiles.

    The first call in a process does the work; later calls return its result.
    ``SWITCHYARD_XEON_KERNELS=0`` turns them off; ``SWITCHYARD_XEON_ISA`` caps the level.
    """
    global _status
    with _lock:
        if _status is None:
            _status = _load()
        return _status


def _load() -> KernelStatus:
    if os.environ.get("SWITCHYARD_XEON_KERNELS", "1").lower() in ("0", "false", "off", "no"):
        return KernelStatus(None, "disabled by SWITCHYARD_XEON_KERNELS")
    try:
        choice = isa.choose()
    except ValueError as exc:
        return KernelStatus(None, f"native kernels not used: {exc}")
    if choice.variant is None:
        return KernelStatus(None, f"native kernels not used: {choice.reason}")
    opened = _open(choice)
    if isinstance(opened, str):
        return KernelStatus(None, opened)
    variant, why = opened
    op = torch.ops.switchyard_xeon.paged_decode_attention
    from switchyard_xeon.kernels import checks

    error = (checks.check_decode(op) or checks.check_fused(NativeFusedOps())
             or checks.check_panels())
    if error:
        return KernelStatus(None, f"native kernels ({variant.name}) failed their check ({error})")
    # Only a build for a CPU with AVX512_BF16 registers the dot-product packers.
    ops = torch.ops.switchyard_xeon
    bf16_dot = hasattr(ops, "pack_panels_bf16_dot")
    dot_error = checks.check_bf16_dot() if bf16_dot else ""
    if dot_error:
        logger.warning("bf16 dot-product panels failed their check, not used: %s", dot_error)
    bf16_amx = bf16_dot and not dot_error and checks.amx_rows() >= 0
    uint4_dot = bf16_dot and not dot_error and hasattr(ops, "pack_panels_uint4_dot")
    uint4_error = checks.check_uint4_dot() if uint4_dot else ""
    if uint4_error:
        logger.warning("uint4 dot-product panels failed their check, not used: %s", uint4_error)
    quant_fma = hasattr(ops, "pack_panels_quant_fma")
    fma_error = checks.check_quant_fma() if quant_fma else ""
    if fma_error:
        logger.warning("quantized fma panels failed their check, not used: %s", fma_error)
    prefill = None
    if hasattr(ops, "paged_prefill_attention"):
        prefill = ops.paged_prefill_attention.default
        prefill_error = checks.check_prefill(prefill)
        if prefill_error:
            logger.warning("paged prefill attention failed its check, not used: %s",
                           prefill_error)
            prefill = None
    w8a8 = ""
    if hasattr(ops, "pack_panels_w8a8"):
        w8a8_error = checks.check_w8a8()
        if w8a8_error:
            logger.warning("W8A8 panels failed their check, not used: %s", w8a8_error)
        else:
            w8a8 = _w8a8_paths(ops.w8a8_paths())
    token_mask = native_token_mask
    mask_error = checks.check_token_mask(token_mask)
    if mask_error:
        logger.warning("grammar token mask failed its check, not used: %s", mask_error)
        token_mask = None
    lora_error = checks.check_lora()
    if lora_error:
        logger.warning("LoRA product failed its check, not used: %s", lora_error)
    return KernelStatus(op, f"native kernels for {variant.name} ({why})", NativeFusedOps(),
                        prefill=prefill, variant=variant.name, lora=not lora_error,
                        bf16_dot=bf16_dot and not dot_error, bf16_amx=bf16_amx,
                        uint4_dot=uint4_dot and not uint4_error,
                        quant_fma=quant_fma and not fma_error, w8a8=w8a8,
                        token_mask=token_mask)


W8A8_AMX_MIN_ROWS = 16
"""``panel_w8a8.cpp``'s ``kAmxMinRows``: calls of this many rows take AMX where it is."""


def _w8a8_paths(bits: int) -> str:
    """How the W8A8 panels run here, for the start-up log, from ``w8a8_paths()``'s bits."""
    from switchyard_xeon.quantized import W8A8_PATHS

    small = next(W8A8_PATHS[p] for p in (2, 3, 4) if bits >> p & 1)
    if bits >> 1 & 1:
        return f"{W8A8_PATHS[1]} from {W8A8_AMX_MIN_ROWS} rows, {small} below"
    return small


def _open(choice: isa.Choice) -> tuple[isa.Variant, str] | str:
    """Load the chosen variant's library, or the best lower one that was built.

    Returns the variant opened and why it was chosen, or why none could be (a
    library that will not load, or one built from other sources than these).
    """
    assert choice.variant is not None
    override = os.environ.get(LIBRARY_ENV)
    if override:
        return _open_override(Path(override), choice.variant)
    below = isa.VARIANTS[: isa.VARIANTS.index(choice.variant) + 1]
    built = [v for v in reversed(below) if isa.library_path(v, _FOLDER) is not None]
    if not built:
        return (f"native kernels not built for {choice.variant.name} or below (a source "
                f"checkout builds them with `{REBUILD}`)")
    variant = built[0]
    why = choice.reason if variant is choice.variant else (
        f"{choice.variant.name} was not built; the best built level this CPU runs")
    path = isa.library_path(variant, _FOLDER)
    assert path is not None
    failed = _load_library(path)
    if failed:
        return f"native kernels for {variant.name} not used: {failed}"
    ops = torch.ops.switchyard_xeon
    built_isa, built_from = ops.build_isa(), ops.build_source_hash()
    if built_isa != variant.name:
        return f"native kernels: {path.name} says it was built for {built_isa}, not {variant.name}"
    if any(_FOLDER.glob("*.cpp")) and built_from != isa.source_hash(_FOLDER):
        return (f"native kernels for {variant.name} are older than their sources, not used "
                f"(rebuild: `{REBUILD}`)")
    return variant, why


def _open_override(path: Path, best: isa.Variant) -> tuple[isa.Variant, str] | str:
    """Open ``SWITCHYARD_XEON_LIBRARY`` (it must come from these sources; the CPU's best
    level stands for it in what the engine decides)."""
    failed = _load_library(path)
    if failed:
        return f"native kernels: {LIBRARY_ENV} not used: {failed}"
    ops = torch.ops.switchyard_xeon
    if ops.build_source_hash() != isa.source_hash(_FOLDER):
        return f"native kernels: {LIBRARY_ENV}={path} was built from other sources"
    return best, f"{LIBRARY_ENV}={path}, built as {ops.build_isa()}"


def _load_library(path: Path) -> str:
    """Open the library at `path` into this process; why not, or '' when it loaded."""
    short = _truncated(path)
    if short:
        return f"{path.name} {short}"
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"{path.name} did not load ({first[:200]})"
    return ""


_ELF64_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_ELF64_PROGRAM_HEADER = struct.Struct("<IIQQQQQQ")


def _truncated(path: Path) -> str:
    """Why `path` is not a whole 64-bit ELF library ('' when it is).

    The loader maps a library's segments from its file: opening one cut short (a build
    or copy killed half way) kills the process with SIGBUS instead of raising, so
    the file is measured against its own headers first.
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read(_ELF64_HEADER.size)
            if len(data) < _ELF64_HEADER.size or not data.startswith(b"\x7fELF\x02"):
                return "is not a 64-bit ELF file"
            (_, _, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
             _) = _ELF64_HEADER.unpack(data)
            need = max(shoff + shnum * shentsize, phoff + phnum * phentsize)
            fh.seek(phoff)
            table = fh.read(phnum * phentsize)
            if len(table) < phnum * phentsize:
                return "is cut short (its program headers are missing)"
            for i in range(phnum):
                fields = _ELF64_PROGRAM_HEADER.unpack_from(table, i * phentsize)
                need = max(need, fields[2] + fields[5])  # p_offset + p_filesz
            size = os.fstat(fh.fileno()).st_size
    except OSError as exc:
        return f"cannot be read ({exc})"
    return "" if size >= need else f"is cut short ({size} of {need} bytes)"
