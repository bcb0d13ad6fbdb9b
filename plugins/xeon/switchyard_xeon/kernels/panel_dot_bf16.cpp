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
// Micro-kernel: up to 6 rows of x times two neighbouring panels (32 output
// features), 12 zmm accumulators held across the whole K loop. Each k-pair of
// a row (two bf16, 32 bits) is broadcast once and feeds one vdpbf16ps per
// panel, so each step does 12 dot products (24 x 16 multiply-adds) for two
// weight loads and six broadcasts. At one row it is a pure weight stream
// (half the bytes of fp32), prefetched 4 KB ahead as panel_gemm.cpp does; at
// dozens of rows the two panels stay in L2 while the row tiles pass over them.
// Against panel_gemm.cpp's fp32 math on the same bf16 weights this doubles the
// multiply-adds per instruction, which is what bounds batched decoding.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 16;        // output features per panel
constexpr int64_t kRows = 6;          // rows of x per micro-kernel call
constexpr int64_t kChunk = 512;       // rows per pass over the weights
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kStep = 2 * kPanel;  // bf16 values per k-pair step of a panel

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

// y[r, n0 : n0 + 16 * P] for R rows (R <= kRows) and P panels (1 or 2) starting at
// `panel`, stored straight from the accumulators where the features are whole.
template <int R, int P>
inline void micro(const uint32_t* x, int64_t pairs, const bf16* panel, const float* bias,
                  float* y, int64_t N, int64_t n0) {
  const int64_t stride = pairs * kStep;  // bf16 values from one panel to the next
  __m512 a0 = _mm512_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0;
  __m512 a3 = a0, b3 = a0, a4 = a0, b4 = a0, a5 = a0, b5 = a0;
  constexpr int64_t ahead = kPrefetchBytes / (kStep * sizeof(bf16));
  const bf16* p0 = panel;
  const bf16* p1 = panel + stride;
#define SY_ROW(i)                                                                       \
  if constexpr (R > i) {                                                                \
    const __m512bh v = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * pairs + k])); \
    a##i = _mm512_dpbf16_ps(a##i, w0, v);                                               \
    if constexpr (P > 1) b##i = _mm512_dpbf16_ps(b##i, w1, v);                          \
  }
  for (int64_t k = 0; k < pairs; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(p0 + (k + ahead) * kStep), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p0 + k * kStep);
    __m512bh w1;
    if constexpr (P > 1) {
      _mm_prefetch(reinterpret_cast<const char*>(p1 + (k + ahead) * kStep), _MM_HINT_T0);
      w1 = (__m512bh)_mm512_loadu_si512(p1 + k * kStep);
    }
    SY_ROW(0) SY_ROW(1) SY_ROW(2) SY_ROW(3) SY_ROW(4) SY_ROW(5)
  }
#undef SY_ROW
  // Features past N (the ragged last panel) are masked off on store.
  const int64_t left0 = std::min(kPanel, N - n0);
  const int64_t left1 = P > 1 ? std::min(kPanel, N - n0 - kPanel) : 0;
  const __mmask16 m0 = left0 >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << left0) - 1);
  const __mmask16 m1 = left1 >= kPanel ? __mmask16(0xFFFF)
                                       : __mmask16(left1 > 0 ? (1u << left1) - 1 : 0);
  __m512 c0 = _mm512_setzero_ps(), c1 = c0;
  if (bias) {
    c0 = _mm512_maskz_loadu_ps(m0, bias + n0);
    if constexpr (P > 1) c1 = _mm512_maskz_loadu_ps(m1, bias + n0 + kPanel);
  }
#define SY_STORE(i)                                                               \
  if constexpr (R > i) {                                                          \
    _mm512_mask_storeu_ps(y + i * N + n0, m0, _mm512_add_ps(a##i, c0));           \
    if constexpr (P > 1)                                                          \
      _mm512_mask_storeu_ps(y + i * N + n0 + kPanel, m1, _mm512_add_ps(b##i, c1)); \
  }
  SY_STORE(0) SY_STORE(1) SY_STORE(2) SY_STORE(3) SY_STORE(4) SY_STORE(5)
#undef SY_STORE
}

// Every row tile of rows [0, rows) times P panels from `panel` (output features n0..).
template <int P>
void panel_rows(const uint32_t* x, const bf16* panel, const float* bias, float* y, int64_t rows,
                int64_t N, int64_t pairs, int64_t n0) {
  for (int64_t r = 0; r < rows; r += kRows) {
    const uint32_t* xr = x + r * pairs;
    float* yr = y + r * N;
    switch (std::min(kRows, rows - r)) {
      case 1: micro<1, P>(xr, pairs, panel, bias, yr, N, n0); break;
      case 2: micro<2, P>(xr, pairs, panel, bias, yr, N, n0); break;
      case 3: micro<3, P>(xr, pairs, panel, bias, yr, N, n0); break;
      case 4: micro<4, P>(xr, pairs, panel, bias, yr, N, n0); break;
      case 5: micro<5, P>(xr, pairs, panel, bias, yr, N, n0); break;
      default: micro<6, P>(xr, pairs, panel, bias, yr, N, n0);
    }
  }
}

}  // namespace

bool switchyard_xeon::is_bf16_dot_packed(const at::Tensor& packed) {
  return packed.dim() == 3 && packed.size(2) == kStep && packed.scalar_type() == at::kBFloat16;
}

at::Tensor switchyard_xeon::panel_linear_bf16_dot(const at::Tensor& x, const at::Tensor& packed,
                                                  const float* bias, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), pairs = packed.size(1);
  const int64_t panels = packed.size(0), duos = (panels + 1) / 2;
  TORCH_CHECK(pairs == (K + 1) / 2 && packed.is_contiguous(),
              "panel_linear: bf16 dot panels do not match x");
  std::vector<uint32_t> pairs_of_x(M * pairs);
  rows_as_pairs(x.data_ptr<float>(), M, K, pairs, pairs_of_x.data());
  const uint32_t* xp = pairs_of_x.data();
  const bf16* wp = packed.data_ptr<bf16>();
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - m0);
    // Threads split pairs of panels; an odd last panel runs alone.
    at::parallel_for(0, duos, 1, [&](int64_t begin, int64_t end) {
      for (int64_t d = begin; d < end; ++d) {
        const int64_t p = 2 * d;
        const bf16* panel = wp + p * pairs * kStep;
        const uint32_t* xr = xp + m0 * pairs;
        float* yr = yp + m0 * N;
        if (p + 1 < panels) {
          panel_rows<2>(xr, panel, bias, yr, rows, N, pairs, p * kPanel);
        } else {
          panel_rows<1>(xr, panel, bias, yr, rows, N, pairs, p * kPanel);
        }
      }
    });
  }
  return y;
}

TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def("pack_panels_bf16_dot(Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_xeon, CPU, m) {
  m.impl("pack_panels_bf16_dot", &pack_panels_bf16_dot);
}

#else  // no AVX512_BF16: the layout is never packed here, so panel_linear never comes here.

bool switchyard_xeon::is_bf16_dot_packed(const at::Tensor&) { return false; }

at::Tensor switchyard_xeon::panel_linear_bf16_dot(const at::Tensor&, const at::Tensor&,
                                                  const float*, int64_t) {
  TORCH_CHECK(false, "panel_linear: bf16 dot panels need AVX512_BF16");
}

#endif
