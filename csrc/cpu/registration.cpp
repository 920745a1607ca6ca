// TORCH_LIBRARY registration of the CPU paged ops: call them as torch.ops.pagedserve_cpu.<op>.
#include <torch/library.h>

#include "ops.h"
#include "parallel.h"
#include "quant_int8_amx.h"

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor context_lens, float scale, int window=0, Tensor? sinks=None) -> ()");
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor query_start_loc, Tensor context_lens, float scale, int window=0, "
      "Tensor? sinks=None) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def("copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def(
      "rotary_embedding_and_cache(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor value, "
      "Tensor cos_sin, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping) -> ()");
  m.def("small_gemm(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  m.def("fixed_gemm(Tensor(a!) out, Tensor x, Tensor packed, int n, Tensor? bias) -> ()");
  m.def("quant_fixed_gemm(Tensor(a!) out, Tensor x, Tensor qweight, int format, Tensor? bias) -> ()");
  m.def("lora_rows(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor slot_of_row) -> ()");
  m.def("sample_from_logits(Tensor(a!) out, Tensor logits, Tensor inv_temperature, Tensor uniforms) -> ()");
  m.def(
      "sample_filtered(Tensor(a!) out, Tensor logits, Tensor inv_temperature, Tensor top_k, Tensor top_p, "
      "Tensor min_p, Tensor uniforms) -> ()");
  m.def(
      "screened_argmax(Tensor(a!) out, Tensor approx, Tensor hidden, Tensor weight, Tensor weight_norms, "
      "float error_scale, float output_slack) -> ()");
  m.def(
      "quant_linear(Tensor(a!) out, Tensor x, Tensor qweight, int format, Tensor? bias, "
      "bool int8_activations, int exact_rows=0) -> ()");
  m.def("quant_linear_bf16(Tensor(a!) out, Tensor x, Tensor qweight, int format, Tensor? bias) -> ()");
  m.def("dequantize_weight(Tensor(a!) out, Tensor qweight, int format) -> ()");
  m.def(
      "quant_screened_argmax(Tensor(a!) out, Tensor(b!) candidates, Tensor approx, Tensor hidden, "
      "Tensor qweight, int format, Tensor norms, float rounding, float norm_slack, Tensor? row_scales=None) -> ()");
  m.def(
      "llama_decoder(Tensor(a!) hidden, Tensor(b!) residual, Tensor positions, Tensor cos_sin, "
      "Tensor slot_mapping, Tensor(c!)[] key_caches, Tensor(d!)[] value_caches, int num_prefill_tokens, int exact_rows, "
      "Tensor prefill_block_tables, Tensor prefill_query_start_loc, Tensor prefill_context_lens, "
      "Tensor decode_block_tables, Tensor decode_context_lens, Tensor[] norm_weights, Tensor[] qweights, "
      "Tensor[] biases, int[] formats, int[] int8_activations, int num_heads, int num_kv_heads, int head_dim, "
      "float eps, float scale, bool bf16_linears, int[] windows, int[] shards, Tensor[] qk_norms, int[] moe_layers, "
      "Tensor[] moe_tensors, int[] moe_config, Tensor? lora_slots, Tensor[] lora_a, Tensor[] lora_b, "
      "int[] lora_slices) -> Tensor");
  m.def(
      "packed_moe_experts(Tensor x, Tensor experts, Tensor weights, Tensor[] gate_up, int[] gate_up_formats, "
      "Tensor down, int down_format, Tensor? exact_mask, bool int8_activations, int activation, float alpha, "
      "float limit, Tensor? gate_up_bias=None, Tensor? down_bias=None) -> Tensor");
  m.def("moe_route(Tensor logits, int top_k, int router, bool norm_topk_prob) -> (Tensor, Tensor)");
  // No tensor to dispatch on: one kernel for every backend.
  m.def("set_openmp_rows(int rows) -> ()", [](int64_t rows) {
    pagedserve::cpu::openmp_rows_setting().store(rows, std::memory_order_relaxed);
  });
  m.def("amx_bf16_available() -> bool", []() { return pagedserve::cpu::amx_bf16_available(); });
  m.def("int8_amx_available() -> bool", []() { return pagedserve::cpu::amx_int8::available(); });
  m.def("bf16_linear_kernel() -> int", []() { return pagedserve::cpu::bf16_linear_kernel(); });
  m.def("openmp_rows() -> int", []() { return pagedserve::cpu::openmp_rows(); });
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("paged_attention", &pagedserve::cpu::paged_attention);
  m.impl("paged_prefill_attention", &pagedserve::cpu::paged_prefill_attention);
  m.impl("reshape_and_cache", &pagedserve::cpu::reshape_and_cache);
  m.impl("copy_blocks", &pagedserve::cpu::copy_blocks);
  m.impl("swap_blocks", &pagedserve::cpu::swap_blocks);
  m.impl("rms_norm", &pagedserve::cpu::rms_norm);
  m.impl("fused_add_rms_norm", &pagedserve::cpu::fused_add_rms_norm);
  m.impl("silu_and_mul", &pagedserve::cpu::silu_and_mul);
  m.impl("rotary_embedding_and_cache", &pagedserve::cpu::rotary_embedding_and_cache);
  m.impl("small_gemm", &pagedserve::cpu::small_gemm);
  m.impl("fixed_gemm", &pagedserve::cpu::fixed_gemm);
  m.impl("quant_fixed_gemm", &pagedserve::cpu::quant_fixed_gemm);
  m.impl("lora_rows", &pagedserve::cpu::lora_rows);
  m.impl("sample_from_logits", &pagedserve::cpu::sample_from_logits);
  m.impl("sample_filtered", &pagedserve::cpu::sample_filtered);
  m.impl("screened_argmax", &pagedserve::cpu::screened_argmax);
  m.impl("quant_linear", &pagedserve::cpu::quant_linear);
  m.impl("quant_linear_bf16", &pagedserve::cpu::quant_linear_bf16);
  m.impl("dequantize_weight", &pagedserve::cpu::dequantize_weight);
  m.impl("quant_screened_argmax", &pagedserve::cpu::quant_screened_argmax);
  m.impl("llama_decoder", &pagedserve::cpu::llama_decoder);
  m.impl("packed_moe_experts", &pagedserve::cpu::packed_moe_experts);
  m.impl("moe_route", &pagedserve::cpu::moe_route);
}
