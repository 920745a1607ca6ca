// Varlen paged prefill attention on CUDA: every prefill sequence of a step in one launch, each
// query attending causally over its sequence's whole context read through the block table.
//
// The rows of a sequence are its (token, head of the GQA group) pairs, so one K/V tile in shared
// memory serves every query head of a KV head. Grid: (row tile, kv head). The row tiles of all
// sequences are numbered without a host-side max query length: sequence s starts at tile
// floor(query_start_loc[s] * group / kRows) + s, an upper bound on the tiles before it, and a CTA
// finds its sequence by binary search (tiles past a sequence's rows exit at once).
//
// A CTA holds kRows = 32 query rows (fp32, pre-scaled) in shared memory and walks the context in
// tiles of kKeys = 32 tokens: K transposed and V, widened to fp32, in shared memory. Each warp owns
// 8 rows; in the QK phase lane j scores key j of the tile for those 8 rows, a warp-wide online
// softmax (running max and sum in registers) turns scores into weights, and in the PV phase lanes
// split the head dimension. Accumulation is fp32 throughout; only keys at or before a query's
// position (hence inside the context) are weighted, and slots past the context are never read.
//
// An int8 cache (C = int8_t) is dequantized with each row's fp16 scale while the tile is widened
// into shared memory. At head size 256 the 32-row tile needs 103,424 bytes of shared memory, past
// the 99 KiB opt-in limit of sm_86/89/120: there the wrapper asks for 4 rows per warp (16-row
// tiles, 84,992 bytes). Rows before query_start_loc[0] belong to no sequence and are not written;
// a sequence whose query range, context length or block-table entries are invalid is skipped (or
// its bad keys read as zeros) and the error flag is set: CTA (0, 0) also checks every sequence's
// ranges, so a flag is raised even where the tile search cannot reach a sequence.
#include <cstdint>

#include "dtype_utils.cuh"
#include "kv_quant.cuh"
#include "ops.h"

namespace pagedserve::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kKeys = kWarpSize;              // context tokens per shared-memory tile

template <int HEAD_SIZE, int ROWS_PER_WARP>
struct Smem {
  static constexpr int kRows = kWarps * ROWS_PER_WARP;     // query rows per CTA
  static constexpr int kQ = kRows * HEAD_SIZE;             // q_s[row][d]
  static constexpr int kKt = HEAD_SIZE * (kKeys + 1);      // kt_s[d][key], padded: no bank conflicts
  static constexpr int kV = kKeys * HEAD_SIZE;             // v_s[key][d]
  static constexpr int kP = kWarps * ROWS_PER_WARP * kKeys;  // p_s[warp][row][key]
  static constexpr size_t kBytes = sizeof(float) * (kQ + kKt + kV + kP);
};

__device__ __forceinline__ int tile_offset(const int32_t* query_start_loc, int seq, int group, int rows) {
  return static_cast<int>(static_cast<int64_t>(query_start_loc[seq]) * group / rows) + seq;
}

// CTA (0, 0): every sequence's query range and context length, flagged where invalid.
__device__ void check_ranges(const PrefillAttentionArgs& a) {
  const int capacity = a.max_blocks_per_seq * a.block_size;
  if (threadIdx.x == 0 && (a.query_start_loc[0] < 0 || a.query_start_loc[a.num_seqs] > a.num_tokens))
    flag_error(a.errors, kBadQueryStart);
  for (int s = threadIdx.x; s < a.num_seqs; s += blockDim.x) {
    const int q_len = a.query_start_loc[s + 1] - a.query_start_loc[s];
    if (q_len < 0) flag_error(a.errors, kBadQueryStart);
    if (a.context_lens[s] > capacity || a.context_lens[s] < max(q_len, 0)) flag_error(a.errors, kBadContextLen);
  }
}

template <typename T, typename C, int HEAD_SIZE, int ROWS_PER_WARP>
__global__ void __launch_bounds__(kThreads) prefill_kernel(const PrefillAttentionArgs a) {
  static_assert(HEAD_SIZE % 4 == 0, "head size must allow float4 reads of q");
  constexpr int kRowsPerWarp = ROWS_PER_WARP;
  constexpr int kDimsPerLane = (HEAD_SIZE + kWarpSize - 1) / kWarpSize;
  constexpr int kRow = row_elems<C, HEAD_SIZE>();  // cache elements per token row
  using S = Smem<HEAD_SIZE, ROWS_PER_WARP>;
  constexpr int kRows = S::kRows;
  extern __shared__ float4 smem_raw[];
  float* q_s = reinterpret_cast<float*>(smem_raw);
  float* kt_s = q_s + S::kQ;
  float* v_s = kt_s + S::kKt;
  float* p_s = v_s + S::kV;

  const int group = a.num_heads / a.num_kv_heads;
  const int kv_head = blockIdx.y;
  const int tile = blockIdx.x;
  if (tile == 0 && kv_head == 0) check_ranges(a);
  int lo = 0, hi = a.num_seqs - 1;  // the last sequence whose first tile is <= this one
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_offset(a.query_start_loc, mid, group, kRows) <= tile) lo = mid; else hi = mid - 1;
  }
  const int seq = lo;
  const int q_start = a.query_start_loc[seq];
  const int q_len = a.query_start_loc[seq + 1] - q_start;
  const int first_tile = tile_offset(a.query_start_loc, seq, group, kRows);
  if (tile < first_tile) return;  // before the first sequence (query_start_loc[0] > 0): no rows
  const int row0 = (tile - first_tile) * kRows;
  if (q_len <= 0 || row0 >= q_len * group) return;
  if (q_start < 0 || q_start + q_len > a.num_tokens) return;  // flagged by check_ranges
  const int context_len = a.context_lens[seq];
  if (context_len > a.max_blocks_per_seq * a.block_size || context_len < q_len) return;  // flagged too
  const int rows_here = min(kRows, q_len * group - row0);
  const int first_pos = context_len - q_len;  // position of the sequence's first query token

  const T* query = static_cast<const T*>(a.query);
  for (int i = threadIdx.x; i < kRows * HEAD_SIZE; i += kThreads) {
    const int r = i / HEAD_SIZE, d = i % HEAD_SIZE;
    float x = 0.f;
    if (r < rows_here) {
      const int row = row0 + r, token = row / group, head = kv_head * group + row % group;
      x = to_float(query[(q_start + token) * a.q_stride_token + head * a.q_stride_head + d]) * a.scale;
    }
    q_s[i] = x;
  }

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  int pos[kRowsPerWarp];  // query position of each of the warp's rows; -1: no row (sees nothing)
  float row_max[kRowsPerWarp], row_sum[kRowsPerWarp], acc[kRowsPerWarp][kDimsPerLane];
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp * kRowsPerWarp + j;
    pos[j] = r < rows_here ? first_pos + (row0 + r) / group : -1;
    row_max[j] = -INFINITY;
    row_sum[j] = 0.f;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) acc[j][i] = 0.f;
  }
  const int kv_end = first_pos + (row0 + rows_here - 1) / group + 1;  // the CTA's last row sees the most
  // A sliding window: the CTA's first row sees the earliest key, position - window + 1
  const int kv_begin = a.window > 0 ? max(0, first_pos + row0 / group - a.window + 1) : 0;
  const int32_t* table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  const C* key_cache = static_cast<const C*>(a.key_cache);
  const C* value_cache = static_cast<const C*>(a.value_cache);
  const float* q_warp = q_s + warp * kRowsPerWarp * HEAD_SIZE;
  float* p_warp = p_s + warp * kRowsPerWarp * kKeys;

  for (int tile_start = kv_begin; tile_start < kv_end; tile_start += kKeys) {
    __syncthreads();  // the previous tile's K/V (and, first time round, q_s) are settled
    for (int i = threadIdx.x; i < kKeys * HEAD_SIZE; i += kThreads) {
      const int t = i / HEAD_SIZE, d = i % HEAD_SIZE, token = tile_start + t;
      float k = 0.f, v = 0.f;
      if (token < kv_end) {
        const int64_t block = table[token / a.block_size];
        if (block >= 0 && block < a.num_blocks) {
          const int64_t row = ((block * a.num_kv_heads + kv_head) * a.block_size + token % a.block_size) * kRow;
          const C* k_row = key_cache + row;
          const C* v_row = value_cache + row;
          k = load_elem(k_row, d, scale_of(k_row, HEAD_SIZE));
          v = load_elem(v_row, d, scale_of(v_row, HEAD_SIZE));
        } else if (d == 0) {
          flag_error(a.errors, kBadBlockEntry);  // read as zeros
        }
      }
      kt_s[d * (kKeys + 1) + t] = k;
      v_s[t * HEAD_SIZE + d] = v;
    }
    __syncthreads();

    float score[kRowsPerWarp];
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) score[j] = 0.f;
    for (int d = 0; d < HEAD_SIZE; d += 4) {
      const float k0 = kt_s[d * (kKeys + 1) + lane], k1 = kt_s[(d + 1) * (kKeys + 1) + lane];
      const float k2 = kt_s[(d + 2) * (kKeys + 1) + lane], k3 = kt_s[(d + 3) * (kKeys + 1) + lane];
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) {
        const float4 q = *reinterpret_cast<const float4*>(q_warp + j * HEAD_SIZE + d);
        score[j] += q.x * k0 + q.y * k1 + q.z * k2 + q.w * k3;
      }
    }
    const int key_pos = tile_start + lane;
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const bool visible = key_pos <= pos[j] && (a.window <= 0 || key_pos > pos[j] - a.window);
      const float tile_max = warp_max(visible ? score[j] : -INFINITY);
      float p = 0.f;
      if (tile_max != -INFINITY) {  // warp-uniform: the row sees at least one key of this tile
        const float new_max = fmaxf(row_max[j], tile_max);
        const float alpha = expf(row_max[j] - new_max);  // 0 on the row's first tile
        p = visible ? expf(score[j] - new_max) : 0.f;
        row_sum[j] = row_sum[j] * alpha + warp_sum(p);
        row_max[j] = new_max;
#pragma unroll
        for (int i = 0; i < kDimsPerLane; ++i) acc[j][i] *= alpha;
      }
      p_warp[j * kKeys + lane] = p;
    }
    __syncwarp();
    const int n = min(kKeys, kv_end - tile_start);
    for (int t = 0; t < n; ++t) {
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int d = lane + i * kWarpSize;
        if (d < HEAD_SIZE) {
          const float v = v_s[t * HEAD_SIZE + d];
#pragma unroll
          for (int j = 0; j < kRowsPerWarp; ++j) acc[j][i] += p_warp[j * kKeys + t] * v;
        }
      }
    }
    __syncwarp();  // p_warp is rewritten by the next tile
  }

  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp * kRowsPerWarp + j;
    if (r >= rows_here) break;
    const int row = row0 + r, token = row / group, head = kv_head * group + row % group;
    float inv = row_sum[j] > 0.f ? 1.f / row_sum[j] : 0.f;
    if (a.sinks) {  // the sink's logit joins the denominator (no value)
      const float sink = a.sinks[head], m = fmaxf(row_max[j], sink);
      const float alpha = expf(row_max[j] - m);  // 0 for a row that saw no key (max -inf)
      inv = alpha / (row_sum[j] * alpha + expf(sink - m));
    }
    T* dst = out + (q_start + token) * a.out_stride_token + head * a.out_stride_head;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = lane + i * kWarpSize;
      if (d < HEAD_SIZE) dst[d] = from_float<T>(acc[j][i] * inv);
    }
  }
}

template <typename T, typename C, int HEAD_SIZE, int ROWS_PER_WARP>
cudaError_t launch(const PrefillAttentionArgs& a, cudaStream_t stream) {
  using S = Smem<HEAD_SIZE, ROWS_PER_WARP>;
  const int group = a.num_heads / a.num_kv_heads;
  const int64_t tiles = static_cast<int64_t>(a.num_tokens) * group / S::kRows + a.num_seqs;
  if (tiles > 0x7fffffff || a.num_kv_heads > kMaxGridYZ) return cudaErrorInvalidValue;
  constexpr size_t smem = S::kBytes;
  auto kernel = prefill_kernel<T, C, HEAD_SIZE, ROWS_PER_WARP>;
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  kernel<<<dim3(static_cast<unsigned>(tiles), a.num_kv_heads), kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, typename C>
cudaError_t dispatch_head(const PrefillAttentionArgs& a, cudaStream_t stream) {
  if (a.rows_per_warp == 4)  // the smaller tile, for head 256 on 99 KiB devices only
    return a.head_size == 256 ? launch<T, C, 256, 4>(a, stream) : cudaErrorInvalidValue;
  if (a.rows_per_warp != 8) return cudaErrorInvalidValue;
  switch (a.head_size) {
    case 64: return launch<T, C, 64, 8>(a, stream);
    case 80: return launch<T, C, 80, 8>(a, stream);
    case 96: return launch<T, C, 96, 8>(a, stream);
    case 128: return launch<T, C, 128, 8>(a, stream);
    case 256: return launch<T, C, 256, 8>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t dispatch_cache(const PrefillAttentionArgs& a, cudaStream_t stream) {
  return a.kv_int8 ? dispatch_head<T, int8_t>(a, stream) : dispatch_head<T, T>(a, stream);
}

}  // namespace

cudaError_t paged_prefill_attention(const PrefillAttentionArgs& args, cudaStream_t stream) {
  if (args.num_seqs == 0 || args.num_tokens == 0) return cudaSuccess;
  if (args.num_kv_heads <= 0 || args.num_heads % args.num_kv_heads != 0 || args.block_size <= 0)
    return cudaErrorInvalidValue;
  switch (args.dtype) {
    case DType::kFloat32: return dispatch_cache<float>(args, stream);
    case DType::kFloat16: return dispatch_cache<__half>(args, stream);
    case DType::kBFloat16: return dispatch_cache<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagedserve::cuda
