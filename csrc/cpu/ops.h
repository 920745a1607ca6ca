// CPU paged ops: declarations shared by the kernels and their TORCH_LIBRARY registration.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace pagedserve::cpu {

// out/query [num_seqs, num_heads, head_size]; caches [num_blocks, num_kv_heads, block_size, head_size].
// window > 0: a query sees only the last `window` tokens of its context (itself included).
void paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, double scale, int64_t window = 0,
                     const std::optional<at::Tensor>& sinks = std::nullopt);

// out/query [num_tokens, num_heads, head_size]; the tokens of sequence s are
// query[query_start_loc[s] : query_start_loc[s + 1]], the last ones of its context_lens[s].
void paged_prefill_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_start_loc, const at::Tensor& context_lens, double scale,
                             int64_t window = 0, const std::optional<at::Tensor>& sinks = std::nullopt);

// The data of an optional attention-sinks tensor (fp32, contiguous, [num_heads], on the CPU), or null.
inline const float* check_sinks(const std::optional<at::Tensor>& sinks, int64_t num_heads) {
  if (!sinks.has_value() || !sinks->defined()) return nullptr;
  TORCH_CHECK_VALUE(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == num_heads &&
                        sinks->is_contiguous() && sinks->device().is_cpu(),
                    "sinks must be a contiguous fp32 CPU tensor of num_heads (", num_heads, ") values; got ",
                    sinks->scalar_type(), " of shape ", sinks->sizes());
  return sinks->data_ptr<float>();
}

// key/value [T, num_kv_heads, head_size] (last dim contiguous); slots < 0 are skipped.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& slot_mapping);

// block_mapping int64 [n, 2] of (src, dst) block ids, applied to every layer.
void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping);

// dst[d] = src[s] for each (s, d) row of block_mapping (both host tensors here).
void swap_blocks(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_mapping);

// out [rows, hidden] = weight * norm(x); rows contiguous in their last dim.
void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);

// In place: residual = x + residual, then x = weight * norm(residual).
void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps);

// out [rows, d] = silu(x[:, :d]) * x[:, d:], x [rows, 2d].
void silu_and_mul(const at::Tensor& out, const at::Tensor& x);

// Rotates query [T, H, D] and key [T, KVH, D] in place by cos_sin[positions] (fp32 [P, D]: cos of
// the D/2 frequencies, then their sin), then stores key/value at slot_mapping in the caches
// (skipped when the caches are empty or a slot is < 0).
void rotary_embedding_and_cache(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const at::Tensor& cos_sin, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& slot_mapping);

// out [M, N] = x [M, K] . weight [N, K]^T (+ bias [N]), fp32, M <= kSmallGemmMaxRows.
constexpr int64_t kSmallGemmMaxRows = 3;
void small_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias);

// out [M, N] = x [M, K] . W^T (+ bias [N]), fp32, each element one fma chain over k in order (csrc/cpu/
// fixed_gemm.cpp): W packed as [P, K, 16] (P a multiple of kFixedGemmPanelGroup; ops/linear.py pack_fixed).
constexpr int64_t kFixedGemmPanelGroup = 4;
void fixed_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t n,
                const c10::optional<at::Tensor>& bias);
// out fp32 [M, N] = x fp32 [M, K] . dequantize(qweight)^T (+ bias) with fixed_gemm's arithmetic
// (one fma chain per output over k in order), the weight dequantized a tile at a time.
void quant_fixed_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t format,
                      const c10::optional<at::Tensor>& bias);

// Multi-LoRA (csrc/cpu/lora.cpp): out fp32 [M, N] += (x [M, K] . a[s]^T) . b[s]^T per row, s =
// slot_of_row[m] (int64; < 0: the row is left alone), a [S, R, K], b [S, N, R]; each sum in one fixed
// order, so a row's bits do not depend on the other rows.
void lora_rows(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& slot_of_row);

// out int64 [rows]: per row, the first token whose running sum of softmax(logits * inv_temperature)
// exceeds uniforms[row] times the total (inverse CDF in token-id order); logits fp32 [rows, vocab].
void sample_from_logits(const at::Tensor& out, const at::Tensor& logits, const at::Tensor& inv_temperature,
                        const at::Tensor& uniforms);

// sample_from_logits after per-row filters, in this order: top_k > 0 keeps the logits reaching the
// k-th largest; top_p < 1 keeps the largest probabilities until their mass reaches top_p; min_p > 0
// keeps probabilities of at least min_p times the largest. Ties at a cut are kept.
void sample_filtered(const at::Tensor& out, const at::Tensor& logits, const at::Tensor& inv_temperature,
                     const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                     const at::Tensor& uniforms);

// out int64 [rows]: per row, the first token maximizing the fp32 logit dot(hidden[row], weight[j]),
// searched among tokens whose bf16 screen approx [rows, vocab] can reach the row's maximum given
// the error bound error_scale * |hidden[row]| * weight_norms[j] + output_slack * |approx|; -1 for
// a row with a non-finite value (see ops/screen.py).
void screened_argmax(const at::Tensor& out, const at::Tensor& approx, const at::Tensor& hidden,
                     const at::Tensor& weight, const at::Tensor& weight_norms, double error_scale,
                     double output_slack);

// GGUF block formats, by ggml type id (csrc/cpu/quant_gemm.cpp, ops/reference/quant.py).
constexpr int64_t kQuantQ4_0 = 2;
constexpr int64_t kQuantQ4_1 = 3;
constexpr int64_t kQuantQ5_0 = 6;
constexpr int64_t kQuantQ5_1 = 7;
constexpr int64_t kQuantQ8_0 = 8;
constexpr int64_t kQuantQ2_K = 10;  // 256-weight blocks (quant_blocks.h)
constexpr int64_t kQuantQ3_K = 11;
constexpr int64_t kQuantQ4_K = 12;
constexpr int64_t kQuantQ5_K = 13;
constexpr int64_t kQuantQ6_K = 14;
constexpr int64_t kQuantIQ4_NL = 20;  // Q4_0's block, nibbles indexing a non-linear table of int8 values
constexpr int64_t kQuantMXFP4 = 39;  // IQ4_NL's nibbles indexing the E2M1 values doubled, an E8M0 exponent byte
constexpr int64_t kQuantIQ4_XS = 23;  // 256-weight blocks of IQ4_NL-style sub-blocks with 6-bit scales
// Q4_0 / Q4_1 repacked eight rows at a time (csrc/cpu/quant_interleaved.cpp): 1000 + the GGUF id.
constexpr int64_t kQuantInterleaved = 1000;
constexpr int64_t kQuantQ4_0R8 = kQuantInterleaved + kQuantQ4_0;
constexpr int64_t kQuantQ4_1R8 = kQuantInterleaved + kQuantQ4_1;
// Q5_0 / Q5_1 / Q8_0 likewise (csrc/cpu/quant_interleaved_q5q8.cpp).
constexpr int64_t kQuantQ5_0R8 = kQuantInterleaved + kQuantQ5_0;
constexpr int64_t kQuantQ5_1R8 = kQuantInterleaved + kQuantQ5_1;
constexpr int64_t kQuantQ8_0R8 = kQuantInterleaved + kQuantQ8_0;
// Q4_K's eight-row layout, its scales and mins unpacked: 148 bytes a row per block (quant_interleaved_k.cpp).
constexpr int64_t kQuantQ4_KR8 = kQuantInterleaved + kQuantQ4_K;
constexpr int64_t kQuantQ6_KR8 = kQuantInterleaved + kQuantQ6_K;  // Q6_K's, same bytes reordered

// out fp32 [M, N] = x fp32 [M, K] . dequantize(qweight uint8 [N, K / block_weights * block_bytes])^T (+ bias [N]);
// int8_activations quantizes x per 32-block to int8 first (integer dot products), except for the
// first exact_rows rows (a step's prompt tokens), which keep fp32 activations.
void quant_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t format,
                  const c10::optional<at::Tensor>& bias, bool int8_activations, int64_t exact_rows);

// out int64 [rows]: per row, the first token maximizing the fp32-activation logit of the quantized
// lm_head qweight, searched among tokens whose int8-activation logit approx [rows, vocab] can reach
// the row's maximum (bound: (norm_slack |x_hat - x| + rounding |x|) norms[j]); -1 for a row with a
// non-finite value. candidates int64 [rows]: how many tokens got their fp32-activation logit.
// row_scales fp32 [rows], when given, replaces that bound's factor per row: approx came from
// another screen (a bf16 GEMM) whose error the caller bounds by row_scales[r] norms[j].
void quant_screened_argmax(const at::Tensor& out, const at::Tensor& candidates, const at::Tensor& approx,
                           const at::Tensor& hidden, const at::Tensor& qweight, int64_t format,
                           const at::Tensor& norms, double rounding, double norm_slack,
                           const c10::optional<at::Tensor>& row_scales);

// out fp32 [M, N] = x fp32 [M, K] . W^T (+ bias) with W the packed weight rounded to bf16 and x
// rounded to bf16, fp32 accumulation, on AMX-BF16 tiles (quant_amx.cpp) or AVX512-BF16 dot products
// (quant_bf16_dot.cpp); any format quant_linear takes. An error where the build's CPU has neither.
void quant_linear_bf16(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t format,
                       const c10::optional<at::Tensor>& bias);

// The kernel quant_linear_bf16 runs here: 2 AMX-BF16 (built for it, and the OS granted the tile
// state), 1 AVX512-BF16, 0 none.
int64_t bf16_linear_kernel();
bool amx_bf16_available();  // bf16_linear_kernel() == 2

// out fp32 [N, K] = the weights of qweight uint8 [N, K / 32 * block_bytes] in `format`.
void dequantize_weight(const at::Tensor& out, const at::Tensor& qweight, int64_t format);

// Every decoder layer of a Llama-family model on quantized linears (csrc/cpu/decoder.cpp): hidden
// [T, H] holds the embeddings (it becomes layer 0's normed input), residual [T, H] receives the
// residual stream; returns the last layer's MLP output (the final norm adds it to residual). Per
// layer: norm_weights 2 (input, post-attention), qweights / biases (numel 0: none) / formats /
// int8_activations 4 (qkv, o, gate_up, down); rows [0, exact_rows) keep fp32 activations
// (quant_linear). Attention as engine/model/attention.py runs it. With `shards` (one count per
// linear), a linear is that many consecutive qweights / formats (each its output features, in
// order), computed apart, concatenated, then its bias added (QuantLinear.forward's order).
// qk_norms (2 per layer: q, k weights [head_dim]): each head's q and k RMSNormed before rotary (Qwen3).
// moe_layers (one per layer, 1: MoE): that layer's MLP is a sparse block (SparseMoE) whose linears 3
// and 4 are its shared expert's gate_up and down (0 shards: none); per MoE layer, in layer order,
// moe_tensors holds its router's fixed_gemm panels, router bias (numel 0: none), shared-expert gate
// panels (numel 0: none), packed down [E, H, row_bytes], then its gate/up shards [E, rows, row_bytes],
// and moe_config top_k, router (kMoESoftmaxTopk / kMoETopkSoftmax), norm_topk_prob, int8_activations,
// down format, gate/up shard count, then one format per gate/up shard.
// LoRA (lora_slots int64 [T], each row's adapter slot, < 0: none; lora_slices non-empty): per linear,
// lora_slices its adapter slices (0: no slots), lora_a its stacked A [S, slices * rank, in] (numel 0:
// none) and lora_b one B [S, out_slice, rank] per slice, in linear order; each row's product is
// added to the linear's output after its bias (LoRASlots.add).
at::Tensor llama_decoder(const at::Tensor& hidden, const at::Tensor& residual, const at::Tensor& positions,
                         const at::Tensor& cos_sin, const at::Tensor& slot_mapping, at::TensorList key_caches,
                         at::TensorList value_caches, int64_t num_prefill_tokens, int64_t exact_rows,
                         const at::Tensor& prefill_block_tables, const at::Tensor& prefill_query_start_loc,
                         const at::Tensor& prefill_context_lens, const at::Tensor& decode_block_tables,
                         const at::Tensor& decode_context_lens, at::TensorList norm_weights, at::TensorList qweights,
                         at::TensorList biases, at::IntArrayRef formats, at::IntArrayRef int8_activations,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                         bool bf16_linears, at::IntArrayRef windows = {}, at::IntArrayRef shards = {},
                         at::TensorList qk_norms = {}, at::IntArrayRef moe_layers = {},
                         at::TensorList moe_tensors = {}, at::IntArrayRef moe_config = {},
                         const c10::optional<at::Tensor>& lora_slots = c10::nullopt, at::TensorList lora_a = {},
                         at::TensorList lora_b = {}, at::IntArrayRef lora_slices = {});
// A sparse MoE block's packed experts (csrc/cpu/packed_moe.cpp): x fp32 [T, H], the router's
// experts int64 [T, k] and weights fp32 [T, k] -> [T, H], bit for bit PackedExperts.forward on
// group_by_expert's pairs. gate_up: each expert's gate/up shards [E, rows, row_bytes] (gate rows then
// up rows), down [E, H, row_bytes]; exact_mask [T] (bool): the rows on fp32 activations under
// int8_activations; activation kMoESilu or kMoEClampedSwiglu (alpha, limit); biases [E, 2I], [E, H].
constexpr int64_t kMoESilu = 0;
constexpr int64_t kMoEClampedSwiglu = 1;
at::Tensor packed_moe_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                              at::TensorList gate_up, at::IntArrayRef gate_up_formats, const at::Tensor& down,
                              int64_t down_format, const c10::optional<at::Tensor>& exact_mask,
                              bool int8_activations, int64_t activation, double alpha, double limit,
                              const c10::optional<at::Tensor>& gate_up_bias,
                              const c10::optional<at::Tensor>& down_bias);

// (weights, experts [T, k] int64) of router logits [T, E] as moe.SparseMoE.route computes them, on the
// same ATen ops: kMoESoftmaxTopk fp32 softmax, top-k, renormalised iff norm_topk_prob; kMoETopkSoftmax
// top-k of the logits, softmax over those k.
constexpr int64_t kMoESoftmaxTopk = 0;
constexpr int64_t kMoETopkSoftmax = 1;
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k, int64_t router,
                                             bool norm_topk_prob);

// Kernels ignore their `openmp` hint (parallel.h) while on: for models with only quantized linears.

}  // namespace pagedserve::cpu
