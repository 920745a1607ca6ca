// The decoder layers of a Llama-family model on quantized weights in one call: for each layer the
// same kernels, in the same order and on the same tensors, as the Python modules call them
// (engine/model/llama.py: LlamaDecoderLayer), so the results are bit for bit those of the module
// path (rows [0, exact_rows) on fp32 activations: the step's prefill tokens, or none; with
// bf16_linears every linear runs quant_linear_bf16 instead, on all rows). What it removes is
// the per-layer Python: a one-row decode step of SmolLM2 makes ~300
// module calls and ~600 op calls, which took longer than its kernels (engine/model/fused_decoder.py).
#include <ATen/ATen.h>

#include <vector>

#include "ops.h"

namespace pagedserve::cpu {
namespace {

constexpr int64_t kLinears = 4;  // per layer: qkv, o, gate_up, down
constexpr int64_t kNorms = 2;    // per layer: input, post-attention

c10::optional<at::Tensor> bias_of(const at::Tensor& bias) {
  return bias.numel() ? c10::optional<at::Tensor>(bias) : c10::nullopt;
}

}  // namespace

at::Tensor llama_decoder(const at::Tensor& hidden, const at::Tensor& residual, const at::Tensor& positions,
                         const at::Tensor& cos_sin, const at::Tensor& slot_mapping, at::TensorList key_caches,
                         at::TensorList value_caches, int64_t num_prefill_tokens, int64_t exact_rows,
                         const at::Tensor& prefill_block_tables, const at::Tensor& prefill_query_start_loc,
                         const at::Tensor& prefill_context_lens, const at::Tensor& decode_block_tables,
                         const at::Tensor& decode_context_lens, at::TensorList norm_weights, at::TensorList qweights,
                         at::TensorList biases, at::IntArrayRef formats, at::IntArrayRef int8_activations,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                         bool bf16_linears, at::IntArrayRef windows, at::IntArrayRef shards) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(shards.empty() || static_cast<int64_t>(shards.size()) == kLinears * layers,
              "llama_decoder: one shard count per linear, or none at all (one shard each)");
  std::vector<int64_t> first(kLinears * layers + 1, 0);  // linear i: qweights [first[i], first[i + 1])
  for (int64_t i = 0; i < kLinears * layers; ++i) {
    const int64_t count = shards.empty() ? 1 : shards[i];
    TORCH_CHECK(count >= 1, "llama_decoder: a linear has at least one shard");
    first[i + 1] = first[i] + count;
  }
  const int64_t total = first.back();
  TORCH_CHECK(static_cast<int64_t>(value_caches.size()) == layers &&
                  static_cast<int64_t>(norm_weights.size()) == kNorms * layers &&
                  static_cast<int64_t>(qweights.size()) == total && static_cast<int64_t>(formats.size()) == total &&
                  static_cast<int64_t>(biases.size()) == kLinears * layers &&
                  static_cast<int64_t>(int8_activations.size()) == kLinears * layers,
              "llama_decoder: per layer 2 norm weights and 4 linears (qkv, o, gate_up, down), a qweight and "
              "format per shard");
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == layers,
              "llama_decoder: one sliding window per layer (0: none), or none at all");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == at::kFloat &&
                  residual.sizes() == hidden.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == at::kFloat,
              "llama_decoder: hidden and residual must be contiguous fp32 [T, hidden]");
  const int64_t tokens = hidden.size(0);
  const int64_t num_decodes = decode_context_lens.size(0);
  TORCH_CHECK(num_prefill_tokens >= 0 && num_prefill_tokens + num_decodes == tokens,
              "llama_decoder: prefill tokens + decode rows must be the step's tokens");
  TORCH_CHECK(exact_rows >= 0 && exact_rows <= tokens, "llama_decoder: exact_rows must be in [0, tokens]");
  const bool prefill = prefill_context_lens.size(0) > 0 && num_prefill_tokens > 0;
  const int64_t q_heads = num_heads, kv_heads = num_kv_heads, heads = q_heads + 2 * kv_heads;
  const auto shard = [&](int64_t index, int64_t s, const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
    const at::Tensor& w = qweights[s];
    at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
    if (bf16_linears) {
      quant_linear_bf16(out, x, w, formats[s], bias);
    } else {
      quant_linear(out, x, w, formats[s], bias, int8_activations[index] != 0, exact_rows);
    }
    return out;
  };
  const auto linear = [&](int64_t index, const at::Tensor& x) {
    if (first[index + 1] - first[index] == 1) return shard(index, first[index], x, bias_of(biases[index]));
    std::vector<at::Tensor> parts;  // shards apart, then concatenated, then the bias: QuantLinear.forward
    for (int64_t s = first[index]; s < first[index + 1]; ++s) parts.push_back(shard(index, s, x, c10::nullopt));
    at::Tensor out = at::cat(parts, 1);
    if (biases[index].numel()) out.add_(biases[index]);
    return out;
  };
  at::Tensor h = hidden;  // the layer's normed input; the MLP output lands in a fresh tensor
  residual.copy_(h);
  rms_norm(h, residual, norm_weights[0], eps);
  for (int64_t layer = 0; layer < layers; ++layer) {
    if (layer > 0) fused_add_rms_norm(h, residual, norm_weights[kNorms * layer], eps);
    const int64_t l4 = kLinears * layer;
    const at::Tensor qkv = linear(l4, h).view({tokens, heads, head_dim});
    const at::Tensor q = qkv.narrow(1, 0, q_heads), k = qkv.narrow(1, q_heads, kv_heads),
                     v = qkv.narrow(1, q_heads + kv_heads, kv_heads);
    const at::Tensor& key_cache = key_caches[layer];
    const at::Tensor& value_cache = value_caches[layer];
    rotary_embedding_and_cache(positions, q, k, v, cos_sin, key_cache, value_cache, slot_mapping);
    const at::Tensor attn = at::empty({tokens, q_heads, head_dim}, h.options());
    const int64_t window = windows.empty() ? 0 : windows[layer];
    if (prefill) {
      paged_prefill_attention(attn.narrow(0, 0, num_prefill_tokens), q.narrow(0, 0, num_prefill_tokens), key_cache,
                              value_cache, prefill_block_tables, prefill_query_start_loc, prefill_context_lens, scale,
                              window);
    }
    if (num_decodes) {
      paged_attention(attn.narrow(0, num_prefill_tokens, num_decodes), q.narrow(0, num_prefill_tokens, num_decodes),
                      key_cache, value_cache, decode_block_tables, decode_context_lens, scale, window);
    }
    const at::Tensor o = linear(l4 + 1, attn.view({tokens, q_heads * head_dim}));
    fused_add_rms_norm(o, residual, norm_weights[kNorms * layer + 1], eps);
    const at::Tensor gate_up = linear(l4 + 2, o);
    const at::Tensor act = at::empty({tokens, gate_up.size(1) / 2}, h.options());
    silu_and_mul(act, gate_up);
    h = linear(l4 + 3, act);
  }
  return h;
}

}  // namespace pagedserve::cpu
