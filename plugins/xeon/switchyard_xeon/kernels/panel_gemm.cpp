// fp32 linear layers over panel-packed weights: y = x @ W.T (+ bias), for the
// few-row matmuls of decoding (one row per sequence) and the many-row ones of
// prefill alike. The math is fp32; the weights are stored as fp32 or as bf16.
//
// Packing: W [N, K] becomes panels of 16 output features, each stored k-major
// ([N/16, K, 16], zero-padded), so one panel is a single contiguous stream and
// each k step of the micro-kernel loads 16 weights as two 8-float vectors.
// Micro-kernel: up to 6 rows of x times one panel, 12 AVX2 accumulators held in
// registers across the whole K loop; each weight vector loaded feeds one FMA
// per row, each x element is broadcast once per panel. At one row the kernel
// is a pure weight stream; at dozens of rows the panel (K x 64 bytes) stays in
// L2 while the row tiles pass over it. Threads split the panels. The kernel
// prefetches its weight stream a few KB ahead (past the last panel too:
// prefetches never fault).
//
// bf16 storage halves that stream. A bf16 value is the top half of the fp32
// with the same bits, so widening is exact: interleaving 16-bit zeros below
// the stored halves (vpunpck{l,h}wd, one shuffle per 8 weights) gives the
// fp32 weights. That interleave works within 128-bit lanes, so each k step's
// 16 bf16 weights are stored in the order kBf16Order, which it undoes.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SY_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 16;  // output features per panel
constexpr int64_t kRows = 6;    // rows of x per micro-kernel call
constexpr int64_t kChunk = 512;  // rows per pass over the weights (each pass streams them all)
// Prefetch distance in the weight stream: 2-8 KB ahead measured alike (a 30-layer
// sweep of the 135M shape's linears, 1-64 rows: 0.80-0.94x the time without it).
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kWidenRows = 96;  // bf16 panels: widen once per pass above this many rows

using bf16 = at::BFloat16;

// Output feature held at each of the 16 stored positions of a bf16 k step:
// unpacklo takes positions 0-3 and 8-11 (features 0-7), unpackhi 4-7 and 12-15.
constexpr int kBf16Order[kPanel] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

template <typename W>
void pack_into(const W* src, W* dst, int64_t N, int64_t K, int64_t panels) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t s = 0; s < kPanel; ++s) {
        const int64_t j = std::is_same_v<W, bf16> ? kBf16Order[s] : s;
        if (p * kPanel + j >= N) continue;
        const W* row = src + (p * kPanel + j) * K;
        W* col = dst + p * K * kPanel + s;
        for (int64_t k = 0; k < K; ++k) col[k * kPanel] = row[k];
      }
    }
  });
}

// Panels in the weight's own dtype: fp32, or bf16 (widened to fp32 in the kernel).
at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat ||
                                    weight.scalar_type() == at::kBFloat16),
              "pack_panels: weight must be float32 or bfloat16 [N, K]");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, K, kPanel}, w.options());
  if (w.scalar_type() == at::kFloat) {
    pack_into(w.data_ptr<float>(), packed.data_ptr<float>(), N, K, panels);
  } else {
    pack_into(w.data_ptr<bf16>(), packed.data_ptr<bf16>(), N, K, panels);
  }
  return packed;
}

#ifdef SY_AVX2
// One k step of a panel as two vectors of 8 fp32 weights (features 0-7, 8-15).
inline void load_step(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(w);
  w1 = _mm256_loadu_ps(w + 8);
}

inline void load_step(const bf16* w, __m256& w0, __m256& w1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i zero = _mm256_setzero_si256();
  w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
  w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}
#endif

inline float weight_at(const float* step, int j) { return step[j]; }
// The order swaps positions 4-7 with 8-11, so it is its own inverse: feature j
// is stored at position kBf16Order[j].
constexpr bool order_is_involution() {
  for (int s = 0; s < kPanel; ++s) {
    if (kBf16Order[kBf16Order[s]] != s) return false;
  }
  return true;
}
static_assert(order_is_involution(), "kBf16Order must be its own inverse");

inline float weight_at(const bf16* step, int j) { return static_cast<float>(step[kBf16Order[j]]); }

// y[r, n0:n0+16] = sum_k x[r, k] * panel[k, 0:16] (+ bias) for R rows (R <= kRows),
// stored straight from the accumulators when the panel is whole (n0 + 16 <= N),
// through a small buffer for the ragged last panel.
// The accumulators are named variables, not an array: GCC keeps an array of
// vectors in registers but also stores it back on every iteration.
template <int R, typename W>
inline void micro(const float* x, int64_t K, const W* panel, const float* bias, float* y,
                  int64_t N, int64_t n0) {
  const int64_t width = std::min(kPanel, N - n0);
#ifdef SY_AVX2
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0;
  __m256 a3 = a0, b3 = a0, a4 = a0, b4 = a0, a5 = a0, b5 = a0;
  const float* x0 = x;
  const float* x1 = x + K;
  const float* x2 = x + 2 * K;
  const float* x3 = x + 3 * K;
  const float* x4 = x + 4 * K;
  const float* x5 = x + 5 * K;
#define SY_ROW(i)                                   \
  if constexpr (R > i) {                            \
    const __m256 v = _mm256_broadcast_ss(x##i + k); \
    a##i = _mm256_fmadd_ps(v, w0, a##i);            \
    b##i = _mm256_fmadd_ps(v, w1, b##i);            \
  }
  // Weights kPrefetchBytes ahead (into the next panel near the end: panels are
  // contiguous), so the first row tile of a panel does not wait on DRAM. The
  // hardware prefetcher alone left batch-1 decode at ~14 GB/s of ~20.
  constexpr int64_t ahead = kPrefetchBytes / (kPanel * sizeof(W));
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + ahead) * kPanel), _MM_HINT_T0);
    load_step(panel + k * kPanel, w0, w1);
    SY_ROW(0) SY_ROW(1) SY_ROW(2) SY_ROW(3) SY_ROW(4) SY_ROW(5)
  }
#undef SY_ROW
  if (width == kPanel) {
    if (bias) {
      const __m256 c0 = _mm256_loadu_ps(bias + n0), c1 = _mm256_loadu_ps(bias + n0 + 8);
#define SY_BIAS(i)                          \
  if constexpr (R > i) {                    \
    a##i = _mm256_add_ps(a##i, c0);         \
    b##i = _mm256_add_ps(b##i, c1);         \
  }
      SY_BIAS(0) SY_BIAS(1) SY_BIAS(2) SY_BIAS(3) SY_BIAS(4) SY_BIAS(5)
#undef SY_BIAS
    }
#define SY_STORE(i)                                        \
  if constexpr (R > i) {                                   \
    _mm256_storeu_ps(y + i * N + n0, a##i);                \
    _mm256_storeu_ps(y + i * N + n0 + 8, b##i);            \
  }
    SY_STORE(0) SY_STORE(1) SY_STORE(2) SY_STORE(3) SY_STORE(4) SY_STORE(5)
#undef SY_STORE
    return;
  }
  float buf[kRows * kPanel];
#define SY_SPILL(i)                                   \
  if constexpr (R > i) {                              \
    _mm256_storeu_ps(buf + i * kPanel, a##i);         \
    _mm256_storeu_ps(buf + i * kPanel + 8, b##i);     \
  }
  SY_SPILL(0) SY_SPILL(1) SY_SPILL(2) SY_SPILL(3) SY_SPILL(4) SY_SPILL(5)
#undef SY_SPILL
#else
  float buf[kRows * kPanel] = {};
  for (int64_t k = 0; k < K; ++k) {
    const W* w = panel + k * kPanel;
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
      for (int j = 0; j < kPanel; ++j) buf[r * kPanel + j] += xv * weight_at(w, j);
    }
  }
#endif
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < width; ++j) {
      y[r * N + n0 + j] = buf[r * kPanel + j] + (bias ? bias[n0 + j] : 0.0f);
    }
  }
}

// Every row tile of rows [0, rows) of x times one panel (output features n0..).
template <typename W>
void panel_rows(const float* x, const W* panel, const float* bias, float* y, int64_t rows,
                int64_t N, int64_t K, int64_t n0) {
  for (int64_t r = 0; r < rows; r += kRows) {
    const float* xr = x + r * K;
    float* yr = y + r * N;
    switch (std::min(kRows, rows - r)) {
      case 1: micro<1>(xr, K, panel, bias, yr, N, n0); break;
      case 2: micro<2>(xr, K, panel, bias, yr, N, n0); break;
      case 3: micro<3>(xr, K, panel, bias, yr, N, n0); break;
      case 4: micro<4>(xr, K, panel, bias, yr, N, n0); break;
      case 5: micro<5>(xr, K, panel, bias, yr, N, n0); break;
      default: micro<6>(xr, K, panel, bias, yr, N, n0);
    }
  }
}

// A bf16 panel widened to an fp32 one, in the fp32 feature order.
void widen(const bf16* panel, int64_t K, float* out) {
#ifdef SY_AVX2
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    load_step(panel + k * kPanel, w0, w1);
    _mm256_storeu_ps(out + k * kPanel, w0);
    _mm256_storeu_ps(out + k * kPanel + 8, w1);
  }
#else
  for (int64_t k = 0; k < K; ++k) {
    for (int j = 0; j < kPanel; ++j) out[k * kPanel + j] = weight_at(panel + k * kPanel, j);
  }
#endif
}

template <typename W>
void run_panels(const float* xp, const W* wp, const float* bp, float* yp, int64_t M, int64_t N,
                int64_t K, int64_t panels) {
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - m0);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      // Past kWidenRows rows a bf16 panel is widened once into an L2 buffer for
      // all row tiles instead of in registers per tile: 0.92x fp32's time at 256
      // rows instead of 1.05x, while at 8-64 rows widening in registers is
      // faster (0.69-0.92x against 0.96-0.97x; linear_sweep.py, 135M shape).
      std::vector<float> wide;
      for (int64_t p = begin; p < end; ++p) {
        const W* panel = wp + p * K * kPanel;
        const float* xr = xp + m0 * K;
        float* yr = yp + m0 * N;
        if constexpr (std::is_same_v<W, bf16>) {
          if (rows > kWidenRows) {
            wide.resize(K * kPanel);
            widen(panel, K, wide.data());
            panel_rows(xr, wide.data(), bp, yr, rows, N, K, p * kPanel);
            continue;
          }
        }
        panel_rows(xr, panel, bp, yr, rows, N, K, p * kPanel);
      }
    });
  }
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed,
                        const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "panel_linear: x must be a contiguous float32 [M, K]");
  // W8A8 panels (panel_w8a8.cpp) carry their own header and check themselves.
  if (switchyard_xeon::is_w8a8_panels(packed)) {
    return switchyard_xeon::panel_linear_w8a8(x, packed, bias, N);
  }
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(),
                "panel_linear: bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  // Weight-only quantized panels for fp32 math (panel_quant_fma.cpp) carry a header.
  if (switchyard_xeon::is_quant_fma_panels(packed)) {
    return switchyard_xeon::panel_linear_quant_fma(x, packed, bp, N);
  }
  // Three kinds of layout: [panels, K, 16] fp32 or bf16 (fp32 math, here), the
  // k-pair layouts of panel_dot_bf16.cpp (bf16 or int8 weights, K/2 rounded up
  // steps), and the uint4 groups of panel_dot_uint4.cpp (which checks K itself).
  const bool uint4 = switchyard_xeon::is_uint4_panels(packed);
  const int64_t dot_pairs = switchyard_xeon::dot_pairs(packed);
  const bool dot = dot_pairs >= 0;
  const int64_t k_steps = dot ? (x.size(1) + 1) / 2 : x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
                  (uint4 || (dot ? dot_pairs : packed.size(1)) == k_steps) &&
                  (uint4 || dot ||
                   (packed.size(2) == kPanel && (packed.scalar_type() == at::kFloat ||
                                                 packed.scalar_type() == at::kBFloat16))) &&
                  N > (packed.size(0) - 1) * kPanel && N <= packed.size(0) * kPanel,
              "panel_linear: packed weight does not match x or N");
  if (uint4) return switchyard_xeon::panel_linear_uint4_dot(x, packed, bp, N);
  if (dot) return switchyard_xeon::panel_linear_bf16_dot(x, packed, bp, N);
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (packed.scalar_type() == at::kFloat) {
    run_panels(x.data_ptr<float>(), packed.data_ptr<float>(), bp, y.data_ptr<float>(), M, N, K,
               panels);
  } else {
    run_panels(x.data_ptr<float>(), packed.data_ptr<bf16>(), bp, y.data_ptr<float>(), M, N, K,
               panels);
  }
  return y;
}

}  // namespace

at::Tensor switchyard_xeon::panel_linear(const at::Tensor& x, const at::Tensor& packed,
                                         const c10::optional<at::Tensor>& bias, int64_t n) {
  return ::panel_linear(x, packed, bias, n);
}

TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_xeon, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}
