"""One decode step's worth of matmuls: ``F.linear`` against oneDNN-packed weights, by row count.

Sweeps every linear of the SmolLM2-135M shape (q|k|v and gate|up fused, as
the engine runs them, plus the tied LM head) for M rows, the way a decode step
of M sequences does, and prints ms per sweep and GFLOP/s for each way of
running it. Rounds interleave the variants, and the table keeps each one's
best round, so a machine that gets busier mid-run skews all of them alike.

    .venv/bin/python benchmarks/kernels/linear_sweep.py --dtype float32 --rows 1 8 32 64

``packed:HINT`` reorders the weights once for a batch-size hint of HINT rows
(``none``: oneDNN's default); it is what ``switchyard_xeon.linears`` does at load.
``panel`` is the engine's own fp32 kernel, ``panel:bf16`` the same with the
weights stored as bf16 (fp32 math), ``panel:dot`` the AVX512_BF16 kernel
(``kernels/panel_dot_bf16.cpp``: bf16 weights and inputs, fp32 sums),
``panel:dot:amx`` and ``panel:dot:rows`` the same weights with every call
sent to its AMX path (tdpbf16ps over the same panels) or kept on the row
kernel, whatever the engine's crossover says (``panel:dot`` follows it),
``panel:int8`` that kernel over int8 weights with per-feature scales (the
engine's ``--quantize int8``), ``panel:int4`` (``panel:int4:G``) the uint4
kernel (``kernels/panel_dot_uint4.cpp``: a scale and zero point per group
of 128 (G) weights along K; ``--quantize int4``). ``panel:fma:int8``,
``panel:fma:int4[:G]`` and ``panel:fma:fp8`` are the same formats (FP8 E4M3
too) on the AVX2 + FMA kernel (``kernels/panel_quant_fma.cpp``, fp32 math),
which the engine takes where AVX512_BF16 is missing. ``int8`` is PyTorch's weight-only int8 with
per-row scales (``torch._weight_int8pack_mm``),
and ``gemv`` a plain AVX2/FMA fp32 kernel over row-major weights, four rows of
W per pass (built with ``torch.utils.cpp_extension``, fp32 only): the two
candidates for batch-1 decode that the engine does not use.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common import SMALL

MEDIUM = dict(hidden=896, inter=4864, layers=24, heads=14, kv_heads=2, head_dim=64, vocab=151936)
"""The Qwen2.5-0.5B shape (``--shape medium``)."""

Matmul = Callable[[torch.Tensor], torch.Tensor]

GEMV_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
// y[m, n] = x[m, :] . w[n, :] for few rows m: each thread streams its share of
// W's rows once per row of x, four rows of W at a time (x stays in L1).
torch::Tensor gemv(torch::Tensor x, torch::Tensor w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  #pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < N; n0 += 4) {
    const int64_t rows = std::min<int64_t>(4, N - n0);
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = X + m * K;
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(),
                       _mm256_setzero_ps(), _mm256_setzero_ps()};
      int64_t k = 0;
      if (rows == 4) {
        for (; k + 8 <= K; k += 8) {
          const __m256 xv = _mm256_loadu_ps(xr + k);
          for (int j = 0; j < 4; ++j)
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(W + (n0 + j) * K + k), xv, acc[j]);
        }
      }
      for (int64_t j = 0; j < rows; ++j) {
        float lanes[8];
        _mm256_storeu_ps(lanes, acc[j]);
        float sum = 0.f;
        for (float v : lanes) sum += v;
        for (int64_t kk = k; kk < K; ++kk) sum += W[(n0 + j) * K + kk] * xr[kk];
        Y[m * N + n0 + j] = sum;
      }
    }
  }
  return y;
}
"""


@functools.cache
def gemv_module() -> object:
    """Build (or load from torch's cache) the ``gemv`` kernel, once per process."""
    from torch.utils.cpp_extension import load_inline

    return load_inline("linear_sweep_gemv", cpp_sources=GEMV_SOURCE, functions=["gemv"],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"])


def step_shapes(cfg: dict = SMALL) -> list[tuple[int, int]]:
    """(out, in) of each matmul of one decode step, fused as the engine fuses them."""
    h, i, d = cfg["hidden"], cfg["inter"], cfg["head_dim"]
    layer = [((cfg["heads"] + 2 * cfg["kv_heads"]) * d, h), (h, cfg["heads"] * d), (2 * i, h), (h, i)]
    return layer * cfg["layers"] + [(cfg["vocab"], h)]


def quantized_panels(name: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` quantized by the quant plugin's method and packed as the engine packs it.

    ``panel:int8``; ``panel:int4`` (groups of 128) or ``panel:int4:G`` (G = 32, 64, 128);
    ``panel:fma:`` before any of them (or ``fp8``) for the AVX2 + FMA kernel's layouts.
    """
    from switchyard_quant.fp8_method import quantize_fp8
    from switchyard_quant.int4 import quantize_uint4
    from switchyard_quant.int8 import quantize_int8
    from switchyard_xeon.quantized import pack_quantized

    fma = name.startswith("panel:fma:")
    parts = name.removeprefix("panel:fma:").removeprefix("panel:").split(":")
    if parts[0] == "int8":
        return pack_quantized(quantize_int8(weight), fma=fma)
    if parts[0] == "fp8":
        return pack_quantized(quantize_fp8(weight), fma=True)
    group = int(parts[1]) if len(parts) == 2 else 128
    return pack_quantized(quantize_uint4(weight, group), fma=fma)


ROUTES = {"panel:dot:amx": 0, "panel:dot:rows": 1 << 40}
"""Variants that pin the bf16 dot panels' AMX crossover (``bf16_amx_rows``) while they run."""


def route(name: str, default: int) -> None:
    """Set the dot panels' AMX crossover for variant ``name`` (``default`` for the others)."""
    ops = torch.ops.switchyard_xeon
    if hasattr(ops, "bf16_amx_rows") and default >= 0:
        ops.bf16_amx_rows(ROUTES.get(name, default))


def variant(name: str, weight: torch.Tensor) -> Matmul:
    """A callable x -> x @ weight.T for the variant ``name``."""
    if name == "F.linear":
        return lambda x: F.linear(x, weight)
    if name == "int8":
        scales = weight.float().abs().amax(1).clamp(min=1e-8) / 127
        q = (weight.float() / scales[:, None]).round().to(torch.int8).contiguous()
        scales = scales.to(weight.dtype)
        return lambda x: torch._weight_int8pack_mm(x, q, scales)
    if name == "gemv":
        kernel = gemv_module().gemv  # type: ignore[attr-defined]
        return lambda x: kernel(x, weight)
    quantized = name.startswith(("panel:int8", "panel:int4", "panel:fma:"))
    if name in ("panel", "panel:bf16", "panel:dot", *ROUTES) or quantized:
        from switchyard_xeon.kernels import load_kernels

        assert load_kernels().fn is not None, load_kernels().reason
        # panel:bf16 keeps the weights as bf16 in memory and computes in fp32.
        stored = weight.to(torch.bfloat16) if name == "panel:bf16" else weight
        if name.startswith("panel:dot"):
            panels = torch.ops.switchyard_xeon.pack_panels_bf16_dot(weight)
        elif quantized:
            panels = quantized_panels(name, weight)
        else:
            panels = torch.ops.switchyard_xeon.pack_panels(stored)
        return lambda x: torch.ops.switchyard_xeon.panel_linear(x, panels, None, weight.shape[0])
    hint_text = name.removeprefix("packed:")
    hint = None if hint_text == "none" else int(hint_text)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--variants", nargs="+", default=["F.linear", "packed:none", "packed:1",
                                                          "packed:64"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shape", default="small", choices=["small", "medium"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weights = [torch.randn(o, i).mul_(0.02).to(dtype) for o, i in step_shapes(
        MEDIUM if args.shape == "medium" else SMALL)]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"{os.cpu_count()} CPUs, {torch.get_num_threads()} threads, {args.dtype}, "
          f"{flops_per_row // 2 / 1e6:.1f} M weights, load {os.getloadavg()[0]:.1f}")
    calls = {name: [variant(name, w) for w in weights] for name in args.variants}
    ops = torch.ops.switchyard_xeon
    crossover = ops.bf16_amx_rows(-1) if hasattr(ops, "bf16_amx_rows") else -1
    if crossover >= 0:
        print(f"bf16 dot panels: AMX from {crossover} rows")
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k).to(dtype) for k in {w.shape[1] for w in weights}}
            for _ in range(args.rounds):
                for name, fns in calls.items():
                    route(name, crossover)
                    start = time.perf_counter()
                    for fn, w in zip(fns, weights, strict=True):
                        fn(inputs[w.shape[1]])
                    took = time.perf_counter() - start
                    key = (name, rows)
                    best[key] = min(best.get(key, took), took)
    print("\n| variant | rows | ms/sweep | GFLOP/s |\n|---|---:|---:|---:|")
    for (name, rows), took in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"| {name} | {rows} | {took * 1e3:.1f} | {flops_per_row * rows / took / 1e9:.1f} |")
    print(f"\nload {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
