// A sparse MoE block's packed experts in one call (engine/model/packed_experts.py, PackedExperts):
// the router's (token, expert) pairs grouped by expert (stable, as moe.group_by_expert), each active
// expert's rows through the same kernels in the same order as the Python path (quant_linear per
// gate/up shard, their concatenation, the gate/up bias, the activation, quant_linear of down, the
// down bias, times the routing weight), and each token's weighted outputs summed in ascending expert
// order, the first copied, the others added left to right (moe.sum_by_token): the results are bit
// for bit the Python path's. What it removes is the ~100 small torch ops per MoE layer around the
// kernels. A token's exact (fp32-activation) rows go first within each expert's group, as there.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "ops.h"

namespace pagedserve::cpu {
namespace {

// gpt-oss's clamped SwiGLU of gate_up [n, 2I] in transformers' order of operations, on the ATen ops
// moe.clamped_swiglu calls (so sigmoid is the same vectorized kernel).
at::Tensor clamped_swiglu(const at::Tensor& gate_up, double alpha, double limit) {
  const int64_t inter = gate_up.size(1) / 2;
  const at::Tensor gate = at::clamp(gate_up.narrow(1, 0, inter), c10::optional<at::Scalar>(), c10::optional<at::Scalar>(limit));
  const at::Tensor up = gate_up.narrow(1, inter, inter).clamp(-limit, limit);
  return (up + 1) * (gate * at::sigmoid(gate * alpha));
}

// rows [n, width] (contiguous rows) += bias [width], row by row.
void add_bias(const at::Tensor& rows, const float* bias) {
  const int64_t n = rows.size(0), width = rows.size(1), stride = rows.stride(0);
  float* data = rows.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    float* row = data + r * stride;
    for (int64_t c = 0; c < width; ++c) row[c] += bias[c];
  }
}

}  // namespace

at::Tensor packed_moe_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                              at::TensorList gate_up, at::IntArrayRef gate_up_formats, const at::Tensor& down,
                              int64_t down_format, const c10::optional<at::Tensor>& exact_mask,
                              bool int8_activations, int64_t activation, double alpha, double limit,
                              const c10::optional<at::Tensor>& gate_up_bias,
                              const c10::optional<at::Tensor>& down_bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "packed_moe_experts: x must be a contiguous fp32 CPU [T, H]");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.dim() == 2 && experts.size(0) == tokens,
              "packed_moe_experts: experts must be int64 [T, k]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == experts.sizes(),
              "packed_moe_experts: weights must be fp32 [T, k] like experts");
  TORCH_CHECK(!gate_up.empty() && gate_up.size() == gate_up_formats.size(),
              "packed_moe_experts: one format per gate/up shard");
  TORCH_CHECK(activation == kMoESilu || activation == kMoEClampedSwiglu,
              "packed_moe_experts: activation must be 0 (silu) or 1 (clamped swiglu); got ", activation);
  TORCH_CHECK(down.dim() == 3 && down.size(1) == hidden && down.is_contiguous(),
              "packed_moe_experts: down must be contiguous [E, H, row_bytes]");
  const int64_t num_experts = down.size(0), k = experts.size(1);
  TORCH_CHECK(k >= 1, "packed_moe_experts: each token needs at least one expert");
  for (const at::Tensor& shard : gate_up)
    TORCH_CHECK(shard.dim() == 3 && shard.size(0) == num_experts && shard.is_contiguous(),
                "packed_moe_experts: contiguous shards [E, rows, row_bytes] of one expert count");
  const float* b1 = nullptr;
  const float* b2 = nullptr;
  int64_t gate_up_rows = 0;
  for (const at::Tensor& shard : gate_up) gate_up_rows += shard.size(1);
  if (gate_up_bias.has_value() && gate_up_bias->defined()) {
    TORCH_CHECK(gate_up_bias->scalar_type() == at::kFloat && gate_up_bias->is_contiguous() &&
                    gate_up_bias->dim() == 2 && gate_up_bias->size(0) == num_experts &&
                    gate_up_bias->size(1) == gate_up_rows,
                "packed_moe_experts: gate_up_bias must be contiguous fp32 [E, 2I]");
    b1 = gate_up_bias->data_ptr<float>();
  }
  if (down_bias.has_value() && down_bias->defined()) {
    TORCH_CHECK(down_bias->scalar_type() == at::kFloat && down_bias->is_contiguous() && down_bias->dim() == 2 &&
                    down_bias->size(0) == num_experts && down_bias->size(1) == hidden,
                "packed_moe_experts: down_bias must be contiguous fp32 [E, H]");
    b2 = down_bias->data_ptr<float>();
  }
  const bool* mask = nullptr;
  at::Tensor mask_bool;
  if (int8_activations && exact_mask.has_value() && exact_mask->defined()) {
    TORCH_CHECK(exact_mask->dim() == 1 && exact_mask->size(0) == tokens,
                "packed_moe_experts: exact_mask must be [T]");
    mask_bool = exact_mask->to(at::kBool).contiguous();
    mask = mask_bool.data_ptr<bool>();
  }
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  if (tokens == 0) return out.zero_();

  // The pairs grouped by expert, stable (moe.group_by_expert): a counting sort of the flat ids.
  const at::Tensor ids_c = experts.contiguous(), weights_c = weights.contiguous();
  const int64_t* ids = ids_c.data_ptr<int64_t>();
  const float* pair_weights = weights_c.data_ptr<float>();
  const int64_t pairs = tokens * k;
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < num_experts, "packed_moe_experts: expert id ", ids[p], " out of [0, ",
                num_experts, ")");
    ++start[ids[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> order(pairs);  // flat pair indices, by expert, in token order within one
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) order[next[ids[p]]++] = p;
  }

  // Each pair's weighted output at row token * k + (its rank among the token's experts, ascending).
  const at::Tensor weighted = at::empty({pairs, hidden}, x.options());
  float* weighted_rows = weighted.data_ptr<float>();
  std::vector<int64_t> seen(tokens, 0);
  const float* x_rows = x.data_ptr<float>();
  std::vector<int64_t> picked;
  std::vector<float> w;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    picked.clear();
    w.clear();
    for (int64_t i = start[e]; i < start[e + 1]; ++i) {
      picked.push_back(order[i] / k);
      w.push_back(pair_weights[order[i]]);
    }
    int64_t num_exact = int8_activations ? 0 : n;
    if (mask != nullptr) {
      for (int64_t t : picked) num_exact += mask[t] ? 1 : 0;
      if (num_exact > 0 && num_exact < n) {  // the kernel takes exact rows as a leading count
        std::vector<int64_t> order_in(n);
        for (int64_t i = 0; i < n; ++i) order_in[i] = i;
        std::stable_partition(order_in.begin(), order_in.end(), [&](int64_t i) { return mask[picked[i]]; });
        std::vector<int64_t> p2(n);
        std::vector<float> w2(n);
        for (int64_t i = 0; i < n; ++i) p2[i] = picked[order_in[i]], w2[i] = w[order_in[i]];
        picked.swap(p2);
        w.swap(w2);
      }
    }
    const at::Tensor xe = at::empty({n, hidden}, x.options());
    float* xe_rows = xe.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(xe_rows + i * hidden, x_rows + picked[i] * hidden, hidden * sizeof(float));
    std::vector<at::Tensor> parts;
    parts.reserve(gate_up.size());
    for (size_t s = 0; s < gate_up.size(); ++s) {
      const at::Tensor qweight = gate_up[s].select(0, e);
      at::Tensor part = at::empty({n, qweight.size(0)}, x.options());
      quant_linear(part, xe, qweight, gate_up_formats[s], c10::nullopt, int8_activations, num_exact);
      parts.push_back(std::move(part));
    }
    const at::Tensor gu = parts.size() == 1 ? parts[0] : at::cat(parts, -1);
    if (b1 != nullptr) add_bias(gu, b1 + e * gate_up_rows);
    at::Tensor act;
    if (activation == kMoESilu) {
      act = at::empty({n, gu.size(1) / 2}, x.options());
      silu_and_mul(act, gu);
    } else {
      act = clamped_swiglu(gu, alpha, limit);
    }
    const at::Tensor qdown = down.select(0, e);
    const at::Tensor y = at::empty({n, hidden}, x.options());
    quant_linear(y, act, qdown, down_format, c10::nullopt, int8_activations, num_exact);
    if (b2 != nullptr) add_bias(y, b2 + e * hidden);
    const float* y_rows = y.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = picked[i];
      TORCH_CHECK(seen[t] < k, "packed_moe_experts: a token has more than k pairs");
      float* dst = weighted_rows + (t * k + seen[t]++) * hidden;
      const float* src = y_rows + i * hidden;
      const float scale = w[i];
      for (int64_t c = 0; c < hidden; ++c) dst[c] = src[c] * scale;
    }
  }

  // moe.sum_by_token: a token's first weighted output copied, the others added in order.
  float* out_rows = out.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    float* dst = out_rows + t * hidden;
    const float* src = weighted_rows + t * k * hidden;
    std::memcpy(dst, src, hidden * sizeof(float));
    for (int64_t j = 1; j < k; ++j) {
      const float* add = src + j * hidden;
      for (int64_t c = 0; c < hidden; ++c) dst[c] += add[c];
    }
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k, int64_t router,
                                             bool norm_topk_prob) {
  TORCH_CHECK(router == kMoESoftmaxTopk || router == kMoETopkSoftmax,
              "moe_route: router must be 0 (softmax then top-k) or 1 (top-k then softmax); got ", router);
  if (router == kMoESoftmaxTopk) {  // moe.SparseMoE.route, op for op
    auto [weights, experts] = at::topk(at::softmax(logits, -1, at::kFloat), top_k, -1);
    if (norm_topk_prob) weights.div_(weights.sum(-1, /*keepdim=*/true));
    return {weights, experts};
  }
  auto [top, experts] = at::topk(logits, top_k, -1);
  return {at::softmax(top, 1, top.scalar_type()), experts};
}

}  // namespace pagedserve::cpu
