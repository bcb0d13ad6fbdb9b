// Weight-only quantized linears for CPUs without AVX512_BF16 (AVX2 + FMA:
// Zen 2/3, Haswell to Ice Lake): y = x @ W.T (+ bias) in fp32, where W is
// stored as int8 per output feature (`--quantize int8`), uint4 in groups
// along K with a scale and zero point per group (`int4`, GPTQ, AWQ), or FP8
// E4M3 with a scale per feature (`fp8`). Batch-1 decoding reads every weight
// once per token, so a weight stream of 1 or 0.5 bytes instead of fp32's 4
// is what makes these formats fast where the bf16 dot-product panels
// (panel_dot_bf16.cpp, panel_dot_uint4.cpp) do not build.
//
// The math is fp32 over the weight the format defines, widened in registers:
//   int8:  sum_k x_k q_k, then times s[n] (one rounding of the sum, one of the
//          product) plus the bias;
//   fp8:   the same with the E4M3 values (exact in fp32) and the caller's
//          per-feature output scale (fp8_linears.py passes a * s[n] and inputs
//          already rounded to E4M3, so every product is exact);
//   uint4: s * (sum_k x_k q_k - z sum_k x_k) per group, the same sum of
//          x (q - z) s up to fp32 rounding; no scale after the sums.
//
// Packing: a 1-D uint8 tensor, a 64-byte Header, then panels of 16 output
// features, each one contiguous stream (stride a multiple of 64 bytes):
//   int8, fp8: K steps of 16 bytes (feature f at byte f), then 16 fp32 scales;
//   uint4:     K steps of 8 bytes (feature f in the low nibble of byte f,
//              feature f + 8 in the high one), then per group 16 fp32 scales
//              and 16 fp32 zero points (given as uint8 0..15, or as fp32 for
//              groups of q * s + b, GGUF Q4_1's form: z = -b / s).
// Zero padding past N (scales 0) and past K in a short last group (never read).
//
// Micro-kernel: up to 6 rows of x times one panel, two 8-float accumulators a
// row (four chains at one row, where FMA latency would bound one); each step
// widens 16 weights once and feeds one FMA per row. uint4 sums x q per group
// and folds in scale and zero point at the group's end:
//   sum_k x_k (q_k - z) s = s (sum_k x_k q_k - z sum_k x_k),
// the row sums of x per group taken once per call. Past kWidenRows rows a
// thread widens a panel once into an fp32 buffer (uint4 as (q - z) s) that
// every row tile reads. Threads split the panels.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kMagic = 0x414d4651444c5953;  // "SYLDQFMA"
constexpr int64_t kPanel = 16;
constexpr int64_t kHeaderBytes = 64;
constexpr int64_t kChunk = 512;          // rows per pass over the weights
constexpr int64_t kPrefetchBytes = 2048;
// Above this many rows a panel is widened once into an fp32 buffer (see the
// header), by loader: int8 and uint4 widen in a few instructions, so tiles redo
// it in registers up to 64 rows (135M-shape sweep, Zen 3, 2 threads, 32 rows:
// 1.0x bf16-stored panels' time in registers, 1.2x through the buffer); E4M3
// takes eleven per 8 weights, so FP8 goes through the buffer from 4 rows
// (32 rows: 1.35x bf16's time through it, 2.1x in registers).
constexpr int64_t kWidenRows = 64;
constexpr int64_t kWidenRowsFp8 = 4;

enum Kind : int64_t { kInt8 = 1, kUint4 = 2, kFp8 = 3 };

struct Header {
  int64_t magic, kind, N, K, G, panels, stride;
};

int64_t step_bytes(int64_t kind) { return kind == kUint4 ? kPanel / 2 : kPanel; }

int64_t const_bytes(int64_t kind, int64_t K, int64_t G) {
  const int64_t groups = kind == kUint4 ? (K + G - 1) / G : 1;
  return groups * (kind == kUint4 ? 2 : 1) * kPanel * static_cast<int64_t>(sizeof(float));
}

bool read_header(const at::Tensor& packed, Header& h) {
  if (packed.dim() != 1 || packed.scalar_type() != at::kByte || !packed.is_contiguous() ||
      packed.size(0) < kHeaderBytes) {
    return false;
  }
  std::memcpy(&h, packed.data_ptr<uint8_t>(), sizeof(h));
  return h.magic == kMagic && (h.kind == kInt8 || h.kind == kUint4 || h.kind == kFp8) &&
         packed.size(0) == kHeaderBytes + h.panels * h.stride;
}

// ---- widening 8 stored weights to fp32 -------------------------------------------------

inline __m256 widen_int8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// E4M3 bytes as fp32, exactly: a normal code's exponent and mantissa moved to
// fp32's positions with the bias difference (127 - 7) added; a subnormal one
// (exponent 0) is m * 2^-9, converted from the integer. No denormal fp32 is
// made on the way, so flush-to-zero modes cannot change the result. The NaN
// codes (0x7F, 0xFF) come out as +-480; the quantizers never write them.
inline __m256 widen_fp8(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i em = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 tiny = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / 512.0f));
  const __m256 is_tiny = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em));
  return _mm256_or_ps(_mm256_blendv_ps(normal, tiny, is_tiny), _mm256_castsi256_ps(sign));
}

// What a tile's loop reads for one step: 16 weights as two vectors of 8 fp32
// (features 0-7, 8-15). Ungrouped loaders yield the weights the sums need;
// the uint4 one yields the integers q and folds scale and zero point in per
// group (see fold_group).
struct Fp32Steps {
  static constexpr bool kGrouped = false;
  const float* w;
  void step(int64_t k, __m256& w0, __m256& w1) const {
    w0 = _mm256_loadu_ps(w + k * kPanel);
    w1 = _mm256_loadu_ps(w + k * kPanel + 8);
  }
  const char* at(int64_t k) const { return reinterpret_cast<const char*>(w + k * kPanel); }
};

struct Int8Steps {
  static constexpr bool kGrouped = false;
  const uint8_t* w;
  void step(int64_t k, __m256& w0, __m256& w1) const {
    w0 = widen_int8(w + k * kPanel);
    w1 = widen_int8(w + k * kPanel + 8);
  }
  const char* at(int64_t k) const { return reinterpret_cast<const char*>(w + k * kPanel); }
};

struct Fp8Steps {
  static constexpr bool kGrouped = false;
  const uint8_t* w;
  void step(int64_t k, __m256& w0, __m256& w1) const {
    w0 = widen_fp8(w + k * kPanel);
    w1 = widen_fp8(w + k * kPanel + 8);
  }
  const char* at(int64_t k) const { return reinterpret_cast<const char*>(w + k * kPanel); }
};

// The integers q of a uint4 step, exact in fp32: sum_k x (q - z) s is taken
// as s * (sum_k x q - z sum_k x) per group, so a step costs two nibble
// extractions and two conversions, not a subtraction and a multiplication more
// per weight (at one row the kernel is bound by those instructions, not by
// the half byte per weight it reads).
struct Uint4Steps {
  static constexpr bool kGrouped = true;
  const uint8_t* w;
  const float* consts;  // per group: 16 scales, 16 zero points
  void step(int64_t k, __m256& w0, __m256& w1) const {
    const __m256i v = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k * (kPanel / 2))));
    w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
  // The dequantized weights of step k in group g, (q - z) * s exactly (widening a panel).
  void dequant(int64_t g, int64_t k, __m256& w0, __m256& w1) const {
    const float* c = consts + g * 2 * kPanel;
    step(k, w0, w1);
    w0 = _mm256_mul_ps(_mm256_sub_ps(w0, _mm256_loadu_ps(c + kPanel)), _mm256_loadu_ps(c));
    w1 = _mm256_mul_ps(_mm256_sub_ps(w1, _mm256_loadu_ps(c + kPanel + 8)),
                       _mm256_loadu_ps(c + 8));
  }
  const char* at(int64_t k) const { return reinterpret_cast<const char*>(w + k * (kPanel / 2)); }
};

// What a tile writes and folds with: a per-feature scale after the sums
// (int8, fp8; null for uint4), the bias, and for uint4 each row's sum of its
// inputs per group (xsum[r * groups + g]).
struct Epilogue {
  const float* scale;  // this panel's 16, or null
  const float* bias;   // the layer's, or null
  int64_t n0, width;
  const float* xsum;
  int64_t groups;
};

// Group g's sums of R rows (acc, R x 16) into the tile's outputs (out, R x 16):
// out += acc for ungrouped loaders (one group), s * (acc - z * xsum) for uint4.
template <typename L>
inline void fold_group(const L& steps, int64_t g, int R, const float* acc, const Epilogue& e,
                       float* out) {
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      __m256 a = _mm256_loadu_ps(acc + r * kPanel + 8 * h);
      if constexpr (L::kGrouped) {
        const float* c = steps.consts + g * 2 * kPanel;
        const __m256 z = _mm256_loadu_ps(c + kPanel + 8 * h);
        a = _mm256_fnmadd_ps(z, _mm256_set1_ps(e.xsum[r * e.groups + g]), a);
        a = _mm256_mul_ps(a, _mm256_loadu_ps(c + 8 * h));
      }
      float* o = out + r * kPanel + 8 * h;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), a));
    }
  }
}

// y[r, 0:16] of the tile from its sums (R rows of 16), scaled, plus bias.
inline void finish(const float* out, int R, const Epilogue& e, float* y, int64_t N) {
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < e.width; ++j) {
      float v = out[r * kPanel + j];
      if (e.scale) v *= e.scale[j];
      y[r * N + e.n0 + j] = e.bias ? v + e.bias[e.n0 + j] : v;
    }
  }
}

// One or two rows: the FMA latency, not the weights, would bound a single chain
// of sums per vector, so consecutive steps go to different accumulators (four
// chains a vector for one row, two for two rows), added at each group's end.
template <int R, typename L>
inline void micro_narrow(const float* x, int64_t K, int64_t G, const L& steps, const Epilogue& e,
                         float* y, int64_t N) {
  static_assert(R == 1 || R == 2, "micro_narrow takes one or two rows");
  const float* x0 = x;
  const float* x1 = x + K;
  float out[2 * kPanel] = {};
  for (int64_t g = 0, k0 = 0; k0 < K; ++g, k0 += G) {
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0,
           b3 = a0;
    const int64_t end = std::min(K, k0 + G);
    int64_t k = k0;
    for (; k + 2 <= end; k += 2) {
      __m256 w0, w1, w2, w3;
      _mm_prefetch(steps.at(k) + kPrefetchBytes, _MM_HINT_T0);
      steps.step(k, w0, w1);
      steps.step(k + 1, w2, w3);
      const __m256 u = _mm256_broadcast_ss(x0 + k), v = _mm256_broadcast_ss(x0 + k + 1);
      if constexpr (R == 1) {  // pairs of steps alternate between chains 0/2 and 1/3
        if ((k - k0) & 2) {
          a1 = _mm256_fmadd_ps(u, w0, a1), b1 = _mm256_fmadd_ps(u, w1, b1);
          a3 = _mm256_fmadd_ps(v, w2, a3), b3 = _mm256_fmadd_ps(v, w3, b3);
        } else {
          a0 = _mm256_fmadd_ps(u, w0, a0), b0 = _mm256_fmadd_ps(u, w1, b0);
          a2 = _mm256_fmadd_ps(v, w2, a2), b2 = _mm256_fmadd_ps(v, w3, b2);
        }
      } else {  // row 0 in chains 0/1, row 1 in 2/3, by step parity
        const __m256 p = _mm256_broadcast_ss(x1 + k), q = _mm256_broadcast_ss(x1 + k + 1);
        a0 = _mm256_fmadd_ps(u, w0, a0), b0 = _mm256_fmadd_ps(u, w1, b0);
        a1 = _mm256_fmadd_ps(v, w2, a1), b1 = _mm256_fmadd_ps(v, w3, b1);
        a2 = _mm256_fmadd_ps(p, w0, a2), b2 = _mm256_fmadd_ps(p, w1, b2);
        a3 = _mm256_fmadd_ps(q, w2, a3), b3 = _mm256_fmadd_ps(q, w3, b3);
      }
    }
    for (; k < end; ++k) {
      __m256 w0, w1;
      steps.step(k, w0, w1);
      const __m256 u = _mm256_broadcast_ss(x0 + k);
      a0 = _mm256_fmadd_ps(u, w0, a0), b0 = _mm256_fmadd_ps(u, w1, b0);
      if constexpr (R == 2) {
        const __m256 p = _mm256_broadcast_ss(x1 + k);
        a2 = _mm256_fmadd_ps(p, w0, a2), b2 = _mm256_fmadd_ps(p, w1, b2);
      }
    }
    float acc[2 * kPanel];
    if constexpr (R == 1) {
      _mm256_storeu_ps(acc, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
      _mm256_storeu_ps(acc + 8, _mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
    } else {
      _mm256_storeu_ps(acc, _mm256_add_ps(a0, a1));
      _mm256_storeu_ps(acc + 8, _mm256_add_ps(b0, b1));
      _mm256_storeu_ps(acc + kPanel, _mm256_add_ps(a2, a3));
      _mm256_storeu_ps(acc + kPanel + 8, _mm256_add_ps(b2, b3));
    }
    fold_group(steps, g, R, acc, e, out);
  }
  finish(out, R, e, y, N);
}

// y[r, n0:n0+16] for R rows: sum over K of x[r, k] * w[k, 0:16], scaled, plus bias.
// Named accumulators (not an array), as panel_gemm.cpp found GCC needs.
template <int R, typename L>
inline void micro(const float* x, int64_t K, int64_t G, const L& steps, const Epilogue& e,
                  float* y, int64_t N) {
  if constexpr (R <= 2) {
    micro_narrow<R>(x, K, G, steps, e, y, N);
    return;
  }
  const float* x0 = x;
  const float* x1 = x + K;
  const float* x2 = x + 2 * K;
  const float* x3 = x + 3 * K;
  const float* x4 = x + 4 * K;
  const float* x5 = x + 5 * K;
  float out[6 * kPanel] = {};
  for (int64_t g = 0, k0 = 0; k0 < K; ++g, k0 += G) {
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0;
    __m256 a3 = a0, b3 = a0, a4 = a0, b4 = a0, a5 = a0, b5 = a0;
#define SY_ROW(i)                                   \
  if constexpr (R > i) {                            \
    const __m256 v = _mm256_broadcast_ss(x##i + k); \
    a##i = _mm256_fmadd_ps(v, w0, a##i);            \
    b##i = _mm256_fmadd_ps(v, w1, b##i);            \
  }
    const int64_t end = std::min(K, k0 + G);
    for (int64_t k = k0; k < end; ++k) {
      __m256 w0, w1;
      _mm_prefetch(steps.at(k) + kPrefetchBytes, _MM_HINT_T0);
      steps.step(k, w0, w1);
      SY_ROW(0) SY_ROW(1) SY_ROW(2) SY_ROW(3) SY_ROW(4) SY_ROW(5)
    }
#undef SY_ROW
    float acc[6 * kPanel];
#define SY_SPILL(i)                                   \
  if constexpr (R > i) {                              \
    _mm256_storeu_ps(acc + i * kPanel, a##i);         \
    _mm256_storeu_ps(acc + i * kPanel + 8, b##i);     \
  }
    SY_SPILL(0) SY_SPILL(1) SY_SPILL(2) SY_SPILL(3) SY_SPILL(4) SY_SPILL(5)
#undef SY_SPILL
    fold_group(steps, g, R, acc, e, out);
  }
  finish(out, R, e, y, N);
}

template <typename L>
void tiles(const float* x, int64_t rows, int64_t K, int64_t G, const L& steps, Epilogue e,
           float* y, int64_t N) {
  constexpr int64_t R = 6;
  const float* xsum = e.xsum;
  for (int64_t r = 0; r < rows; r += R) {
    const float* xr = x + r * K;
    float* yr = y + r * N;
    e.xsum = xsum ? xsum + r * e.groups : nullptr;
    switch (std::min(R, rows - r)) {
      case 1: micro<1>(xr, K, G, steps, e, yr, N); break;
      case 2: micro<2>(xr, K, G, steps, e, yr, N); break;
      case 3: micro<3>(xr, K, G, steps, e, yr, N); break;
      case 4: micro<4>(xr, K, G, steps, e, yr, N); break;
      case 5: micro<5>(xr, K, G, steps, e, yr, N); break;
      default: micro<6>(xr, K, G, steps, e, yr, N);
    }
  }
}

// One panel over `rows` rows: widened in registers, or, when the rows are many,
// once into `wide` (as the weights the sums need: uint4 dequantized) for every tile.
template <typename L>
void panel_rows(const float* x, int64_t rows, int64_t K, int64_t G, const L& steps,
                const Epilogue& e, float* y, int64_t N, std::vector<float>& wide) {
  if (rows <= (std::is_same_v<L, Fp8Steps> ? kWidenRowsFp8 : kWidenRows)) {
    tiles(x, rows, K, G, steps, e, y, N);
    return;
  }
  wide.resize(K * kPanel);
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    if constexpr (L::kGrouped) {
      steps.dequant(k / G, k, w0, w1);
    } else {
      steps.step(k, w0, w1);
    }
    _mm256_storeu_ps(wide.data() + k * kPanel, w0);
    _mm256_storeu_ps(wide.data() + k * kPanel + 8, w1);
  }
  tiles(x, rows, K, K, Fp32Steps{wide.data()}, e, y, N);
}

// Each row's sum of its inputs per group of G (what the uint4 fold subtracts z times).
std::vector<float> group_sums(const float* x, int64_t M, int64_t K, int64_t G) {
  const int64_t groups = (K + G - 1) / G;
  std::vector<float> sums(M * groups);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t k = g * G; k < std::min(K, (g + 1) * G); ++k) s += x[r * K + k];
      sums[r * groups + g] = s;
    }
  }
  return sums;
}

// data: int8 [N, K] (int8), uint8 E4M3 bytes [N, K] (fp8) or int32 [N, ceil(K/8)]
// words of nibbles (uint4); scales fp32 [N] or [N, groups]; zeros uint8 0..15 or fp32
// [N, groups] (uint4 only). Returns the packed layout of the header.
at::Tensor pack_panels_quant_fma(int64_t kind, const at::Tensor& data, const at::Tensor& scales,
                                 const c10::optional<at::Tensor>& zeros, int64_t G, int64_t K) {
  TORCH_CHECK(kind == kInt8 || kind == kUint4 || kind == kFp8,
              "pack_panels_quant_fma: kind must be 1 (int8), 2 (uint4) or 3 (fp8)");
  TORCH_CHECK(data.dim() == 2 && K > 0, "pack_panels_quant_fma: data must be 2-D and K > 0");
  const int64_t N = data.size(0);
  const int64_t groups = kind == kUint4 ? (K + G - 1) / G : 1;
  if (kind == kUint4) {
    TORCH_CHECK(G > 0 && data.scalar_type() == at::kInt && data.size(1) == (K + 7) / 8,
                "pack_panels_quant_fma: uint4 data must be int32 [N, ceil(K / 8)]");
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == groups &&
                    scales.scalar_type() == at::kFloat,
                "pack_panels_quant_fma: uint4 scales must be float32 [N, ceil(K / G)]");
    TORCH_CHECK(zeros.has_value() && zeros->sizes() == scales.sizes() &&
                    (zeros->scalar_type() == at::kFloat ||
                     (zeros->scalar_type() == at::kByte && zeros->max().item<int>() <= 15)),
                "pack_panels_quant_fma: uint4 zero points must be uint8 0..15 or float32 "
                "[N, ceil(K / G)]");
  } else {
    TORCH_CHECK(data.size(1) == K && (kind == kInt8 ? data.scalar_type() == at::kChar
                                                    : data.scalar_type() == at::kByte),
                "pack_panels_quant_fma: int8 data must be int8 [N, K], fp8 data uint8 [N, K]");
    TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N && scales.scalar_type() == at::kFloat,
                "pack_panels_quant_fma: scales must be float32 [N]");
  }
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t body = K * step_bytes(kind) + const_bytes(kind, K, G);
  const int64_t stride = (body + 63) / 64 * 64;
  at::Tensor packed = at::zeros({kHeaderBytes + panels * stride}, data.options().dtype(at::kByte));
  uint8_t* base = packed.data_ptr<uint8_t>();
  const Header h{kMagic, kind, N, K, kind == kUint4 ? G : K, panels, stride};
  std::memcpy(base, &h, sizeof(h));
  const at::Tensor d = data.contiguous(), s = scales.contiguous();
  const at::Tensor z = kind == kUint4 ? zeros->contiguous().to(at::kFloat) : at::Tensor();
  const float* sp = s.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* panel = base + kHeaderBytes + p * stride;
      float* consts = reinterpret_cast<float*>(panel + K * step_bytes(kind));
      for (int64_t f = 0; f < kPanel && p * kPanel + f < N; ++f) {
        const int64_t n = p * kPanel + f;
        if (kind != kUint4) {
          const uint8_t* row = reinterpret_cast<const uint8_t*>(d.data_ptr()) + n * K;
          for (int64_t k = 0; k < K; ++k) panel[k * kPanel + f] = row[k];
          consts[f] = sp[n];
          continue;
        }
        const uint32_t* words = reinterpret_cast<const uint32_t*>(d.data_ptr<int32_t>()) +
                                n * d.size(1);
        for (int64_t k = 0; k < K; ++k) {
          const uint8_t q = (words[k / 8] >> (4 * (k % 8))) & 15u;
          uint8_t& byte = panel[k * (kPanel / 2) + f % 8];
          byte = static_cast<uint8_t>(byte | (f < 8 ? q : q << 4));
        }
        const float* zp = z.data_ptr<float>() + n * groups;
        for (int64_t g = 0; g < groups; ++g) {
          consts[g * 2 * kPanel + f] = sp[n * groups + g];
          consts[g * 2 * kPanel + kPanel + f] = zp[g];
        }
      }
    }
  });
  return packed;
}

}  // namespace

bool switchyard_xeon::is_quant_fma_panels(const at::Tensor& packed) {
  Header h;
  return read_header(packed, h);
}

at::Tensor switchyard_xeon::panel_linear_quant_fma(const at::Tensor& x, const at::Tensor& packed,
                                                   const float* bias, int64_t N) {
  Header h;
  TORCH_CHECK(read_header(packed, h) && h.N == N && h.K == x.size(1),
              "panel_linear: quantized fma panels do not match x or N");
  const int64_t M = x.size(0), K = h.K, G = h.G;
  const uint8_t* base = packed.data_ptr<uint8_t>() + kHeaderBytes;
  const float* xp = x.data_ptr<float>();
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const int64_t groups = (K + G - 1) / G;
  const std::vector<float> xsum =
      h.kind == kUint4 ? group_sums(xp, M, K, G) : std::vector<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - m0);
    at::parallel_for(0, h.panels, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> wide;
      for (int64_t p = begin; p < end; ++p) {
        const uint8_t* panel = base + p * h.stride;
        const float* consts = reinterpret_cast<const float*>(panel + K * step_bytes(h.kind));
        const Epilogue e{h.kind == kUint4 ? nullptr : consts, bias, p * kPanel,
                         std::min(kPanel, N - p * kPanel),
                         h.kind == kUint4 ? xsum.data() + m0 * groups : nullptr, groups};
        const float* xr = xp + m0 * K;
        float* yr = yp + m0 * N;
        switch (h.kind) {
          case kInt8: panel_rows(xr, rows, K, K, Int8Steps{panel}, e, yr, N, wide); break;
          case kFp8: panel_rows(xr, rows, K, K, Fp8Steps{panel}, e, yr, N, wide); break;
          default: panel_rows(xr, rows, K, G, Uint4Steps{panel, consts}, e, yr, N, wide);
        }
      }
    });
  }
  return y;
}

TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def("pack_panels_quant_fma(int kind, Tensor data, Tensor scales, Tensor? zeros, "
        "int group_size, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_xeon, CPU, m) {
  m.impl("pack_panels_quant_fma", &pack_panels_quant_fma);
}

#else  // no AVX2 + FMA: the packer is not registered, so these layouts never reach here.

bool switchyard_xeon::is_quant_fma_panels(const at::Tensor&) { return false; }

at::Tensor switchyard_xeon::panel_linear_quant_fma(const at::Tensor&, const at::Tensor&,
                                                   const float*, int64_t) {
  TORCH_CHECK(false, "panel_linear: quantized fma panels need AVX2 and FMA");
}

#endif
