// CUDA launchers for the paged ops: raw pointers and a cudaStream_t, no torch headers, so the
// .cu files compile in seconds and `nvcc -c` works on a machine without a GPU or CUDA torch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace pagedserve::cuda {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// The kernels skip work on an index a host check cannot see without a device sync, and record
// why in one byte of an 8-byte flag in mapped host memory (plain byte stores: no atomics, no lost
// kinds); the Python wrappers read it with no sync (ops/device_errors.py). Index = kind.
// The flag is 8 bytes (kErrorFlagBytes); kinds stay below that.
enum ErrorKind : int {
  kBadBlockEntry = 0,   // a block-table entry outside [0, num_blocks)
  kBadContextLen = 1,   // a context length outside [0, table capacity], or shorter than its query
  kBadSlot = 2,         // a cache slot at or past num_blocks * block_size
  kBadQueryStart = 3,   // query_start_loc not non-decreasing within [0, num_tokens]
  kBadPosition = 4,     // a RoPE position outside the cos/sin table (the token is left unrotated)
};
constexpr int kErrorFlagBytes = 8;

// gridDim.y and gridDim.z stop here: launchers loop over larger counts.
constexpr int kMaxGridYZ = 65535;

// Tokens per split-K partition; contexts longer than this are reduced by a second kernel.
constexpr int kPartitionSize = 512;

struct PagedAttentionArgs {
  void* out;                   // [num_seqs, num_heads, head_size], strides below
  const void* query;           // [num_seqs, num_heads, head_size], strides below
  const void* key_cache;       // [num_blocks, num_kv_heads, block_size, head_size (+ 2 for int8)], contiguous
  const void* value_cache;     // same layout as key_cache
  const int32_t* block_tables; // [num_seqs, max_blocks_per_seq], contiguous; bad entries are flagged
  const int32_t* context_lens; // [num_seqs]
  float* tmp_out;              // [num_seqs, num_heads, max_num_partitions, head_size] when partitioned
  float* max_logits;           // [num_seqs, num_heads, max_num_partitions] when partitioned
  float* exp_sums;             // [num_seqs, num_heads, max_num_partitions] when partitioned
  int num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq, max_num_partitions;
  int64_t num_blocks;
  int64_t q_stride_seq, q_stride_head, out_stride_seq, out_stride_head;
  float scale;
  DType dtype;          // of query and out (and of a float cache)
  bool kv_int8;         // int8 cache rows: head_size values, then their fp16 scale (kv_quant.cuh)
  unsigned char* errors;  // device view of the error flag (ErrorKind bytes)
  int seq_begin;        // first sequence of this launch (set by the launcher: grids stop at 65,535)
  int window;           // > 0: a query sees only the last `window` tokens of its context; 0: all
  const float* sinks;   // [num_heads] fp32 logits joining each head's softmax denominator (no value); null: none
};

struct PrefillAttentionArgs {
  void* out;                      // [num_tokens, num_heads, head_size], strides below
  const void* query;              // [num_tokens, num_heads, head_size], strides below
  const void* key_cache;          // [num_blocks, num_kv_heads, block_size, head_size], contiguous
  const void* value_cache;        // same layout as key_cache
  const int32_t* block_tables;    // [num_seqs, max_blocks_per_seq], contiguous
  const int32_t* query_start_loc; // [num_seqs + 1]: sequence s owns query rows [qsl[s], qsl[s + 1])
  const int32_t* context_lens;    // [num_seqs]: its query rows are the last ones of this context
  int num_seqs, num_tokens, num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq;
  int64_t num_blocks;
  int64_t q_stride_token, q_stride_head, out_stride_token, out_stride_head;
  float scale;
  DType dtype;
  bool kv_int8;
  int rows_per_warp;    // 8, or 4 (head 256 only: the smaller tile for devices with 99 KiB of shared memory)
  unsigned char* errors;
  int window;           // > 0: query at q sees keys p with q - window < p <= q; 0: every p <= q
  const float* sinks;   // [num_heads] fp32 logits joining each head's softmax denominator (no value); null: none
};

struct RotaryArgs {
  const int64_t* positions;     // [num_tokens]
  void* query;                  // [num_tokens, num_heads, head_size], rotated in place
  void* key;                    // [num_tokens, num_kv_heads, head_size], rotated in place
  const void* value;            // [num_tokens, num_kv_heads, head_size]
  const float* cos_sin;         // [table_rows, head_size]: head_size/2 cosines, then the sines
  void* key_cache;              // [num_blocks, num_kv_heads, block_size, head_size] or nullptr
  void* value_cache;            // same layout, or nullptr (no cache write)
  const int64_t* slot_mapping;  // [num_tokens]; < 0 skipped
  int64_t num_tokens, table_rows, num_blocks;
  int num_heads, num_kv_heads, head_size, block_size;
  int64_t q_stride_token, q_stride_head, k_stride_token, k_stride_head, v_stride_token, v_stride_head;
  DType dtype;
  bool kv_int8;         // quantize into int8 cache rows
  unsigned char* errors;
};

struct CacheWriteArgs {
  const void* key;              // [num_tokens, num_kv_heads, head_size], strides below (elements)
  const void* value;
  void* key_cache;              // [num_blocks, num_kv_heads, block_size, head_size (+ 2 for int8)]
  void* value_cache;
  const int64_t* slot_mapping;  // [num_tokens]; < 0 skipped, >= num_blocks * block_size flagged
  int64_t num_tokens, num_blocks;
  int num_kv_heads, head_size, block_size;
  int64_t key_stride_token, key_stride_head, value_stride_token, value_stride_head;
  DType dtype;                  // of key and value
  bool kv_int8;
  unsigned char* errors;
};

// Each returns cudaSuccess, cudaErrorInvalidValue for an unsupported shape, or the launch error.
cudaError_t paged_attention(const PagedAttentionArgs& args, cudaStream_t stream);

// Varlen causal prefill over the paged context of every sequence (head sizes 64/80/96/128/256).
cudaError_t paged_prefill_attention(const PrefillAttentionArgs& args, cudaStream_t stream);

// out = weight * norm(x) per row; with residual != nullptr first residual = x + residual (in place)
// and the norm is of that sum. Rows contiguous; strides in elements.
cudaError_t rms_norm(void* out, const void* x, void* residual, const void* weight, int64_t rows, int hidden,
                     int64_t out_stride, int64_t x_stride, int64_t residual_stride, float eps, DType dtype,
                     cudaStream_t stream);

// out[r][c] = silu(x[r][c]) * x[r][width + c].
cudaError_t silu_and_mul(void* out, const void* x, int64_t rows, int width, int64_t out_stride, int64_t x_stride,
                         DType dtype, cudaStream_t stream);

cudaError_t rotary_embedding_and_cache(const RotaryArgs& args, cudaStream_t stream);

// Store (or quantize, for an int8 cache) each token's K/V at its slot.
cudaError_t reshape_and_cache(const CacheWriteArgs& args, cudaStream_t stream);

// cache_ptrs: device array of 2 * num_layers base addresses (all key caches, then all value
// caches); mapping: device int64 [num_pairs, 2]. One launch copies every layer (one per 65,535 pairs).
cudaError_t copy_blocks(const int64_t* cache_ptrs, const int64_t* mapping, int num_caches, int num_pairs,
                        int64_t block_bytes, cudaStream_t stream);

// mapping_host: host int64 [num_pairs, 2]; one cudaMemcpyAsync per block on `stream`.
cudaError_t swap_blocks(const void* src, void* dst, const int64_t* mapping_host, int num_pairs,
                        int64_t block_bytes, cudaMemcpyKind kind, cudaStream_t stream);

}  // namespace pagedserve::cuda
