// W8A8 linear layers (`--quantize smoothquant`): int8 weights with a scale per
// output feature, int8 activations quantized as each call starts, int32 sums.
//
//   t[m, k]  = x[m, k] * r[k]            r = 1 / s, the SmoothQuant factors
//   a[m]     = max_k |t[m, k]| / 127      per token (or one static scale)
//   xq[m, k] = clamp(rint(t[m, k] * (127 / max_k |t[m, k]|)), -127, 127)
//   y[m, n]  = float(sum_k xq[m, k] q[n, k]) * (a[m] * ws[n]) + b[n]   (one fma)
//
// Every product of the sum is an integer, so every path below computes the
// same int32 sums, bit for bit; the float steps are done once per element in
// a fixed order (the divisions through SSE intrinsics, which -ffast-math may
// not turn into multiplications by reciprocals), so a PyTorch reference that
// follows them matches exactly (tests/xeon/test_xeon_w8a8.py).
//
// vpdpbusd and tdpbusd multiply unsigned bytes (the activations) by signed
// ones (the weights). Activations are stored as u = xq + 128 (1..255) and the
// packing keeps 128 * sum_k q[n, k] per feature, taken off the sums.
//
// Packing: [lines, 64] uint8. Line 0 is a header (magic, K, Kpad, N, panels,
// the static activation scale or 0); then Kpad / 16 lines of r (fp32, zero
// past K); then per panel of 16 output features Kpad / 4 lines of weights,
// line j holding for each feature f its weights at k = 4j..4j+3 (bytes 4f..4f+3,
// the operand order of vpdpbusd), then a line of 16 fp32 scales ws and a line
// of 16 int32 compensations. K is padded with zeros to a multiple of 64, so 16
// consecutive weight lines of a panel are one AMX B tile (64 k x 16 features).
//
// Paths, chosen per call (`path` 0) by what the build and the CPU have:
// - amx: tdpbusd on 32 x 32 blocks (two A tiles of 16 rows, two B tiles of
//   one panel each, four int32 C tiles), for calls of at least kAmxMinRows
//   rows; needs a build for AMX-INT8 and the kernel's permission
//   (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), asked once.
// - vnni: AVX512-VNNI vpdpbusd, up to 6 rows x 4 panels, 24 zmm accumulators
//   (the structure of panel_dot_bf16.cpp's micro-kernel).
// - avx2: no VNNI (Zen 3): vpmaddubsw over |xq| and sign(xq) * q (each pair
//   sum at most 2 * 127 * 127, so it never saturates), vpmaddwd to int32.
// - scalar: plain loops; any x86-64 build.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SY_W8A8_VNNI 1
#endif
#include "amx.h"
#if defined(SY_W8A8_VNNI) && defined(SY_AMX_TILE) && defined(__AMX_INT8__)
#define SY_W8A8_AMX 1
#endif
#if defined(__AVX2__)
#define SY_W8A8_AVX2 1
#endif

namespace {

constexpr int64_t kLine = 64;
constexpr int64_t kPanel = 16;
constexpr int64_t kKBlock = 64;  // K is padded to this: one AMX tile row of bytes
constexpr int64_t kMagic = 0x3841385751535957;
constexpr int64_t kRows = 6;     // vnni: rows per micro-kernel call
constexpr int64_t kGroup = 4;    // vnni: panels per micro-kernel call
constexpr int64_t kChunk = 512;  // rows per pass over the weights
constexpr int64_t kPrefetchBytes = 4096;
// amx from this many rows (auto path); below it vnni. On the 135M shape's
// sweep (Sapphire Rapids class, one thread, benchmarks/kernels/w8a8_sweep.py)
// vnni took 9.0 ms at 4 rows against amx's 9.7, amx 12.0 at 16 against 17.3.
constexpr int64_t kAmxMinRows = 16;

enum Path : int64_t { kAuto = 0, kAmx = 1, kVnni = 2, kAvx2 = 3, kScalar = 4 };

// Divisions the compiler must not rewrite (x / c as x * (1 / c) under -ffast-math).
inline float div_exact(float a, float b) {
  return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(a), _mm_set_ss(b)));
}

struct Layout {
  int64_t K = 0, Kpad = 0, N = 0, panels = 0;
  float act_scale = 0.f;
  const uint8_t* base = nullptr;

  int64_t panel_lines() const { return Kpad / 4 + 2; }
  int64_t panel_bytes() const { return panel_lines() * kLine; }
  const float* inv() const { return reinterpret_cast<const float*>(base + kLine); }
  const int8_t* weights(int64_t p) const {
    return reinterpret_cast<const int8_t*>(base + (1 + Kpad / 16) * kLine + p * panel_bytes());
  }
  const float* scales(int64_t p) const {
    return reinterpret_cast<const float*>(weights(p) + Kpad / 4 * kLine);
  }
  const int32_t* comp(int64_t p) const {
    return reinterpret_cast<const int32_t*>(weights(p) + (Kpad / 4 + 1) * kLine);
  }
};

struct Header {
  int64_t magic, K, Kpad, N, panels;
  float act_scale;
};

bool is_w8a8(const at::Tensor& packed) {
  if (packed.dim() != 2 || packed.scalar_type() != at::kByte || packed.size(1) != kLine ||
      packed.size(0) < 1 || !packed.is_contiguous()) {
    return false;
  }
  Header h;
  std::memcpy(&h, packed.data_ptr<uint8_t>(), sizeof(h));
  return h.magic == kMagic && h.Kpad % kKBlock == 0 &&
         packed.size(0) == 1 + h.Kpad / 16 + h.panels * (h.Kpad / 4 + 2);
}

Layout layout_of(const at::Tensor& packed) {
  TORCH_CHECK(is_w8a8(packed), "w8a8: not a W8A8 packed weight");
  Header h;
  std::memcpy(&h, packed.data_ptr<uint8_t>(), sizeof(h));
  Layout l;
  l.K = h.K, l.Kpad = h.Kpad, l.N = h.N, l.panels = h.panels, l.act_scale = h.act_scale;
  l.base = packed.data_ptr<uint8_t>();
  return l;
}

// q int8 [N, K], scale fp32 [N] (> 0), smoothing fp32 [K] (> 0), act_scale >= 0 (0: per token).
at::Tensor pack_panels_w8a8(const at::Tensor& q, const at::Tensor& scale,
                            const at::Tensor& smoothing, double act_scale) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.size(0) > 0 && q.size(1) > 0,
              "pack_panels_w8a8: weight must be int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat,
              "pack_panels_w8a8: scale must be float32 [N]");
  TORCH_CHECK(smoothing.dim() == 1 && smoothing.size(0) == K &&
                  smoothing.scalar_type() == at::kFloat,
              "pack_panels_w8a8: smoothing must be float32 [K]");
  const at::Tensor w = q.contiguous(), s = scale.contiguous(), sm = smoothing.contiguous();
  TORCH_CHECK(at::all(at::isfinite(sm)).item<bool>() && sm.gt(0).all().item<bool>(),
              "pack_panels_w8a8: smoothing factors must be finite and positive");
  TORCH_CHECK(w.gt(-128).all().item<bool>(), "pack_panels_w8a8: weights must be -127..127");
  TORCH_CHECK(std::isfinite(act_scale) && act_scale >= 0,
              "pack_panels_w8a8: the static activation scale must be >= 0");
  const int64_t Kpad = (K + kKBlock - 1) / kKBlock * kKBlock;
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t lines = 1 + Kpad / 16 + panels * (Kpad / 4 + 2);
  at::Tensor packed = at::zeros({lines, kLine}, w.options().dtype(at::kByte));
  Header h{kMagic, K, Kpad, N, panels, static_cast<float>(act_scale)};
  std::memcpy(packed.data_ptr<uint8_t>(), &h, sizeof(h));
  const Layout l = layout_of(packed);
  float* inv = const_cast<float*>(l.inv());
  const float* smp = sm.data_ptr<float>();
  for (int64_t k = 0; k < K; ++k) inv[k] = div_exact(1.0f, smp[k]);
  const int8_t* src = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      int8_t* dst = const_cast<int8_t*>(l.weights(p));
      float* scales = const_cast<float*>(l.scales(p));
      int32_t* comp = const_cast<int32_t*>(l.comp(p));
      for (int64_t f = 0; f < kPanel && p * kPanel + f < N; ++f) {
        const int8_t* row = src + (p * kPanel + f) * K;
        int32_t sum = 0;
        for (int64_t k = 0; k < K; ++k) {
          dst[(k / 4) * kLine + 4 * f + k % 4] = row[k];
          sum += row[k];
        }
        comp[f] = 128 * sum;
        scales[f] = sp[p * kPanel + f];
      }
    }
  });
  return packed;
}

// Rows of x as u = xq + 128 [M, Kpad] (128 past K) and their scales a [M].
void quantize_rows(const float* x, int64_t M, const Layout& l, uint8_t* out, float* a) {
  const float* inv = l.inv();
  const int64_t K = l.K, Kpad = l.Kpad;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> t(K);
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = x + m * K;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        t[k] = xr[k] * inv[k];
        amax = std::max(amax, std::fabs(t[k]));
      }
      float q_scale;  // t * q_scale rounds to xq
      if (l.act_scale > 0.f) {
        a[m] = l.act_scale;
        q_scale = div_exact(1.0f, l.act_scale);
      } else {
        a[m] = div_exact(amax, 127.0f);
        q_scale = amax > 0.f ? div_exact(127.0f, amax) : 0.f;
      }
      uint8_t* u = out + m * Kpad;
      for (int64_t k = 0; k < K; ++k) {
        const float v = std::min(127.0f, std::max(-127.0f, t[k] * q_scale));
        u[k] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(v)) + 128);
      }
      std::memset(u + K, 128, Kpad - K);
    }
  });
}

// Where a call writes: float y (a[m] * ws[n] scaled, plus bias) or the raw int32 sums.
struct Out {
  const float* a;  // row scales
  const float* bias;
  float* y;
  int32_t* raw;
  int64_t N;
};

// One row's 16 sums of panel p (compensation not yet taken off when `comp`).
inline void finish_scalar(const int32_t* sums, const int32_t* comp, const float* ws, const Out& o,
                          int64_t m, int64_t n0) {
  for (int64_t f = 0; f < kPanel && n0 + f < o.N; ++f) {
    const int32_t acc = sums[f] - (comp ? comp[f] : 0);
    if (o.raw) {
      o.raw[m * o.N + n0 + f] = acc;
    } else {
      const float sc = o.a[m] * ws[f];
      o.y[m * o.N + n0 + f] =
          std::fma(static_cast<float>(acc), sc, o.bias ? o.bias[n0 + f] : 0.f);
    }
  }
}

void run_scalar(const uint8_t* xu, int64_t M, const Layout& l, const Out& o) {
  at::parallel_for(0, l.panels, 1, [&](int64_t begin, int64_t end) {
    int32_t sums[kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const int8_t* w = l.weights(p);
      for (int64_t m = 0; m < M; ++m) {
        const uint8_t* u = xu + m * l.Kpad;
        for (int64_t f = 0; f < kPanel; ++f) {
          int32_t s = 0;
          for (int64_t k = 0; k < l.K; ++k) {
            s += (static_cast<int32_t>(u[k]) - 128) * w[(k / 4) * kLine + 4 * f + k % 4];
          }
          sums[f] = s;
        }
        finish_scalar(sums, nullptr, l.scales(p), o, m, p * kPanel);
      }
    }
  });
}

#if defined(SY_W8A8_AVX2)
// Four rows x one panel: 8 ymm accumulators (features 0-7 and 8-15).
template <int R>
inline void avx2_micro(const uint8_t* xu, int64_t ldx, const int8_t* w, int64_t steps,
                       const Layout& l, int64_t p, const Out& o, int64_t m0) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  for (int64_t j = 0; j < steps; ++j) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * kLine));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * kLine + 32));
    for (int i = 0; i < R; ++i) {
      int32_t four;
      std::memcpy(&four, xu + i * ldx + 4 * j, 4);
      const __m256i xs = _mm256_xor_si256(_mm256_set1_epi32(four), flip);  // xq, signed
      const __m256i ax = _mm256_abs_epi8(xs);
      acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(
          _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xs)), ones));
      acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(
          _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xs)), ones));
    }
  }
  alignas(32) int32_t sums[kPanel];
  for (int i = 0; i < R; ++i) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums), acc[i][0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums + 8), acc[i][1]);
    finish_scalar(sums, nullptr, l.scales(p), o, m0 + i, p * kPanel);
  }
}

void run_avx2(const uint8_t* xu, int64_t M, const Layout& l, const Out& o) {
  const int64_t steps = (l.K + 3) / 4;  // lines past K hold zeros
  at::parallel_for(0, l.panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t m = 0; m < M; m += 4) {
        const uint8_t* xr = xu + m * l.Kpad;
        switch (std::min<int64_t>(4, M - m)) {
          case 1: avx2_micro<1>(xr, l.Kpad, l.weights(p), steps, l, p, o, m); break;
          case 2: avx2_micro<2>(xr, l.Kpad, l.weights(p), steps, l, p, o, m); break;
          case 3: avx2_micro<3>(xr, l.Kpad, l.weights(p), steps, l, p, o, m); break;
          default: avx2_micro<4>(xr, l.Kpad, l.weights(p), steps, l, p, o, m);
        }
      }
    }
  });
}
#endif

#if defined(SY_W8A8_VNNI)
// Row m's 16 sums of panel p (compensation included in `acc`) into the output.
inline void finish_row(__m512i acc, const Layout& l, int64_t p, const Out& o, int64_t m) {
  const int64_t n0 = p * kPanel;
  const int64_t left = std::min(kPanel, o.N - n0);
  const __mmask16 mask = left >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  acc = _mm512_sub_epi32(acc, _mm512_loadu_si512(l.comp(p)));
  if (o.raw) {
    _mm512_mask_storeu_epi32(o.raw + m * o.N + n0, mask, acc);
    return;
  }
  const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(o.a[m]), _mm512_loadu_ps(l.scales(p)));
  const __m512 b = o.bias ? _mm512_maskz_loadu_ps(mask, o.bias + n0) : _mm512_setzero_ps();
  _mm512_mask_storeu_ps(o.y + m * o.N + n0, mask,
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), sc, b));
}

template <int R, int P>
inline void vnni_micro(const uint8_t* xu, int64_t ldx, const Layout& l, int64_t p0,
                       int64_t steps, const Out& o, int64_t m0) {
  const int64_t stride = l.panel_bytes();
  const int8_t* w0 = l.weights(p0);
  __m512i acc[R][P];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[i][p] = _mm512_setzero_si512();
  }
  for (int64_t j = 0; j < steps; ++j) {
    __m512i w[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const int8_t* line = w0 + p * stride + j * kLine;
      _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetchBytes), _MM_HINT_T0);
      w[p] = _mm512_loadu_si512(line);
    }
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      int32_t four;
      std::memcpy(&four, xu + i * ldx + 4 * j, 4);
      const __m512i v = _mm512_set1_epi32(four);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) acc[i][p] = _mm512_dpbusd_epi32(acc[i][p], v, w[p]);
    }
  }
  for (int p = 0; p < P; ++p) {
    for (int i = 0; i < R; ++i) finish_row(acc[i][p], l, p0 + p, o, m0 + i);
  }
}

template <int P>
void vnni_tiles(const uint8_t* xu, int64_t rows, const Layout& l, int64_t p0, int64_t steps,
                const Out& o, int64_t m0) {
  for (int64_t r = 0; r < rows; r += kRows) {
    const uint8_t* xr = xu + r * l.Kpad;
#define SY_TILE(R) vnni_micro<R, P>(xr, l.Kpad, l, p0, steps, o, m0 + r)
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

void run_vnni(const uint8_t* xu, int64_t M, const Layout& l, const Out& o) {
  const int64_t steps = (l.K + 3) / 4;
  const int64_t groups = (l.panels + kGroup - 1) / kGroup;
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - m0);
    const uint8_t* xr = xu + m0 * l.Kpad;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p = g * kGroup;
        switch (std::min(kGroup, l.panels - p)) {
          case 1: vnni_tiles<1>(xr, rows, l, p, steps, o, m0); break;
          case 2: vnni_tiles<2>(xr, rows, l, p, steps, o, m0); break;
          case 3: vnni_tiles<3>(xr, rows, l, p, steps, o, m0); break;
          default: vnni_tiles<4>(xr, rows, l, p, steps, o, m0);
        }
      }
    });
  }
}
#endif

#if defined(SY_W8A8_AMX)
// Rows m0..m0 + 16 RA, panels p0..p0 + PB: RA A tiles x PB B tiles over all of K.
template <int RA, int PB>
void amx_block(const uint8_t* xu, int64_t M, const Layout& l, int64_t p0, int64_t m0,
               const Out& o, int32_t* c) {
  const int64_t ldx = l.Kpad;
  const int8_t* b0 = l.weights(p0);
  const int8_t* b1 = PB > 1 ? l.weights(p0 + 1) : b0;
  const uint8_t* a0 = xu + m0 * ldx;
  const uint8_t* a1 = a0 + 16 * ldx;
  _tile_zero(0);
  if (PB > 1) _tile_zero(1);
  if (RA > 1) _tile_zero(2);
  if (RA > 1 && PB > 1) _tile_zero(3);
  for (int64_t kb = 0; kb < l.Kpad; kb += kKBlock) {
    _tile_loadd(4, a0 + kb, ldx);
    _tile_loadd(6, b0 + kb / 4 * kLine, kLine);
    _tile_dpbusd(0, 4, 6);
    if (PB > 1) {
      _tile_loadd(7, b1 + kb / 4 * kLine, kLine);
      _tile_dpbusd(1, 4, 7);
    }
    if (RA > 1) {
      _tile_loadd(5, a1 + kb, ldx);
      _tile_dpbusd(2, 5, 6);
      if (PB > 1) _tile_dpbusd(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if (PB > 1) _tile_stored(1, c + 256, 64);
  if (RA > 1) _tile_stored(2, c + 512, 64);
  if (RA > 1 && PB > 1) _tile_stored(3, c + 768, 64);
  for (int ra = 0; ra < RA; ++ra) {
    for (int pb = 0; pb < PB; ++pb) {
      const int32_t* tile = c + (2 * ra + pb) * 256;
      for (int64_t i = 0; i < 16 && m0 + 16 * ra + i < M; ++i) {
        finish_row(_mm512_load_si512(tile + 16 * i), l, p0 + pb, o, m0 + 16 * ra + i);
      }
    }
  }
}

void run_amx(const uint8_t* xu, int64_t M, const Layout& l, const Out& o) {
  const int64_t pairs = (l.panels + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    switchyard_xeon::amx::configure();
    alignas(64) int32_t c[4 * 256];
    for (int64_t pp = begin; pp < end; ++pp) {
      const int64_t p0 = 2 * pp;
      const bool two = p0 + 1 < l.panels;
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const bool tall = m0 + 16 < M;
        if (tall && two) amx_block<2, 2>(xu, M, l, p0, m0, o, c);
        else if (tall) amx_block<2, 1>(xu, M, l, p0, m0, o, c);
        else if (two) amx_block<1, 2>(xu, M, l, p0, m0, o, c);
        else amx_block<1, 1>(xu, M, l, p0, m0, o, c);
      }
    }
    _tile_release();
  });
}
#endif

bool have(int64_t path) {
  switch (path) {
#if defined(SY_W8A8_AMX)
    case kAmx: return switchyard_xeon::amx::permitted();
#endif
#if defined(SY_W8A8_VNNI)
    case kVnni: return true;
#endif
#if defined(SY_W8A8_AVX2)
    case kAvx2: return true;
#endif
    case kScalar: return true;
    default: return false;
  }
}

// Bit `path` set for each path this build and this process can run.
int64_t w8a8_paths() {
  int64_t bits = 0;
  for (int64_t p = kAmx; p <= kScalar; ++p) bits |= have(p) ? (int64_t{1} << p) : 0;
  return bits;
}

int64_t choose(int64_t M) {
  if (M >= kAmxMinRows && have(kAmx)) return kAmx;
  if (have(kVnni)) return kVnni;
  if (have(kAvx2)) return kAvx2;
  return kScalar;
}

at::Tensor w8a8_run(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t N,
                    int64_t path, bool raw) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "w8a8: x must be a contiguous float32 [M, K]");
  const Layout l = layout_of(packed);
  TORCH_CHECK(x.size(1) == l.K && N == l.N, "panel_linear: packed weight does not match x or N");
  if (path == kAuto) path = choose(x.size(0));
  TORCH_CHECK(path >= kAmx && path <= kScalar && have(path),
              "w8a8: kernel path ", path, " is not available in this build or process");
  const int64_t M = x.size(0);
  const int64_t rows = (M + 15) / 16 * 16;  // AMX reads whole tiles of 16 rows
  std::vector<uint8_t> xu(rows * l.Kpad, 128);
  std::vector<float> a(M);
  quantize_rows(x.data_ptr<float>(), M, l, xu.data(), a.data());
  at::Tensor y = at::empty({M, N}, x.options().dtype(raw ? at::kInt : at::kFloat));
  const Out o{a.data(), bias, raw ? nullptr : y.data_ptr<float>(),
              raw ? y.data_ptr<int32_t>() : nullptr, N};
  if (M == 0) return y;
  switch (path) {
#if defined(SY_W8A8_AMX)
    case kAmx: run_amx(xu.data(), M, l, o); break;
#endif
#if defined(SY_W8A8_VNNI)
    case kVnni: run_vnni(xu.data(), M, l, o); break;
#endif
#if defined(SY_W8A8_AVX2)
    case kAvx2: run_avx2(xu.data(), M, l, o); break;
#endif
    default: run_scalar(xu.data(), M, l, o);
  }
  return y;
}

const float* bias_of(const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                  bias->is_contiguous(),
              "panel_linear: bias must be float32 [N]");
  return bias->data_ptr<float>();
}

// y = x @ W.T (+ bias) on `path` (0: chosen by the call's rows); `raw`: the int32 sums.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t n, int64_t path,
                       bool raw) {
  return w8a8_run(x, packed, bias_of(bias, n), n, path, raw);
}

// The integers xq (int8 [M, K]) and scales a (fp32 [M]) each call quantizes x to.
std::tuple<at::Tensor, at::Tensor> w8a8_quantize_rows(const at::Tensor& x,
                                                      const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "w8a8: x must be a contiguous float32 [M, K]");
  const Layout l = layout_of(packed);
  TORCH_CHECK(x.size(1) == l.K, "w8a8: x does not match the packed weight");
  const int64_t M = x.size(0);
  std::vector<uint8_t> xu(M * l.Kpad);
  at::Tensor a = at::empty({M}, x.options());
  quantize_rows(x.data_ptr<float>(), M, l, xu.data(), a.data_ptr<float>());
  at::Tensor xq = at::empty({M, l.K}, x.options().dtype(at::kChar));
  int8_t* dst = xq.data_ptr<int8_t>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < l.K; ++k) dst[m * l.K + k] = static_cast<int8_t>(xu[m * l.Kpad + k] - 128);
  }
  return {xq, a};
}

}  // namespace

bool switchyard_xeon::is_w8a8_panels(const at::Tensor& packed) { return is_w8a8(packed); }

at::Tensor switchyard_xeon::panel_linear_w8a8(const at::Tensor& x, const at::Tensor& packed,
                                              const c10::optional<at::Tensor>& bias, int64_t n) {
  return w8a8_run(x, packed, bias_of(bias, n), n, kAuto, false);
}

TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def("pack_panels_w8a8(Tensor weight, Tensor scale, Tensor smoothing, float act_scale) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor? bias, int n, int path, bool raw) -> Tensor");
  m.def("w8a8_quantize_rows(Tensor x, Tensor packed) -> (Tensor, Tensor)");
  m.def("w8a8_paths() -> int", &w8a8_paths);
}

TORCH_LIBRARY_IMPL(switchyard_xeon, CPU, m) {
  m.impl("pack_panels_w8a8", &pack_panels_w8a8);
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("w8a8_quantize_rows", &w8a8_quantize_rows);
}
