"""The device seam: the only module that imports Habana's software (``habana_frameworks``).

Everything the engine asks of its device goes through a :class:`Device`:
``mark_step`` (lazy mode's graph boundary), ``capture`` (HPU graphs, or
``torch.compile``), ``attention`` (Habana's FusedSDPA, or torch's SDPA),
``free_memory``, FP8 casts and matmuls (``to_fp8``, ``fp8_linear``),
the profiler's activities, and for sharding the device
count, the collective backend (HCCL, or gloo) and what lazy mode needs. Each has a CPU implementation,
so the very same engine runs on the CPU device for tests
(``--engine-option device=cpu``).

On the CPU, the HPU graph's analogue is ``torch.compile`` over the static
shapes (``dynamic=False``): dynamo compiles one graph per shape and guards on
it, so a shape that was not warmed up is a recompile there exactly as it is a
graph recompile on an HPU, and :attr:`Device.compiles` counts them. The
default backend is dynamo's ``eager`` one (the captured graph runs through
PyTorch's kernels): on a 2-core machine a tiny Llama shape compiled in 0.7-1.6 s
with it, 1.1-2.0 s with ``aot_eager`` (whose functionalized graph then ran
3x slower), and 5-26 s with ``inductor``, whose C++ kernels also moved the
logits by ~5e-6 (``cpu_compile`` engine option picks another).

HPU paths are written against Habana's documented API but have not run on an
HPU: docs/gaudi.md says "verified on CPU only" for each of them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from switchyard_spec import FP8_E4M3_MAX, EngineStartError

if TYPE_CHECKING:
    import torch

# torch is imported where it is used, not here: the plugin's probe calls
# detect_hpu() just to list engines, and importing torch takes seconds.

logger = logging.getLogger("switchyard.gaudi")

HPU, CPU = "hpu", "cpu"
CPU_COMPILE_BACKENDS = ("eager", "aot_eager", "inductor")
"""``cpu_compile`` option values: dynamo backends for the CPU's stand-in for HPU graphs."""


@dataclass(frozen=True)
class HpuStatus:
    """Whether an HPU can be used here, and why not."""

    available: bool
    name: str
    detail: str


def detect_hpu() -> HpuStatus:
    """Look for Habana's PyTorch bridge and a Gaudi device; never raises.

    Cheap where Habana's software is absent (a module lookup, no import), so
    ``switchyard plugins`` can call it on any machine.
    """
    if importlib.util.find_spec("habana_frameworks") is None:
        return HpuStatus(False, "Intel Gaudi (HPU)",
                         "no HPU: habana_frameworks (Intel Gaudi software) is not installed; "
                         "--engine gaudi --engine-option device=cpu runs this engine on the CPU")
    try:
        import habana_frameworks.torch.hpu as hthpu

        count = int(hthpu.device_count())
        if not hthpu.is_available() or count == 0:
            return HpuStatus(False, "Intel Gaudi (HPU)", "habana_frameworks found no HPU")
        return HpuStatus(True, f"Intel Gaudi: {hthpu.get_device_name()}", f"{count} HPU(s)")
    except Exception as exc:  # a probe must not raise
        return HpuStatus(False, "Intel Gaudi (HPU)", f"habana_frameworks failed: {exc!r}")


def available_cpu_memory(meminfo: str = "/proc/meminfo",
                         cgroup: str = "/sys/fs/cgroup") -> int:
    """Bytes the process may still allocate: MemAvailable, capped by a cgroup v2 limit.

    0 when neither can be read (the caller then cannot check fits).
    """
    available = 0
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(os.path.join(cgroup, "memory.max"), encoding="ascii") as fh:
            limit = fh.read().strip()
        with open(os.path.join(cgroup, "memory.current"), encoding="ascii") as fh:
            used = int(fh.read().strip())
        if limit != "max":
            room = max(0, int(limit) - used)
            available = min(available, room) if available else room
    except (OSError, ValueError):
        pass
    return available


class Device:
    """One device (an HPU or the CPU) as the engine uses it.

    ``graphs`` turns capture on (``ENABLE_HPU_GRAPH``); ``lazy`` is HPU lazy
    mode (``PT_HPU_LAZY_MODE``); ``cpu_compile`` names the dynamo backend on the
    CPU; ``fused_attention``/``recompute`` are ``USE_FLASH_ATTENTION`` and
    ``FLASH_ATTENTION_RECOMPUTE`` (HPU only).
    """

    def __init__(self, kind: str, graphs: bool = True, lazy: bool = True,
                 cpu_compile: str = "eager", fused_attention: bool = False,
                 recompute: bool = False) -> None:
        if kind not in (HPU, CPU):
            raise EngineStartError(f"gaudi option device must be hpu, cpu or auto, not {kind!r}")
        if cpu_compile not in CPU_COMPILE_BACKENDS:
            raise EngineStartError(f"gaudi option cpu_compile must be one of "
                                   f"{', '.join(CPU_COMPILE_BACKENDS)}, not {cpu_compile!r}")
        self.kind = kind
        self.graphs = graphs
        self.lazy = lazy
        self.cpu_compile = cpu_compile
        self.fused_attention = fused_attention and kind == HPU
        self.recompute = recompute and self.fused_attention
        self.compiles = 0
        """Graphs compiled so far (dynamo backend calls); a recompile after warmup shows here."""
        import torch

        self.torch_device = torch.device(kind)
        self._htcore = None
        if kind == HPU:
            import habana_frameworks.torch.core as htcore

            self._htcore = htcore

    def describe(self) -> str:
        """What runs the static shapes, for the start-up log."""
        if not self.graphs:
            return f"{self.kind}, no graphs (ENABLE_HPU_GRAPH=false): eager"
        if self.kind == HPU:
            return "hpu, HPU graphs (lazy mode)" if self.lazy else \
                "hpu, torch.compile(backend=hpu_backend)"
        return f"cpu, torch.compile(backend={self.cpu_compile}, dynamic=False) per shape"

    # ------------------------------------------------------------- graphs
    def mark_step(self) -> None:
        """End the lazy-mode graph here (HPU lazy mode); nothing elsewhere."""
        if self._htcore is not None and self.lazy:
            self._htcore.mark_step()

    def capture(self, fn: Callable[..., object], shapes: int) -> Callable[..., object]:
        """``fn`` run as a captured graph per input shape (at most ``shapes`` of them).

        HPU lazy mode wraps it in an HPU graph; otherwise ``torch.compile`` with
        static shapes and a backend that counts compiles. Dynamo's recompile
        limit (8 by default) is raised to fit the plan, and hitting it is an
        error rather than a silent fall back to eager.
        """
        if not self.graphs:
            return fn
        import torch

        if self.kind == HPU and self.lazy:
            import habana_frameworks.torch as htorch

            class AsModule(torch.nn.Module):  # wrap_in_hpu_graph wraps modules
                def forward(self, *args: object) -> object:
                    return fn(*args)

            return htorch.hpu.wrap_in_hpu_graph(AsModule(), disable_tensor_cache=True)
        import torch._dynamo.config as dynamo_config

        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 2 * shapes + 8)
        dynamo_config.accumulated_recompile_limit = max(
            dynamo_config.accumulated_recompile_limit, 4 * shapes + 64)
        dynamo_config.fail_on_recompile_limit_hit = True
        inner = "hpu_backend" if self.kind == HPU else self.cpu_compile
        return torch.compile(_own_code(fn), backend=self._counting(inner), dynamic=False,
                             fullgraph=self.kind == CPU)

    def _counting(self, name: str) -> Callable[..., object]:
        from torch._dynamo.backends.registry import lookup_backend

        real = lookup_backend(name)

        def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
            self.compiles += 1
            return real(gm, example_inputs)

        return backend

    # ---------------------------------------------------------- attention
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, causal: bool, scale: float | None,
                  prefill: bool) -> torch.Tensor:
        """Scaled dot-product attention, [B, heads, q, d] over [B, kv_heads, k, d] keys.

        FusedSDPA on an HPU with ``USE_FLASH_ATTENTION`` (recompute mode for
        prefill with ``FLASH_ATTENTION_RECOMPUTE``), torch's SDPA otherwise.
        """
        if self.fused_attention:
            from habana_frameworks.torch.hpex.kernels import FusedSDPA

            group = q.shape[1] // k.shape[1]
            if group > 1:  # FusedSDPA wants as many key heads as query heads
                k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            return FusedSDPA.apply(q, k, v, mask, 0.0, causal, scale, "None",
                                   self.recompute and prefill)
        import torch.nn.functional as F

        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=q.shape[1] != k.shape[1])

    # ---------------------------------------------------------------- FP8
    def fp8_problem(self) -> str | None:
        """Why this device cannot run ``fp8-e4m3-per-tensor`` layers, or None.

        The format's scales map the largest value to E4M3's 448; Gaudi 2's
        FP8 units saturate at 240 (Intel Neural Compressor scales for that
        range there), so the format runs on Gaudi 3 and on the CPU device.
        """
        if self.kind != HPU:
            return None
        import habana_frameworks.torch.utils.experimental as htexp

        if htexp._get_device_type() == htexp.synDeviceType.synDeviceGaudi2:
            return ("Gaudi 2's FP8 range is +-240, and fp8-e4m3-per-tensor scales to E4M3's "
                    "+-448; serve FP8 there through QUANT_CONFIG, which scales for the device")
        return None

    def to_fp8(self, x: torch.Tensor, scale: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        """``float8_e4m3fn(x / scale)``, saturating at +-448; ``inverse`` is ``1 / scale``.

        HPU: Habana's cast, which multiplies by ``inverse``. CPU: the
        contract's formula (fp32 division, clamp, round to nearest even).
        """
        import torch

        if self.kind == HPU:
            return torch.ops.hpu.cast_to_fp8_v2(x, inverse, False, False,
                                                torch.float8_e4m3fn)[0]
        return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)

    def fp8_linear(self, xq: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor,
                   w_scale: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype) -> torch.Tensor:
        """``(xq * x_scale) @ (weight * w_scale).T + bias`` in ``out_dtype``.

        ``xq`` [..., K] and ``weight`` [N, K] are ``float8_e4m3fn``; the scales
        are 0-d fp32 tensors. HPU: Habana's FP8 GEMM (``fp8_gemm_v2``, the
        op Intel Neural Compressor's FP8 linears call). CPU: both operands
        widened to fp32 (every E4M3 value and every product of two is exact
        there) and one fp32 matmul, scaled by ``x_scale * w_scale`` after.
        """
        import torch
        import torch.nn.functional as F

        if self.kind == HPU:
            y = torch.ops.hpu.fp8_gemm_v2(xq, False, weight, True, None, out_dtype, x_scale,
                                          w_scale, None, False)
            return y if bias is None else y + bias
        y = F.linear(xq.float(), weight.float()) * (x_scale * w_scale)
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype)

    # ------------------------------------------------------------- memory
    def free_memory(self) -> int:
        """Free device memory in bytes (HPU: ``torch.hpu.mem_get_info``; CPU: MemAvailable)."""
        if self.kind == HPU:
            import torch

            free, _total = torch.hpu.mem_get_info()  # type: ignore[attr-defined]
            return int(free)
        return available_cpu_memory()

    # ------------------------------------------------------------ sharding
    def count(self) -> int:
        """Devices of this kind the engine can shard over (``--sharded true`` alone).

        The HPUs Habana's runtime sees; 0 on the CPU device, which has no count
        to take: its ranks are processes, so ``--num-shard`` must say how many.
        """
        if self.kind == HPU:
            import habana_frameworks.torch.hpu as hthpu

            return int(hthpu.device_count())
        return 0

    def collective_backend(self) -> str:
        """The torch.distributed backend between ranks: HCCL on HPUs, gloo on the CPU.

        Importing Habana's ``hccl`` module registers the "hccl" backend.
        """
        if self.kind == HPU:
            import habana_frameworks.torch.distributed.hccl  # noqa: F401

            return "hccl"
        return "gloo"

    def sharding_problem(self, environ: Mapping[str, str]) -> str | None:
        """Why this device cannot run sharded as configured, or None.

        HPU graphs in lazy mode capture the all-reduces of tensor parallelism
        only with ``PT_HPU_ENABLE_LAZY_COLLECTIVES=true`` in the environment
        (Habana's runtime reads it; the seed's eight-card commands set it).
        """
        if self.kind == HPU and self.lazy and self.graphs and \
                environ.get("PT_HPU_ENABLE_LAZY_COLLECTIVES", "").strip().lower() \
                not in ("1", "true"):
            return ("HPU graphs in lazy mode need PT_HPU_ENABLE_LAZY_COLLECTIVES=true when "
                    "sharded (as the seed's eight-card command sets it)")
        return None

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        """What the torch profiler records on this device."""
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.kind == HPU:
            acts.append(torch.profiler.ProfilerActivity.HPU)
        return acts


def _own_code(fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` (a function or bound method) with a code object of its own.

    Dynamo keeps compiled graphs, and counts recompiles against its limit,
    per code object. Every engine's step functions come from the same ``def``,
    so without this the engines of one process (tests build many) would pile
    their shapes onto one count and hit the limit, and old engines' graphs
    would live as long as the code. A copy gives each engine its own cache,
    freed with it.
    """
    func = getattr(fn, "__func__", fn)
    clone = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__,
                               func.__defaults__, func.__closure__)
    owner = getattr(fn, "__self__", None)
    return clone if owner is None else types.MethodType(clone, owner)


def open_device(requested: str, graphs: bool, lazy: bool, cpu_compile: str,
                fused_attention: bool, recompute: bool) -> Device:
    """The :class:`Device` for the ``device`` option: "hpu", "cpu" or "auto" (an HPU if present).

    Asking for an HPU where there is none is a start-up error that says how to
    run on the CPU instead.
    """
    if requested not in ("auto", HPU, CPU):
        raise EngineStartError(f"gaudi option device must be auto, hpu or cpu, not {requested!r}")
    if requested != CPU:
        status = detect_hpu()
        if not status.available:
            raise EngineStartError(f"gaudi engine: {status.detail}")
        kind = HPU
    else:
        kind = CPU
    return Device(kind, graphs=graphs, lazy=lazy, cpu_compile=cpu_compile,
                  fused_attention=fused_attention, recompute=recompute)
