"""Native CPU kernels of the Xeon engine, built on first use for the machine that runs them.

Ten sources, one library, registered as ``switchyard_xeon::*`` torch operators:

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
  scales (``--quantize int8``, :mod:`switchyard_xeon.quantized`);
- ``panel_dot_uint4.cpp``: the same dot products over uint4 weights with a
  scale and zero point per group along K (``--quantize int4``);
- ``panel_w8a8.cpp``: W8A8 linears (``--quantize smoothquant``): int8
  activations quantized per call, int32 sums on AMX, AVX512-VNNI, AVX2 or
  scalar code, whichever the build and the CPU have;
- ``panel_quant_fma.cpp``: the same weight-only formats (int8, uint4) and
  FP8 E4M3 in fp32 math on AVX2 + FMA, for CPUs without AVX512_BF16;
- ``decode_layers.cpp``: all decoder layers of a decode step in one call, the
  same kernels chained from C++ (``ops.h`` declares them).
- ``token_mask.cpp``: :class:`TokenMaskFn`, constrained rows' grammar
  bitmasks written onto fp32 logits as -inf in one pass (AVX-512 masked
  stores; a bit loop elsewhere).

They are compiled with ``torch.utils.cpp_extension`` for this CPU
(``-march=native``: AVX-512 where there is some) into torch's extension cache,
once per machine and source version (about 30 s of CPU; later starts load the
cached library).

A machine without a C++ compiler still serves: :func:`load_kernels` returns
no kernels with the reason, attention takes the portable SDPA path and the
decoder the PyTorch ops of :class:`~switchyard_xeon.kernels.reference.TorchFusedOps`.
The built kernels are checked against those paths (:mod:`~switchyard_xeon.kernels.checks`)
before they are trusted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

logger = logging.getLogger("switchyard.xeon")

_SOURCES = tuple(Path(__file__).with_name(n) for n in ("paged_attention.cpp", "fused_ops.cpp",
                                                                "paged_prefill.cpp",
                                                                "panel_gemm.cpp",
                                                                "panel_dot_bf16.cpp",
                                                                "panel_dot_uint4.cpp",
                                                                "panel_w8a8.cpp",
                                                                "panel_quant_fma.cpp",
                                                                "decode_layers.cpp",
                                                                "token_mask.cpp"))
_HEADERS = (Path(__file__).with_name("ops.h"),)
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]

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
    """Grammar bitmasks onto logits, as :func:`switchyard.engine.grammar.mask_logits` defines it."""

    def __call__(self, logits: torch.Tensor, words: torch.Tensor,
                 index: torch.Tensor) -> list[int]:
        """Set ``logits[index[j], t]`` to -inf wherever bit ``t`` of ``words[j]`` is 0, in
        place; rows allowing no token are left alone and their positions returned."""
        ...


def native_token_mask(logits: torch.Tensor, words: torch.Tensor, index: torch.Tensor) -> list[int]:
    """:class:`TokenMaskFn` on ``token_mask.cpp`` for fp32 logits rows with unit stride;
    other logits take :func:`switchyard.engine.grammar.mask_logits`."""
    if logits.dtype != torch.float32 or logits.stride(-1) != 1 or logits.dim() != 2:
        from switchyard.engine.grammar import mask_logits

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


_lock = threading.Lock()
_status: KernelStatus | None = None


def load_kernels() -> KernelStatus:
    """Build (or load from the cache) and check the native kernels; never raises.

    The first call in a process does the work; later calls return its result.
    ``SWITCHYARD_XEON_KERNELS=0`` turns them off.
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
        op = _build()
    except Exception as exc:  # no compiler, no ninja, odd platform: serve without it
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return KernelStatus(None, f"native kernels unavailable ({first[:200]})")
    from switchyard_xeon.kernels import checks

    error = (checks.check_decode(op) or checks.check_fused(NativeFusedOps())
             or checks.check_panels())
    if error:
        return KernelStatus(None, f"native kernels failed their check ({error})")
    # Only a build for a CPU with AVX512_BF16 registers the dot-product packers.
    ops = torch.ops.switchyard_xeon
    bf16_dot = hasattr(ops, "pack_panels_bf16_dot")
    dot_error = checks.check_bf16_dot() if bf16_dot else ""
    if dot_error:
        logger.warning("bf16 dot-product panels failed their check, not used: %s", dot_error)
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
    return KernelStatus(op, "native paged attention (C++)", NativeFusedOps(), prefill=prefill,
                        bf16_dot=bf16_dot and not dot_error,
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


def _build() -> PagedDecodeFn:
    """Compile the extension into torch's extension cache and return the operator."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    source = b"".join(path.read_bytes() for path in _SOURCES + _HEADERS)
    # -march=native code is only valid on CPUs like this one: the name carries the
    # source, the flags and the CPU's features, so a shared cache never mixes them up.
    key = hashlib.sha256(
        source + " ".join(_CFLAGS).encode() + _cpu_signature().encode() + torch.__version__.encode()
    ).hexdigest()[:12]
    logger.info("building native kernels (once per machine; cached by torch)")
    cpp_extension.load(
        name=f"switchyard_xeon_kernels_{key}",
        sources=[str(path) for path in _SOURCES],
        extra_cflags=_CFLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.switchyard_xeon.paged_decode_attention


def _ninja_on_path() -> None:
    """torch builds with ninja: put the one from the ``ninja`` wheel on PATH if it is there."""
    try:
        import ninja  # the wheel ships the binary; a venv's bin/ need not be on PATH
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()
