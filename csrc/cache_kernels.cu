// CUDA cache kernels: store new K/V into their slots, copy blocks for every layer in one launch,
// and swap blocks between device and (pinned) host memory with cudaMemcpyAsync.
#include <cstdint>

#include "ops.h"

namespace pagedserve::cuda {
namespace {

// One CTA per token; threads walk the token's num_kv_heads * head_size elements (copied as bits).
template <typename Word>
__global__ void reshape_and_cache_kernel(const Word* key, const Word* value, Word* key_cache,
                                         Word* value_cache, const int64_t* slot_mapping, int num_kv_heads,
                                         int head_size, int block_size, int64_t key_stride_token,
                                         int64_t key_stride_head, int64_t value_stride_token,
                                         int64_t value_stride_head) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // padding token
  const int64_t block = slot / block_size, offset = slot % block_size;
  const int count = num_kv_heads * head_size;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int64_t head = i / head_size, dim = i % head_size;
    const int64_t dst = ((block * num_kv_heads + head) * block_size + offset) * head_size + dim;
    key_cache[dst] = key[token * key_stride_token + head * key_stride_head + dim];
    value_cache[dst] = value[token * value_stride_token + head * value_stride_head + dim];
  }
}

// Grid (cache, pair): each CTA copies one block of one cache; Word is the copy granule.
template <typename Word>
__global__ void copy_blocks_kernel(const int64_t* cache_ptrs, const int64_t* mapping, int64_t block_words) {
  Word* cache = reinterpret_cast<Word*>(cache_ptrs[blockIdx.x]);
  const int64_t src = mapping[2 * static_cast<int64_t>(blockIdx.y)];
  const int64_t dst = mapping[2 * static_cast<int64_t>(blockIdx.y) + 1];
  for (int64_t i = threadIdx.x; i < block_words; i += blockDim.x)
    cache[dst * block_words + i] = cache[src * block_words + i];
}

}  // namespace

cudaError_t reshape_and_cache(const void* key, const void* value, void* key_cache, void* value_cache,
                              const int64_t* slot_mapping, int64_t num_tokens, int num_kv_heads,
                              int head_size, int block_size, int64_t key_stride_token,
                              int64_t key_stride_head, int64_t value_stride_token,
                              int64_t value_stride_head, int element_size, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (num_tokens > 0x7fffffff) return cudaErrorInvalidValue;
  const int threads = min(512, ((num_kv_heads * head_size + 31) / 32) * 32);
  const dim3 grid(static_cast<unsigned>(num_tokens));
  if (element_size == 4) {
    reshape_and_cache_kernel<uint32_t><<<grid, threads, 0, stream>>>(
        static_cast<const uint32_t*>(key), static_cast<const uint32_t*>(value),
        static_cast<uint32_t*>(key_cache), static_cast<uint32_t*>(value_cache), slot_mapping, num_kv_heads,
        head_size, block_size, key_stride_token, key_stride_head, value_stride_token, value_stride_head);
  } else if (element_size == 2) {
    reshape_and_cache_kernel<uint16_t><<<grid, threads, 0, stream>>>(
        static_cast<const uint16_t*>(key), static_cast<const uint16_t*>(value),
        static_cast<uint16_t*>(key_cache), static_cast<uint16_t*>(value_cache), slot_mapping, num_kv_heads,
        head_size, block_size, key_stride_token, key_stride_head, value_stride_token, value_stride_head);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t copy_blocks(const int64_t* cache_ptrs, const int64_t* mapping, int num_caches, int num_pairs,
                        int64_t block_bytes, cudaStream_t stream) {
  if (num_caches == 0 || num_pairs == 0) return cudaSuccess;
  if (num_pairs > 65535) return cudaErrorInvalidValue;
  const dim3 grid(num_caches, num_pairs);
  if (block_bytes % 16 == 0) {
    copy_blocks_kernel<uint4><<<grid, 256, 0, stream>>>(cache_ptrs, mapping, block_bytes / 16);
  } else {
    copy_blocks_kernel<uint8_t><<<grid, 256, 0, stream>>>(cache_ptrs, mapping, block_bytes);
  }
  return cudaGetLastError();
}

cudaError_t swap_blocks(const void* src, void* dst, const int64_t* mapping_host, int num_pairs,
                        int64_t block_bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  const char* src_bytes = static_cast<const char*>(src);
  char* dst_bytes = static_cast<char*>(dst);
  for (int p = 0; p < num_pairs; ++p) {
    const int64_t s = mapping_host[2 * p], d = mapping_host[2 * p + 1];
    const cudaError_t err =
        cudaMemcpyAsync(dst_bytes + d * block_bytes, src_bytes + s * block_bytes, block_bytes, kind, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace pagedserve::cuda
