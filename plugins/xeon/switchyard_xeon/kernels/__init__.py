"""Native CPU kernels of the Xeon engine, built on first use for the machine that runs them.

Today one kernel: :func:`paged_decode_attention` (``paged_attention.cpp``),
decode attention that walks the block tables of the paged cache in place. It
is compiled with ``torch.utils.cpp_extension`` for this CPU (``-march=native``:
AVX-512 where there is some) into torch's extension cache, once per machine
and source version (about 30 s of CPU; later starts load the cached library),
and registered as the torch operator ``switchyard_xeon::paged_decode_attention``.

A machine without a C++ compiler still serves: :func:`load_paged_attention`
returns None with the reason, and attention takes the portable SDPA path.
The built kernel is checked against that path before it is trusted.
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

import torch

logger = logging.getLogger("switchyard.xeon")

_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]

PagedDecodeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int],
    torch.Tensor,
]
"""``(q [B, H, D], k_pool, v_pool, block_tables int32 [B, n], context_lens int32 [B],
scale, window) -> [B, H, D]``; ``window`` 0 means no sliding window."""


@dataclass(frozen=True)
class KernelStatus:
    """Whether the native paged attention is in use, and why (for the start-up log)."""

    fn: PagedDecodeFn | None
    reason: str


_lock = threading.Lock()
_status: KernelStatus | None = None


def load_paged_attention() -> KernelStatus:
    """Build (or load from the cache) and check the paged decode-attention kernel; never raises.

    The first call in a process does the work; later calls return its result.
    ``SWITCHYARD_XEON_KERNELS=0`` turns the kernel off.
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
        return KernelStatus(None, f"native kernel unavailable ({first[:200]})")
    error = _self_check(op)
    if error:
        return KernelStatus(None, f"native kernel failed its check ({error})")
    return KernelStatus(op, "native paged attention (C++)")


def _build() -> PagedDecodeFn:
    """Compile the extension into torch's extension cache and return the operator."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    source = _SOURCE.read_bytes()
    # -march=native code is only valid on CPUs like this one: the name carries the
    # source, the flags and the CPU's features, so a shared cache never mixes them up.
    key = hashlib.sha256(
        source + " ".join(_CFLAGS).encode() + _cpu_signature().encode() + torch.__version__.encode()
    ).hexdigest()[:12]
    logger.info("building native paged attention (once per machine; cached by torch)")
    cpp_extension.load(
        name=f"switchyard_xeon_kernels_{key}",
        sources=[str(_SOURCE)],
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
    """Compare the kernel with plain SDPA on a small scattered cache; '' when they agree."""
    from switchyard_xeon.kernels.reference import paged_decode_reference

    gen = torch.Generator().manual_seed(0)
    for dtype, dim, window, tol in ((torch.float32, 64, 0, 1e-4), (torch.bfloat16, 80, 7, 2e-2)):
        kv_heads, heads, blocks, size = 2, 6, 12, 4
        k = torch.randn(kv_heads, blocks, size, dim, generator=gen).to(dtype)
        v = torch.randn(kv_heads, blocks, size, dim, generator=gen).to(dtype)
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
            return f"{dtype} max error {err:.3g} > {tol}"
    return ""
