"""A hand-written paged decode-attention kernel (C++, built with torch.utils.cpp_extension).

Only a measuring stick: how fast decode attention over the paged cache can be
on this CPU when nothing but the K/V bytes is paid for (no gather copy, no
padding, one pass per (sequence, KV head) with all query heads of the group
sharing each K/V row, fp32 accumulation, at::parallel_for over sequence x KV head).

Layout: pools [kv_heads, num_blocks, block_size, head_dim] bf16, tables
[B, max_blocks] int64, lens [B] int64, q [B, heads, head_dim] bf16.
"""

from __future__ import annotations

import os

import torch

_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

static inline float bf2f(uint16_t x) {
  uint32_t u = ((uint32_t)x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int D>
static void kernel(const uint16_t* q, const uint16_t* kp, const uint16_t* vp,
                   const int64_t* tables, const int64_t* lens, uint16_t* out,
                   int64_t B, int64_t H, int64_t KVH, int64_t NB, int64_t BS, int64_t maxnb,
                   float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> qf(G * D), acc(G * D);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / KVH, h = w % KVH;
      const int64_t L = lens[b];
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d)
          qf[g * D + d] = bf2f(q[(b * H + h * G + g) * D + d]) * scale;
      const int64_t* tab = tables + b * maxnb;
      // pass 1: scores
      for (int64_t l = 0; l < L; ++l) {
        const uint16_t* krow = kp + ((h * NB + tab[l / BS]) * BS + l % BS) * D;
        float kf[D];
        for (int d = 0; d < D; ++d) kf[d] = bf2f(krow[d]);
        for (int64_t g = 0; g < G; ++g) {
          float s = 0.f;
          for (int d = 0; d < D; ++d) s += qf[g * D + d] * kf[d];
          scores[g * L + l] = s;
        }
      }
      // softmax per query head
      for (int64_t g = 0; g < G; ++g) {
        float m = -INFINITY;
        for (int64_t l = 0; l < L; ++l) m = std::max(m, scores[g * L + l]);
        float sum = 0.f;
        for (int64_t l = 0; l < L; ++l) {
          float e = std::exp(scores[g * L + l] - m);
          scores[g * L + l] = e;
          sum += e;
        }
        const float inv = 1.f / sum;
        for (int64_t l = 0; l < L; ++l) scores[g * L + l] *= inv;
      }
      // pass 2: weighted sum of values
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < L; ++l) {
        const uint16_t* vrow = vp + ((h * NB + tab[l / BS]) * BS + l % BS) * D;
        float vf[D];
        for (int d = 0; d < D; ++d) vf[d] = bf2f(vrow[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + l];
          for (int d = 0; d < D; ++d) acc[g * D + d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) {
          float f = acc[g * D + d];
          uint32_t u;
          std::memcpy(&u, &f, 4);
          u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
          out[(b * H + h * G + g) * D + d] = (uint16_t)(u >> 16);
        }
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kpool, torch::Tensor vpool,
                           torch::Tensor tables, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kpool.scalar_type() == at::kBFloat16);
  TORCH_CHECK(q.is_contiguous() && kpool.is_contiguous() && vpool.is_contiguous());
  auto t = tables.to(at::kLong).contiguous();
  auto n = lens.to(at::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = kpool.size(0), NB = kpool.size(1), BS = kpool.size(2);
  auto out = torch::empty_like(q);
  auto qp = (const uint16_t*)q.data_ptr();
  auto kp = (const uint16_t*)kpool.data_ptr();
  auto vp = (const uint16_t*)vpool.data_ptr();
  auto op = (uint16_t*)out.data_ptr();
  if (D == 64)
    kernel<64>(qp, kp, vp, t.data_ptr<int64_t>(), n.data_ptr<int64_t>(), op, B, H, KVH, NB, BS,
               t.size(1), (float)scale);
  else if (D == 128)
    kernel<128>(qp, kp, vp, t.data_ptr<int64_t>(), n.data_ptr<int64_t>(), op, B, H, KVH, NB, BS,
                t.size(1), (float)scale);
  else
    TORCH_CHECK(false, "head_dim 64 or 128");
  return out;
}
"""

_mod = None


def load():
    """Build (first time, cached under ~/.cache/torch_extensions) and return the module."""
    global _mod
    if _mod is None:
        from torch.utils.cpp_extension import load_inline
        _mod = load_inline(
            name="cpu_path_paged_attn",
            cpp_sources=_SRC,
            functions=["paged_decode"],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=bool(os.environ.get("VERBOSE_EXT")),
        )
    return _mod


def paged_decode(q, kpool, vpool, tables, lens, scale):
    return load().paged_decode(q, kpool, vpool, tables, lens, float(scale))
