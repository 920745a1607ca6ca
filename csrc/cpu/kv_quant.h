// int8 KV cache rows for the CPU kernels: each token row of a cache block holds head_size int8
// values, then the row's fp16 scale in its last 2 bytes (ops/reference/kv_quant.py is the
// contract: scale = fp16(absmax / 127), q = clamp(round_half_even(x / scale), -127, 127), q = 0
// where the scale is 0; read back as q * scale in fp32). Float caches hold the model dtype as is.
#pragma once

#include <c10/util/Half.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

namespace pagedserve::cpu::kvq {

constexpr int64_t kScaleBytes = 2;
constexpr float kQMax = 127.f;

// Elements of C per cache row of `head_size` values.
template <typename C>
constexpr int64_t row_elems(int64_t head_size) {
  return std::is_same_v<C, int8_t> ? head_size + kScaleBytes : head_size;
}

// Eight int8 values as one fp32 vector: sign-extend and convert (vpmovsxbd + vcvtdq2ps on AVX2;
// GCC scalarizes the generic int8 -> float vector conversion, slower than reading fp32 rows).
inline vec::Vec widen8(const int8_t* p) {
#if defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  vec::Vec v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#else
  vec::Vec v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline float row_scale(const int8_t* row, int64_t dim) {
  uint16_t bits;
  std::memcpy(&bits, row + dim, sizeof bits);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// dim values of one cache row as fp32 into dst (dequantized for int8, widened for bf16/fp16).
template <typename C>
inline void load_row(float* dst, const C* row, int64_t dim) {
  if constexpr (std::is_same_v<C, int8_t>) {
    const float s = row_scale(row, dim);
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) vec::store(dst + i, widen8(row + i) * s);
    for (; i < dim; ++i) dst[i] = static_cast<float>(row[i]) * s;
  } else if constexpr (std::is_same_v<C, float>) {
    std::memcpy(dst, row, dim * sizeof(float));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) dst[i] = static_cast<float>(row[i]);
  }
}

// One row of T into an int8 cache row (values, then the fp16 scale).
template <typename T>
inline void quantize_row(int8_t* dst, const T* src, int64_t dim) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(static_cast<float>(src[i])));
  const c10::Half half_scale(amax / kQMax);
  const float s = static_cast<float>(half_scale);
  if (s > 0.f) {
    for (int64_t i = 0; i < dim; ++i) {
      const float q = std::nearbyint(static_cast<float>(src[i]) / s);  // round half to even, as torch.round
      dst[i] = static_cast<int8_t>(std::clamp(q, -kQMax, kQMax));
    }
  } else {
    std::memset(dst, 0, dim);
  }
  const uint16_t bits = half_scale.x;
  std::memcpy(dst + dim, &bits, sizeof bits);
}

// One row of T stored into a cache row of C: a copy for a float cache of T, quantized for int8.
template <typename T, typename C>
inline void store_row(C* dst, const T* src, int64_t dim) {
  if constexpr (std::is_same_v<C, int8_t>) {
    quantize_row(dst, src, dim);
  } else {
    static_assert(std::is_same_v<C, T>, "a float cache holds the model dtype");
    std::memcpy(dst, src, dim * sizeof(T));
  }
}

}  // namespace pagedserve::cpu::kvq
