// Paged decode attention for the Xeon engine: one query token per sequence,
// attending over that sequence's keys and values where they lie in the block
// pool, with no gather copy and no padding.
//
// Layout (see kv_cache.py): pools are [kv_heads, num_blocks, block_size, head_dim];
// block_tables is [batch, max_blocks] (int32), context_lens [batch] (int32);
// q is [batch, heads, head_dim]. The output has q's shape and dtype. The pools
// share q's dtype, or are bf16 under an fp32 q (the engine's bf16 matmul mode).
//
// Work is split over (sequence, kv head): the query heads of a GQA group share
// every key/value row read, which is the only memory traffic that matters
// here. Scores, softmax and the weighted sum accumulate in fp32.
//
// Two optional score terms, applied in this order after the scale and before
// the softmax: logit soft-capping (softcap > 0: s = softcap * tanh(s / softcap),
// Gemma 2) and ALiBi (alibi_slopes, fp32 [heads]: s += slope[head] * (j - i) for
// the key at position j and the query at position i = context_len - 1).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#else
#define _mm_prefetch(p, hint) __builtin_prefetch(p)
#endif

namespace {

// Far-off keys get probabilities near zero, and products with them fall into
// the subnormal range, where x86 arithmetic is up to a hundred times slower.
// Flushing them to zero changes nothing measurable and keeps the kernel at
// memory speed; the thread's previous mode comes back on exit.
class FlushDenormals {
 public:
  FlushDenormals() {
#if defined(__SSE__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8040);  // FTZ | DAZ
#endif
  }
  ~FlushDenormals() {
#if defined(__SSE__)
    _mm_setcsr(saved_);
#endif
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned int saved_ = 0;
};

// A cached row as floats: fp32 rows are read in place, others converted into buf.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

// DC > 0 fixes head_dim at compile time (the common sizes, fully vectorised);
// DC == 0 reads it at run time.
// T: q and the output; C: the pools (T, or bf16 under an fp32 q).
template <typename T, typename C, int DC>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                   const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                   double scale, int64_t window, double softcap, const float* slopes) {
  const int64_t batch = q.size(0), heads = q.size(1);
  const int64_t D = DC > 0 ? DC : q.size(2);
  const int64_t kv_heads = k_pool.size(0), num_blocks = k_pool.size(1);
  const int64_t block_size = k_pool.size(2), max_blocks = tables.size(1);
  const int64_t group = heads / kv_heads;
  const int64_t q_stride = q.stride(0);  // rows may be views into a wider q|k|v buffer
  const T* qp = q.data_ptr<T>();
  const C* kp = k_pool.data_ptr<C>();
  const C* vp = v_pool.data_ptr<C>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const float cap = static_cast<float>(softcap), inv_cap = softcap > 0 ? 1.f / cap : 0.f;

  const int64_t block_bytes = block_size * D * static_cast<int64_t>(sizeof(C));
  // The first key row of work item `work` (-1: none), to request ahead of it.
  auto next_item_keys = [&](int64_t work) -> const C* {
    if (work < 0) return nullptr;
    const int64_t b = work / kv_heads, h = work % kv_heads, length = lp[b];
    const int64_t first = (window > 0 && length > window) ? length - window : 0;
    if (length <= first) return nullptr;
    return kp + h * num_blocks * block_size * D +
           (static_cast<int64_t>(tp[b * max_blocks + first / block_size]) * block_size +
            first % block_size) * D;
  };

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush;
    std::vector<float> qf(group * D), acc(group * D), row(D), scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / kv_heads, h = work % kv_heads;
      const int64_t length = lp[b];
      const int64_t first = (window > 0 && length > window) ? length - window : 0;
      const int64_t span = length - first;
      if (span <= 0) continue;
      scores.resize(group * span);
      const int32_t* table = tp + b * max_blocks;
      const T* qrow = qp + b * q_stride + h * group * D;
      for (int64_t i = 0; i < group * D; ++i) qf[i] = static_cast<float>(qrow[i]) * fscale;
      const C* kbase = kp + h * num_blocks * block_size * D;
      const C* vbase = vp + h * num_blocks * block_size * D;

      // Rows first .. length-1, a block at a time: the table lookup (a division)
      // once per block rather than once per row. While a block's rows are worked
      // on, the next block's lines are requested (`then`: the block after the
      // last one, the V walk's first or the next item's first): blocks lie
      // scattered in the pool, and the hardware prefetcher stops at each jump.
      auto for_rows = [&](const C* base, const C* then, auto&& body) {
        for (int64_t l = first; l < length;) {
          const int64_t off = l % block_size, n = std::min(block_size - off, length - l);
          const C* r = base + (static_cast<int64_t>(table[l / block_size]) * block_size + off) * D;
          const int64_t next = l + n;
          const char* ahead = reinterpret_cast<const char*>(
              next < length ? base + static_cast<int64_t>(table[next / block_size]) * block_size * D
                            : then);
          const int64_t per_row = (block_bytes / 64 + n - 1) / n;  // lines to request a row
          for (int64_t j = 0; j < n; ++j) {
            if (ahead) {
              for (int64_t c = 0; c < per_row; ++c) {
                _mm_prefetch(ahead + (j * per_row + c) * 64, _MM_HINT_T0);
              }
            }
            body(l - first + j, r + j * D);
          }
          l = next;
        }
      };
      const C* v_first = vbase + (static_cast<int64_t>(table[first / block_size]) * block_size +
                                  first % block_size) * D;
      for_rows(kbase, v_first, [&](int64_t i, const C* krow) {
        const float* k = as_float(krow, row.data(), D);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * k[d];
          scores[g * span + i] = s;
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * span;
        if (softcap > 0) {
          for (int64_t i = 0; i < span; ++i) sg[i] = cap * std::tanh(sg[i] * inv_cap);
        }
        if (slopes != nullptr) {
          // Key first + i against the query at length - 1: a distance of
          // first + i - (length - 1) <= 0, exact in fp32 as an integer, so the
          // bias of the keys that matter stays near zero whatever the position.
          const float slope = slopes[h * group + g];
          for (int64_t i = 0; i < span; ++i) {
            sg[i] += slope * static_cast<float>(first + i - (length - 1));
          }
        }
        float m = sg[0];
        for (int64_t i = 1; i < span; ++i) m = std::max(m, sg[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < span; ++i) {
          sg[i] = std::exp(sg[i] - m);
          sum += sg[i];
        }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < span; ++i) sg[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_rows(vbase, next_item_keys(work + 1 < end ? work + 1 : -1), [&](int64_t i,
                                                                         const C* vrow) {
        const float* v = as_float(vrow, row.data(), D);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * span + i];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
        }
      });
      T* orow = op + (b * heads + h * group) * D;
      for (int64_t i = 0; i < group * D; ++i) orow[i] = static_cast<T>(acc[i]);
    }
  });
}

template <typename T, typename C = T>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& t, const at::Tensor& n, at::Tensor& out, double scale,
                  int64_t window, double softcap, const float* slopes) {
  switch (q.size(2)) {
    case 64: decode_kernel<T, C, 64>(q, k, v, t, n, out, scale, window, softcap, slopes); break;
    case 128: decode_kernel<T, C, 128>(q, k, v, t, n, out, scale, window, softcap, slopes); break;
    default: decode_kernel<T, C, 0>(q, k, v, t, n, out, scale, window, softcap, slopes);
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool,
                                  const at::Tensor& v_pool, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t window,
                                  double softcap, const c10::optional<at::Tensor>& alibi_slopes) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
              "paged_decode_attention: q [B, H, D], pools [KVH, blocks, block_size, D]");
  const bool bf16_pools = q.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kBFloat16;
  TORCH_CHECK((q.scalar_type() == k_pool.scalar_type() || bf16_pools) &&
                  k_pool.scalar_type() == v_pool.scalar_type(),
              "paged_decode_attention: q and the pools must share a dtype "
              "(or the pools be bfloat16 under a float32 q)");
  TORCH_CHECK(q.size(2) == k_pool.size(3), "paged_decode_attention: head_dim mismatch");
  TORCH_CHECK(q.size(1) % k_pool.size(0) == 0, "paged_decode_attention: heads % kv_heads != 0");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_tables and context_lens must be int32");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
              "paged_decode_attention: one block table and length per query");
  // A size-1 dimension's stride is arbitrary (one head: PyTorch keeps the view's stride).
  TORCH_CHECK(q.stride(2) == 1 && (q.size(1) == 1 || q.stride(1) == q.size(2)),
              "paged_decode_attention: q's heads must be dense (any row stride)");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() &&
              block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode_attention: inputs must be contiguous");
  TORCH_CHECK(softcap >= 0, "paged_decode_attention: softcap must be >= 0 (0: none)");
  const float* slopes = nullptr;
  if (alibi_slopes.has_value()) {
    const at::Tensor& s = *alibi_slopes;
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 1 && s.size(0) == q.size(1) &&
                    s.is_contiguous(),
                "paged_decode_attention: alibi_slopes must be contiguous float32 [heads]");
    slopes = s.data_ptr<float>();
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (bf16_pools) {
    dispatch_dim<float, c10::BFloat16>(q, k_pool, v_pool, block_tables, context_lens, out, scale,
                                       window, softcap, slopes);
  } else if (q.scalar_type() == at::kFloat) {
    dispatch_dim<float>(q, k_pool, v_pool, block_tables, context_lens, out, scale, window,
                        softcap, slopes);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch_dim<c10::BFloat16>(q, k_pool, v_pool, block_tables, context_lens, out, scale, window,
                                softcap, slopes);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only");
  }
  return out;
}

}  // namespace

at::Tensor switchyard_xeon::paged_decode_attention(
    const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
    int64_t window, double softcap, const c10::optional<at::Tensor>& alibi_slopes) {
  return ::paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale, window,
                                  softcap, alibi_slopes);
}

TORCH_LIBRARY(switchyard_xeon, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
      "Tensor context_lens, float scale, int window, float softcap=0., "
      "Tensor? alibi_slopes=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_xeon, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
