// The decoder layers of a Llama-family model on quantized weights in one call: for each layer the
// same kernels, in the same order and on the same tensors, as the Python modules call them
// (engine/model/llama.py: LlamaDecoderLayer; engine/model/moe.py: SparseMoE for an MoE layer), so the
// results are bit for bit those of the module path (rows [0, exact_rows) on fp32 activations: the
// step's prefill tokens, or none; with bf16_linears every dense linear runs quant_linear_bf16 instead,
// on all rows, while packed experts keep their kernel, as PackedExperts does). What it removes is the
// per-layer Python: a one-row decode step of SmolLM2 makes ~300 module calls and ~600 op calls, which
// took longer than its kernels (engine/model/fused_decoder.py). Options: per-head q/k RMSNorm before
// rotary (Qwen3), and per layer a dense SwiGLU or a sparse MoE block on packed experts (router on
// fixed_gemm, moe_route, packed_moe_experts, Qwen2-MoE's shared expert behind its sigmoid gate).
// Multi-LoRA rows: a linear with adapter slots adds each row's product after its own output (bias
// included), slice by slice as lora_rows adds it on the module path (LoRASlots.add).
#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "lora.h"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

constexpr int64_t kLinears = 4;  // per layer: qkv, o, gate_up, down
constexpr int64_t kNorms = 2;    // per layer: input, post-attention

// out[m][n] += bias[n] on the calling thread: the same one fp32 add per element as `out.add_(bias)`,
// without ATen's parallel region, which for a batch's rows wakes OpenMP's threads while the kernels'
// own pool still holds the cores.
void add_bias_rows(at::Tensor& out, const at::Tensor& bias) {
  if (out.scalar_type() != at::kFloat || bias.scalar_type() != at::kFloat || !out.is_contiguous() ||
      !bias.is_contiguous()) {
    out.add_(bias);
    return;
  }
  const int64_t rows = out.size(0), cols = out.size(1);
  float* o = out.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t n = 0; n < cols; ++n) o[m * cols + n] += b[n];
}

c10::optional<at::Tensor> bias_of(const at::Tensor& bias) {
  return bias.numel() ? c10::optional<at::Tensor>(bias) : c10::nullopt;
}

// One MoE layer's block (llama_decoder's moe_tensors / moe_config, ops.h).
struct MoELayer {
  at::Tensor router, router_bias, shared_gate, down;  // router / gate: fixed_gemm panels; bias numel 0: none
  std::vector<at::Tensor> gate_up;
  std::vector<int64_t> gate_up_formats;
  int64_t down_format = 0, top_k = 0, router_kind = 0;
  bool norm_topk_prob = false, int8_activations = true;
};

constexpr int64_t kMoETensors = 4;  // per MoE layer before its gate/up shards: router, bias, shared gate, down
constexpr int64_t kMoEConfig = 6;   // per MoE layer before its gate/up formats (ops.h)

// The MoE layers' blocks by layer (a dense layer's entry stays empty).
std::vector<MoELayer> moe_layer_list(at::IntArrayRef moe_layers, at::TensorList tensors, at::IntArrayRef config) {
  std::vector<MoELayer> out(moe_layers.size());
  size_t t = 0, c = 0;
  for (size_t layer = 0; layer < moe_layers.size(); ++layer) {
    if (moe_layers[layer] == 0) continue;
    TORCH_CHECK(c + kMoEConfig <= config.size() && t + kMoETensors <= tensors.size(),
                "llama_decoder: moe_tensors / moe_config end before MoE layer ", layer);
    MoELayer& m = out[layer];
    m.top_k = config[c];
    m.router_kind = config[c + 1];
    m.norm_topk_prob = config[c + 2] != 0;
    m.int8_activations = config[c + 3] != 0;
    m.down_format = config[c + 4];
    const int64_t shards = config[c + 5];
    c += kMoEConfig;
    TORCH_CHECK(shards >= 1 && c + shards <= config.size() && t + kMoETensors + shards <= tensors.size(),
                "llama_decoder: MoE layer ", layer, " needs at least one gate/up shard, each with a format");
    m.router = tensors[t];
    m.router_bias = tensors[t + 1];
    m.shared_gate = tensors[t + 2];
    m.down = tensors[t + 3];
    t += kMoETensors;
    for (int64_t s = 0; s < shards; ++s) {
      m.gate_up.push_back(tensors[t++]);
      m.gate_up_formats.push_back(config[c++]);
    }
    TORCH_CHECK(m.down.dim() == 3 && m.router.dim() == 3,
                "llama_decoder: MoE layer ", layer, ": down [E, H, row_bytes], router fixed_gemm panels [P, H, 16]");
  }
  TORCH_CHECK(t == tensors.size() && c == config.size(), "llama_decoder: moe_tensors / moe_config left over");
  return out;
}

// LlamaAttention._qkv's "head" norm: heads [T, N, D] (a view into the qkv output) -> a new [T, N, D]
// tensor, each head's row normed by weight [D] (the module reshapes to [T N, D], copying where it must).
at::Tensor head_norm(const at::Tensor& heads, const at::Tensor& weight, double eps) {
  const int64_t d = heads.size(2);
  const at::Tensor rows = heads.reshape({-1, d});
  const at::Tensor out = at::empty_like(rows);
  if (rows.size(0)) rms_norm(out, rows, weight, eps);
  return out.view(heads.sizes());
}

// SparseMoE.forward's routed part on x [T, H] (the post-attention normed rows): the router's logits on
// fixed_gemm (RouterLinear), moe_route, then the packed experts with the exact rows as PackedExperts
// masks them (exact_row_mask: rows [0, exact_rows) under int8 activations).
at::Tensor routed_experts(const MoELayer& m, const at::Tensor& x, int64_t exact_rows) {
  const int64_t tokens = x.size(0), experts = m.down.size(0);
  const at::Tensor logits = at::empty({tokens, experts}, x.options());
  fixed_gemm(logits, x, m.router, experts, bias_of(m.router_bias));
  const auto [weights, ids] = moe_route(logits, m.top_k, m.router_kind, m.norm_topk_prob);
  c10::optional<at::Tensor> mask;
  if (m.int8_activations && exact_rows > 0) {
    mask = at::zeros({tokens}, x.options().dtype(at::kBool));
    mask->narrow(0, 0, exact_rows).fill_(true);
  }
  return packed_moe_experts(x, ids, weights, m.gate_up, m.gate_up_formats, m.down, m.down_format, mask,
                            m.int8_activations, kMoESilu, 0.0, 0.0, c10::nullopt, c10::nullopt);
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
                         bool bf16_linears, at::IntArrayRef windows, at::IntArrayRef shards, at::TensorList qk_norms,
                         at::IntArrayRef moe_layers, at::TensorList moe_tensors, at::IntArrayRef moe_config,
                         const c10::optional<at::Tensor>& lora_slots, at::TensorList lora_a, at::TensorList lora_b,
                         at::IntArrayRef lora_slice_counts) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(moe_layers.empty() || static_cast<int64_t>(moe_layers.size()) == layers,
              "llama_decoder: one MLP kind per layer (0 dense, 1 MoE), or none at all");
  const auto is_moe = [&](int64_t layer) { return !moe_layers.empty() && moe_layers[layer] != 0; };
  TORCH_CHECK(shards.empty() || static_cast<int64_t>(shards.size()) == kLinears * layers,
              "llama_decoder: one shard count per linear, or none at all (one shard each)");
  std::vector<int64_t> first(kLinears * layers + 1, 0);  // linear i: qweights [first[i], first[i + 1])
  for (int64_t i = 0; i < kLinears * layers; ++i) {
    const int64_t count = shards.empty() ? 1 : shards[i];
    TORCH_CHECK(count >= (is_moe(i / kLinears) && i % kLinears >= 2 ? 0 : 1),
                "llama_decoder: a linear has at least one shard (an MoE layer's shared expert: 0 for none)");
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
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers,
              "llama_decoder: q and k norm weights per layer, or none at all");
  const std::vector<MoELayer> moe = moe_layer_list(moe_layers, moe_tensors, moe_config);
  const bool lora = lora_slots.has_value() && !lora_slice_counts.empty();
  std::vector<int64_t> first_b(kLinears * layers + 1, 0);  // linear i: lora_b [first_b[i], first_b[i + 1])
  if (lora) {
    TORCH_CHECK(lora_slots->scalar_type() == at::kLong && lora_slots->dim() == 1 && lora_slots->size(0) == tokens,
                "llama_decoder: lora_slots must be int64 [tokens]");
    TORCH_CHECK(static_cast<int64_t>(lora_slice_counts.size()) == kLinears * layers &&
                    static_cast<int64_t>(lora_a.size()) == kLinears * layers,
                "llama_decoder: one LoRA slice count and A stack per linear (0 / numel 0: none)");
    for (int64_t i = 0; i < kLinears * layers; ++i) {
      TORCH_CHECK(lora_slice_counts[i] == 0 || (lora_a[i].dim() == 3 && lora_a[i].size(1) % lora_slice_counts[i] == 0),
                  "llama_decoder: a linear's LoRA A is [slots, slices * rank, in]");
      first_b[i + 1] = first_b[i] + lora_slice_counts[i];
    }
    TORCH_CHECK(first_b.back() == static_cast<int64_t>(lora_b.size()), "llama_decoder: one LoRA B per slice");
  }
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
  const auto base_linear = [&](int64_t index, const at::Tensor& x) {
    if (first[index + 1] - first[index] == 1) return shard(index, first[index], x, bias_of(biases[index]));
    std::vector<at::Tensor> parts;  // shards apart, then concatenated, then the bias: QuantLinear.forward
    for (int64_t s = first[index]; s < first[index + 1]; ++s) parts.push_back(shard(index, s, x, c10::nullopt));
    at::Tensor out = at::cat(parts, 1);
    if (biases[index].numel()) add_bias_rows(out, biases[index]);
    return out;
  };
  const auto linear = [&](int64_t index, const at::Tensor& x) {
    at::Tensor out = base_linear(index, x);
    if (!lora || lora_slice_counts[index] == 0) return out;
    // LoRASlots._add_kernel's lora_rows per slice, in one call (the same bits)
    lora_slices(out, x, lora_a[index], lora_b.slice(first_b[index], lora_slice_counts[index]), *lora_slots);
    return out;
  };
  const auto swiglu = [&](int64_t gate_up_index, const at::Tensor& x) {  // SwiGLU.forward
    const at::Tensor gate_up = linear(gate_up_index, x);
    const at::Tensor act = at::empty({x.size(0), gate_up.size(1) / 2}, x.options());
    silu_and_mul(act, gate_up);
    return linear(gate_up_index + 1, act);
  };
  at::Tensor h = hidden;  // the layer's normed input; the MLP output lands in a fresh tensor
  residual.copy_(h);
  rms_norm(h, residual, norm_weights[0], eps);
  for (int64_t layer = 0; layer < layers; ++layer) {
    if (layer > 0) fused_add_rms_norm(h, residual, norm_weights[kNorms * layer], eps);
    const int64_t l4 = kLinears * layer;
    const at::Tensor qkv = linear(l4, h).view({tokens, heads, head_dim});
    at::Tensor q = qkv.narrow(1, 0, q_heads), k = qkv.narrow(1, q_heads, kv_heads);
    const at::Tensor v = qkv.narrow(1, q_heads + kv_heads, kv_heads);
    if (!qk_norms.empty()) {
      q = head_norm(q, qk_norms[2 * layer], eps);
      k = head_norm(k, qk_norms[2 * layer + 1], eps);
    }
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
    if (!is_moe(layer)) {
      h = swiglu(l4 + 2, o);
      continue;
    }
    const MoELayer& block = moe[layer];  // SparseMoE.forward: routed experts, then the gated shared expert
    h = routed_experts(block, o, exact_rows);
    if (block.shared_gate.numel()) {
      const at::Tensor gate = at::empty({tokens, 1}, o.options());
      fixed_gemm(gate, o, block.shared_gate, 1, c10::nullopt);
      h = h + at::sigmoid(gate) * swiglu(l4 + 2, o);
    }
  }
  return h;
}

}  // namespace pagedserve::cpu
