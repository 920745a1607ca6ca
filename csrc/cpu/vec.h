// Eight-lane fp32 vectors for the CPU kernels, written with GCC/Clang vector extensions.
//
// The compiler lowers them to AVX2/FMA (or AVX-512, NEON, SSE) for the target, so one source
// serves every CPU; with -march=native on an AVX2 machine a `Vec` is one ymm register. Whether
// `acc += a * b` becomes one FMA is the compiler's choice (ops/build.py pins it: contraction on,
// whatever the CPU's tuning); where a result's bits are part of a contract, `fma` says it outright.
// Loads and stores go through memcpy: unaligned, no aliasing issues.
#pragma once

#if defined(__FMA__)
#include <immintrin.h>
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pagedserve::cpu::vec {

constexpr int64_t kWidth = 8;
typedef float Vec __attribute__((vector_size(32)));
typedef int32_t IVec __attribute__((vector_size(32)));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

// p[0..3] in both halves: one 16-byte load broadcast (vbroadcastf128 on AVX), where building the
// vector from lanes loaded 32 bytes (split across cache lines every other time) and shuffled.
inline Vec load4_twice(const float* p) {
  typedef float Vec4 __attribute__((vector_size(16)));
  Vec4 h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_shufflevector(h, h, 0, 1, 2, 3, 0, 1, 2, 3);
}

inline Vec splat(float x) { return Vec{} + x; }

// a * b + c rounded once, in every lane, on any target (an FMA instruction where there is one).
inline Vec fma(Vec a, Vec b, Vec c) {
#if defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  Vec r;
  for (int64_t i = 0; i < kWidth; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#endif
}

// *p in every lane: one vbroadcastss from memory (splat's + 0 costs an add and a register
// broadcast, and keeps -0 from reaching the lanes; this keeps it).
inline Vec broadcast(const float* p) {
  const float x = *p;
  return Vec{x, x, x, x, x, x, x, x};
}

inline Vec vmax(Vec a, Vec b) { return a > b ? a : b; }

// A shuffle tree, not a chain of eight dependent scalar adds.
inline float hsum(Vec v) {
  Vec t = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  t = t + __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5);
  t = t + __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6);
  return t[0];
}

// Whether any lane of a comparison's result (0 or -1 per lane) is set.
inline bool any(IVec mask) {
  uint64_t words[4];
  std::memcpy(words, &mask, sizeof words);
  return (words[0] | words[1] | words[2] | words[3]) != 0;
}

inline float hmax(Vec v) {
  float m = v[0];
  for (int64_t i = 1; i < kWidth; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// exp(x) to ~2 ulp (Cephes' expf polynomial after a log2 range reduction). Inputs below -87.3
// give ~1e-38 rather than 0: callers zero masked lanes themselves.
inline Vec exp(Vec x) {
  x = x < -87.3f ? splat(-87.3f) : x;
  x = x > 88.3f ? splat(88.3f) : x;
  const Vec t = x * 1.44269504088896341f + 127.5f;  // floor(x / ln2 + 0.5) + 127 after truncation
  const IVec biased = __builtin_convertvector(t, IVec);
  const Vec n = __builtin_convertvector(biased, Vec) - 127.f;
  const Vec r = x - n * 0.693359375f - n * -2.12194440e-4f;  // ln2 split in two for exactness
  Vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const IVec bits = biased << 23;
  Vec pow2;
  std::memcpy(&pow2, &bits, sizeof pow2);
  return p * pow2;
}

// n elements of T as fp32 into dst (a plain copy for float).
template <typename T>
inline void widen(float* dst, const T* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// n fp32 elements into dst as T (round to nearest even for bf16/fp16).
template <typename T>
inline void narrow(T* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

}  // namespace pagedserve::cpu::vec
