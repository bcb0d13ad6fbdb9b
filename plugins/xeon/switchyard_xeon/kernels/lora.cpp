// Each row's LoRA adapter over one projection: out[row] += (x[row] @ A.T) @ (B * s).T,
// for the rows of a step grouped by adapter, in one call per projection.
//
// An adapter is a flat buffer and a table (switchyard_engine/lora/flat.py): per
// layer, projection and part (q, k and v are the parts of a fused q|k|v), the
// offsets of A [rank, in] and of (B * scaling).T [rank, width], the rank and the
// part's output columns. `rows` lists the step's adapter rows group by group
// (`starts[g] .. starts[g + 1]` are group g's, whose adapter is weights[g] with
// tables[g]); base-model rows are not listed and get nothing.
//
// Work items are (group, part) pairs, spread over threads: parts own disjoint
// columns and groups disjoint rows, so no two items write the same number.
// An item takes its rows four at a time: the shrink loads each of A's weights
// once for the four rows' dot products, the expand each of B's once for the
// four rows' multiply-adds; the adapter's matrices are read from memory once
// per step for all of its rows. Weights are fp32 or bf16 (widened exactly);
// math and activations are fp32. AVX-512 builds run both halves on intrinsics:
// the shrink widens each 16 weights in registers for the four rows' multiply-adds,
// the expand keeps the four rows' sums for 16 output columns in registers over
// every rank (each output loaded and stored once), and the weights are asked
// for 4 KB ahead of use. Other builds (AVX2) run plain C++ loops that the compiler
// vectorizes for their level (-O3 -ffast-math).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "ops.h"

#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define SY_LORA_AVX512 1
#endif

namespace {

constexpr int64_t kParts = 3;   // parts per projection in a table (q|k|v's three)
constexpr int64_t kFields = 5;  // a_offset, b_offset, rank, col_start, col_end
constexpr int64_t kBlock = 4;   // rows per pass over an adapter's part

// fp32 values read through a buffer written as their bit patterns (see Row).
typedef float __attribute__((may_alias)) aliased_float;

// One row of an adapter matrix as fp32: fp32 weights as they are, bf16 ones
// widened into a buffer first (a bf16 is the top half of the fp32 with the same
// bits: a shift of integers, which the compiler vectorizes, where widening inside
// the multiply-add loops kept them scalar).
template <typename W>
struct Row {
  explicit Row(int64_t) {}
  const float* get(const float* src, int64_t) { return src; }
};

template <>
struct Row<c10::BFloat16> {
  std::vector<uint32_t> bits;
  explicit Row(int64_t n) : bits(n) {}
  const float* get(const c10::BFloat16* src, int64_t n) {
    const uint16_t* __restrict__ in = reinterpret_cast<const uint16_t*>(src);
    uint32_t* __restrict__ out = bits.data();
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(in[i]) << 16;
    return reinterpret_cast<const aliased_float*>(out);
  }
};

// s[j * rank + r] = x_j . a_r for the n (1..4) rows x_j; rows past n repeat the
// last one (their sums are computed and dropped: one loop shape for every n).
template <typename W>
void shrink(const float* const* x, int64_t n, const W* a, int64_t rank, int64_t in, float* s,
            Row<W>& row) {
  const float* __restrict__ x0 = x[0];
  const float* __restrict__ x1 = x[n > 1 ? 1 : 0];
  const float* __restrict__ x2 = x[n > 2 ? 2 : 0];
  const float* __restrict__ x3 = x[n > 3 ? 3 : 0];
  for (int64_t r = 0; r < rank; ++r) {
    const float* __restrict__ ar = row.get(a + r * in, in);
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    for (int64_t k = 0; k < in; ++k) {
      const float w = ar[k];
      s0 += x0[k] * w;
      s1 += x1[k] * w;
      s2 += x2[k] * w;
      s3 += x3[k] * w;
    }
    const float sums[kBlock] = {s0, s1, s2, s3};
    for (int64_t j = 0; j < n; ++j) s[j * rank + r] = sums[j];
  }
}

// out_j[c] += sum_r s[j * rank + r] * b_r[c] for the N rows out_j.
template <int N, typename W>
void expand(float* const* out, const W* b, int64_t rank, int64_t width, const float* s,
            Row<W>& row) {
  float* __restrict__ o0 = out[0];
  float* __restrict__ o1 = out[N > 1 ? 1 : 0];
  float* __restrict__ o2 = out[N > 2 ? 2 : 0];
  float* __restrict__ o3 = out[N > 3 ? 3 : 0];
  for (int64_t r = 0; r < rank; ++r) {
    const float* __restrict__ br = row.get(b + r * width, width);
    const float c0 = s[r];
    const float c1 = N > 1 ? s[rank + r] : 0.f;
    const float c2 = N > 2 ? s[2 * rank + r] : 0.f;
    const float c3 = N > 3 ? s[3 * rank + r] : 0.f;
    for (int64_t c = 0; c < width; ++c) {
      const float w = br[c];
      o0[c] += c0 * w;
      if constexpr (N > 1) o1[c] += c1 * w;
      if constexpr (N > 2) o2[c] += c2 * w;
      if constexpr (N > 3) o3[c] += c3 * w;
    }
  }
}

#if SY_LORA_AVX512
// 16 weights as fp32; the masked forms read only the lanes of `m` (zeros elsewhere).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i wide = _mm512_cvtepu16_epi32(half);
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Weight bytes asked for ahead of the loops' reads (the panel kernels' distance): an
// adapter's matrices are streams of a few KB to tens of KB that the hardware
// prefetcher does not ramp up on before they end.
constexpr int64_t kAheadBytes = 4096;
inline void ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kAheadBytes, _MM_HINT_T0);
}

inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// shrink's contract, on AVX-512.
template <typename W>
void shrink512(const float* const* x, int64_t n, const W* a, int64_t rank, int64_t in,
               float* s) {
  const float* x0 = x[0];
  const float* x1 = x[n > 1 ? 1 : 0];
  const float* x2 = x[n > 2 ? 2 : 0];
  const float* x3 = x[n > 3 ? 3 : 0];
  const int64_t full = in & ~int64_t{15};
  const __mmask16 tail = lanes(in - full);
  for (int64_t r = 0; r < rank; ++r) {
    const W* ar = a + r * in;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t k = 0; k < full; k += 16) {
      ahead(ar + k);
      const __m512 w = load16(ar + k);
      s0 = _mm512_fmadd_ps(_mm512_loadu_ps(x0 + k), w, s0);
      s1 = _mm512_fmadd_ps(_mm512_loadu_ps(x1 + k), w, s1);
      s2 = _mm512_fmadd_ps(_mm512_loadu_ps(x2 + k), w, s2);
      s3 = _mm512_fmadd_ps(_mm512_loadu_ps(x3 + k), w, s3);
    }
    if (tail) {
      const __m512 w = load16(ar + full, tail);
      s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x0 + full), w, s0);
      s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x1 + full), w, s1);
      s2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x2 + full), w, s2);
      s3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x3 + full), w, s3);
    }
    const float sums[kBlock] = {_mm512_reduce_add_ps(s0), _mm512_reduce_add_ps(s1),
                                _mm512_reduce_add_ps(s2), _mm512_reduce_add_ps(s3)};
    for (int64_t j = 0; j < n; ++j) s[j * rank + r] = sums[j];
  }
}

// expand's contract, on AVX-512.
template <int N, typename W>
void expand512(float* const* out, const W* b, int64_t rank, int64_t width, const float* s) {
  for (int64_t c0 = 0; c0 < width; c0 += 16) {
    const __mmask16 m = lanes(width - c0);
    __m512 acc[N];
    for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t r = 0; r < rank; ++r) {
      const W* br = b + r * width + c0;
      if ((c0 * static_cast<int64_t>(sizeof(W))) % 64 == 0) ahead(br);  // once per line
      const __m512 w = m == 0xFFFF ? load16(br) : load16(br, m);
      for (int j = 0; j < N; ++j) {
        acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(s[j * rank + r]), w, acc[j]);
      }
    }
    for (int j = 0; j < N; ++j) {
      float* o = out[j] + c0;
      _mm512_mask_storeu_ps(o, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), acc[j]));
    }
  }
}
#endif

struct Item {
  int64_t group;
  const int64_t* part;  // the table's row: a_offset, b_offset, rank, col_start, col_end
};

template <typename W>
void run_item(const Item& item, const at::Tensor& x, at::Tensor& out, const int64_t* rows,
              const int64_t* starts, const W* weights) {
  const int64_t in = x.size(1), x_stride = x.stride(0), out_stride = out.stride(0);
  const int64_t rank = item.part[2], col = item.part[3], width = item.part[4] - item.part[3];
  const W* a = weights + item.part[0];
  const W* b = weights + item.part[1];
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<float> s(kBlock * rank);
#if !SY_LORA_AVX512
  Row<W> row(std::max(in, width));
#endif
  for (int64_t first = starts[item.group]; first < starts[item.group + 1]; first += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, starts[item.group + 1] - first);
    const float* xs[kBlock];
    float* os[kBlock];
    for (int64_t j = 0; j < n; ++j) {
      xs[j] = xp + rows[first + j] * x_stride;
      os[j] = op + rows[first + j] * out_stride + col;
    }
#if SY_LORA_AVX512
    shrink512(xs, n, a, rank, in, s.data());
    switch (n) {
      case 1: expand512<1>(os, b, rank, width, s.data()); break;
      case 2: expand512<2>(os, b, rank, width, s.data()); break;
      case 3: expand512<3>(os, b, rank, width, s.data()); break;
      default: expand512<4>(os, b, rank, width, s.data()); break;
    }
#else
    shrink(xs, n, a, rank, in, s.data(), row);
    switch (n) {
      case 1: expand<1>(os, b, rank, width, s.data(), row); break;
      case 2: expand<2>(os, b, rank, width, s.data(), row); break;
      case 3: expand<3>(os, b, rank, width, s.data(), row); break;
      default: expand<4>(os, b, rank, width, s.data(), row); break;
    }
#endif
  }
}

}  // namespace

namespace switchyard_xeon {

void lora_add_(const at::Tensor& x, at::Tensor& out, const at::Tensor& rows,
               const at::Tensor& starts, at::TensorList weights, at::TensorList tables,
               int64_t layer, int64_t projection) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "lora_add_: x must be float32 [tokens, in] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              "lora_add_: out must be float32 [tokens, width] with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  starts.dim() == 1 && starts.scalar_type() == at::kLong &&
                  starts.is_contiguous(),
              "lora_add_: rows and starts must be 1-D int64");
  const int64_t groups = starts.size(0) - 1;
  TORCH_CHECK(groups >= 0 && static_cast<int64_t>(weights.size()) == groups &&
                  static_cast<int64_t>(tables.size()) == groups,
              "lora_add_: one weight buffer and one table per group");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t tokens = x.size(0), in = x.size(1);
  TORCH_CHECK(groups == 0 || (sp[0] == 0 && sp[groups] == rows.size(0)),
              "lora_add_: starts must run from 0 to len(rows)");
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < tokens, "lora_add_: a row index is out of range");
  }
  if (groups == 0 || rows.size(0) == 0) return;
  const at::ScalarType wtype = weights[0].scalar_type();
  std::vector<Item> items;
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(sp[g] <= sp[g + 1], "lora_add_: starts must not decrease");
    const at::Tensor& table = tables[g];
    const at::Tensor& w = weights[g];
    TORCH_CHECK(table.dim() == 4 && table.scalar_type() == at::kLong && table.is_contiguous() &&
                    table.size(2) == kParts && table.size(3) == kFields &&
                    layer >= 0 && layer < table.size(0) && projection >= 0 &&
                    projection < table.size(1),
                "lora_add_: tables must be int64 [layers, projections, 3, 5] covering the call");
    TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.scalar_type() == wtype &&
                    (wtype == at::kFloat || wtype == at::kBFloat16),
                "lora_add_: weights must be 1-D float32 or bfloat16, one dtype for all");
    if (sp[g] == sp[g + 1]) continue;
    const int64_t* parts = table.data_ptr<int64_t>() + (layer * table.size(1) + projection) *
                                                          kParts * kFields;
    for (int64_t p = 0; p < kParts; ++p) {
      const int64_t* part = parts + p * kFields;
      const int64_t rank = part[2];
      if (rank == 0) continue;
      TORCH_CHECK(rank > 0 && part[0] >= 0 && part[0] + rank * in <= w.numel() &&
                      part[3] >= 0 && part[3] < part[4] && part[4] <= out.size(1) &&
                      part[1] >= 0 && part[1] + rank * (part[4] - part[3]) <= w.numel(),
                  "lora_add_: a table entry does not fit its weights, x or out");
      items.push_back({g, part});
    }
  }
  const int64_t count = static_cast<int64_t>(items.size());
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[i];
      if (wtype == at::kFloat) {
        run_item(item, x, out, rp, sp, weights[item.group].data_ptr<float>());
      } else {
        run_item(item, x, out, rp, sp, weights[item.group].data_ptr<c10::BFloat16>());
      }
    }
  });
}

}  // namespace switchyard_xeon

namespace {

void lora_add_op(const at::Tensor& x, at::Tensor out, const at::Tensor& rows,
                 const at::Tensor& starts, at::TensorList weights, at::TensorList tables,
                 int64_t layer, int64_t projection) {
  switchyard_xeon::lora_add_(x, out, rows, starts, weights, tables, layer, projection);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def(
      "lora_add_(Tensor x, Tensor(a!) out, Tensor rows, Tensor starts, Tensor[] weights, "
      "Tensor[] tables, int layer, int projection) -> ()");
}

TORCH_LIBRARY_IMPL(switchyard_xeon, CPU, m) {
  m.impl("lora_add_", &lora_add_op);
}
