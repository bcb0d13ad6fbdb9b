// Fused elementwise steps of a Llama-family decoder layer, for the hand-written
// forward (decoder.py). Each replaces a run of small PyTorch ops (RMSNorm alone
// is six: to, pow, mean, add, rsqrt, mul) whose dispatch cost dominates at one
// token per step.
//
// Rounding follows the PyTorch ops they replace: math in fp32, and for bf16 a
// rounding back to bf16 wherever transformers' code produces a bf16 tensor, so
// bf16 results match transformers' op by op rather than only approximately.
//
// Tensors are row-major: rows are tokens. Rows are spread over threads only
// when there are enough of them to pay for waking the pool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "ops.h"

#include <cmath>

namespace {

// Round through T and back (identity for float).
template <typename T>
inline float rnd(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// Calls body(T{}) with T = float or c10::BFloat16 as `dtype` is; others are an error.
template <typename Body>
void by_dtype(at::ScalarType dtype, const char* op, Body&& body) {
  if (dtype == at::kFloat) {
    body(float{});
  } else if (dtype == at::kBFloat16) {
    body(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16 only");
  }
}

inline int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems));
}

// out = w * T(x * rsqrt(mean(x^2) + eps)), x as float.
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<T>(static_cast<float>(w[i]) * rnd<T>(static_cast<float>(x[i]) * inv));
  }
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * n, wp, op + r * n, n, float(eps));
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be a contiguous [rows, n]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [n] of x's dtype");
  at::Tensor out = at::empty_like(x);
  by_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    rms_norm_impl<decltype(tag)>(x, weight, out, eps);
  });
  return out;
}

// residual <- T(residual + x); x <- rms_norm(residual) * w. Both in place.
template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * n;
      T* rr = rp + r * n;
      for (int64_t i = 0; i < n; ++i) {
        rr[i] = static_cast<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
      }
      norm_row(rr, wp, xr, n, float(eps));
    }
  });
}

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm_: x and residual must be contiguous [rows, n] of one dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "add_rms_norm_: weight must be [n] of x's dtype");
  by_dtype(x.scalar_type(), "add_rms_norm_", [&](auto tag) {
    add_rms_norm_impl<decltype(tag)>(x, residual, weight, eps);
  });
}

// transformers' rotate_half convention over the first R dims of a head (R even;
// the rest pass through): out[i] = x[i] c[i] - x[i+R/2] s[i],
// out[i+R/2] = x[i+R/2] c[i+R/2] + x[i] s[i+R/2]. Products and the sum round
// to T as transformers' three bf16 ops do.
template <typename T>
inline void rotate_head(T* x, const T* c, const T* s, int64_t R) {
  const int64_t h = R / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + h]);
    const float lo = rnd<T>(a * static_cast<float>(c[i])) + rnd<T>(-b * static_cast<float>(s[i]));
    const float hi =
        rnd<T>(b * static_cast<float>(c[i + h])) + rnd<T>(a * static_cast<float>(s[i + h]));
    x[i] = static_cast<T>(lo);
    x[i + h] = static_cast<T>(hi);
  }
}

// qkv: [T, (H + 2 KVH) * D], rows q heads | k heads | v heads. Rotates q and k
// in place and stores each token's k and v at its slot of the pools
// ([KVH, blocks, block_size, D], slot = block * block_size + offset).
// T: qkv, cos and sin; C: the pools (T, or bf16 under fp32 qkv: keys and values
// are rounded to bf16 as they are stored).
template <typename T, typename C = T>
void rotary_store_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                       at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots,
                       int64_t heads, int64_t kv_heads) {
  const int64_t tokens = qkv.size(0), width = qkv.size(1);
  const int64_t D = width / (heads + 2 * kv_heads), R = cos.size(1);
  const int64_t pool_slots = k_pool.size(1) * k_pool.size(2);
  T* xp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  C* kp = k_pool.data_ptr<C>();
  C* vp = v_pool.data_ptr<C>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  at::parallel_for(0, tokens, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = xp + t * width;
      const T* c = cp + t * R;
      const T* s = sp + t * R;
      for (int64_t h = 0; h < heads + kv_heads; ++h) rotate_head(row + h * D, c, s, R);
      const int64_t at_slot = slot[t];
      for (int64_t h = 0; h < kv_heads; ++h) {
        const T* k = row + (heads + h) * D;
        const T* v = row + (heads + kv_heads + h) * D;
        C* kd = kp + (h * pool_slots + at_slot) * D;
        C* vd = vp + (h * pool_slots + at_slot) * D;
        for (int64_t i = 0; i < D; ++i) {
          kd[i] = static_cast<C>(k[i]);
          vd[i] = static_cast<C>(v[i]);
        }
      }
    }
  });
}

void rotary_store_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots,
                   int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "rotary_store_: qkv must be contiguous 2-D");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && qkv.size(1) % (heads + 2 * kv_heads) == 0,
              "rotary_store_: qkv width must be (heads + 2 kv_heads) * head_dim");
  const int64_t D = qkv.size(1) / (heads + 2 * kv_heads);
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == qkv.size(0) &&
                  cos.size(1) <= D && cos.size(1) % 2 == 0 && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "rotary_store_: cos/sin must be contiguous [tokens, R] with R even and <= head_dim");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.size(0) == kv_heads &&
                  k_pool.size(3) == D && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "rotary_store_: pools must be contiguous [kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == qkv.size(0) &&
                  slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "rotary_store_: slots must be int64 [tokens]");
  const auto dtype = qkv.scalar_type(), pool_dtype = k_pool.scalar_type();
  const bool bf16_pools = dtype == at::kFloat && pool_dtype == at::kBFloat16;
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype &&
                  (pool_dtype == dtype || bf16_pools) && v_pool.scalar_type() == pool_dtype,
              "rotary_store_: qkv, cos and sin must share a dtype, and the pools it too "
              "(or bfloat16 under float32)");
  const int64_t capacity = k_pool.size(1) * k_pool.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.size(0); ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "rotary_store_: slot out of range");
  }
  if (bf16_pools) {
    rotary_store_impl<float, c10::BFloat16>(qkv, cos, sin, k_pool, v_pool, slots, heads,
                                            kv_heads);
    return;
  }
  by_dtype(dtype, "rotary_store_", [&](auto tag) {
    rotary_store_impl<decltype(tag)>(qkv, cos, sin, k_pool, v_pool, slots, heads, kv_heads);
  });
}

// x: [T, 2I] = gate | up; out: [T, I] = T(T(silu(gate)) * up).
template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), n = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = xp + r * 2 * n;
      const T* u = g + n;
      T* o = op + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const float gv = static_cast<float>(g[i]);
        o[i] = static_cast<T>(rnd<T>(gv / (1.f + std::exp(-gv))) * static_cast<float>(u[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.is_contiguous(),
              "silu_and_mul: x must be a contiguous [rows, 2 * n]");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  by_dtype(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    silu_and_mul_impl<decltype(tag)>(x, out);
  });
  return out;
}

}  // namespace

void switchyard_xeon::add_rms_norm_(at::Tensor& x, at::Tensor& residual,
                                    const at::Tensor& weight, double eps) {
  ::add_rms_norm_(x, residual, weight, eps);
}

void switchyard_xeon::rotary_store_(at::Tensor& qkv, const at::Tensor& cos,
                                    const at::Tensor& sin, at::Tensor& k_pool,
                                    at::Tensor& v_pool, const at::Tensor& slots, int64_t heads,
                                    int64_t kv_heads) {
  ::rotary_store_(qkv, cos, sin, k_pool, v_pool, slots, heads, kv_heads);
}

at::Tensor switchyard_xeon::silu_and_mul(const at::Tensor& x) { return ::silu_and_mul(x); }

TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rotary_store_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_pool, "
      "Tensor(c!) v_pool, Tensor slots, int heads, int kv_heads) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_xeon, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rotary_store_", &rotary_store_);
  m.impl("silu_and_mul", &silu_and_mul);
}
