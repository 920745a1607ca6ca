// int8 KV cache rows on CUDA, the contract of ops/reference/kv_quant.py (and csrc/cpu/kv_quant.h):
// a row holds head_size int8 values, then its fp16 scale in the last 2 bytes; scale =
// fp16(absmax / 127), q = clamp(round_half_even(x / scale), -127, 127), q = 0 where the scale is 0;
// read back as float(q) * float(scale). Divisions are IEEE round-to-nearest (__fdiv_rn), so the
// bytes match the reference whatever the fast-math flags. Plus the error-flag store.
#pragma once

#include <cstdint>
#include <type_traits>

#include "dtype_utils.cuh"
#include "ops.h"

namespace pagedserve::cuda {

constexpr int kScaleBytes = 2;
constexpr float kQMax = 127.f;

template <typename C>
constexpr bool is_int8_v = std::is_same_v<C, int8_t>;

// Elements of C per cache row of HEAD_SIZE values.
template <typename C, int HEAD_SIZE>
__host__ __device__ constexpr int row_elems() { return is_int8_v<C> ? HEAD_SIZE + kScaleBytes : HEAD_SIZE; }

// The fp16 scale of an int8 row (rows start at even byte offsets, so the load is aligned).
__device__ __forceinline__ float row_scale(const int8_t* row, int head_size) {
  return __half2float(*reinterpret_cast<const __half*>(row + head_size));
}

// Element d of a cache row as fp32: dequantized with the row's scale for int8, widened otherwise.
template <typename C>
__device__ __forceinline__ float load_elem(const C* row, int d, float scale) {
  if constexpr (is_int8_v<C>) {
    return static_cast<float>(row[d]) * scale;
  } else {
    return to_float(row[d]);
  }
}

template <typename C>
__device__ __forceinline__ float scale_of(const C* row, int head_size) {
  if constexpr (is_int8_v<C>) {
    return row_scale(row, head_size);
  } else {
    return 1.f;
  }
}

// One row of T quantized into an int8 cache row by one whole warp (lanes stride over dims).
template <typename T>
__device__ void quantize_row_warp(int8_t* dst, const T* src, int head_size, int lane) {
  float amax = 0.f;
  for (int d = lane; d < head_size; d += 32) amax = fmaxf(amax, fabsf(to_float(src[d])));
  amax = warp_max(amax);
  const __half half_scale = __float2half_rn(__fdiv_rn(amax, kQMax));
  const float s = __half2float(half_scale);
  for (int d = lane; d < head_size; d += 32) {
    float q = 0.f;
    if (s > 0.f) q = fminf(fmaxf(rintf(__fdiv_rn(to_float(src[d]), s)), -kQMax), kQMax);  // rint: half to even
    dst[d] = static_cast<int8_t>(q);
  }
  if (lane == 0) *reinterpret_cast<__half*>(dst + head_size) = half_scale;
}

// Record that a kernel skipped work on a bad index (read by ops/device_errors.py).
__device__ __forceinline__ void flag_error(unsigned char* errors, ErrorKind kind) {
  if (errors != nullptr) reinterpret_cast<volatile unsigned char*>(errors)[kind] = 1;
}

}  // namespace pagedserve::cuda
