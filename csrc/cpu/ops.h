// CPU paged ops: declarations shared by the kernels and their TORCH_LIBRARY registration.
#pragma once

#include <ATen/core/Tensor.h>

namespace pagedserve::cpu {

// out/query [num_seqs, num_heads, head_size]; caches [num_blocks, num_kv_heads, block_size, head_size].
void paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, double scale);

// key/value [T, num_kv_heads, head_size] (last dim contiguous); slots < 0 are skipped.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& slot_mapping);

// block_mapping int64 [n, 2] of (src, dst) block ids, applied to every layer.
void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping);

// dst[d] = src[s] for each (s, d) row of block_mapping (both host tensors here).
void swap_blocks(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_mapping);

}  // namespace pagedserve::cpu
