// bf16 linear layers on CPUs with AVX512_BF16: y = bf16(x) @ W.T (+ bias), fp32
// accumulation and output, the weights stored as bf16 in panels of 16 output
// features. This is what a bf16 matmul means in oneDNN or on AMX (inputs
// rounded to bf16, products summed in fp32); the activations outside the
// matmul stay fp32.
//
// Packing: W [N, K] becomes [N/16, K/2, 16, 2] bf16 (K and N zero-padded to
// even and to a multiple of 16): each k-pair step of a panel is one 64-byte
// vector holding, for each of the 16 features, its weights at k and k+1, the
// operand order of vdpbf16ps. One panel is a single contiguous stream.
//
// Micro-kernel: up to 6 rows of x times up to four neighbouring panels (64
// output features), 24 zmm accumulators held across the whole K loop. Each
// k-pair of a row (two bf16, 32 bits) is broadcast once and feeds one
// vdpbf16ps per panel, so each step does 24 dot products (48 x 16
// multiply-adds) for four weight loads and six broadcasts. At one row it is a
// pure weight stream (half the bytes of fp32), prefetched 4 KB ahead as
// panel_gemm.cpp does; at dozens of rows the panels stay in L2 while the row
// tiles pass over them. Four panels rather than two measured 2-6% faster over
// the 135M shape's decode-step sweep at 1-1,024 rows (Zen 4,
// benchmarks/kernels/linear_sweep.py). Against panel_gemm.cpp's fp32 math on
// the same bf16 weights this doubles the multiply-adds per instruction, which
// is what bounds batched decoding.
//
// int8 weights (weight-only quantization, `--quantize int8`): the same layout
// with one byte per weight, [N/16, K/2 + 2, 16, 2] int8, where the two extra
// k-pair steps of each panel hold its 16 fp32 per-feature scales. Integers in
// [-127, 127] are exact in bf16, so the kernel widens each step to bf16 and
// runs the bf16 micro-kernel: y = scale * sum(bf16(x) * q). At a few rows it
// widens in registers and reads half the bytes of bf16 (batch-1 decoding is a
// weight stream); past kWidenInRegisters rows it widens a group of panels once
// into a per-thread bf16 buffer that every row tile then reads, so large
// batches pay the conversion once per weight, not once per row tile.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 16;        // output features per panel
constexpr int64_t kRows = 6;          // rows of x per micro-kernel call
constexpr int64_t kGroup = 4;         // panels per micro-kernel call: 6 x 4 accumulators
constexpr int64_t kChunk = 512;       // rows per pass over the weights
constexpr int64_t kPrefetchBytes = 4096;
// int8 weights: up to this many rows widen in registers (each row tile widens
// again); past it a panel pair is widened once into a buffer. Measured on the
// 135M shape's sweep (Zen 4, 2 cores): in registers matched or beat bf16
// weights up to 24 rows; the buffer costs ~4 ms a sweep at any row count.
constexpr int64_t kWidenInRegisters = 4 * kRows;
constexpr int64_t kStep = 2 * kPanel;  // weights per k-pair step of a panel
constexpr int64_t kScaleSteps = static_cast<int64_t>(kPanel * sizeof(float)) / kStep;
// ^ k-pair steps of an int8 panel taken by its 16 fp32 scales (64 bytes: two)

using bf16 = at::BFloat16;

// [N, K] bf16 -> [panels, K/2 (rounded up), 16, 2], zero-padded.
at::Tensor pack_panels_bf16_dot(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_panels_bf16_dot: weight must be [N, K]");
  const at::Tensor w = weight.to(at::kBFloat16).contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2;
  at::Tensor packed = at::zeros({panels, pairs, kStep}, w.options());
  const bf16* src = w.data_ptr<bf16>();
  bf16* dst = packed.data_ptr<bf16>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const bf16* row = src + (p * kPanel + j) * K;
        bf16* out = dst + p * pairs * kStep + 2 * j;
        for (int64_t k = 0; k < K; ++k) out[(k / 2) * kStep + (k % 2)] = row[k];
      }
    }
  });
  return packed;
}

// q [N, K] int8 with scale [N] fp32 -> [panels, K/2 (rounded up) + 2, 16, 2] int8,
// zero-padded, each panel's 16 scales in its last two steps (padded features: 0).
at::Tensor pack_panels_int8_dot(const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar,
              "pack_panels_int8_dot: weight must be int8 [N, K]");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == weight.size(0) &&
                  scale.scalar_type() == at::kFloat,
              "pack_panels_int8_dot: scale must be float32 [N]");
  const at::Tensor w = weight.contiguous(), s = scale.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2;
  const int64_t steps = pairs + kScaleSteps;
  at::Tensor packed = at::zeros({panels, steps, kStep}, w.options());
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      float* scales = reinterpret_cast<float*>(dst + (p * steps + pairs) * kStep);
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const int8_t* row = src + (p * kPanel + j) * K;
        int8_t* out = dst + p * steps * kStep + 2 * j;
        for (int64_t k = 0; k < K; ++k) out[(k / 2) * kStep + (k % 2)] = row[k];
        scales[j] = s.data_ptr<float>()[p * kPanel + j];
      }
    }
  });
  return packed;
}

// One k-pair step of an int8 panel (32 weights) as the bf16 operand of vdpbf16ps:
// widened to fp32 and rounded to bf16, which is exact for integers this small.
inline __m512bh widen_step(const int8_t* q) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0-15 from lo: the order of the bytes
}

// Rows of x as bf16 pairs: [M, K] fp32 -> [M, K/2 (rounded up)] 32-bit words,
// rounded to nearest even as .to(bfloat16) does, odd K padded with a zero.
// Done here rather than with .to(): a dispatched op and a tensor per call
// cost more than the conversion at one row (~10 us, a linear's worth of time).
void rows_as_pairs(const float* x, int64_t M, int64_t K, int64_t pairs, uint32_t* out) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* src = x + r * K;
      bf16* dst = reinterpret_cast<bf16*>(out + r * pairs);
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + k));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), (__m256i)v);
      }
      for (; k < K; ++k) dst[k] = static_cast<bf16>(src[k]);
      if (K % 2) dst[K] = static_cast<bf16>(0.0f);
    }
  });
}

// y[r, n0 : n0 + 16 * P] for R rows (R <= kRows) and P panels (P <= kGroup)
// starting at `panel`, `stride` apart, stored straight from the accumulators
// where the features are whole. W is the weight type: bf16, or int8 (widened
// step by step). With `scales` (int8 weights), panel p's sums are multiplied
// by the 16 floats at scales + p * scale_stride.
template <int R, int P, typename W>
inline void micro(const uint32_t* x, int64_t pairs, const W* panel, int64_t stride,
                  const float* scales, int64_t scale_stride, const float* bias, float* y,
                  int64_t N, int64_t n0) {
  constexpr bool kInt8 = std::is_same_v<W, int8_t>;
  constexpr int64_t ahead = kPrefetchBytes / (kStep * sizeof(W));
  __m512 acc[R][P];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[i][p] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < pairs; ++k) {
    __m512bh w[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const W* step = panel + p * stride + k * kStep;
      _mm_prefetch(reinterpret_cast<const char*>(step + ahead * kStep), _MM_HINT_T0);
      if constexpr (kInt8) {
        w[p] = widen_step(step);
      } else {
        w[p] = (__m512bh)_mm512_loadu_si512(step);
      }
    }
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m512bh v = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * pairs + k]));
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) acc[i][p] = _mm512_dpbf16_ps(acc[i][p], w[p], v);
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) {
    // Features past N (the ragged last panel) are masked off on store.
    const int64_t left = std::min(kPanel, N - n0 - p * kPanel);
    const __mmask16 m = left >= kPanel ? __mmask16(0xFFFF)
                                       : __mmask16(left > 0 ? (1u << left) - 1 : 0);
    const __m512 c = bias ? _mm512_maskz_loadu_ps(m, bias + n0 + p * kPanel) : _mm512_setzero_ps();
    const __m512 sc = scales ? _mm512_loadu_ps(scales + p * scale_stride) : _mm512_set1_ps(1.0f);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      _mm512_mask_storeu_ps(y + i * N + n0 + p * kPanel, m, _mm512_fmadd_ps(acc[i][p], sc, c));
    }
  }
}

// Every row tile of rows [0, rows) times P panels from `panel` (output features n0..).
template <int P, typename W>
void tiles(const uint32_t* x, const W* panel, int64_t stride, const float* scales,
           int64_t scale_stride, const float* bias, float* y, int64_t rows, int64_t N,
           int64_t pairs, int64_t n0) {
  for (int64_t r = 0; r < rows; r += kRows) {
    const uint32_t* xr = x + r * pairs;
    float* yr = y + r * N;
#define SY_TILE(R) \
  micro<R, P, W>(xr, pairs, panel, stride, scales, scale_stride, bias, yr, N, n0)
    switch (std::min(kRows, rows - r)) {
      case 1: SY_TILE(1); break;
      case 2: SY_TILE(2); break;
      case 3: SY_TILE(3); break;
      case 4: SY_TILE(4); break;
      case 5: SY_TILE(5); break;
      default: SY_TILE(6);
    }
#undef SY_TILE
  }
}

// P panels of either layout from `panel` over rows [0, rows). int8 panels past
// kWidenInRegisters rows are widened once into this thread's bf16 buffer.
template <int P, typename W>
void panel_rows(const uint32_t* x, const W* panel, const float* bias, float* y, int64_t rows,
                int64_t N, int64_t pairs, int64_t n0) {
  if constexpr (std::is_same_v<W, bf16>) {
    tiles<P>(x, panel, pairs * kStep, nullptr, 0, bias, y, rows, N, pairs, n0);
  } else {
    const int64_t stride = (pairs + kScaleSteps) * kStep;
    const float* scales = reinterpret_cast<const float*>(panel + pairs * kStep);
    const int64_t scale_stride = stride / static_cast<int64_t>(sizeof(float));
    if (rows <= kWidenInRegisters) {
      tiles<P>(x, panel, stride, scales, scale_stride, bias, y, rows, N, pairs, n0);
      return;
    }
    static thread_local std::vector<bf16> widened;
    widened.resize(P * pairs * kStep);
    for (int64_t p = 0; p < P; ++p) {
      for (int64_t k = 0; k < pairs; ++k) {
        _mm512_storeu_si512(widened.data() + (p * pairs + k) * kStep,
                            (__m512i)widen_step(panel + p * stride + k * kStep));
      }
    }
    tiles<P>(x, widened.data(), pairs * kStep, scales, scale_stride, bias, y, rows, N, pairs,
             n0);
  }
}

}  // namespace

int64_t switchyard_xeon::dot_pairs(const at::Tensor& packed) {
  if (packed.dim() != 3 || packed.size(2) != kStep) return -1;
  if (packed.scalar_type() == at::kBFloat16) return packed.size(1);
  if (packed.scalar_type() == at::kChar && packed.size(1) > kScaleSteps) {
    return packed.size(1) - kScaleSteps;
  }
  return -1;
}

namespace {

template <typename W>
void run_dot(const uint32_t* xp, const W* wp, const float* bias, float* yp, int64_t M, int64_t N,
             int64_t pairs, int64_t panels, int64_t stride) {
  const int64_t groups = (panels + kGroup - 1) / kGroup;
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - m0);
    // Threads split groups of kGroup panels; the last group may be short.
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p = g * kGroup;
        const W* panel = wp + p * stride;
        const uint32_t* xr = xp + m0 * pairs;
        float* yr = yp + m0 * N;
        switch (std::min(kGroup, panels - p)) {
          case 1: panel_rows<1>(xr, panel, bias, yr, rows, N, pairs, p * kPanel); break;
          case 2: panel_rows<2>(xr, panel, bias, yr, rows, N, pairs, p * kPanel); break;
          case 3: panel_rows<3>(xr, panel, bias, yr, rows, N, pairs, p * kPanel); break;
          default: panel_rows<4>(xr, panel, bias, yr, rows, N, pairs, p * kPanel);
        }
      }
    });
  }
}

}  // namespace

at::Tensor switchyard_xeon::panel_linear_bf16_dot(const at::Tensor& x, const at::Tensor& packed,
                                                  const float* bias, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), pairs = dot_pairs(packed);
  TORCH_CHECK(pairs == (K + 1) / 2 && packed.is_contiguous(),
              "panel_linear: dot panels do not match x");
  std::vector<uint32_t> pairs_of_x(M * pairs);
  rows_as_pairs(x.data_ptr<float>(), M, K, pairs, pairs_of_x.data());
  at::Tensor y = at::empty({M, N}, x.options());
  const int64_t panels = packed.size(0), stride = packed.size(1) * kStep;
  if (packed.scalar_type() == at::kChar) {
    run_dot(pairs_of_x.data(), packed.data_ptr<int8_t>(), bias, y.data_ptr<float>(), M, N, pairs,
            panels, stride);
  } else {
    run_dot(pairs_of_x.data(), packed.data_ptr<bf16>(), bias, y.data_ptr<float>(), M, N, pairs,
            panels, stride);
  }
  return y;
}

TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def("pack_panels_bf16_dot(Tensor weight) -> Tensor");
  m.def("pack_panels_int8_dot(Tensor weight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_xeon, CPU, m) {
  m.impl("pack_panels_bf16_dot", &pack_panels_bf16_dot);
  m.impl("pack_panels_int8_dot", &pack_panels_int8_dot);
}

#else  // no AVX512_BF16: the layout is never packed here, so panel_linear never comes here.

int64_t switchyard_xeon::dot_pairs(const at::Tensor&) { return -1; }

at::Tensor switchyard_xeon::panel_linear_bf16_dot(const at::Tensor&, const at::Tensor&,
                                                  const float*, int64_t) {
  TORCH_CHECK(false, "panel_linear: bf16 dot panels need AVX512_BF16");
}

#endif
