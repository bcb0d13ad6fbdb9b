// The kernels of this library as C++ functions, for code in the library that
// chains them (decode_layers.cpp) without a trip through the dispatcher.
// Each is the function registered as the switchyard_xeon operator of the
// same name; see that operator's source file for its contract.

#pragma once

#include <ATen/ATen.h>

namespace switchyard_xeon {

// softcap 0 and no slopes: plain attention (what decode_layers.cpp's Llama family uses).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool,
                                  const at::Tensor& v_pool, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t window,
                                  double softcap = 0.0,
                                  const c10::optional<at::Tensor>& alibi_slopes = c10::nullopt);

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed,
                        const c10::optional<at::Tensor>& bias, int64_t n);

// panel_dot_bf16.cpp: the k-pair steps of x that `packed` covers when it is in
// one of that file's layouts (bf16 or int8 weights), else -1; and its kernel
// (called by panel_linear, which checks x and the bias first).
int64_t dot_pairs(const at::Tensor& packed);
at::Tensor panel_linear_bf16_dot(const at::Tensor& x, const at::Tensor& packed, const float* bias,
                                 int64_t n);

// panel_dot_uint4.cpp: whether `packed` is in its uint4 layout, and its kernel
// (called by panel_linear, which checks N and the bias first).
bool is_uint4_panels(const at::Tensor& packed);
at::Tensor panel_linear_uint4_dot(const at::Tensor& x, const at::Tensor& packed, const float* bias,
                                  int64_t n);

// panel_quant_fma.cpp: whether `packed` is in its layout (int8, uint4 or fp8
// weights for fp32 math on AVX2 + FMA), and its kernel (called by panel_linear,
// which checks x and the bias first).
bool is_quant_fma_panels(const at::Tensor& packed);
at::Tensor panel_linear_quant_fma(const at::Tensor& x, const at::Tensor& packed, const float* bias,
                                  int64_t n);

// panel_w8a8.cpp: whether `packed` is in its W8A8 layout (int8 weights, int8
// activations quantized per call), and its kernel on the path the call's rows choose.
bool is_w8a8_panels(const at::Tensor& packed);
at::Tensor panel_linear_w8a8(const at::Tensor& x, const at::Tensor& packed,
                             const c10::optional<at::Tensor>& bias, int64_t n);

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);

void rotary_store_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots,
                   int64_t heads, int64_t kv_heads);

at::Tensor silu_and_mul(const at::Tensor& x);

// lora.cpp: out[rows] += each row's adapter delta over one projection of one layer.
void lora_add_(const at::Tensor& x, at::Tensor& out, const at::Tensor& rows,
               const at::Tensor& starts, at::TensorList weights, at::TensorList tables,
               int64_t layer, int64_t projection);

}  // namespace switchyard_xeon
