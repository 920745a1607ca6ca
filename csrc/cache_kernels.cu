// CUDA cache kernels: store new K/V into their slots (quantized for an int8 cache; a slot past the
// cache is skipped and flagged), copy blocks for every layer in one launch,
// and swap blocks between device and (pinned) host memory with cudaMemcpyAsync.
#include <cstdint>

#include "kv_quant.cuh"
#include "ops.h"

namespace pagedserve::cuda {
namespace {

// The slot of a token, or -1 for padding and for a slot past the cache (flagged, skipped).
__device__ __forceinline__ int64_t checked_slot(const CacheWriteArgs& a, int64_t token) {
  const int64_t slot = a.slot_mapping[token];
  if (slot >= a.num_blocks * a.block_size) {
    flag_error(a.errors, kBadSlot);
    return -1;
  }
  return slot;
}

// One CTA per token; threads walk the token's num_kv_heads * head_size elements (copied as bits).
template <typename Word>
__global__ void reshape_and_cache_kernel(const CacheWriteArgs a) {
  const int64_t token = blockIdx.x;
  const int64_t slot = checked_slot(a, token);
  if (slot < 0) return;  // padding token (or a bad slot)
  const Word* key = static_cast<const Word*>(a.key);
  const Word* value = static_cast<const Word*>(a.value);
  Word* key_cache = static_cast<Word*>(a.key_cache);
  Word* value_cache = static_cast<Word*>(a.value_cache);
  const int64_t block = slot / a.block_size, offset = slot % a.block_size;
  const int count = a.num_kv_heads * a.head_size;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int64_t head = i / a.head_size, dim = i % a.head_size;
    const int64_t dst = ((block * a.num_kv_heads + head) * a.block_size + offset) * a.head_size + dim;
    key_cache[dst] = key[token * a.key_stride_token + head * a.key_stride_head + dim];
    value_cache[dst] = value[token * a.value_stride_token + head * a.value_stride_head + dim];
  }
}

// One CTA per token, one warp per KV head: each K and V row quantized into its int8 cache row.
template <typename T>
__global__ void reshape_and_quantize_kernel(const CacheWriteArgs a) {
  const int64_t token = blockIdx.x;
  const int64_t slot = checked_slot(a, token);
  if (slot < 0) return;
  const int64_t block = slot / a.block_size, offset = slot % a.block_size;
  const int row = a.head_size + kScaleBytes;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int head = warp; head < a.num_kv_heads; head += warps) {
    const int64_t dst = ((block * a.num_kv_heads + head) * a.block_size + offset) * row;
    quantize_row_warp(static_cast<int8_t*>(a.key_cache) + dst,
                      static_cast<const T*>(a.key) + token * a.key_stride_token + head * a.key_stride_head,
                      a.head_size, lane);
    quantize_row_warp(static_cast<int8_t*>(a.value_cache) + dst,
                      static_cast<const T*>(a.value) + token * a.value_stride_token + head * a.value_stride_head,
                      a.head_size, lane);
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

cudaError_t reshape_and_cache(const CacheWriteArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.num_tokens > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(a.num_tokens));
  if (a.kv_int8) {
    const int threads = 32 * min(16, a.num_kv_heads);
    switch (a.dtype) {
      case DType::kFloat32: reshape_and_quantize_kernel<float><<<grid, threads, 0, stream>>>(a); break;
      case DType::kFloat16: reshape_and_quantize_kernel<__half><<<grid, threads, 0, stream>>>(a); break;
      case DType::kBFloat16: reshape_and_quantize_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(a); break;
      default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
  }
  const int threads = min(512, ((a.num_kv_heads * a.head_size + 31) / 32) * 32);
  if (a.dtype == DType::kFloat32) {
    reshape_and_cache_kernel<uint32_t><<<grid, threads, 0, stream>>>(a);
  } else {
    reshape_and_cache_kernel<uint16_t><<<grid, threads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

cudaError_t copy_blocks(const int64_t* cache_ptrs, const int64_t* mapping, int num_caches, int num_pairs,
                        int64_t block_bytes, cudaStream_t stream) {
  if (num_caches == 0 || num_pairs == 0) return cudaSuccess;
  if (num_caches > 0x7fffffff) return cudaErrorInvalidValue;
  for (int begin = 0; begin < num_pairs; begin += kMaxGridYZ) {  // gridDim.y stops at 65,535
    const dim3 grid(num_caches, min(kMaxGridYZ, num_pairs - begin));
    const int64_t* chunk = mapping + 2 * static_cast<int64_t>(begin);
    if (block_bytes % 16 == 0) {
      copy_blocks_kernel<uint4><<<grid, 256, 0, stream>>>(cache_ptrs, chunk, block_bytes / 16);
    } else {
      copy_blocks_kernel<uint8_t><<<grid, 256, 0, stream>>>(cache_ptrs, chunk, block_bytes);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
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
