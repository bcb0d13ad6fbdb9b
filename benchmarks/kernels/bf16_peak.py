"""This CPU's bf16 dot-product peak, and what it allows a 32-stream wave at most.

    .venv/bin/python benchmarks/kernels/bf16_peak.py

Runs ``vdpbf16ps`` (AVX512_BF16) on registers only, twelve independent
accumulators per thread, on 1 thread and on every core: GFLOP/s with no
memory in the way, the ceiling of any bf16 matmul here. Then the arithmetic
of the 32-stream benchmark (docs/benchmarks.md) on the 135M shape (32 prompts of 128
tokens, 128 new tokens each): the linear FLOPs of the wave, the shortest time
they can take at that peak, and what a median time to first token under 1 s
asks for (16 of the 32 prompts prefilled within it).
"""

from __future__ import annotations

import argparse
import os

from common import SMALL

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
// Seconds for `iters` steps of 12 independent vdpbf16ps on each of `threads` threads.
double dot_seconds(int64_t iters, int64_t threads) {
  const double start = omp_get_wtime();
  float sink = 0.f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m512 a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(1e-9f * i);
    const __m512bh w = (__m512bh)_mm512_set1_epi16(0x3f80);
    const __m512bh v = (__m512bh)_mm512_set1_epi16(0x3c00);
    for (int64_t k = 0; k < iters; ++k) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbf16_ps(a[i], w, v);
    }
    for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(a[i]);
  }
  const double took = omp_get_wtime() - start;
  return sink == 12345.f ? -took : took;  // keeps the loop from being optimised away
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=100_000_000)
    args = parser.parse_args()
    from torch.utils.cpp_extension import load_inline

    module = load_inline("bf16_peak", cpp_sources=SOURCE, functions=["dot_seconds"],
                         extra_cflags=["-O2", "-march=native", "-fopenmp"],
                         extra_ldflags=["-fopenmp"])
    cores = os.cpu_count() or 1
    flops_per_iter = 12 * 32 * 2  # 12 instructions x 32 bf16 products x 2 FLOPs
    peak = 0.0
    for threads in sorted({1, cores}):
        module.dot_seconds(args.iters // 10, threads)  # wake the cores up
        took = abs(module.dot_seconds(args.iters, threads))
        rate = threads * args.iters * flops_per_iter / took / 1e9
        peak = max(peak, rate)
        print(f"{threads} thread(s): {rate:.0f} GFLOP/s of bf16 dot products")
    h, i, layers, vocab = SMALL["hidden"], SMALL["inter"], SMALL["layers"], SMALL["vocab"]
    qkv = (SMALL["heads"] + 2 * SMALL["kv_heads"]) * SMALL["head_dim"]
    per_token = 2 * layers * (h * qkv + SMALL["heads"] * SMALL["head_dim"] * h + 3 * h * i)
    head = 2 * h * vocab
    streams, prompt, new = 32, 128, 128
    prefill = streams * prompt * per_token + streams * head  # the LM head on last tokens only
    decode = streams * new * (per_token + head)
    wave = (prefill + decode) / 1e9
    print(f"\n135M shape: {per_token / 2e6:.0f} M weights in the layers, {head / 2e6:.0f} M in "
          f"the LM head; a {streams}-stream wave of {prompt}+{new} tokens: {wave:.0f} GFLOP "
          f"of linears, >= {wave / peak:.1f} s at {peak:.0f} GFLOP/s, so <= "
          f"{streams * new / (wave / peak):.0f} output tokens/s before attention and overhead")
    half = (streams // 2) * (prompt * per_token + head) / 1e9
    print(f"a median TTFT under 1 s at {streams} streams: {half:.0f} GFLOP of prefill within "
          f"1 s, {100 * half / peak:.0f}% of that peak")


if __name__ == "__main__":
    main()
