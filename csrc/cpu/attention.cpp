// CPU decode paged attention: one task per (sequence, kv head), online softmax over K/V blocks.
//
// Every K or V row is read (and widened to fp32) once and used by all query heads of its
// GQA group. Inner loops are `omp simd` so the compiler vectorizes them without -ffast-math.
// An int8 cache (rows of head_size values and an fp16 scale, kv_quant.h) is dequantized a row at
// a time into the same fp32 scratch the bf16/fp16 rows are widened into; on AVX-512 blocks of 16
// tokens of an int8 cache take a register-blocked path instead (block_i8_avx512; on AVX2,
// block_i8_avx2, for head sizes 64 / 80 / 96 / 128 and any GQA group).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv_quant.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

struct Shape {
  int64_t num_heads, num_kv_heads, head_size, row_elems, block_size, num_blocks, max_blocks;
  int64_t q_stride_seq, q_stride_head, out_stride_seq, out_stride_head;
  float scale;
  int64_t window;  // tokens a query sees, itself included; 0: all of its context
  const float* sinks;  // [num_heads] fp32 logits that join each head's softmax denominator; null: none
};

// Two independent 8-wide FMA chains, then one shuffle-tree horizontal sum.
inline float dot(const float* a, const float* b, int64_t n) {
  vec::Vec acc0{}, acc1{};
  int64_t i = 0;
  for (; i + 2 * vec::kWidth <= n; i += 2 * vec::kWidth) {
    acc0 += vec::load(a + i) * vec::load(b + i);
    acc1 += vec::load(a + i + vec::kWidth) * vec::load(b + i + vec::kWidth);
  }
  for (; i + vec::kWidth <= n; i += vec::kWidth) acc0 += vec::load(a + i) * vec::load(b + i);
  float s = vec::hsum(acc0 + acc1);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// int8 rows (kv_quant.h) are used where they lie: 8 values widened per vector inside the dot and
// the axpy, the row's scale applied once to the logit (K) or to the weight (V).
inline vec::Vec load_i8(const int8_t* p) { return kvq::widen8(p); }

inline float dot_i8(const float* a, const int8_t* b, int64_t n) {
  vec::Vec acc0{}, acc1{};
  int64_t i = 0;
  for (; i + 2 * vec::kWidth <= n; i += 2 * vec::kWidth) {
    acc0 += vec::load(a + i) * load_i8(b + i);
    acc1 += vec::load(a + i + vec::kWidth) * load_i8(b + i + vec::kWidth);
  }
  for (; i + vec::kWidth <= n; i += vec::kWidth) acc0 += vec::load(a + i) * load_i8(b + i);
  float s = vec::hsum(acc0 + acc1);
  for (; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

// y += a0 * x0 + a1 * x1 over int8 rows (x1 may be null: one row).
inline void axpy2_i8(float* y, float a0, const int8_t* x0, float a1, const int8_t* x1, int64_t n) {
  const vec::Vec w0 = vec::splat(a0), w1 = vec::splat(a1);
  int64_t i = 0;
  for (; i + vec::kWidth <= n; i += vec::kWidth) {
    vec::Vec acc = vec::load(y + i) + w0 * load_i8(x0 + i);
    if (x1) acc += w1 * load_i8(x1 + i);
    vec::store(y + i, acc);
  }
  for (; i < n; ++i) y[i] += a0 * static_cast<float>(x0[i]) + (x1 ? a1 * static_cast<float>(x1[i]) : 0.f);
}

// Touch the next block's K and V so they stream in while this block is computed: blocks are
// scattered, so the hardware prefetcher restarts at every block boundary.
//
// Into L2, not L1 (locality 1, `prefetcht2`): a prefetch into L1 holds one of the core's few L1
// miss buffers until its line arrives from DRAM, and with two blocks in flight those ran out, so
// the prefetches themselves stalled the loop. Into L2 the same kernel reads more bytes per second
// (benchmarks/kernels/kernel_bench.py --kernels decode).
constexpr int kLocality = 1;

template <typename T>
inline void prefetch_block(const T* k, const T* v, int64_t elems) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t i = 0; i < elems; i += kLine) {
    __builtin_prefetch(k + i, 0, kLocality);
    __builtin_prefetch(v + i, 0, kLocality);
  }
}

// Touch `elems` contiguous cache elements (a row or two of a later block) so they stream in.
template <typename T>
inline void prefetch_rows(const T* p, int64_t elems) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t i = 0; i < elems; i += kLine) __builtin_prefetch(p + i, 0, kLocality);
}

// K/V elements below which one call runs on a single thread.
constexpr int64_t kMinParallelElems = 128 * 1024;

// How many blocks ahead to prefetch: far enough to hide a TLB miss plus the fetch of a
// scattered block, near enough to stay in L2 until used.
constexpr int64_t kPrefetchAhead = 2;

inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// Two tokens per pass over the accumulator: half the load/store traffic on `y`.
inline void axpy2(float* y, float a0, const float* x0, float a1, const float* x1, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a0 * x0[i] + a1 * x1[i];
}

inline void scale_in_place(float* y, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// A row of the cache as fp32: the row itself for float, else widened (or dequantized) into `buf`.
template <typename C>
inline const float* as_float(const C* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<C, float>) {
    return src;
  } else {
    kvq::load_row(buf, src, n);
    return buf;
  }
}

// Softmax bookkeeping for one block: turns logits into weights, rescales earlier sums.
inline void online_softmax_step(float* logits, int64_t n, float& running_max, float& running_sum,
                                float* acc, int64_t head_size) {
  float block_max = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, logits[t]);
  const float new_max = std::max(running_max, block_max);
  if (new_max > running_max) {
    const float alpha = std::exp(running_max - new_max);  // exp(-inf) == 0 on the first block
    running_sum *= alpha;
    scale_in_place(acc, alpha, head_size);
    running_max = new_max;
  }
  // Vectorized exp: scalar std::exp was most of the kernel's time at SmolLM2's head size 64.
  const vec::Vec m = vec::splat(new_max);
  vec::Vec total{};
  int64_t t = 0;
  for (; t + vec::kWidth <= n; t += vec::kWidth) {
    const vec::Vec e = vec::exp(vec::load(logits + t) - m);
    vec::store(logits + t, e);
    total += e;
  }
  running_sum += vec::hsum(total);
  for (; t < n; ++t) {
    logits[t] = std::exp(logits[t] - new_max);
    running_sum += logits[t];
  }
}

// The first context position the query (at context_len - 1) sees: past the sliding window's
// start, or 0 without one (transformers' sliding mask: key p is seen from query q when p > q - W).
inline int64_t window_start(int64_t context_len, const Shape& s) {
  return s.window > 0 ? std::max<int64_t>(0, context_len - s.window) : 0;
}

// The first blocks of a task, fetched while the task before it runs (nothing else would warm them).
template <typename C>
inline void prefetch_start(const C* key_cache, const C* value_cache, const int32_t* table, int64_t context_len,
                           int64_t kv_head, const Shape& s) {
  const int64_t used = std::min(s.max_blocks, (context_len + s.block_size - 1) / s.block_size);
  const int64_t first_block = window_start(context_len, s) / s.block_size;
  for (int64_t b = first_block; b < std::min(used, first_block + kPrefetchAhead); ++b) {
    if (table[b] < 0 || table[b] >= s.num_blocks) continue;
    const int64_t first = (static_cast<int64_t>(table[b]) * s.num_kv_heads + kv_head) * s.block_size * s.row_elems;
    prefetch_block(key_cache + first, value_cache + first, s.block_size * s.row_elems);
  }
}

#if defined(__AVX512F__)
// Sixteen 16-lane vectors v[0..15] -> one vector whose lane t is the sum of v[t]'s lanes: a
// transposing tree of adds (~3 operations per vector) instead of a horizontal sum per vector.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
    c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // c[j], 128-bit lane L: the sums of lane L of v[4j], ..., v[4j+3], in that order.
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// 16 int8 cache values as fp32.
inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// exp of 16 lanes: vec::exp's range clamp and polynomial, lane for lane.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(127.5f));
  const __m512i biased = _mm512_cvttps_epi32(t);
  const __m512 n = _mm512_sub_ps(_mm512_cvtepi32_ps(biased), _mm512_set1_ps(127.f));
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(biased, 23)));
}

// 16 fp16 row scales (the last 2 bytes of each of n <= 16 int8 rows, `rs` apart) as fp32; 0 past n.
inline __m512 row_scales16(const int8_t* rows, int64_t n, int64_t rs, int64_t dim) {
  alignas(32) uint16_t bits[16] = {};
  for (int64_t t = 0; t < n; ++t) std::memcpy(&bits[t], rows + t * rs + dim, sizeof(uint16_t));
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(bits)));
}

// One block (n <= 16 tokens) of an int8 cache for a GQA group of G heads, head size 16 * NV, in
// 512-bit registers: each K and V row is widened once for all G heads (the generic loop widens
// it per head), the G x n dot products are reduced by one transposing tree per head, the online
// softmax runs on the block's 16 logits of a head at once, and the G output accumulators stay in
// registers across the block's V rows (rescaled there when a head's max grows).
template <int NV, int G>
void block_i8_avx512(const float* q, const int8_t* k_rows, const int8_t* v_rows, int64_t n, int64_t rs,
                     const int8_t* next_k, const int8_t* next_v, float* logits, float* maxes, float* sums,
                     float* acc) {
  constexpr int64_t dim = 16 * NV;
  __m512 qv[G][NV];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < NV; ++j) qv[h][j] = _mm512_loadu_ps(q + h * dim + 16 * j);
  __m512 part[G][16];
  for (int64_t t = 0; t < 16; ++t) {
    if (t >= n) {
      for (int h = 0; h < G; ++h) part[h][t] = _mm512_setzero_ps();
      continue;
    }
    const int8_t* k = k_rows + t * rs;
    __m512 kv[NV];
    for (int j = 0; j < NV; ++j) kv[j] = widen16(k + 16 * j);
    for (int h = 0; h < G; ++h) {
      __m512 a = _mm512_mul_ps(qv[h][0], kv[0]);
      for (int j = 1; j < NV; ++j) a = _mm512_fmadd_ps(qv[h][j], kv[j], a);
      part[h][t] = a;
    }
    if (next_k) prefetch_rows(next_k + t * rs, rs);
  }
  const __mmask16 valid = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  const __m512 k_scales = row_scales16(k_rows, n, rs, dim), v_scales = row_scales16(v_rows, n, rs, dim);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 alpha[G];
  for (int h = 0; h < G; ++h) {
    const __m512 l = _mm512_mask_mul_ps(neg_inf, valid, sum_lanes16(part[h]), k_scales);
    const float new_max = std::max(maxes[h], _mm512_reduce_max_ps(l));
    alpha[h] = _mm512_set1_ps(1.f);
    if (new_max > maxes[h]) {
      const float a = std::exp(maxes[h] - new_max);  // exp(-inf) == 0 on the first block
      sums[h] *= a;
      alpha[h] = _mm512_set1_ps(a);
      maxes[h] = new_max;
    }
    const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(l, _mm512_set1_ps(new_max))));
    sums[h] += _mm512_reduce_add_ps(e);
    _mm512_storeu_ps(logits + h * 16, _mm512_mul_ps(e, v_scales));  // the V rows' weights, their scales folded in
  }
  __m512 av[G][NV];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < NV; ++j) av[h][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * dim + 16 * j), alpha[h]);
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* v = v_rows + t * rs;
    __m512 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = widen16(v + 16 * j);
    for (int h = 0; h < G; ++h) {
      const __m512 w = _mm512_set1_ps(logits[h * 16 + t]);
      for (int j = 0; j < NV; ++j) av[h][j] = _mm512_fmadd_ps(vv[j], w, av[h][j]);
    }
    if (next_v) prefetch_rows(next_v + t * rs, rs);
  }
  if (next_v)
    for (int64_t t = n; t < 16; ++t) prefetch_rows(next_v + t * rs, rs);
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + h * dim + 16 * j, av[h][j]);
}

using BlockI8 = void (*)(const float*, const int8_t*, const int8_t*, int64_t, int64_t, const int8_t*,
                         const int8_t*, float*, float*, float*, float*);

// The register-blocked int8 block for this shape, or null (then the generic loop): blocks of 16
// tokens, head size 64 or 128, a GQA group small enough for its accumulators to stay in registers.
inline BlockI8 block_i8_kernel(int64_t dim, int64_t group, int64_t block_size) {
  if (block_size != 16) return nullptr;
  if (dim == 64) {
    switch (group) {
      case 1: return &block_i8_avx512<4, 1>;
      case 2: return &block_i8_avx512<4, 2>;
      case 3: return &block_i8_avx512<4, 3>;
      case 4: return &block_i8_avx512<4, 4>;
      case 5: return &block_i8_avx512<4, 5>;
      case 6: return &block_i8_avx512<4, 6>;
      default: return nullptr;
    }
  }
  if (dim == 128) {
    switch (group) {
      case 1: return &block_i8_avx512<8, 1>;
      case 2: return &block_i8_avx512<8, 2>;
      case 3: return &block_i8_avx512<8, 3>;
      default: return nullptr;
    }
  }
  return nullptr;
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Eight 8-lane vectors v[0..7] -> one vector whose lane t is the sum of v[t]'s lanes (a tree of
// horizontal adds, then the two 128-bit halves added).
inline __m256 sum_lanes8(const __m256* v) {
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// 8 int8 cache values as fp32.
inline __m256 widen8_ps(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The fp16 scales of rows [t0, t0 + 8) of n int8 rows `rs` apart, as fp32; 0 past n.
inline __m256 row_scales8(const int8_t* rows, int64_t t0, int64_t n, int64_t rs, int64_t dim) {
  alignas(16) uint16_t bits[8] = {};
  for (int64_t t = t0; t < std::min(n, t0 + 8); ++t) std::memcpy(&bits[t - t0], rows + t * rs + dim, sizeof(uint16_t));
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(bits)));
}

// The largest / the sum of a vector's eight lanes.
inline float max_lanes8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

inline float add_lanes8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

inline __m256 exp8(__m256 x) {
  vec::Vec v;
  std::memcpy(&v, &x, sizeof v);
  v = vec::exp(v);
  std::memcpy(&x, &v, sizeof v);
  return x;
}

// One block (n <= 16 tokens) of an int8 cache for HG <= 4 heads of a GQA group, head size 8 * NV, in
// 256-bit registers: each K row is widened once for the HG heads, TT rows at a time (TT * HG independent
// FMA chains); the dot products' partial vectors are reduced eight tokens at once (sum_lanes8); the
// online softmax runs on eight logits per vector; V rows are widened once per J-vector slice of the
// head, whose HG x J accumulators stay in registers across the block's rows.
template <int NV, int HG>
void block_i8_avx2(const float* q, const int8_t* k_rows, const int8_t* v_rows, int64_t n, int64_t rs,
                   const int8_t* next_k, const int8_t* next_v, float* maxes, float* sums, float* acc) {
  constexpr int64_t dim = 8 * NV;
  constexpr int TT = HG == 1 ? 8 : HG == 4 ? 2 : 4;
  constexpr int J = HG == 1 ? (NV % 8 == 0 ? 8 : NV % 4 == 0 ? 4 : 2) : HG == 2 && NV % 4 == 0 ? 4 : 2;
  static_assert(NV % J == 0 && 16 % TT == 0, "block_i8_avx2 tiling");
  const int64_t halves = n > 8 ? 2 : 1;  // eight-token halves of the block holding its rows
  __m256 part[HG][16];  // per head and token: the dot product's eight partial sums
  for (int64_t t0 = 0; t0 < 8 * halves; t0 += TT) {
    const int8_t* kr[TT];
    for (int tt = 0; tt < TT; ++tt) kr[tt] = k_rows + std::min<int64_t>(t0 + tt, n - 1) * rs;  // past n: masked
    __m256 a[TT][HG];
    for (int tt = 0; tt < TT; ++tt)
      for (int h = 0; h < HG; ++h) a[tt][h] = _mm256_setzero_ps();
    for (int j = 0; j < NV; ++j)
      for (int tt = 0; tt < TT; ++tt) {
        const __m256 kv = widen8_ps(kr[tt] + 8 * j);
        for (int h = 0; h < HG; ++h) a[tt][h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dim + 8 * j), kv, a[tt][h]);
      }
    for (int tt = 0; tt < TT; ++tt)
      for (int h = 0; h < HG; ++h) part[h][t0 + tt] = a[tt][h];
    if (next_k)
      for (int tt = 0; tt < TT; ++tt) prefetch_rows(next_k + (t0 + tt) * rs, rs);
  }
  if (next_k && halves == 1)
    for (int64_t t = 8; t < 16; ++t) prefetch_rows(next_k + t * rs, rs);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 lane = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  const __m256 valid[2] = {_mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ),
                           _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n - 8)), _CMP_LT_OQ)};
  const __m256 k_scales[2] = {row_scales8(k_rows, 0, n, rs, dim), row_scales8(k_rows, 8, n, rs, dim)};
  const __m256 v_scales[2] = {row_scales8(v_rows, 0, n, rs, dim), row_scales8(v_rows, 8, n, rs, dim)};
  alignas(32) float weights[HG][16];
  __m256 alpha[HG];
  for (int h = 0; h < HG; ++h) {
    __m256 l[2] = {neg_inf, neg_inf};
    for (int64_t i = 0; i < halves; ++i)
      l[i] = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(sum_lanes8(part[h] + 8 * i), k_scales[i]), valid[i]);
    const float block_max = max_lanes8(_mm256_max_ps(l[0], l[1]));
    const float new_max = std::max(maxes[h], block_max);
    alpha[h] = _mm256_set1_ps(1.f);
    if (new_max > maxes[h]) {
      const float a = std::exp(maxes[h] - new_max);  // exp(-inf) == 0 on the first block
      sums[h] *= a;
      alpha[h] = _mm256_set1_ps(a);
      maxes[h] = new_max;
    }
    const __m256 m = _mm256_set1_ps(new_max);
    __m256 total = _mm256_setzero_ps();
    for (int64_t i = 0; i < 2; ++i) {
      const __m256 e = i < halves ? _mm256_and_ps(valid[i], exp8(_mm256_sub_ps(l[i], m))) : _mm256_setzero_ps();
      total = _mm256_add_ps(total, e);
      _mm256_store_ps(weights[h] + 8 * i, _mm256_mul_ps(e, v_scales[i]));  // the V rows' scales folded in
    }
    sums[h] += add_lanes8(total);
  }
  for (int j0 = 0; j0 < NV; j0 += J) {
    __m256 av[HG][J];
    for (int h = 0; h < HG; ++h)
      for (int j = 0; j < J; ++j) av[h][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * dim + 8 * (j0 + j)), alpha[h]);
    for (int64_t t = 0; t < n; ++t) {
      const int8_t* v = v_rows + t * rs + 8 * j0;
      __m256 w[HG];
      for (int h = 0; h < HG; ++h) w[h] = _mm256_broadcast_ss(&weights[h][t]);
      for (int j = 0; j < J; ++j) {
        const __m256 vv = widen8_ps(v + 8 * j);
        for (int h = 0; h < HG; ++h) av[h][j] = _mm256_fmadd_ps(vv, w[h], av[h][j]);
      }
      if (next_v && j0 == 0) prefetch_rows(next_v + t * rs, rs);
    }
    for (int h = 0; h < HG; ++h)
      for (int j = 0; j < J; ++j) _mm256_storeu_ps(acc + h * dim + 8 * (j0 + j), av[h][j]);
  }
  if (next_v)
    for (int64_t t = n; t < 16; ++t) prefetch_rows(next_v + t * rs, rs);
}

using BlockI8x8 = void (*)(const float*, const int8_t*, const int8_t*, int64_t, int64_t, const int8_t*,
                           const int8_t*, float*, float*, float*);

template <int NV>
constexpr BlockI8x8 kBlockI8x8[4] = {&block_i8_avx2<NV, 1>, &block_i8_avx2<NV, 2>, &block_i8_avx2<NV, 3>,
                                     &block_i8_avx2<NV, 4>};

// The 256-bit register-blocked int8 kernels for this head size (index: heads per call - 1), or null (then
// the generic loop): blocks of 16 tokens, head size 64, 80, 96 or 128; a group of more than four heads
// runs four at a time.
inline const BlockI8x8* block_i8x8_kernels(int64_t dim, int64_t block_size) {
  if (block_size != 16) return nullptr;
  switch (dim) {
    case 64: return kBlockI8x8<8>;
    case 80: return kBlockI8x8<10>;
    case 96: return kBlockI8x8<12>;
    case 128: return kBlockI8x8<16>;
    default: return nullptr;
  }
}
#define PAGEDSERVE_BLOCK_I8_AVX2 1
#endif

// T: the query/out dtype; C: the cache element (T, or int8_t for a quantized cache).
template <typename T, typename C>
void attend_group(T* out, const T* query, const C* key_cache, const C* value_cache, const int32_t* table,
                  int64_t context_len, int64_t kv_head, const Shape& s, std::vector<float>& work) {
  const int64_t group = s.num_heads / s.num_kv_heads, dim = s.head_size, bs = s.block_size, rs = s.row_elems;
  work.assign(2 * group * dim + 2 * dim + group * bs + 2 * group, 0.f);
  float* q = work.data();
  float* acc = q + group * dim;
  float* row = acc + group * dim;
  float* logits = row + 2 * dim;  // row holds two widened K/V rows
  float* maxes = logits + group * bs;
  float* sums = maxes + group;
  for (int64_t h = 0; h < group; ++h) {
    const T* src = query + (kv_head * group + h) * s.q_stride_head;
    for (int64_t d = 0; d < dim; ++d) q[h * dim + d] = static_cast<float>(src[d]) * s.scale;
    maxes[h] = -std::numeric_limits<float>::infinity();
  }
  const int64_t num_used = std::min(s.max_blocks, (context_len + bs - 1) / bs);
  // A sliding window: the blocks wholly before it are never read (nor checked: they may be freed),
  // and the rows of the first one before the window's start are skipped.
  const int64_t start = window_start(context_len, s), first_block = start / bs;
#if defined(__AVX512F__)
  [[maybe_unused]] BlockI8 fast = nullptr;
  if constexpr (std::is_same_v<C, int8_t>) fast = block_i8_kernel(dim, group, bs);
#endif
#if defined(PAGEDSERVE_BLOCK_I8_AVX2)
  [[maybe_unused]] const BlockI8x8* fast8 = nullptr;
  if constexpr (std::is_same_v<C, int8_t>) fast8 = block_i8x8_kernels(dim, bs);
#if defined(__AVX512F__)
  if (fast) fast8 = nullptr;
#endif
#endif
  for (int64_t b = first_block + 1; b < std::min(num_used, first_block + kPrefetchAhead); ++b) {
    const int64_t first = (static_cast<int64_t>(table[b]) * s.num_kv_heads + kv_head) * bs * rs;
    if (table[b] >= 0 && table[b] < s.num_blocks) prefetch_block(key_cache + first, value_cache + first, bs * rs);
  }
  for (int64_t b = first_block; b < num_used; ++b) {
    const int64_t block = table[b];
    TORCH_CHECK(block >= 0 && block < s.num_blocks, "block table entry ", block, " out of range [0, ",
                s.num_blocks, ")");
    const int64_t skip = b == first_block ? start - b * bs : 0;  // rows before the window
    const int64_t n = std::min(bs, context_len - b * bs) - skip;
    const int64_t base = ((block * s.num_kv_heads + kv_head) * bs + skip) * rs;
    // The block kPrefetchAhead on is fetched a row at a time as this block's rows are used: a
    // whole block at once (128 lines) overflows the miss queue and stalls on the prefetches.
    const C* next_k = nullptr;
    const C* next_v = nullptr;
    if (b + kPrefetchAhead < num_used) {
      const int64_t ahead = table[b + kPrefetchAhead];
      const int64_t next = (ahead * s.num_kv_heads + kv_head) * bs * rs;
      if (ahead >= 0 && ahead < s.num_blocks) next_k = key_cache + next, next_v = value_cache + next;
    }
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<C, int8_t>) {
      if (fast) {
        fast(q, key_cache + base, value_cache + base, n, rs, next_k, next_v, logits, maxes, sums, acc);
        continue;
      }
    }
#endif
#if defined(PAGEDSERVE_BLOCK_I8_AVX2)
    if constexpr (std::is_same_v<C, int8_t>) {
      if (fast8) {
        for (int64_t h0 = 0; h0 < group; h0 += 4) {
          const bool first = h0 == 0;  // the next block is prefetched once
          fast8[std::min<int64_t>(4, group - h0) - 1](q + h0 * dim, key_cache + base, value_cache + base, n, rs,
                                                      first ? next_k : nullptr, first ? next_v : nullptr,
                                                      maxes + h0, sums + h0, acc + h0 * dim);
        }
        continue;
      }
    }
#endif
    for (int64_t t = 0; t < n; ++t) {
      if constexpr (std::is_same_v<C, int8_t>) {
        const int8_t* k = key_cache + base + t * rs;
        const float k_scale = kvq::row_scale(k, dim);
        for (int64_t h = 0; h < group; ++h) logits[h * bs + t] = dot_i8(q + h * dim, k, dim) * k_scale;
      } else {
        const float* k = as_float(key_cache + base + t * rs, row, dim);
        for (int64_t h = 0; h < group; ++h) logits[h * bs + t] = dot(q + h * dim, k, dim);
      }
      if (next_k) prefetch_rows(next_k + t * rs, rs);
    }
    if (next_k)
      for (int64_t t = n; t < bs; ++t) prefetch_rows(next_k + t * rs, rs);
    for (int64_t h = 0; h < group; ++h)
      online_softmax_step(logits + h * bs, n, maxes[h], sums[h], acc + h * dim, dim);
    int64_t t = 0;
    if constexpr (std::is_same_v<C, int8_t>) {
      for (; t < n; t += 2) {
        const int8_t* v0 = value_cache + base + t * rs;
        const int8_t* v1 = t + 1 < n ? v0 + rs : nullptr;
        const float s0 = kvq::row_scale(v0, dim), s1 = v1 ? kvq::row_scale(v1, dim) : 0.f;
        for (int64_t h = 0; h < group; ++h)
          axpy2_i8(acc + h * dim, logits[h * bs + t] * s0, v0, v1 ? logits[h * bs + t + 1] * s1 : 0.f, v1, dim);
        if (next_v) prefetch_rows(next_v + t * rs, 2 * rs);
      }
      t = vec::round_up(n, 2);
    }
    for (; t + 1 < n; t += 2) {
      const float* v0 = as_float(value_cache + base + t * rs, row, dim);
      const float* v1 = as_float(value_cache + base + (t + 1) * rs, row + dim, dim);
      for (int64_t h = 0; h < group; ++h)
        axpy2(acc + h * dim, logits[h * bs + t], v0, logits[h * bs + t + 1], v1, dim);
      if (next_v) prefetch_rows(next_v + t * rs, 2 * rs);
    }
    if (t < n) {
      const float* v = as_float(value_cache + base + t * rs, row, dim);
      for (int64_t h = 0; h < group; ++h) axpy(acc + h * dim, logits[h * bs + t], v, dim);
    }
    if (next_v)
      for (; t < bs; t += 2) prefetch_rows(next_v + t * rs, std::min<int64_t>(2, bs - t) * rs);
  }
  for (int64_t h = 0; h < group; ++h) {
    float inv = sums[h] > 0.f ? 1.f / sums[h] : 0.f;  // empty context -> zeros
    if (s.sinks) {  // the sink's logit joins the denominator (no value): rescale to max(max, sink)
      const float sink = s.sinks[kv_head * group + h], m = std::max(maxes[h], sink);
      const float a = std::exp(maxes[h] - m);  // 0 for an empty context (max -inf)
      inv = a / (sums[h] * a + std::exp(sink - m));
    }
    T* dst = out + (kv_head * group + h) * s.out_stride_head;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[h * dim + d] * inv);
  }
}

template <typename T, typename C>
void run(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
         const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& context_lens,
         const Shape& s) {
  T* out_ptr = static_cast<T*>(out.data_ptr());
  const T* q_ptr = static_cast<const T*>(query.data_ptr());
  const C* k_ptr = static_cast<const C*>(key_cache.data_ptr());
  const C* v_ptr = static_cast<const C*>(value_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t num_seqs = query.size(0), num_tasks = num_seqs * s.num_kv_heads;
  const int64_t capacity = s.max_blocks * s.block_size;
  int64_t total_len = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {  // checked here, not in Python: no per-layer tensor ops
    TORCH_CHECK_VALUE(lens[seq] >= 0 && lens[seq] <= capacity, "context_lens must lie in [0, ", capacity,
                      "] (block_tables width x block_size); got ", lens[seq], " for sequence ", seq);
    total_len += lens[seq] - window_start(lens[seq], s);  // the rows read
  }
  // A small batch (decode of a few short sequences) is done before a second thread would start.
  const bool small = total_len * s.num_kv_heads * s.head_size * 2 < kMinParallelElems;
  // About eight chunks per thread: a chunk's tasks run in order, so each can warm the next one's blocks.
  const int64_t chunk = small ? num_tasks : std::max<int64_t>(1, num_tasks / (8 * at::get_num_threads()));
  parallel_chunks(num_tasks, chunk, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> work;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / s.num_kv_heads, kv_head = task % s.num_kv_heads;
      if (task + 1 < end) {
        const int64_t next = (task + 1) / s.num_kv_heads;
        prefetch_start<C>(k_ptr, v_ptr, tables + next * table_stride, lens[next], (task + 1) % s.num_kv_heads, s);
      }
      attend_group<T, C>(out_ptr + seq * s.out_stride_seq, q_ptr + seq * s.q_stride_seq, k_ptr, v_ptr,
                      tables + seq * table_stride, lens[seq], kv_head, s, work);
    }
  }, num_seqs >= openmp_rows());
}

}  // namespace

void paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, double scale, int64_t window,
                     const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out head dim must be contiguous");
  TORCH_CHECK_VALUE(window >= -1, "window must be -1 or 0 (none) or the tokens a query sees; got ", window);
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  const bool quantized = key_cache.scalar_type() == at::kChar;
  const float* sink_ptr = check_sinks(sinks, query.size(1));
  const Shape s{query.size(1), key_cache.size(1), query.size(2), key_cache.size(3), key_cache.size(2),
                key_cache.size(0), block_tables.size(1), query.stride(0), query.stride(1),
                out.stride(0), out.stride(1), static_cast<float>(scale), std::max<int64_t>(window, 0), sink_ptr};
  const auto go = [&](auto tag) {
    using T = decltype(tag);
    if (quantized) return run<T, int8_t>(out, query, key_cache, value_cache, block_tables, context_lens, s);
    return run<T, T>(out, query, key_cache, value_cache, block_tables, context_lens, s);
  };
  switch (query.scalar_type()) {
    case at::kFloat: return go(float{});
    case at::kBFloat16: return go(c10::BFloat16{});
    case at::kHalf: return go(c10::Half{});
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace pagedserve::cpu
