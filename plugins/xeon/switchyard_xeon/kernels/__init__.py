"""Native CPU kernels of the Xeon engine, built on first use for the machine that runs them.

Six sources, one library, registered as ``switchyard_xeon::*`` torch operators:

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
  scales (``--quantize int8``, :mod:`switchyard_xeon.quantization`);
- ``decode_layers.cpp``: all decoder layers of a decode step in one call, the
  same kernels chained from C++ (``ops.h`` declares them).

They are compiled with ``torch.utils.cpp_extension`` for this CPU
(``-march=native``: AVX-512 where there is some) into torch's extension cache,
once per machine and source version (about 30 s of CPU; later starts load the
cached library).

A machine without a C++ compiler still serves: :func:`load_kernels` returns
no kernels with the reason, attention takes the portable SDPA path and the
decoder the PyTorch ops of :class:`~switchyard_xeon.kernels.reference.TorchFusedOps`.
The built kernels are checked against those paths before they are trusted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

logger = logging.getLogger("switchyard.xeon")

_SOURCES = tuple(Path(__file__).with_name(n) for n in ("paged_attention.cpp", "fused_ops.cpp",
                                                                "paged_prefill.cpp",
                                                                "panel_gemm.cpp",
                                                                "panel_dot_bf16.cpp",
                                                                "decode_layers.cpp"))
_HEADERS = (Path(__file__).with_name("ops.h"),)
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]

PagedDecodeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int],
    torch.Tensor,
]
"""``(q [B, H, D], k_pool, v_pool, block_tables int32 [B, n], context_lens int32 [B],
scale, window) -> [B, H, D]``; ``window`` 0 means no sliding window."""

PagedPrefillFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
     torch.Tensor, float, int],
    torch.Tensor,
]
"""``(q fp32 [T, H, D], k_pool, v_pool, block_tables int32 [S, n], context_lens int32 [S],
query_starts int32 [S], query_lens int32 [S], scale, window) -> [T, H, D]``: sequence
``s``'s rows of ``q`` attend causally over its cached context, their own keys included
(see :func:`~switchyard_xeon.kernels.reference.paged_prefill_reference`)."""


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
    error = _self_check(op) or _self_check_fused(NativeFusedOps()) or _self_check_panels()
    if error:
        return KernelStatus(None, f"native kernels failed their check ({error})")
    # Only a build for a CPU with AVX512_BF16 registers the bf16 dot-product packer.
    bf16_dot = hasattr(torch.ops.switchyard_xeon, "pack_panels_bf16_dot")
    dot_error = _self_check_bf16_dot() if bf16_dot else ""
    if dot_error:
        logger.warning("bf16 dot-product panels failed their check, not used: %s", dot_error)
    prefill = None
    if hasattr(torch.ops.switchyard_xeon, "paged_prefill_attention"):
        prefill = torch.ops.switchyard_xeon.paged_prefill_attention.default
        prefill_error = _self_check_prefill(prefill)
        if prefill_error:
            logger.warning("paged prefill attention failed its check, not used: %s",
                           prefill_error)
            prefill = None
    return KernelStatus(op, "native paged attention (C++)", NativeFusedOps(), prefill=prefill,
                        bf16_dot=bf16_dot and not dot_error)


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


def _self_check(op: PagedDecodeFn) -> str:
    """Compare the attention kernel with plain SDPA on a small scattered cache; '' when they agree."""
    from switchyard_xeon.kernels.reference import paged_decode_reference

    gen = torch.Generator().manual_seed(0)
    cases = ((torch.float32, torch.float32, 64, 0, 1e-4),
             (torch.bfloat16, torch.bfloat16, 80, 7, 2e-2),
             (torch.float32, torch.bfloat16, 64, 5, 1e-4))  # bf16 pools under an fp32 q
    for dtype, pool_dtype, dim, window, tol in cases:
        kv_heads, heads, blocks, size = 2, 6, 12, 4
        k = torch.randn(kv_heads, blocks, size, dim, generator=gen).to(pool_dtype)
        v = torch.randn(kv_heads, blocks, size, dim, generator=gen).to(pool_dtype)
        q = torch.randn(3, heads, dim, generator=gen).to(dtype)
        tables = torch.tensor([[5, 2, 9], [1, 0, 0], [11, 3, 7]], dtype=torch.int32)
        lens = torch.tensor([10, 3, 12], dtype=torch.int32)
        try:
            got = op(q, k, v, tables, lens, dim**-0.5, window)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        want = paged_decode_reference(q, k, v, tables, lens, dim**-0.5, window)
        err = (got.float() - want.float()).abs().max().item()
        if not err <= tol:
            return f"{dtype} q, {pool_dtype} pools: max error {err:.3g} > {tol}"
    return ""


def _self_check_fused(ops: FusedOps) -> str:
    """Compare the fused ops with their PyTorch definitions; '' when they agree."""
    from switchyard_xeon.kernels.reference import TorchFusedOps

    ref = TorchFusedOps()
    gen = torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype)

        try:
            x, res, w = rand(5, 96), rand(5, 96), rand(96)
            pairs = [(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))]
            got_x, got_r, want_x, want_r = x.clone(), res.clone(), x.clone(), res.clone()
            ops.add_rms_norm_(got_x, got_r, w, 1e-6)
            ref.add_rms_norm_(want_x, want_r, w, 1e-6)
            pairs += [(got_x, want_x), (got_r, want_r)]
            gate_up = rand(3, 64)
            pairs.append((ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up)))
            heads, kv_heads, dim, rot = 4, 2, 16, 12  # partial rotary, as Phi-3 may use
            qkv, cos, sin = rand(3, (heads + 2 * kv_heads) * dim), rand(3, rot), rand(3, rot)
            slots = torch.tensor([5, 0, 9])
            # fp32 qkv may store into bf16 pools (the bf16 matmul mode's cache).
            pool_dtypes = (dtype, torch.bfloat16) if dtype == torch.float32 else (dtype,)
            for pool_dtype in pool_dtypes:
                results = []
                for impl in (ops, ref):
                    buf = qkv.clone()
                    k_pool, v_pool = torch.zeros(2, kv_heads, 3, 4, dim, dtype=pool_dtype)
                    impl.rotary_store_(buf, cos, sin, k_pool, v_pool, slots, heads, kv_heads)
                    results.append((buf, k_pool, v_pool))
                pairs += list(zip(*results, strict=True))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        for got, want in pairs:
            err = (got.float() - want.float()).abs().max().item()
            scale = max(1.0, want.float().abs().max().item())
            if not err <= tol * scale:
                return f"fused op {dtype} max error {err:.3g} > {tol * scale:.3g}"
    return ""


def _self_check_prefill(op: PagedPrefillFn) -> str:
    """Compare paged prefill attention with the SDPA reference; '' when they agree.

    Fresh prompts, a chunk after cached context, rows shared by two sequences'
    neighbours, a sliding window, fp32 and bf16 pools, head_dim 64 and 128.
    """
    from switchyard_xeon.kernels.reference import paged_prefill_reference

    gen = torch.Generator().manual_seed(4)
    for pool_dtype, dim, window in ((torch.float32, 64, 0), (torch.bfloat16, 128, 5),
                                    (torch.bfloat16, 64, 0)):
        kv_heads, heads, blocks, size = 2, 6, 14, 4
        k = torch.randn(kv_heads, blocks, size, dim, generator=gen).to(pool_dtype)
        v = torch.randn(kv_heads, blocks, size, dim, generator=gen).to(pool_dtype)
        q = torch.randn(30, heads, dim, generator=gen)
        tables = torch.tensor([[5, 2, 9, 0, 0], [1, 0, 0, 0, 0], [11, 3, 7, 13, 4]],
                              dtype=torch.int32)
        lens = torch.tensor([10, 3, 19], dtype=torch.int32)
        starts = torch.tensor([0, 12, 15], dtype=torch.int32)  # rows 10, 11 and 29+ unowned
        counts = torch.tensor([10, 3, 14], dtype=torch.int32)  # the last after 5 cached
        args = (q, k, v, tables, lens, starts, counts, dim**-0.5, window)
        try:
            got = op(*args)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        want = paged_prefill_reference(*args)
        owned = torch.cat([torch.arange(0, 10), torch.arange(12, 29)])
        err = (got[owned] - want[owned]).abs().max().item()
        if not err <= 1e-4:
            return f"paged prefill ({pool_dtype}, D={dim}) max error {err:.3g}"
    return ""


def _self_check_panels() -> str:
    """Compare the panel linear with ``F.linear`` over ragged shapes; '' when they agree.

    Both weight storages: fp32, and bf16 (widened in registers below 96 rows,
    through a buffer above).
    """
    gen = torch.Generator().manual_seed(2)
    for storage in (torch.float32, torch.bfloat16):
        for case in ((1, 37, 24), (7, 50, 64), (13, 16, 9), (100, 33, 40)):
            error = _panel_case_error(lambda w: torch.ops.switchyard_xeon.pack_panels(
                w.to(storage)), case, gen, bf16_inputs=False)
            if error:
                return f"panel linear ({storage}): {error}"
    return ""


def _self_check_bf16_dot() -> str:
    """Compare the dot-product panels with ``F.linear`` on bf16-rounded inputs; '' when they agree.

    Both weight storages: bf16, and int8 with per-feature scales (the
    reference uses the dequantized weight). Ragged shapes: odd K (a padded k
    pair), N not a multiple of 16 (a masked last panel), an odd number of
    panels (one runs alone), 1-13 and 600 rows (int8: widened in registers up
    to 6 rows, through a per-thread buffer past that).
    """
    from switchyard_xeon.quantization import quantize_int8

    ops = torch.ops.switchyard_xeon

    def pack_int8(w: torch.Tensor) -> torch.Tensor:
        weight = quantize_int8(w)
        return ops.pack_panels_int8_dot(weight.q, weight.scale)

    gen = torch.Generator().manual_seed(3)
    for case in ((1, 37, 24), (7, 50, 65), (13, 16, 9), (600, 33, 40)):
        error = _panel_case_error(ops.pack_panels_bf16_dot, case, gen, bf16_inputs=True)
        if error:
            return f"bf16 dot panels: {error}"
        error = _panel_case_error(pack_int8, case, gen, bf16_inputs=True,
                                  seen=lambda w: quantize_int8(w).dequantize())
        if error:
            return f"int8 dot panels: {error}"
    return ""


def _panel_case_error(pack: Callable[[torch.Tensor], torch.Tensor], case: tuple[int, int, int],
                      gen: torch.Generator, bf16_inputs: bool,
                      seen: Callable[[torch.Tensor], torch.Tensor] | None = None) -> str:
    """'' when ``panel_linear`` over ``pack(w)`` matches ``F.linear`` for (rows, out, inner).

    The reference sees the weight as packed: ``seen(w)`` when given, else
    ``w`` rounded to bf16 where the packing stores bf16; with
    ``bf16_inputs``, the input rounded to bf16 too.
    """
    rows, out, inner = case
    x = torch.randn(rows, inner, generator=gen)
    w = torch.randn(out, inner, generator=gen)
    b = torch.randn(out, generator=gen)
    try:
        packed = pack(w)
        got = torch.ops.switchyard_xeon.panel_linear(x, packed, b, out)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    if seen is not None:
        w = seen(w)
    elif packed.dtype == torch.bfloat16:
        w = w.bfloat16().float()
    if bf16_inputs:
        x = x.bfloat16().float()
    err = (got - torch.nn.functional.linear(x, w, b)).abs().max().item()
    return "" if err <= 1e-4 * max(1.0, inner ** 0.5) else f"max error {err:.3g}"
