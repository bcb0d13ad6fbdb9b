// Paged attention for prefill rows: every sequence of a step that feeds a chunk
// of its prompt (fresh, after a prefix-cache hit, or a later chunk) attends
// causally over its context where it lies in the block pool, its new keys and
// values already stored there. One call per layer replaces a gather of the
// cached blocks, a bf16 round trip of the new keys and one SDPA call per
// sequence (~170 of the ~830 ms of a 1,024-token prefill step of the 135M shape).
//
// Layout as paged_attention.cpp: pools [kv_heads, num_blocks, block_size, D],
// block_tables [S, max_blocks] int32, context_lens [S] (tokens cached after
// this step), query_starts and query_lens [S] (each sequence's rows of q); q is
// [T, heads, D] fp32 (rows may be strided, heads dense). Row r of sequence s
// sits at position context_lens[s] - query_lens[s] + r and sees keys at
// positions up to its own, and within `window` of it when window > 0. Rows no
// sequence owns are left unwritten in the output (the caller's decode rows).
//
// Work is split over (sequence, kv head, 16-row chunk of queries); each item
// widens the keys and values its rows can see into fp32 once, then per query
// head and row computes 16 scores per vector (lane j: key j's dot product, by
// interleave-and-add of 16 rows' partial sums), a softmax, and the weighted
// sum of values in D / 16 registers. fp32 arithmetic throughout.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t kRowChunk = 16;  // query rows per work item

// Lane j: the sum of the 16 lanes of p[j].
inline __m512 sum_rows16(const __m512* p) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [r0 r1 r0 r1] partial pairs
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                         _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [r0 r1 r2 r3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {  // fold the four 128-bit lanes of two 4-row groups
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

template <typename C, int D>
void prefill_kernel(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                    const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& starts,
                    const at::Tensor& counts, at::Tensor& out, double scale, int64_t window) {
  constexpr int64_t V = D / 16;
  const int64_t seqs = tables.size(0), heads = q.size(1);
  const int64_t kv_heads = k_pool.size(0), num_blocks = k_pool.size(1);
  const int64_t block_size = k_pool.size(2), max_blocks = tables.size(1);
  const int64_t group = heads / kv_heads, q_stride = q.stride(0);
  const float* qp = q.data_ptr<float>();
  const C* kp = k_pool.data_ptr<C>();
  const C* vp = v_pool.data_ptr<C>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int32_t* np = counts.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // Work items: (sequence, kv head, chunk), numbered sequence by sequence.
  std::vector<int64_t> first_item(seqs + 1, 0);
  for (int64_t s = 0; s < seqs; ++s) {
    first_item[s + 1] = first_item[s] + kv_heads * ((np[s] + kRowChunk - 1) / kRowChunk);
  }
  at::parallel_for(0, first_item[seqs], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> keys, values, scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = std::upper_bound(first_item.begin(), first_item.end(), item) -
                        first_item.begin() - 1;
      const int64_t local = item - first_item[s];
      const int64_t chunks = (np[s] + kRowChunk - 1) / kRowChunk;
      const int64_t h = local / chunks, chunk = local % chunks;
      const int64_t length = lp[s], n = np[s], base = length - n;
      const int64_t r0 = chunk * kRowChunk, r1 = std::min(n, r0 + kRowChunk);
      // Keys the chunk's rows can see: [lo, hi).
      const int64_t hi = base + r1;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, base + r0 - window + 1) : 0;
      keys.resize((hi - lo) * D);
      values.resize((hi - lo) * D);
      scores.resize(hi - lo + 16);
      const int32_t* table = tp + s * max_blocks;
      const C* kbase = kp + h * num_blocks * block_size * D;
      const C* vbase = vp + h * num_blocks * block_size * D;
      for (int64_t l = lo; l < hi;) {
        const int64_t off = l % block_size, rows = std::min(block_size - off, hi - l);
        const int64_t at = (static_cast<int64_t>(table[l / block_size]) * block_size + off) * D;
        for (int64_t i = 0; i < rows * D; ++i) {
          keys[(l - lo) * D + i] = static_cast<float>(kbase[at + i]);
          values[(l - lo) * D + i] = static_cast<float>(vbase[at + i]);
        }
        l += rows;
      }
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t pos = base + r;
        const int64_t from = window > 0 ? std::max<int64_t>(lo, pos - window + 1) : lo;
        const int64_t span = pos + 1 - from;
        const float* kr = keys.data() + (from - lo) * D;
        const float* vr = values.data() + (from - lo) * D;
        for (int64_t g = 0; g < group; ++g) {
          const float* qrow = qp + (sp[s] + r) * q_stride + (h * group + g) * D;
          __m512 qv[V];
          const __m512 sc = _mm512_set1_ps(fscale);
          for (int64_t c = 0; c < V; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(qrow + 16 * c), sc);
          for (int64_t j0 = 0; j0 < span; j0 += 16) {
            const int64_t m = std::min<int64_t>(16, span - j0);
            __m512 part[16];
            for (int64_t j = 0; j < 16; ++j) {
              if (j >= m) {
                part[j] = _mm512_setzero_ps();
                continue;
              }
              const float* row = kr + (j0 + j) * D;
              __m512 sum = _mm512_mul_ps(qv[0], _mm512_loadu_ps(row));
              for (int64_t c = 1; c < V; ++c) {
                sum = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(row + 16 * c), sum);
              }
              part[j] = sum;
            }
            _mm512_mask_storeu_ps(scores.data() + j0, static_cast<__mmask16>((1u << m) - 1),
                                  sum_rows16(part));
          }
          float mx = scores[0];
          for (int64_t i = 1; i < span; ++i) mx = std::max(mx, scores[i]);
          float total = 0.f;
          for (int64_t i = 0; i < span; ++i) {
            scores[i] = std::exp(scores[i] - mx);
            total += scores[i];
          }
          const __m512 inv = _mm512_set1_ps(1.f / total);
          __m512 acc[V];
          for (int64_t c = 0; c < V; ++c) acc[c] = _mm512_setzero_ps();
          for (int64_t i = 0; i < span; ++i) {
            const __m512 p = _mm512_set1_ps(scores[i]);
            for (int64_t c = 0; c < V; ++c) {
              acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + i * D + 16 * c), acc[c]);
            }
          }
          float* orow = op + ((sp[s] + r) * heads + h * group + g) * D;
          for (int64_t c = 0; c < V; ++c) _mm512_storeu_ps(orow + 16 * c, _mm512_mul_ps(acc[c], inv));
        }
      }
    }
  });
}

template <typename C>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& t, const at::Tensor& l, const at::Tensor& s,
                  const at::Tensor& n, at::Tensor& out, double scale, int64_t window) {
  switch (q.size(2)) {
    case 64: prefill_kernel<C, 64>(q, k, v, t, l, s, n, out, scale, window); break;
    case 128: prefill_kernel<C, 128>(q, k, v, t, l, s, n, out, scale, window); break;
    default: TORCH_CHECK(false, "paged_prefill_attention: head_dim must be 64 or 128");
  }
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_pool,
                                   const at::Tensor& v_pool, const at::Tensor& block_tables,
                                   const at::Tensor& context_lens, const at::Tensor& query_starts,
                                   const at::Tensor& query_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
              "paged_prefill_attention: q [T, H, D], pools [KVH, blocks, block_size, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat &&
                  (k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kBFloat16) &&
                  k_pool.scalar_type() == v_pool.scalar_type(),
              "paged_prefill_attention: a float32 q over float32 or bfloat16 pools");
  TORCH_CHECK(q.size(2) == k_pool.size(3) && q.size(1) % k_pool.size(0) == 0,
              "paged_prefill_attention: head_dim or head counts do not match the pools");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_prefill_attention: q's heads must be dense (any row stride)");
  for (const at::Tensor* t : {&block_tables, &context_lens, &query_starts, &query_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "paged_prefill_attention: tables, lengths and starts must be contiguous int32");
  }
  const int64_t seqs = block_tables.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.size(0) == seqs &&
                  query_starts.size(0) == seqs && query_lens.size(0) == seqs,
              "paged_prefill_attention: one table, length, start and count per sequence");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(),
              "paged_prefill_attention: pools must be contiguous");
  const int32_t* lp = context_lens.data_ptr<int32_t>();
  const int32_t* sp = query_starts.data_ptr<int32_t>();
  const int32_t* np = query_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(np[s] >= 1 && np[s] <= lp[s] && sp[s] >= 0 && sp[s] + np[s] <= q.size(0) &&
                    (lp[s] + k_pool.size(2) - 1) / k_pool.size(2) <= block_tables.size(1),
                "paged_prefill_attention: sequence ", s, " does not fit its table or q");
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (k_pool.scalar_type() == at::kBFloat16) {
    dispatch_dim<c10::BFloat16>(q, k_pool, v_pool, block_tables, context_lens, query_starts,
                                query_lens, out, scale, window);
  } else {
    dispatch_dim<float>(q, k_pool, v_pool, block_tables, context_lens, query_starts, query_lens,
                        out, scale, window);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
      "Tensor context_lens, Tensor query_starts, Tensor query_lens, float scale, int window) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_xeon, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}

#endif  // no AVX-512: not registered; prefill attention stays on SDPA
