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
// Many rows (prefill chunks, wide decode batches) go to AMX where the CPU
// and the kernel grant it: the same panels as B tiles, below ("Many rows on
// AMX"); the row count where that starts is measured by the engine at load.
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

#include "amx.h"
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cstring>
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


// ---------------------------------------------------------------------------
// Many rows on AMX (tdpbf16ps), over the same panels. A k-step of 16 pairs of
// one panel, [16 pairs][16 features][2], is exactly an AMX B tile in its
// VNNI order (16 lines of 64 bytes), so the panels are read in place and the
// weights are stored once for both paths. The products are the same bf16
// products summed in fp32 (in another order), so a call's rows get the same
// numbers on either path up to fp32 rounding of the sums.
//
// The rows of x are converted once into A tiles (rows_as_tiles), zero-padded
// to whole tiles (16 rows, 16 pairs); each thread takes
// a pair of panels (32 output features) and runs every 32-row block of the
// call over it (two A tiles x two B tiles, four fp32 C tiles over all of K),
// so the pair stays in L1/L2 while the rows pass. A panel whose K is not a
// whole number of k-steps, and int8 panels (widened exactly to bf16, scaled
// at the end), are first copied into a per-thread buffer of whole k-steps.
#if defined(SY_AMX_TILE) && defined(__AMX_BF16__)
#define SY_DOT_AMX 1

constexpr int64_t kTilePairs = 16;  // k-pair steps per tile: 32 k

// Calls with at least this many rows take AMX; the engine sets it from a
// sweep it measures at load (the bf16_amx_rows op). Until then: about the
// crossover of the 135M shape's linears (Sapphire Rapids, 2 cores: AMX 14.2
// ms a sweep at 16 rows against 28.6 on the row kernel, 13.2 against 17.3
// at 8, 12.9 against 12.4 at 4).
std::atomic<int64_t> g_amx_rows{16};

// Rows of x as AMX A tiles: tile (r, t) holds rows 16 r.. and k-pairs 16 t.. as
// one contiguous 1 KB block (16 rows of 64 bytes), so every tile load reads
// consecutive lines. `out` has whole tiles of zeros past M and K.
void rows_as_tiles(const float* x, int64_t M, int64_t K, int64_t tiles, uint32_t* out) {
  const int64_t lda = tiles * kTilePairs;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> row(lda, 0);
    for (int64_t r = begin; r < end; ++r) {
      rows_as_pairs(x + r * K, 1, K, lda, row.data());
      uint32_t* dst = out + (r / 16) * tiles * 256 + (r % 16) * kTilePairs;
      for (int64_t t = 0; t < tiles; ++t) {
        _mm512_storeu_si512(dst + t * 256, _mm512_loadu_si512(row.data() + t * kTilePairs));
      }
    }
  });
}

// A panel's k-steps as whole tiles: `src` in place when it is bf16 with whole
// k-steps, else copied (int8: widened) into `buf`, zero-padded.
template <typename W>
const bf16* tile_panel(const W* src, int64_t pairs, int64_t tiles, bf16* buf) {
  if constexpr (std::is_same_v<W, bf16>) {
    if (pairs == tiles * kTilePairs) return src;
  }
  for (int64_t k = 0; k < pairs; ++k) {
    if constexpr (std::is_same_v<W, bf16>) {
      _mm512_storeu_si512(buf + k * kStep, _mm512_loadu_si512(src + k * kStep));
    } else {
      _mm512_storeu_si512(buf + k * kStep, (__m512i)widen_step(src + k * kStep));
    }
  }
  std::memset(buf + pairs * kStep, 0, (tiles * kTilePairs - pairs) * kStep * sizeof(bf16));
  return buf;
}

// C tiles for rows m0.. (RA tiles of 16, from rows_as_tiles' `a`) x panels
// b[0..PB) over `tiles` k-steps, then y = sum * scale + bias for the rows
// below M and the features below N. A whole 32 x 32 block without scales or
// bias is stored straight into y; `c` (4 KB) holds the others' sums.
template <int RA, int PB>
void amx_block(const uint32_t* a, int64_t tiles, const bf16* const* b,
               const float* const* scales, const float* bias, float* y, int64_t M, int64_t N,
               int64_t m0, int64_t n0, float* c) {
  constexpr int64_t stride = 64;  // bytes per tile row, in a and in the panels
  const uint32_t* a0 = a + (m0 / 16) * tiles * 256;
  const uint32_t* a1 = a0 + tiles * 256;
  _tile_zero(0);
  if (PB > 1) _tile_zero(1);
  if (RA > 1) _tile_zero(2);
  if (RA > 1 && PB > 1) _tile_zero(3);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t k = t * kTilePairs;
    _tile_loadd(4, a0 + t * 256, stride);
    _tile_loadd(6, b[0] + k * kStep, stride);
    _tile_dpbf16ps(0, 4, 6);
    if (PB > 1) {
      _tile_loadd(7, b[1] + k * kStep, stride);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (RA > 1) {
      _tile_loadd(5, a1 + t * 256, stride);
      _tile_dpbf16ps(2, 5, 6);
      if (PB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (RA > 1 && PB > 1 && !bias && !scales[0] && m0 + 32 <= M && n0 + 32 <= N) {
    float* out = y + m0 * N + n0;
    const int64_t ldy = N * static_cast<int64_t>(sizeof(float));
    _tile_stored(0, out, ldy);
    _tile_stored(1, out + kPanel, ldy);
    _tile_stored(2, out + 16 * N, ldy);
    _tile_stored(3, out + 16 * N + kPanel, ldy);
    return;
  }
  _tile_stored(0, c, 64);
  if (PB > 1) _tile_stored(1, c + 256, 64);
  if (RA > 1) _tile_stored(2, c + 512, 64);
  if (RA > 1 && PB > 1) _tile_stored(3, c + 768, 64);
  for (int pb = 0; pb < PB; ++pb) {
    const int64_t n = n0 + pb * kPanel, left = std::min(kPanel, N - n);
    const __mmask16 mask = left >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    const __m512 mul = scales[pb] ? _mm512_loadu_ps(scales[pb]) : _mm512_set1_ps(1.0f);
    for (int ra = 0; ra < RA; ++ra) {
      const float* tile = c + (2 * ra + pb) * 256;
      for (int64_t i = 0; i < 16 && m0 + 16 * ra + i < M; ++i) {
        _mm512_mask_storeu_ps(y + (m0 + 16 * ra + i) * N + n, mask,
                              _mm512_fmadd_ps(_mm512_load_ps(tile + 16 * i), mul, add));
      }
    }
  }
}

// Rows per pass over a thread's panels: the bf16 rows of a pass stay in L2
// (896 rows of K = 576 are 1 MB) while each panel pair runs over them.
constexpr int64_t kAmxChunkBytes = 1 << 20;

template <typename W>
void run_amx(const float* x, const W* wp, const float* bias, float* yp, int64_t M, int64_t N,
             int64_t K, int64_t pairs, int64_t panels, int64_t stride) {
  const int64_t tiles = (pairs + kTilePairs - 1) / kTilePairs, lda = tiles * kTilePairs;
  const int64_t rows = (M + 15) / 16 * 16;
  std::vector<uint32_t> a(rows * lda, 0);
  rows_as_tiles(x, M, K, tiles, a.data());
  const int64_t chunk = std::max<int64_t>(
      32, kAmxChunkBytes / (lda * static_cast<int64_t>(sizeof(uint32_t))) / 32 * 32);
  const int64_t blocks = (panels + 1) / 2;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    switchyard_xeon::amx::configure();
    alignas(64) float c[4 * 256];
    std::vector<bf16> buf(2 * lda * kStep);
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t c1 = std::min(M, c0 + chunk);
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t p0 = 2 * blk;
        const int PB = p0 + 1 < panels ? 2 : 1;
        const bf16* b[2];
        const float* scales[2] = {nullptr, nullptr};
        for (int pb = 0; pb < PB; ++pb) {
          const W* panel = wp + (p0 + pb) * stride;
          b[pb] = tile_panel(panel, pairs, tiles, buf.data() + pb * lda * kStep);
          if constexpr (std::is_same_v<W, int8_t>) {
            scales[pb] = reinterpret_cast<const float*>(panel + pairs * kStep);
          }
        }
        if (PB == 1) b[1] = b[0];
        const int64_t n0 = p0 * kPanel;
        for (int64_t m0 = c0; m0 < c1; m0 += 32) {
          const bool tall = m0 + 16 < M;
#define SY_AMX_BLOCK(RA, PB) \
  amx_block<RA, PB>(a.data(), tiles, b, scales, bias, yp, M, N, m0, n0, c)
          if (tall && PB == 2) SY_AMX_BLOCK(2, 2);
          else if (tall) SY_AMX_BLOCK(2, 1);
          else if (PB == 2) SY_AMX_BLOCK(1, 2);
          else SY_AMX_BLOCK(1, 1);
#undef SY_AMX_BLOCK
        }
      }
    }
    _tile_release();
  });
}

bool amx_ready() { return switchyard_xeon::amx::bf16_permitted(); }

#else
bool amx_ready() { return false; }
#endif
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
  at::Tensor y = at::empty({M, N}, x.options());
  const int64_t panels = packed.size(0), stride = packed.size(1) * kStep;
  if (M == 0) return y;
#if defined(SY_DOT_AMX)
  if (M >= g_amx_rows.load(std::memory_order_relaxed) && amx_ready()) {
    if (packed.scalar_type() == at::kChar) {
      run_amx(x.data_ptr<float>(), packed.data_ptr<int8_t>(), bias, y.data_ptr<float>(), M, N,
              K, pairs, panels, stride);
    } else {
      run_amx(x.data_ptr<float>(), packed.data_ptr<bf16>(), bias, y.data_ptr<float>(), M, N, K,
              pairs, panels, stride);
    }
    return y;
  }
#endif
  std::vector<uint32_t> pairs_of_x(M * pairs);
  rows_as_pairs(x.data_ptr<float>(), M, K, pairs, pairs_of_x.data());
  if (packed.scalar_type() == at::kChar) {
    run_dot(pairs_of_x.data(), packed.data_ptr<int8_t>(), bias, y.data_ptr<float>(), M, N, pairs,
            panels, stride);
  } else {
    run_dot(pairs_of_x.data(), packed.data_ptr<bf16>(), bias, y.data_ptr<float>(), M, N, pairs,
            panels, stride);
  }
  return y;
}

namespace {

// The row count from which calls take AMX: set to `rows` when it is >= 0, and
// returned; -1 when this build or this process has no AMX-BF16.
int64_t bf16_amx_rows(int64_t rows) {
#if defined(SY_DOT_AMX)
  if (!amx_ready()) return -1;
  if (rows >= 0) g_amx_rows.store(rows, std::memory_order_relaxed);
  return g_amx_rows.load(std::memory_order_relaxed);
#else
  (void)rows;
  return -1;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def("pack_panels_bf16_dot(Tensor weight) -> Tensor");
  m.def("pack_panels_int8_dot(Tensor weight, Tensor scale) -> Tensor");
  m.def("bf16_amx_rows(int rows) -> int", &bf16_amx_rows);
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
