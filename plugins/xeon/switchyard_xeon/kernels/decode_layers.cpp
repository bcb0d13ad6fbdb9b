// Every decoder layer of a Llama-family model for one decode step, in one call.
//
// At one token per sequence a layer is nine short kernels, and calling them
// one by one from Python costs a few microseconds each in the interpreter and
// the dispatcher: ~270 calls and some 3-4 ms of a ~24 ms step on the 135M
// shape. This loop makes the same calls, in the same order and with the same
// arguments as switchyard_xeon/decoder.py's Python loop, from C++.
//
// Weights are panel-packed (panel_gemm.cpp), six tensors per layer in
// `weights`: input norm, post-attention norm, q|k|v, o, gate|up, down; four
// optional biases per layer in `biases` (q|k|v, o, gate|up, down). `h` is the
// first layer's normed input; `residual` is updated in place and the last
// layer's MLP output is returned (the caller adds, norms and projects).
// `inner`, the MLP's intermediate size, is read off the packed down
// projection when 0 (fp32, bf16 and int8 panels of even width).
//
// decode_layers_lora is the same loop for a step whose rows run LoRA adapters:
// each projection's output gets its rows' adapter deltas right after the
// projection, as the Python loop adds them (lora.cpp; projections numbered
// q|k|v 0, o 1, gate|up 2, down 3), so such steps keep the one-call loop too.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

namespace {

at::Tensor run_layers(at::Tensor residual, at::Tensor h, const at::Tensor& cos,
                      const at::Tensor& sin, const at::Tensor& slots,
                      const at::Tensor& block_tables, const at::Tensor& context_lens,
                      at::TensorList weights,
                      const c10::List<c10::optional<at::Tensor>>& biases,
                      at::TensorList k_pools, at::TensorList v_pools,
                      at::ArrayRef<double> scalings, at::IntArrayRef windows,
                      at::ArrayRef<double> eps, int64_t heads, int64_t kv_heads,
                      int64_t inner_size, const c10::optional<at::Tensor>& lora_rows,
                      const c10::optional<at::Tensor>& lora_starts,
                      at::TensorList lora_weights, at::TensorList lora_tables) {
  namespace sy = switchyard_xeon;
  TORCH_CHECK(lora_rows.has_value() == lora_starts.has_value(),
              "decode_layers: lora_rows and lora_starts come together");
  // out += the adapter rows' deltas of `projection` in layer `i`, over input x.
  auto lora = [&](const at::Tensor& x, at::Tensor& out, int64_t i, int64_t projection) {
    if (lora_rows.has_value()) {
      sy::lora_add_(x, out, *lora_rows, *lora_starts, lora_weights, lora_tables, i, projection);
    }
  };
  const int64_t layers = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == 6 * layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers &&
                  static_cast<int64_t>(v_pools.size()) == layers &&
                  static_cast<int64_t>(scalings.size()) == layers &&
                  static_cast<int64_t>(windows.size()) == layers &&
                  static_cast<int64_t>(eps.size()) == layers,
              "decode_layers: per layer six weights, four biases, two pools, a scaling, "
              "a window and an eps");
  TORCH_CHECK(residual.dim() == 2 && h.sizes() == residual.sizes(),
              "decode_layers: residual and h must be [tokens, hidden]");
  const int64_t tokens = residual.size(0), hidden = residual.size(1);
  const int64_t dim = k_pools[0].size(3), q_width = heads * dim;
  const int64_t qkv_width = (heads + 2 * kv_heads) * dim;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + 6 * i;
    at::Tensor k_pool = k_pools[i], v_pool = v_pools[i];
    if (i) sy::add_rms_norm_(h, residual, w[0], eps[i]);
    at::Tensor qkv = sy::panel_linear(h, w[2], biases.get(4 * i), qkv_width);
    lora(h, qkv, i, 0);  // before rotary: an adapter changes q and k too
    sy::rotary_store_(qkv, cos, sin, k_pool, v_pool, slots, heads, kv_heads);
    const at::Tensor q = qkv.narrow(1, 0, q_width).view({tokens, heads, dim});
    const at::Tensor attended = sy::paged_decode_attention(q, k_pool, v_pool, block_tables,
                                                           context_lens, scalings[i], windows[i]);
    const at::Tensor attended_rows = attended.view({tokens, q_width});
    h = sy::panel_linear(attended_rows, w[3], biases.get(4 * i + 1), hidden);
    lora(attended_rows, h, i, 1);
    sy::add_rms_norm_(h, residual, w[1], eps[i]);
    // The MLP's intermediate size (gate|up is twice as wide): given by the caller,
    // since no quantized layout can tell it exactly, or else read off down's
    // panels: the packed K, or twice the k pairs of dot panels.
    const int64_t pairs = sy::dot_pairs(w[5]);
    const int64_t inner = inner_size > 0 ? inner_size : pairs >= 0 ? 2 * pairs : w[5].size(1);
    at::Tensor gate_up = sy::panel_linear(h, w[4], biases.get(4 * i + 2), 2 * inner);
    lora(h, gate_up, i, 2);
    const at::Tensor act = sy::silu_and_mul(gate_up);
    h = sy::panel_linear(act, w[5], biases.get(4 * i + 3), hidden);
    lora(act, h, i, 3);
  }
  return h;
}

at::Tensor decode_layers(at::Tensor residual, at::Tensor h, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slots,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         at::TensorList weights,
                         const c10::List<c10::optional<at::Tensor>>& biases,
                         at::TensorList k_pools, at::TensorList v_pools,
                         at::ArrayRef<double> scalings, at::IntArrayRef windows,
                         at::ArrayRef<double> eps, int64_t heads, int64_t kv_heads,
                         int64_t inner_size) {
  return run_layers(residual, h, cos, sin, slots, block_tables, context_lens, weights, biases,
                    k_pools, v_pools, scalings, windows, eps, heads, kv_heads, inner_size,
                    c10::nullopt, c10::nullopt, {}, {});
}

at::Tensor decode_layers_lora(at::Tensor residual, at::Tensor h, const at::Tensor& cos,
                              const at::Tensor& sin, const at::Tensor& slots,
                              const at::Tensor& block_tables, const at::Tensor& context_lens,
                              at::TensorList weights,
                              const c10::List<c10::optional<at::Tensor>>& biases,
                              at::TensorList k_pools, at::TensorList v_pools,
                              at::ArrayRef<double> scalings, at::IntArrayRef windows,
                              at::ArrayRef<double> eps, int64_t heads, int64_t kv_heads,
                              int64_t inner_size, const at::Tensor& lora_rows,
                              const at::Tensor& lora_starts, at::TensorList lora_weights,
                              at::TensorList lora_tables) {
  return run_layers(residual, h, cos, sin, slots, block_tables, context_lens, weights, biases,
                    k_pools, v_pools, scalings, windows, eps, heads, kv_heads, inner_size,
                    lora_rows, lora_starts, lora_weights, lora_tables);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def(
      "decode_layers(Tensor(a!) residual, Tensor h, Tensor cos, Tensor sin, Tensor slots, "
      "Tensor block_tables, Tensor context_lens, Tensor[] weights, Tensor?[] biases, "
      "Tensor(b!)[] k_pools, Tensor(c!)[] v_pools, float[] scalings, int[] windows, "
      "float[] eps, int heads, int kv_heads, int inner=0) -> Tensor");
  m.def(
      "decode_layers_lora(Tensor(a!) residual, Tensor h, Tensor cos, Tensor sin, Tensor slots, "
      "Tensor block_tables, Tensor context_lens, Tensor[] weights, Tensor?[] biases, "
      "Tensor(b!)[] k_pools, Tensor(c!)[] v_pools, float[] scalings, int[] windows, "
      "float[] eps, int heads, int kv_heads, int inner, Tensor lora_rows, Tensor lora_starts, "
      "Tensor[] lora_weights, Tensor[] lora_tables) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_xeon, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_layers_lora", &decode_layers_lora);
}
