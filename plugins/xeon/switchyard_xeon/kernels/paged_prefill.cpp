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
// widens the keys and values its rows can see into fp32 once, the keys
// transposed into blocks of 16 so that a row's 16 scores are one vector of
// broadcast multiply-adds; four query rows at a time share every key block and
// value row loaded, for each query head of the group: scores, a softmax per
// row, and the weighted sums of values in registers. fp32 arithmetic throughout.
//
// Optional score terms, as paged_attention.cpp applies them after the scale and
// before the softmax: soft-capping (softcap > 0) and ALiBi (alibi_slopes fp32
// [heads]: slope * (j - i) for the key at position j, the row at position i).

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
constexpr int64_t kRows = 4;       // query rows sharing each key and value load

template <typename C, int D>
void prefill_kernel(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                    const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& starts,
                    const at::Tensor& counts, at::Tensor& out, double scale, int64_t window,
                    double softcap, const float* slopes) {
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
  const float cap = static_cast<float>(softcap), inv_cap = softcap > 0 ? 1.f / cap : 0.f;

  // Work items: (sequence, kv head, chunk), numbered sequence by sequence.
  std::vector<int64_t> first_item(seqs + 1, 0);
  for (int64_t s = 0; s < seqs; ++s) {
    first_item[s + 1] = first_item[s] + kv_heads * ((np[s] + kRowChunk - 1) / kRowChunk);
  }
  at::parallel_for(0, first_item[seqs], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> keys_t, values, scores;
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
      // Keys transposed into blocks of 16 ([block][d][16]): a query row's 16
      // scores are then 64 broadcast multiply-adds into one vector, no
      // reduction; values stay rows. Both widened to fp32 once per item.
      const int64_t key_blocks = (hi - lo + 15) / 16;
      keys_t.assign(key_blocks * D * 16, 0.f);
      values.resize((hi - lo) * D);
      const int32_t* table = tp + s * max_blocks;
      const C* kbase = kp + h * num_blocks * block_size * D;
      const C* vbase = vp + h * num_blocks * block_size * D;
      for (int64_t l = lo; l < hi;) {
        const int64_t off = l % block_size, rows = std::min(block_size - off, hi - l);
        const int64_t at = (static_cast<int64_t>(table[l / block_size]) * block_size + off) * D;
        for (int64_t j = 0; j < rows; ++j) {
          const int64_t key = l - lo + j;
          float* kt = keys_t.data() + (key / 16) * D * 16 + key % 16;
          for (int64_t d = 0; d < D; ++d) kt[d * 16] = static_cast<float>(kbase[at + j * D + d]);
          for (int64_t d = 0; d < D; ++d) {
            values[key * D + d] = static_cast<float>(vbase[at + j * D + d]);
          }
        }
        l += rows;
      }
      // kRows query rows at a time share every key block and value row loaded.
      for (int64_t ra = r0; ra < r1; ra += kRows) {
        const int64_t rows = std::min(kRows, r1 - ra);
        int64_t from[kRows], upto[kRows];  // each row's keys, [from, upto), relative to lo
        for (int64_t i = 0; i < kRows; ++i) {
          const int64_t pos = base + ra + std::min(i, rows - 1);
          from[i] = (window > 0 ? std::max<int64_t>(lo, pos - window + 1) : lo) - lo;
          upto[i] = pos + 1 - lo;
        }
        const int64_t kb0 = from[0] / 16, kb1 = (upto[rows - 1] + 15) / 16;
        const int64_t width = (kb1 - kb0) * 16;  // scores per row, from key kb0 * 16
        scores.resize(kRows * width);
        for (int64_t g = 0; g < group; ++g) {
          const float* qrow[kRows];
          for (int64_t i = 0; i < kRows; ++i) {
            qrow[i] = qp + (sp[s] + ra + std::min(i, rows - 1)) * q_stride + (h * group + g) * D;
          }
          for (int64_t kb = kb0; kb < kb1; ++kb) {
            const float* kt = keys_t.data() + kb * D * 16;
            __m512 acc[kRows];
            for (int64_t i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; ++d) {
              const __m512 k16 = _mm512_loadu_ps(kt + d * 16);
              for (int64_t i = 0; i < kRows; ++i) {
                acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(qrow[i][d]), k16, acc[i]);
              }
            }
            for (int64_t i = 0; i < kRows; ++i) {
              _mm512_storeu_ps(scores.data() + i * width + (kb - kb0) * 16,
                               _mm512_mul_ps(acc[i], _mm512_set1_ps(fscale)));
            }
          }
          // Softmax over each row's own keys; the rest of its width weighs zero.
          const float slope = slopes != nullptr ? slopes[h * group + g] : 0.f;
          for (int64_t i = 0; i < rows; ++i) {
            float* si = scores.data() + i * width - kb0 * 16;  // indexed by key - lo
            if (softcap > 0) {
              for (int64_t key = from[i]; key < upto[i]; ++key) {
                si[key] = cap * std::tanh(si[key] * inv_cap);
              }
            }
            if (slopes != nullptr) {
              // Key lo + key against the row at upto[i] - 1 + lo: a distance <= 0, exact
              // in fp32, so the bias near the diagonal (what dominates) stays near zero.
              for (int64_t key = from[i]; key < upto[i]; ++key) {
                si[key] += slope * static_cast<float>(key - (upto[i] - 1));
              }
            }
            float mx = si[from[i]];
            for (int64_t key = from[i] + 1; key < upto[i]; ++key) mx = std::max(mx, si[key]);
            float total = 0.f;
            for (int64_t key = from[i]; key < upto[i]; ++key) {
              si[key] = std::exp(si[key] - mx);
              total += si[key];
            }
            const float inv = 1.f / total;
            for (int64_t key = kb0 * 16; key < kb1 * 16; ++key) {
              si[key] = key >= from[i] && key < upto[i] ? si[key] * inv : 0.f;
            }
          }
          __m512 acc[kRows][V];
          for (int64_t i = 0; i < kRows; ++i)
            for (int64_t c = 0; c < V; ++c) acc[i][c] = _mm512_setzero_ps();
          const int64_t k0 = std::max(kb0 * 16, from[0]), k1 = upto[rows - 1];
          for (int64_t key = k0; key < k1; ++key) {
            const float* vr = values.data() + key * D;
            __m512 v[V];
            for (int64_t c = 0; c < V; ++c) v[c] = _mm512_loadu_ps(vr + 16 * c);
            for (int64_t i = 0; i < rows; ++i) {
              const __m512 p = _mm512_set1_ps(scores[i * width + key - kb0 * 16]);
              for (int64_t c = 0; c < V; ++c) acc[i][c] = _mm512_fmadd_ps(p, v[c], acc[i][c]);
            }
          }
          for (int64_t i = 0; i < rows; ++i) {
            float* orow = op + ((sp[s] + ra + i) * heads + h * group + g) * D;
            for (int64_t c = 0; c < V; ++c) _mm512_storeu_ps(orow + 16 * c, acc[i][c]);
          }
        }
      }
    }
  });
}

template <typename C>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& t, const at::Tensor& l, const at::Tensor& s,
                  const at::Tensor& n, at::Tensor& out, double scale, int64_t window,
                  double softcap, const float* slopes) {
  switch (q.size(2)) {
    case 64: prefill_kernel<C, 64>(q, k, v, t, l, s, n, out, scale, window, softcap, slopes); break;
    case 128:
      prefill_kernel<C, 128>(q, k, v, t, l, s, n, out, scale, window, softcap, slopes);
      break;
    default: TORCH_CHECK(false, "paged_prefill_attention: head_dim must be 64 or 128");
  }
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_pool,
                                   const at::Tensor& v_pool, const at::Tensor& block_tables,
                                   const at::Tensor& context_lens, const at::Tensor& query_starts,
                                   const at::Tensor& query_lens, double scale, int64_t window,
                                   double softcap, const c10::optional<at::Tensor>& alibi_slopes) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
              "paged_prefill_attention: q [T, H, D], pools [KVH, blocks, block_size, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat &&
                  (k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kBFloat16) &&
                  k_pool.scalar_type() == v_pool.scalar_type(),
              "paged_prefill_attention: a float32 q over float32 or bfloat16 pools");
  TORCH_CHECK(q.size(2) == k_pool.size(3) && q.size(1) % k_pool.size(0) == 0,
              "paged_prefill_attention: head_dim or head counts do not match the pools");
  // A size-1 dimension's stride is arbitrary (one head: PyTorch keeps the view's stride).
  TORCH_CHECK(q.stride(2) == 1 && (q.size(1) == 1 || q.stride(1) == q.size(2)),
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
  TORCH_CHECK(softcap >= 0, "paged_prefill_attention: softcap must be >= 0 (0: none)");
  const float* slopes = nullptr;
  if (alibi_slopes.has_value()) {
    const at::Tensor& a = *alibi_slopes;
    TORCH_CHECK(a.scalar_type() == at::kFloat && a.dim() == 1 && a.size(0) == q.size(1) &&
                    a.is_contiguous(),
                "paged_prefill_attention: alibi_slopes must be contiguous float32 [heads]");
    slopes = a.data_ptr<float>();
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (k_pool.scalar_type() == at::kBFloat16) {
    dispatch_dim<c10::BFloat16>(q, k_pool, v_pool, block_tables, context_lens, query_starts,
                                query_lens, out, scale, window, softcap, slopes);
  } else {
    dispatch_dim<float>(q, k_pool, v_pool, block_tables, context_lens, query_starts, query_lens,
                        out, scale, window, softcap, slopes);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
      "Tensor context_lens, Tensor query_starts, Tensor query_lens, float scale, int window, "
      "float softcap=0., Tensor? alibi_slopes=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_xeon, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}

#endif  // no AVX-512: not registered; prefill attention stays on SDPA
