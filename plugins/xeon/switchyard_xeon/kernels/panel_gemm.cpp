// fp32 linear layers over panel-packed weights: y = x @ W.T (+ bias), for the
// few-row matmuls of decoding (one row per sequence) and the many-row ones of
// prefill alike.
//
// Packing: W [N, K] becomes panels of 16 output features, each stored k-major
// ([N/16, K, 16], zero-padded), so one panel is a single contiguous stream and
// each k step of the micro-kernel loads 16 weights as two 8-float vectors.
// Micro-kernel: up to 6 rows of x times one panel, 12 AVX2 accumulators held in
// registers across the whole K loop; each weight vector loaded feeds one FMA
// per row, each x element is broadcast once per panel. At one row the kernel
// is a pure weight stream; at dozens of rows the panel (K x 64 bytes) stays in
// L2 while the row tiles pass over it. Threads split the panels.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SY_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 16;  // output features per panel
constexpr int64_t kRows = 6;    // rows of x per micro-kernel call
constexpr int64_t kChunk = 512;  // rows per pass over the weights (each pass streams them all)

at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_panels: weight must be float32 [N, K]");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const float* row = src + (p * kPanel + j) * K;
        float* col = dst + p * K * kPanel + j;
        for (int64_t k = 0; k < K; ++k) col[k * kPanel] = row[k];
      }
    }
  });
  return packed;
}

// out[r, 0:16] = sum_k x[r, k] * panel[k, 0:16] for R rows (R <= kRows).
// The accumulators are named variables, not an array: GCC keeps an array of
// vectors in registers but also stores it back on every iteration.
template <int R>
inline void micro(const float* x, int64_t x_stride, const float* panel, int64_t K,
                  float* out /* [R][16] */) {
#ifdef SY_AVX2
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0;
  __m256 a3 = a0, b3 = a0, a4 = a0, b4 = a0, a5 = a0, b5 = a0;
  const float* x0 = x;
  const float* x1 = x + x_stride;
  const float* x2 = x + 2 * x_stride;
  const float* x3 = x + 3 * x_stride;
  const float* x4 = x + 4 * x_stride;
  const float* x5 = x + 5 * x_stride;
#define SY_ROW(i)                                   \
  if constexpr (R > i) {                            \
    const __m256 v = _mm256_broadcast_ss(x##i + k); \
    a##i = _mm256_fmadd_ps(v, w0, a##i);            \
    b##i = _mm256_fmadd_ps(v, w1, b##i);            \
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    SY_ROW(0) SY_ROW(1) SY_ROW(2) SY_ROW(3) SY_ROW(4) SY_ROW(5)
  }
#undef SY_ROW
#define SY_STORE(i)                                   \
  if constexpr (R > i) {                              \
    _mm256_storeu_ps(out + i * kPanel, a##i);         \
    _mm256_storeu_ps(out + i * kPanel + 8, b##i);     \
  }
  SY_STORE(0) SY_STORE(1) SY_STORE(2) SY_STORE(3) SY_STORE(4) SY_STORE(5)
#undef SY_STORE
#else
  float acc[R][kPanel] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kPanel;
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * x_stride + k];
      for (int j = 0; j < kPanel; ++j) acc[r][j] += xv * w[j];
    }
  }
  for (int r = 0; r < R; ++r) std::copy(acc[r], acc[r] + kPanel, out + r * kPanel);
#endif
}

template <int R>
void tile(const float* x, int64_t K, const float* panel, const float* bias, float* y,
          int64_t N, int64_t n0) {
  float buf[kRows * kPanel];
  micro<R>(x, K, panel, K, buf);
  const int64_t width = std::min(kPanel, N - n0);
  for (int r = 0; r < R; ++r) {
    float* dst = y + r * N + n0;
    const float* src = buf + r * kPanel;
    if (bias) {
      for (int64_t j = 0; j < width; ++j) dst[j] = src[j] + bias[n0 + j];
    } else {
      for (int64_t j = 0; j < width; ++j) dst[j] = src[j];
    }
  }
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed,
                        const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "panel_linear: x must be a contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.size(1) == x.size(1) &&
                  packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  N > (packed.size(0) - 1) * kPanel && N <= packed.size(0) * kPanel,
              "panel_linear: packed weight does not match x or N");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(),
                "panel_linear: bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - m0);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const float* panel = wp + p * K * kPanel;
        for (int64_t r = 0; r < rows; r += kRows) {
          const float* xr = xp + (m0 + r) * K;
          float* yr = yp + (m0 + r) * N;
          switch (std::min(kRows, rows - r)) {
            case 1: tile<1>(xr, K, panel, bp, yr, N, p * kPanel); break;
            case 2: tile<2>(xr, K, panel, bp, yr, N, p * kPanel); break;
            case 3: tile<3>(xr, K, panel, bp, yr, N, p * kPanel); break;
            case 4: tile<4>(xr, K, panel, bp, yr, N, p * kPanel); break;
            case 5: tile<5>(xr, K, panel, bp, yr, N, p * kPanel); break;
            default: tile<6>(xr, K, panel, bp, yr, N, p * kPanel);
          }
        }
      }
    });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_xeon, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}
