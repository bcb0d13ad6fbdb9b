// Grammar masks on logits: one pass that writes -inf over the tokens a bitmask forbids.
//
// `mask_logits_(logits, words, index)`: for each bitmask row r (xgrammar's int32 words,
// bit t % 32 of word t // 32 set when token t is allowed), logits row index[r] gets -inf
// at every token t < V whose bit is 0. The other logits are not written. A row that
// allows no token below V is left alone and reported in the returned bool tensor (the
// caller fails its sequence). This is what switchyard.engine.grammar.mask_logits does
// in several torch operations (a table lookup per mask byte and an add, or a gather and
// scatter); here each logits row is touched once, and a word whose 32 tokens are all
// allowed (most of a free string's row) is skipped without touching its logits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// -inf by its bits: the build uses -ffast-math, under which infinity constants are unsafe.
constexpr uint32_t kNegInfBits = 0xFF800000u;

inline void store_neg_inf(float* dst) { std::memcpy(dst, &kNegInfBits, sizeof(float)); }

// Write -inf over the 32 logits at `row` whose bits in `forbid` are set (bit i: row[i]);
// `limit` bits at most (the vocabulary's tail word).
inline void forbid_word(float* row, uint32_t forbid, int limit) {
  if (limit < 32) forbid &= (1u << limit) - 1u;
  if (forbid == 0) return;
#if defined(__AVX512F__)
  // Masked stores write only the chosen lanes and never fault on the others.
  const __m512 neg_inf = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(kNegInfBits)));
  _mm512_mask_storeu_ps(row, static_cast<__mmask16>(forbid & 0xFFFFu), neg_inf);
  _mm512_mask_storeu_ps(row + 16, static_cast<__mmask16>(forbid >> 16), neg_inf);
#else
  while (forbid) {
    const int bit = __builtin_ctz(forbid);
    store_neg_inf(row + bit);
    forbid &= forbid - 1u;
  }
#endif
}

at::Tensor mask_logits_(at::Tensor& logits, const at::Tensor& words, const at::Tensor& index) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "mask_logits_: logits must be float32 [rows, vocab] with unit column stride");
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == at::kInt && words.is_contiguous(),
              "mask_logits_: words must be contiguous int32 [masked rows, words]");
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong &&
                  index.size(0) == words.size(0),
              "mask_logits_: index must be int64 [masked rows]");
  const int64_t vocab = logits.size(1);
  const int64_t width = words.size(1);
  const int64_t rows = words.size(0);
  TORCH_CHECK(width * 32 >= vocab, "mask_logits_: ", width, " words cover fewer than ", vocab,
              " tokens");
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(idx[r] >= 0 && idx[r] < logits.size(0), "mask_logits_: index ", idx[r],
                " outside ", logits.size(0), " logits rows");
  }
  at::Tensor dead = at::zeros({rows}, at::kBool);
  bool* dead_ptr = dead.data_ptr<bool>();
  float* base = logits.data_ptr<float>();
  const int64_t ld = logits.stride(0);
  const auto* all_words = reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>());
  const int64_t full = vocab / 32;
  const int tail = static_cast<int>(vocab % 32);
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const uint32_t* w = all_words + r * width;
      uint32_t allowed = 0;
      for (int64_t i = 0; i < full; ++i) allowed |= w[i];
      if (tail) allowed |= w[full] & ((1u << tail) - 1u);
      if (allowed == 0) {
        dead_ptr[r] = true;
        continue;
      }
      float* row = base + idx[r] * ld;
      for (int64_t i = 0; i < full; ++i) {
        if (w[i] != 0xFFFFFFFFu) forbid_word(row + 32 * i, ~w[i], 32);
      }
      if (tail) forbid_word(row + 32 * full, ~w[full], tail);
    }
  });
  return dead;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def("mask_logits_(Tensor(a!) logits, Tensor words, Tensor index) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_xeon, CPU, m) { m.impl("mask_logits_", &mask_logits_); }
