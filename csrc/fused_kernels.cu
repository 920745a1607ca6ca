// Fused decoder-layer kernels on CUDA: RMSNorm (plain and with the residual add, in place),
// SiLU-and-mul, and rotary embedding fused with the K/V cache write. fp32 math; results are rounded
// to the tensor dtype where HF Llama rounds (residual sum, normalized row, SiLU output), as the CPU
// kernels and the torch reference do. The cache write quantizes into an int8 cache (kv_quant.cuh);
// a slot past the cache is skipped and flagged.
#include <cstdint>

#include "dtype_utils.cuh"
#include "kv_quant.cuh"
#include "ops.h"

namespace pagedserve::cuda {
namespace {

constexpr int kNormThreads = 256;

// Sum over the CTA (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float x) {
  __shared__ float partial[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  x = warp_sum(x);
  if (lane == 0) partial[warp] = x;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < warps; ++w) total += partial[w];
  return total;
}

// One CTA per row. With a residual: residual = T(x + residual) first, and the norm is of that sum.
template <typename T, bool kAddResidual>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(T* out, const T* x, T* residual, const T* weight,
                                                                int hidden, int64_t out_stride, int64_t x_stride,
                                                                int64_t residual_stride, float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  T* rr = kAddResidual ? residual + row * residual_stride : nullptr;
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = to_float(xr[i]);
    if constexpr (kAddResidual) {
      const T sum = from_float<T>(v + to_float(rr[i]));
      rr[i] = sum;  // read back below by this same thread only
      v = to_float(sum);
    }
    sum_sq += v * v;
  }
  const float inv = rsqrtf(block_sum(sum_sq) / static_cast<float>(hidden) + eps);
  T* o = out + row * out_stride;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = kAddResidual ? to_float(rr[i]) : to_float(xr[i]);
    o[i] = from_float<T>(to_float(weight[i]) * to_float(from_float<T>(v * inv)));
  }
}

template <typename T>
__global__ void silu_and_mul_kernel(T* out, const T* x, int64_t rows, int width, int64_t out_stride,
                                    int64_t x_stride) {
  const int64_t total = rows * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / width;
    const int c = static_cast<int>(i % width);
    const float g = to_float(x[r * x_stride + c]);
    const float u = to_float(x[r * x_stride + width + c]);
    const T act = from_float<T>(g / (1.f + expf(-g)));
    out[r * out_stride + c] = from_float<T>(to_float(act) * u);
  }
}

// One CTA per token: rotate every q and k head pair (i, i + D/2), then store k and v in the cache.
template <typename T>
__global__ void rope_and_cache_kernel(const RotaryArgs a) {
  const int64_t token = blockIdx.x;
  const int64_t pos = a.positions[token];
  const int half = a.head_size / 2;
  T* query = static_cast<T*>(a.query);
  T* key = static_cast<T*>(a.key);
  if (threadIdx.x == 0 && (pos < 0 || pos >= a.table_rows)) flag_error(a.errors, kBadPosition);
  if (pos >= 0 && pos < a.table_rows) {  // out-of-table positions (never made by the engine) stay put, flagged
    const float* cos = a.cos_sin + pos * a.head_size;
    const float* sin = cos + half;
    const int pairs = (a.num_heads + a.num_kv_heads) * half;
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
      const int head = i / half, j = i % half;
      T* x = head < a.num_heads ? query + token * a.q_stride_token + head * a.q_stride_head
                                : key + token * a.k_stride_token + (head - a.num_heads) * a.k_stride_head;
      const float x0 = to_float(x[j]), x1 = to_float(x[j + half]);
      x[j] = from_float<T>(x0 * cos[j] - x1 * sin[j]);
      x[j + half] = from_float<T>(x1 * cos[j] + x0 * sin[j]);
    }
  }
  if (a.key_cache == nullptr) return;
  const int64_t slot = a.slot_mapping[token];
  if (slot < 0) return;  // padding token
  if (slot >= a.num_blocks * a.block_size) {
    if (threadIdx.x == 0) flag_error(a.errors, kBadSlot);
    return;
  }
  __syncthreads();  // the rotated key is complete before it is copied
  const T* value = static_cast<const T*>(a.value);
  if (a.kv_int8) {  // one warp per KV head quantizes its K and V rows (blockDim is a multiple of 32)
    const int row = a.head_size + kScaleBytes, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t block = slot / a.block_size, offset = slot % a.block_size;
    for (int head = warp; head < a.num_kv_heads; head += blockDim.x / 32) {
      const int64_t dst = ((block * a.num_kv_heads + head) * a.block_size + offset) * row;
      quantize_row_warp(static_cast<int8_t*>(a.key_cache) + dst, key + token * a.k_stride_token + head * a.k_stride_head,
                        a.head_size, lane);
      quantize_row_warp(static_cast<int8_t*>(a.value_cache) + dst,
                        value + token * a.v_stride_token + head * a.v_stride_head, a.head_size, lane);
    }
    return;
  }
  T* key_cache = static_cast<T*>(a.key_cache);
  T* value_cache = static_cast<T*>(a.value_cache);
  const int64_t block = slot / a.block_size, offset = slot % a.block_size;
  for (int i = threadIdx.x; i < a.num_kv_heads * a.head_size; i += blockDim.x) {
    const int head = i / a.head_size, d = i % a.head_size;
    const int64_t dst = ((block * a.num_kv_heads + head) * a.block_size + offset) * a.head_size + d;
    key_cache[dst] = key[token * a.k_stride_token + head * a.k_stride_head + d];
    value_cache[dst] = value[token * a.v_stride_token + head * a.v_stride_head + d];
  }
}

template <typename F>
cudaError_t by_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); break;
    case DType::kFloat16: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t rms_norm(void* out, const void* x, void* residual, const void* weight, int64_t rows, int hidden,
                     int64_t out_stride, int64_t x_stride, int64_t residual_stride, float eps, DType dtype,
                     cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(rows));
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (residual != nullptr) {
      rms_norm_kernel<T, true><<<grid, kNormThreads, 0, stream>>>(
          static_cast<T*>(out), static_cast<const T*>(x), static_cast<T*>(residual), static_cast<const T*>(weight),
          hidden, out_stride, x_stride, residual_stride, eps);
    } else {
      rms_norm_kernel<T, false><<<grid, kNormThreads, 0, stream>>>(
          static_cast<T*>(out), static_cast<const T*>(x), nullptr, static_cast<const T*>(weight), hidden,
          out_stride, x_stride, 0, eps);
    }
  });
}

cudaError_t silu_and_mul(void* out, const void* x, int64_t rows, int width, int64_t out_stride, int64_t x_stride,
                         DType dtype, cudaStream_t stream) {
  const int64_t total = rows * width;
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  const dim3 grid(static_cast<unsigned>(blocks < 65536 ? blocks : 65536));
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_kernel<T><<<grid, threads, 0, stream>>>(static_cast<T*>(out), static_cast<const T*>(x), rows, width,
                                                         out_stride, x_stride);
  });
}

cudaError_t rotary_embedding_and_cache(const RotaryArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  if (args.num_tokens > 0x7fffffff || args.head_size % 2 != 0) return cudaErrorInvalidValue;
  const int pairs = (args.num_heads + args.num_kv_heads) * args.head_size / 2;
  const int threads = pairs >= 512 ? 512 : ((pairs + 31) / 32) * 32;
  return by_dtype(args.dtype, [&](auto tag) {
    rope_and_cache_kernel<decltype(tag)><<<static_cast<unsigned>(args.num_tokens), threads, 0, stream>>>(args);
  });
}

}  // namespace pagedserve::cuda
