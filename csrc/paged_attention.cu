// Decode paged attention on CUDA.
//
// Grid (kv_head x head_chunk, seq, partition). One CTA owns up to kMaxHeads query heads of one
// GQA group and one partition of kPartitionSize tokens: every K/V row it loads serves all of
// those heads. Logits, softmax and accumulation are fp32. With more than one partition each CTA
// writes a normalized partial output plus (max, sum), and reduce_kernel merges them (split-K).
// Only tokens below the context length (and, with a sliding window, within its last `window`
// tokens) are ever read, so stale slots cannot leak NaN. An int8 cache (C = int8_t) is
// dequantized in registers with each row's fp16 scale (kv_quant.cuh). A
// context length outside the table's capacity, or a block-table entry outside the pool, makes the
// CTA skip its work (zeros out) and sets the error flag the wrapper raises on.
#include <cstdint>

#include "dtype_utils.cuh"
#include "kv_quant.cuh"
#include "ops.h"

namespace pagedserve::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kMaxHeads = 8;  // query heads per CTA; larger groups are split across CTAs

__host__ __device__ constexpr int max_int(int a, int b) { return a > b ? a : b; }

// The context length of a sequence, or 0 (nothing read) for one outside [0, table capacity].
__device__ __forceinline__ int valid_context_len(const PagedAttentionArgs& a, int seq, int block_size) {
  const int len = a.context_lens[seq];
  return len < 0 || len > a.max_blocks_per_seq * block_size ? 0 : len;
}

template <typename T, typename C, int HEAD_SIZE, int BLOCK_SIZE>
__global__ void __launch_bounds__(kThreads) attention_kernel(const PagedAttentionArgs a) {
  constexpr int kVec = Pack<T>::kSize;
  constexpr int kNumVecs = HEAD_SIZE / kVec;
  // Lanes that share one token in the QK phase, and tokens a warp scores at once.
  constexpr int kLanesPerToken = kNumVecs >= 32 ? 32 : kNumVecs >= 16 ? 16 : kNumVecs >= 8 ? 8 : 4;
  constexpr int kTokensPerWarp = kWarpSize / kLanesPerToken;
  constexpr int kVecsPerLane = (kNumVecs + kLanesPerToken - 1) / kLanesPerToken;
  constexpr int kDimsPerLane = (HEAD_SIZE + kWarpSize - 1) / kWarpSize;
  constexpr int kWorkFloats = max_int(kMaxHeads * kPartitionSize, kWarps * kMaxHeads * HEAD_SIZE);
  constexpr int kRow = row_elems<C, HEAD_SIZE>();  // cache elements per token row

  __shared__ float q_s[kMaxHeads * HEAD_SIZE];
  __shared__ float work_s[kWorkFloats];  // logits, then per-warp partial outputs
  __shared__ float max_s[kMaxHeads];
  __shared__ float sum_s[kMaxHeads];
  __shared__ int bad_block_s;

  const int group = a.num_heads / a.num_kv_heads;
  const int chunks = (group + kMaxHeads - 1) / kMaxHeads;
  const int kv_head = blockIdx.x / chunks;
  const int head0 = kv_head * group + (blockIdx.x % chunks) * kMaxHeads;
  const int num_heads_here = min(kMaxHeads, kv_head * group + group - head0);
  const int seq = a.seq_begin + blockIdx.y;
  const int part = blockIdx.z;
  const int context_len = valid_context_len(a, seq, BLOCK_SIZE);
  if (threadIdx.x == 0 && context_len != a.context_lens[seq]) flag_error(a.errors, kBadContextLen);
  const int part_start = part * kPartitionSize;
  if (part > 0 && part_start >= context_len) return;  // whole CTA past the context: nothing to do
  // A sliding window: tokens before context_len - window are not read; a partition wholly before
  // it reads nothing and writes an empty partial (zeros, max -inf) for the reduce.
  const int start = a.window > 0 ? max(part_start, context_len - a.window) : part_start;
  int n = max(0, min(context_len, part_start + kPartitionSize) - start);
  const int32_t* table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  // Every block this partition reads must lie in the pool, else the CTA reads nothing.
  if (threadIdx.x == 0) bad_block_s = 0;
  __syncthreads();
  for (int b = start / BLOCK_SIZE + threadIdx.x; n > 0 && b * BLOCK_SIZE < start + n; b += kThreads) {
    if (table[b] < 0 || table[b] >= a.num_blocks) bad_block_s = 1;
  }
  __syncthreads();
  if (bad_block_s) {
    if (threadIdx.x == 0) flag_error(a.errors, kBadBlockEntry);
    n = 0;
  }

  const T* query = static_cast<const T*>(a.query) + seq * a.q_stride_seq;
  for (int i = threadIdx.x; i < num_heads_here * HEAD_SIZE; i += kThreads) {
    const int h = i / HEAD_SIZE, d = i % HEAD_SIZE;
    q_s[i] = to_float(query[(head0 + h) * a.q_stride_head + d]) * a.scale;
  }
  __syncthreads();

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const C* key_cache = static_cast<const C*>(a.key_cache);
  const C* value_cache = static_cast<const C*>(a.value_cache);
  auto row_offset = [&](int token) -> int64_t {
    const int64_t block = table[token / BLOCK_SIZE];
    return ((block * a.num_kv_heads + kv_head) * BLOCK_SIZE + token % BLOCK_SIZE) * kRow;
  };

  // QK: each group of kLanesPerToken lanes scores one token against every head of the CTA.
  const int token_slot = lane / kLanesPerToken, sub_lane = lane % kLanesPerToken;
  for (int t0 = warp * kTokensPerWarp; t0 < n; t0 += kWarps * kTokensPerWarp) {
    const int t = t0 + token_slot;
    float dots[kMaxHeads];
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) dots[h] = 0.f;
    if (t < n) {
      const C* k_row = key_cache + row_offset(start + t);
      const float k_scale = scale_of(k_row, HEAD_SIZE);
#pragma unroll
      for (int i = 0; i < kVecsPerLane; ++i) {
        const int v = sub_lane + i * kLanesPerToken;
        if (v >= kNumVecs) break;
        float k[kVec];
        if constexpr (is_int8_v<C>) {  // rows are only 2-byte aligned: byte loads, scaled in registers
#pragma unroll
          for (int e = 0; e < kVec; ++e) k[e] = load_elem(k_row, v * kVec + e, k_scale);
        } else {
          const Pack<T> pack = *reinterpret_cast<const Pack<T>*>(k_row + v * kVec);
#pragma unroll
          for (int e = 0; e < kVec; ++e) k[e] = to_float(pack.v[e]);
        }
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
#pragma unroll
          for (int h = 0; h < kMaxHeads; ++h)
            if (h < num_heads_here) dots[h] += q_s[h * HEAD_SIZE + v * kVec + e] * k[e];
        }
      }
    }
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
#pragma unroll
      for (int off = kLanesPerToken / 2; off > 0; off /= 2)
        dots[h] += __shfl_xor_sync(0xffffffffu, dots[h], off);
    }
    if (t < n && sub_lane == 0) {
      for (int h = 0; h < num_heads_here; ++h) work_s[h * kPartitionSize + t] = dots[h];
    }
  }
  __syncthreads();

  // Softmax within the partition: one warp per head.
  for (int h = warp; h < num_heads_here; h += kWarps) {
    float* logits = work_s + h * kPartitionSize;
    float m = -INFINITY;
    for (int t = lane; t < n; t += kWarpSize) m = fmaxf(m, logits[t]);
    m = warp_max(m);
    float s = 0.f;
    for (int t = lane; t < n; t += kWarpSize) {
      const float p = __expf(logits[t] - m);
      logits[t] = p;
      s += p;
    }
    s = warp_sum(s);
    if (lane == 0) {
      max_s[h] = m;
      sum_s[h] = s;
    }
  }
  __syncthreads();

  // PV: warps stride over tokens, lanes over head dims; each V row serves every head.
  float acc[kMaxHeads][kDimsPerLane];
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h)
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) acc[h][i] = 0.f;
  for (int t = warp; t < n; t += kWarps) {
    const C* v_row = value_cache + row_offset(start + t);
    const float v_scale = scale_of(v_row, HEAD_SIZE);
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = lane + i * kWarpSize;
      if (d < HEAD_SIZE) {
        const float v = load_elem(v_row, d, v_scale);
#pragma unroll
        for (int h = 0; h < kMaxHeads; ++h)
          if (h < num_heads_here) acc[h][i] += work_s[h * kPartitionSize + t] * v;
      }
    }
  }
  __syncthreads();  // every warp is done reading logits before work_s is reused
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h) {
    if (h >= num_heads_here) break;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = lane + i * kWarpSize;
      if (d < HEAD_SIZE) work_s[(warp * kMaxHeads + h) * HEAD_SIZE + d] = acc[h][i];
    }
  }
  __syncthreads();

  const bool partitioned = a.max_num_partitions > 1;
  for (int i = threadIdx.x; i < num_heads_here * HEAD_SIZE; i += kThreads) {
    const int h = i / HEAD_SIZE, d = i % HEAD_SIZE;
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += work_s[(w * kMaxHeads + h) * HEAD_SIZE + d];
    float value = sum_s[h] > 0.f ? total / sum_s[h] : 0.f;  // empty context -> zeros
    if (a.sinks && !partitioned) {  // the sink's logit joins the denominator (no value)
      const float sink = a.sinks[head0 + h], m = fmaxf(max_s[h], sink);
      const float alpha = expf(max_s[h] - m);  // 0 for an empty context (max -inf)
      value = total * alpha / (sum_s[h] * alpha + expf(sink - m));
    }
    const int64_t row = static_cast<int64_t>(seq) * a.num_heads + head0 + h;
    if (partitioned) {
      a.tmp_out[(row * a.max_num_partitions + part) * HEAD_SIZE + d] = value;
    } else {
      T* out = static_cast<T*>(a.out) + seq * a.out_stride_seq + (head0 + h) * a.out_stride_head;
      out[d] = from_float<T>(value);
    }
  }
  if (partitioned && threadIdx.x < num_heads_here) {
    const int64_t row = static_cast<int64_t>(seq) * a.num_heads + head0 + threadIdx.x;
    a.max_logits[row * a.max_num_partitions + part] = max_s[threadIdx.x];
    a.exp_sums[row * a.max_num_partitions + part] = sum_s[threadIdx.x];
  }
}

__device__ float block_reduce(float x, bool is_max, float* scratch) {
  x = is_max ? warp_max(x) : warp_sum(x);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < kWarps; ++w) r = is_max ? fmaxf(r, scratch[w]) : r + scratch[w];
  return r;
}

// Merge the partitions of one (seq, head): weights exp_sum * exp(max - global max).
template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
__global__ void __launch_bounds__(kThreads) reduce_kernel(const PagedAttentionArgs a) {
  extern __shared__ float weights_s[];  // [max_num_partitions]
  __shared__ float scratch[kWarps];
  const int head = blockIdx.x, seq = a.seq_begin + blockIdx.y;
  const int context_len = valid_context_len(a, seq, BLOCK_SIZE);  // the partitions the first kernel wrote
  const int num_parts =
      min(a.max_num_partitions, max(1, (context_len + kPartitionSize - 1) / kPartitionSize));
  const int64_t row = static_cast<int64_t>(seq) * a.num_heads + head;
  const float* maxes = a.max_logits + row * a.max_num_partitions;
  const float* sums = a.exp_sums + row * a.max_num_partitions;

  float m = -INFINITY;
  for (int p = threadIdx.x; p < num_parts; p += kThreads) m = fmaxf(m, maxes[p]);
  m = block_reduce(m, true, scratch);
  float s = 0.f;
  for (int p = threadIdx.x; p < num_parts; p += kThreads) {
    const float w = maxes[p] == -INFINITY ? 0.f : sums[p] * __expf(maxes[p] - m);
    weights_s[p] = w;
    s += w;
  }
  s = block_reduce(s, false, scratch);  // its barriers also publish weights_s
  float inv = s > 0.f ? 1.f / s : 0.f;
  if (a.sinks) {  // the sink's logit joins the denominator of the partitions' combined softmax
    const float sink = a.sinks[head], m_all = fmaxf(m, sink);
    const float alpha = expf(m - m_all);  // 0 for an empty context (max -inf)
    inv = alpha / (s * alpha + expf(sink - m_all));
  }
  const float* partial = a.tmp_out + row * a.max_num_partitions * HEAD_SIZE;
  T* out = static_cast<T*>(a.out) + seq * a.out_stride_seq + head * a.out_stride_head;
  for (int d = threadIdx.x; d < HEAD_SIZE; d += kThreads) {
    float total = 0.f;
    for (int p = 0; p < num_parts; ++p) total += weights_s[p] * partial[p * HEAD_SIZE + d];
    out[d] = from_float<T>(total * inv);
  }
}

// One launch (and reduce) per 65,535 sequences: gridDim.y stops there.
template <typename T, typename C, int HEAD_SIZE, int BLOCK_SIZE>
cudaError_t launch(const PagedAttentionArgs& args, cudaStream_t stream) {
  const int group = args.num_heads / args.num_kv_heads;
  const int chunks = (group + kMaxHeads - 1) / kMaxHeads;
  for (int begin = 0; begin < args.num_seqs; begin += kMaxGridYZ) {
    PagedAttentionArgs a = args;
    a.seq_begin = begin;
    const int seqs = min(kMaxGridYZ, args.num_seqs - begin);
    attention_kernel<T, C, HEAD_SIZE, BLOCK_SIZE>
        <<<dim3(a.num_kv_heads * chunks, seqs, a.max_num_partitions), kThreads, 0, stream>>>(a);
    if (a.max_num_partitions > 1) {
      const size_t smem = static_cast<size_t>(a.max_num_partitions) * sizeof(float);
      reduce_kernel<T, HEAD_SIZE, BLOCK_SIZE><<<dim3(a.num_heads, seqs), kThreads, smem, stream>>>(a);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename T, typename C, int HEAD_SIZE>
cudaError_t dispatch_block(const PagedAttentionArgs& a, cudaStream_t stream) {
  switch (a.block_size) {
    case 8: return launch<T, C, HEAD_SIZE, 8>(a, stream);
    case 16: return launch<T, C, HEAD_SIZE, 16>(a, stream);
    case 32: return launch<T, C, HEAD_SIZE, 32>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, typename C>
cudaError_t dispatch_head(const PagedAttentionArgs& a, cudaStream_t stream) {
  switch (a.head_size) {
    case 64: return dispatch_block<T, C, 64>(a, stream);
    case 80: return dispatch_block<T, C, 80>(a, stream);
    case 96: return dispatch_block<T, C, 96>(a, stream);
    case 128: return dispatch_block<T, C, 128>(a, stream);
    case 256: return dispatch_block<T, C, 256>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t dispatch_cache(const PagedAttentionArgs& a, cudaStream_t stream) {
  return a.kv_int8 ? dispatch_head<T, int8_t>(a, stream) : dispatch_head<T, T>(a, stream);
}

}  // namespace

cudaError_t paged_attention(const PagedAttentionArgs& args, cudaStream_t stream) {
  if (args.num_seqs == 0) return cudaSuccess;
  if (args.num_kv_heads <= 0 || args.num_heads % args.num_kv_heads != 0 || args.max_num_partitions < 1 ||
      args.max_num_partitions > kMaxGridYZ)
    return cudaErrorInvalidValue;
  switch (args.dtype) {
    case DType::kFloat32: return dispatch_cache<float>(args, stream);
    case DType::kFloat16: return dispatch_cache<__half>(args, stream);
    case DType::kBFloat16: return dispatch_cache<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagedserve::cuda
