// Weight-only uint4 linear layers on CPUs with AVX512_BF16 (`--quantize int4`):
// y = bf16(x) @ W.T (+ bias) with fp32 sums, where W is stored as unsigned
// 4-bit integers q with a scale s and zero point z per group of G weights
// along K: W[n, k] = (q - z) * s. A quarter of the bytes of bf16 weights, for
// batch-1 decoding, which reads every weight once per token.
//
// The trick that makes 4-bit weights cheap to widen: for q in 0..15 the bf16
// value 16 + q is 16 * (1 + q / 16), whose bits are 0x4180 | (q << 3). So one
// shift and one bitwise select (vpternlogd) turn a nibble into an exact bf16
// operand of vdpbf16ps, with no conversion instructions (the int8 kernel
// needs five per k-pair step). The offset comes out with the group's sums:
//   sum_k x_k (q_k - z) s = s * (sum_k x_k (16 + q_k) - (16 + z) sum_k x_k),
// where x_k are the bf16-rounded inputs; the packing stores s and
// c = -(16 + z) per feature and group, and the sums of each row's inputs per
// group are taken once per call. The zero points come as uint8 (0..15, the
// contract's integers) or as fp32 (any float: a group whose weights are
// q * s + b, GGUF Q4_1's form, is z = -b / s; c then rounds once). The
// bracket is one fused multiply-add (the product exact, one rounding) of
// sums whose terms are exact in fp32 (bf16 times a 5-bit integer), so what
// is left is within an ulp or so of sum x (q - z): scaling first, or
// storing (16 + z) s, measured 4x further from a float64 reference, enough
// to flip the bf16 rounding of cached keys.
//
// Packing: [panels, groups, 8 G + 128] uint8. A panel of 16 output features
// is one contiguous stream, group after group; a group is G / 8 "quads" of 64
// bytes, then 16 fp32 scales s, then 16 fp32 c. A quad holds four k-pair
// steps as 32 16-bit lanes in vdpbf16ps's operand order (lane 2f + i:
// feature f at k = 2 step + i), the nibble of step j in bits 4j..4j+3, so one
// 64-byte load feeds four dot-product steps. K is zero-padded to whole groups
// (a zero input meets a zero weight), N to whole panels (scales 0).
//
// Micro-kernel: up to 4 rows of x times four panels, 16 accumulators for the
// current group; at each group's end they are scaled into y (in L1):
// y += s * (acc + c * xsum). The loops stop at the last quad of a short last
// group that holds weights. Past kWidenInRegisters rows each thread widens a
// group of panels once into a bf16 buffer that the row tiles read, so
// prefill-sized batches pay the shifts once per weight, not once per tile.
// Constraints: G a multiple of 16 (the format's 32, 64 and 128 are); any K
// and N.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 16;       // output features per panel
constexpr int64_t kStep = 32;        // 16-bit lanes per k-pair step
constexpr int64_t kQuad = 64;        // bytes of four steps
constexpr int64_t kConstBytes = 2 * kPanel * static_cast<int64_t>(sizeof(float));
constexpr int64_t kGroup = 4;        // panels per micro-kernel call
// Rows per tile: 16 accumulators, 4 quads and 4 widened steps, a broadcast.
// Six rows (24 accumulators), as the bf16 kernel uses, spilled: 8% slower at
// 512 rows over a widened buffer, and five were slower still (Zen 4).
constexpr int64_t kRows = 4;
constexpr int64_t kChunk = 512;      // rows per pass over the weights
constexpr int64_t kPrefetchBytes = 4096;
// Up to this many rows each row tile widens in registers; past it a group of
// panels is widened once into a per-thread buffer (see the header). Over the
// 135M shape's decode-step sweep (Zen 4, 2 cores) registers took 26 ms at 32
// rows against 29 through the buffer, 99 against 95 at 128, 430 against 408
// at 512 (benchmarks/kernels/linear_sweep.py).
constexpr int64_t kWidenInRegisters = 64;
constexpr int kOffset = 16;          // bf16 0x4180 | (q << 3) == 16 + q
constexpr short kOffsetBits = 0x4180;
constexpr short kNibbleAt3 = 0x78;   // a nibble shifted to bits 3..6

using bf16 = at::BFloat16;

int64_t group_bytes(int64_t G) { return G / 2 / 4 * kQuad + kConstBytes; }

// data int32 [N, ceil(K/8)] (nibble k % 8 of word k / 8), scales fp32 [N, groups],
// zeros uint8 0..15 or fp32 [N, groups] -> [panels, groups, 8 G + 128] uint8.
at::Tensor pack_panels_uint4_dot(const at::Tensor& data, const at::Tensor& scales,
                                 const at::Tensor& zeros, int64_t G, int64_t K) {
  TORCH_CHECK(G > 0 && G % 16 == 0, "pack_panels_uint4_dot: group size must be a multiple of 16");
  TORCH_CHECK(K > 0 && data.dim() == 2 && data.scalar_type() == at::kInt &&
                  data.size(1) == (K + 7) / 8,
              "pack_panels_uint4_dot: data must be int32 [N, ceil(K / 8)]");
  const int64_t N = data.size(0), groups = (K + G - 1) / G;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == groups &&
                  scales.scalar_type() == at::kFloat,
              "pack_panels_uint4_dot: scales must be float32 [N, ceil(K / G)]");
  const bool float_zeros = zeros.scalar_type() == at::kFloat;
  TORCH_CHECK(zeros.sizes() == scales.sizes() &&
                  (zeros.scalar_type() == at::kByte || float_zeros),
              "pack_panels_uint4_dot: zero points must be uint8 or float32 [N, ceil(K / G)]");
  const at::Tensor d = data.contiguous(), s = scales.contiguous(), z = zeros.contiguous();
  TORCH_CHECK(float_zeros || z.max().item<int>() <= 15,
              "pack_panels_uint4_dot: uint8 zero points must be 0..15");
  const int64_t panels = (N + kPanel - 1) / kPanel, gbytes = group_bytes(G);
  at::Tensor packed = at::zeros({panels, groups, gbytes}, d.options().dtype(at::kByte));
  const uint32_t* src = reinterpret_cast<const uint32_t*>(d.data_ptr<int32_t>());
  const float* sp = s.data_ptr<float>();
  const uint8_t* zp = float_zeros ? nullptr : z.data_ptr<uint8_t>();
  const float* zf = float_zeros ? z.data_ptr<float>() : nullptr;
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t words = d.size(1);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t f = 0; f < kPanel && p * kPanel + f < N; ++f) {
        const int64_t n = p * kPanel + f;
        for (int64_t g = 0; g < groups; ++g) {
          uint8_t* grp = dst + (p * groups + g) * gbytes;
          for (int64_t k = g * G; k < std::min(K, (g + 1) * G); ++k) {
            const uint32_t q = (src[n * words + k / 8] >> (4 * (k % 8))) & 15u;
            const int64_t step = (k - g * G) / 2;
            uint16_t* lane = reinterpret_cast<uint16_t*>(grp + step / 4 * kQuad) + 2 * f + k % 2;
            *lane = static_cast<uint16_t>(*lane | (q << (4 * (step % 4))));
          }
          float* consts = reinterpret_cast<float*>(grp + gbytes - kConstBytes);
          const float scale = sp[n * groups + g];
          consts[f] = scale;
          const int64_t at = n * groups + g;
          consts[kPanel + f] = zf ? static_cast<float>(-(kOffset + static_cast<double>(zf[at])))
                                  : -static_cast<float>(kOffset + zp[at]);
        }
      }
    }
  });
  return packed;
}

// Step j (0..3) of a quad as bf16 16 + q: the nibble moved to bits 3..6, then
// (v & 0x78) | 0x4180 in one vpternlogd (0xEA: a & b | c).
template <int J>
inline __m512bh widen(__m512i quad) {
  const __m512i shifted = J == 0 ? _mm512_slli_epi16(quad, 3) : _mm512_srli_epi16(quad, 4 * J - 3);
  return (__m512bh)_mm512_ternarylogic_epi32(shifted, _mm512_set1_epi16(kNibbleAt3),
                                             _mm512_set1_epi16(kOffsetBits), 0xEA);
}

// Rows of x as bf16 pairs, zero-padded to `pairs` (whole groups), and each
// row's sum of its bf16 inputs per group (fp32), as the correction term needs.
void prepare_rows(const float* x, int64_t M, int64_t K, int64_t pairs, int64_t G, int64_t groups,
                  uint32_t* out, float* sums) {
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
      for (; k < 2 * pairs; ++k) dst[k] = static_cast<bf16>(0.0f);
      for (int64_t g = 0; g < groups; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = g * G; i < (g + 1) * G; i += 16) {
          acc = _mm512_add_ps(acc, _mm512_cvtpbh_ps(
                                       (__m256bh)_mm256_loadu_si256(
                                           reinterpret_cast<const __m256i*>(dst + i))));
        }
        sums[r * groups + g] = _mm512_reduce_add_ps(acc);
      }
    }
  });
}

// What a row tile reads: its x pairs and sums, the P panels (packed stream for
// the constants; `wide` when they were widened into a buffer), and y.
struct Tile {
  const uint32_t* x;   // [rows, pairs]
  const float* sums;   // [rows, groups]
  const uint8_t* panel;
  int64_t stride;      // bytes from one panel to the next
  const bf16* wide;    // widened steps [P, groups * G / 2, 32], or null
  float* y;            // row 0, feature n0
  int64_t N, pairs, G, groups;
  int64_t last_steps;  // k-pair steps of the last group that hold weights (whole quads)
  __mmask16 mask[kGroup];
};

// The steps of group g that hold weights: all but in a short last group,
// whose zero padding the loops skip (K = 576 in groups of 128 would
// otherwise pay 11% more dot products, and at one row read 11% more bytes).
inline int64_t steps_of(const Tile& t, int64_t g) {
  return g + 1 == t.groups ? t.last_steps : t.G / 2;
}

// y[0:R, n0 : n0 + 16 P] += the tile's product, group by group.
template <int R, int P, bool Wide>
inline void micro(const Tile& t) {
  const int64_t gbytes = group_bytes(t.G), steps = t.G / 2;
  for (int64_t g = 0; g < t.groups; ++g) {
    __m512 acc[R][P];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) acc[i][p] = _mm512_setzero_ps();
    }
    const uint32_t* xg = t.x + g * steps;
    const int64_t used = steps_of(t, g);
    for (int64_t s = 0; s < used; s += 4) {
      __m512i quad[P];
      if constexpr (!Wide) {
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          const uint8_t* at = t.panel + p * t.stride + g * gbytes + s / 4 * kQuad;
          _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchBytes), _MM_HINT_T0);
          quad[p] = _mm512_loadu_si512(at);
        }
      }
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512bh w[P];
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          if constexpr (Wide) {
            w[p] = (__m512bh)_mm512_loadu_si512(
                t.wide + ((p * t.groups + g) * steps + s + j) * kStep);
          } else {
            switch (j) {
              case 0: w[p] = widen<0>(quad[p]); break;
              case 1: w[p] = widen<1>(quad[p]); break;
              case 2: w[p] = widen<2>(quad[p]); break;
              default: w[p] = widen<3>(quad[p]);
            }
          }
        }
#pragma GCC unroll 6
        for (int i = 0; i < R; ++i) {
          const __m512bh v = (__m512bh)_mm512_set1_epi32(static_cast<int>(xg[i * t.pairs + s + j]));
#pragma GCC unroll 4
          for (int p = 0; p < P; ++p) acc[i][p] = _mm512_dpbf16_ps(acc[i][p], w[p], v);
        }
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const float* consts =
          reinterpret_cast<const float*>(t.panel + p * t.stride + (g + 1) * gbytes - kConstBytes);
      const __m512 scale = _mm512_loadu_ps(consts), c = _mm512_loadu_ps(consts + kPanel);
#pragma GCC unroll 6
      for (int i = 0; i < R; ++i) {
        float* out = t.y + i * t.N + p * kPanel;
        const __m512 d = _mm512_fmadd_ps(_mm512_set1_ps(t.sums[i * t.groups + g]), c, acc[i][p]);
        const __m512 y = _mm512_maskz_loadu_ps(t.mask[p], out);
        _mm512_mask_storeu_ps(out, t.mask[p], _mm512_fmadd_ps(d, scale, y));
      }
    }
  }
}

// Every row tile of rows [0, rows) over the P panels of `t`.
template <int P, bool Wide>
void tiles(Tile t, int64_t rows) {
  const uint32_t* x = t.x;
  const float* sums = t.sums;
  float* y = t.y;
  for (int64_t r = 0; r < rows; r += kRows) {
    t.x = x + r * t.pairs;
    t.sums = sums + r * t.groups;
    t.y = y + r * t.N;
    switch (std::min(kRows, rows - r)) {
      case 1: micro<1, P, Wide>(t); break;
      case 2: micro<2, P, Wide>(t); break;
      case 3: micro<3, P, Wide>(t); break;
      default: micro<4, P, Wide>(t);
    }
  }
}

// P panels from `t.panel` over rows [0, rows): y starts as the bias, then
// the tiles add their groups in.
template <int P>
void panel_rows(Tile t, const float* bias, int64_t rows, int64_t n0) {
  for (int p = 0; p < P; ++p) {
    const int64_t left = std::min(kPanel, t.N - n0 - p * kPanel);
    t.mask[p] = left >= kPanel ? __mmask16(0xFFFF) : __mmask16(left > 0 ? (1u << left) - 1 : 0);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(t.mask[p], bias + n0 + p * kPanel)
                          : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      _mm512_mask_storeu_ps(t.y + r * t.N + p * kPanel, t.mask[p], b);
    }
  }
  if (rows <= kWidenInRegisters) {
    tiles<P, false>(t, rows);
    return;
  }
  const int64_t steps = t.G / 2, gbytes = group_bytes(t.G);
  static thread_local std::vector<bf16> widened;
  widened.resize(P * t.groups * steps * kStep);
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t g = 0; g < t.groups; ++g) {
      for (int64_t s = 0; s < steps_of(t, g); s += 4) {
        const __m512i quad =
            _mm512_loadu_si512(t.panel + p * t.stride + g * gbytes + s / 4 * kQuad);
        bf16* out = widened.data() + ((p * t.groups + g) * steps + s) * kStep;
        _mm512_storeu_si512(out, (__m512i)widen<0>(quad));
        _mm512_storeu_si512(out + kStep, (__m512i)widen<1>(quad));
        _mm512_storeu_si512(out + 2 * kStep, (__m512i)widen<2>(quad));
        _mm512_storeu_si512(out + 3 * kStep, (__m512i)widen<3>(quad));
      }
    }
  }
  t.wide = widened.data();
  tiles<P, true>(t, rows);
}

}  // namespace

bool switchyard_xeon::is_uint4_panels(const at::Tensor& packed) {
  return packed.dim() == 3 && packed.scalar_type() == at::kByte;
}

at::Tensor switchyard_xeon::panel_linear_uint4_dot(const at::Tensor& x, const at::Tensor& packed,
                                                   const float* bias, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), groups = packed.size(1);
  const int64_t G = (packed.size(2) - kConstBytes) / kQuad * 8;
  TORCH_CHECK(packed.is_contiguous() && G > 0 && group_bytes(G) == packed.size(2) &&
                  (K + G - 1) / G == groups,
              "panel_linear: uint4 panels do not match x");
  const int64_t pairs = groups * G / 2;
  const int64_t last_steps = (K - (groups - 1) * G + 7) / 8 * 4;
  std::vector<uint32_t> xp(M * pairs);
  std::vector<float> sums(M * groups);
  prepare_rows(x.data_ptr<float>(), M, K, pairs, G, groups, xp.data(), sums.data());
  at::Tensor y = at::empty({M, N}, x.options());
  const int64_t panels = packed.size(0), stride = groups * packed.size(2);
  const int64_t blocks = (panels + kGroup - 1) / kGroup;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - m0);
    // Threads split blocks of kGroup panels; the last block may be short.
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t p = b * kGroup;
        Tile t{xp.data() + m0 * pairs, sums.data() + m0 * groups, wp + p * stride, stride,
               nullptr, yp + m0 * N + p * kPanel, N, pairs, G, groups, last_steps, {}};
        switch (std::min(kGroup, panels - p)) {
          case 1: panel_rows<1>(t, bias, rows, p * kPanel); break;
          case 2: panel_rows<2>(t, bias, rows, p * kPanel); break;
          case 3: panel_rows<3>(t, bias, rows, p * kPanel); break;
          default: panel_rows<4>(t, bias, rows, p * kPanel);
        }
      }
    });
  }
  return y;
}

TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def("pack_panels_uint4_dot(Tensor data, Tensor scales, Tensor zeros, int group_size, "
        "int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_xeon, CPU, m) {
  m.impl("pack_panels_uint4_dot", &pack_panels_uint4_dot);
}

#else  // no AVX512_BF16: the layout is never packed here, so panel_linear never comes here.

bool switchyard_xeon::is_uint4_panels(const at::Tensor&) { return false; }

at::Tensor switchyard_xeon::panel_linear_uint4_dot(const at::Tensor&, const at::Tensor&,
                                                   const float*, int64_t) {
  TORCH_CHECK(false, "panel_linear: uint4 dot panels need AVX512_BF16");
}

#endif
