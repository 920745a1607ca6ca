// Linear layers on Q5_0 / Q5_1 / Q8_0 weights repacked eight rows at a time (Q5_0r8, Q5_1r8, Q8_0r8;
// ops/reference/quant.py: interleave): the Q4 r8 layouts' scheme (quant_interleaved.cpp) for the
// other 32-weight affine formats. Group g = weight rows 8g..8g+7; per 32-weight block one tile of
//
//   d[8] (fp16, one per row), m[8] (fp16, Q5_1 only),
//   Q5: eight 32-bit masks, mask c = 4 half + j holding at bit 4r + i the fifth bit of row r's
//       weight 16 half + 4j + i (the lanes of chunk j's low (half 0) or high (half 1) nibbles),
//   chunks of 32 bytes, chunk j holding row r's packed bytes 4j..4j+3 at bytes 4r..4r+3 (Q5: four
//       chunks of nibbles as Q4's; Q8_0: eight chunks of signed quants, weights 4j..4j+3).
//
// One u8 x s8 multiply-add of a chunk against four activation quants broadcast to every lane leaves
// each row's partial sum in its own lane, as for Q4. A Q5 mask becomes the chunk's 0x10 bytes in one
// masked move (AVX-512BW) or a shuffle-and-compare (AVX2). Q8_0's signed quants: with dot products
// (VNNI) the bytes flipped to w + 128 (unsigned) and 128 times the activation block's integer sum
// subtracted per block; without (maddubs, int16 pairs) |w| times the activation with w's sign. Both
// give the exact integer dot product.
//
// int16 on AVX2 (maddubs): Q5 quants reach 31, so a chunk's low and high products are summed in
// int16 (|sum| <= 2 * 2 * 31 * 127 = 15748) and widened to int32 every chunk; Q8_0's |w| <= 128
// pairs reach 2 * 128 * 127 = 32512 and are widened at once.
//
// Dequantization and bf16 panels read a group's tiles back in GGUF order and take the GGUF-order
// code (quant_blocks.h), so they give its values exactly; the fp32 (exact) rows run those values
// through the fp32 panel kernel (fp32_panels.h).
#include "quant_interleaved_q5q8.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <optional>
#include <vector>

#include "fp32_panels.h"
#include "ops.h"
#include "parallel.h"
#include "prefetch.h"
#include "quant_blocks.h"
#include "quant_int8_amx.h"
#include "r8_asm.h"
#include "r8_lanes.h"
#include "row_passes.h"

namespace pagedserve::cpu {
namespace {

using namespace r8;  // NOLINT: the r8 lane helpers (r8_lanes.h)

using namespace quant;  // NOLINT: the block formats (quant_blocks.h)

constexpr int64_t kRows = 8;  // weight rows per group

template <int64_t F>
constexpr int64_t kTileBytes = kRows * static_cast<int64_t>(sizeof(BlockOf<F>));
template <int64_t F>
constexpr int64_t kHeadBytes = (F == kQuantQ5_1 ? 4 : 2) * kRows;  // the fp16 fields
template <int64_t F>
constexpr int64_t kQuantsAt = kHeadBytes<F> + (kIsQ5<F> ? 32 : 0);
template <int64_t F>
constexpr int kChunks = F == kQuantQ8_0 ? 8 : 4;

// Row r's block of `tile` in GGUF order into blk (sizeof(BlockOf<F>) bytes).
template <int64_t F>
void tile_to_block(const uint8_t* tile, int r, uint8_t* blk) {
  std::memcpy(blk, tile + 2 * r, 2);
  int64_t at = 2;
  if constexpr (F == kQuantQ5_1) {
    std::memcpy(blk + 2, tile + 2 * kRows + 2 * r, 2);
    at = 4;
  }
  if constexpr (kIsQ5<F>) {
    const uint8_t* masks = tile + kHeadBytes<F>;
    const int shift = 4 * (r % 2);
    for (int k = 0; k < 4; ++k) {  // qh byte k: nibbles 2k (bits 8k..8k+3) and 2k + 1
      const int lo = (masks[4 * (2 * k) + r / 2] >> shift) & 0x0F;
      const int hi = (masks[4 * (2 * k + 1) + r / 2] >> shift) & 0x0F;
      blk[at + k] = static_cast<uint8_t>(lo | hi << 4);
    }
    at += 4;
  }
  const uint8_t* quants = tile + kQuantsAt<F>;
  for (int j = 0; j < kChunks<F>; ++j) std::memcpy(blk + at + 4 * j, quants + 32 * j + 4 * r, 4);
}

// Group tiles (nb of them) as eight GGUF-order rows of nb blocks at dst, dst + row_bytes, ...
template <int64_t F>
void group_to_gguf(const uint8_t* tiles, int64_t nb, uint8_t* dst, int64_t row_bytes) {
  constexpr int64_t bsize = sizeof(BlockOf<F>);
  for (int64_t b = 0; b < nb; ++b)
    for (int r = 0; r < kRows; ++r) tile_to_block<F>(tiles + b * kTileBytes<F>, r, dst + r * row_bytes + b * bsize);
}

#if defined(__AVX2__)

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define PAGEDSERVE_R8Q_DOT 1
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#endif

// 0x10 in byte i where bit i of the 32-bit mask at m is set.
inline __m256i fifth256(const uint8_t* m) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  uint32_t bits;
  std::memcpy(&bits, m, 4);
  return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(0x10));
#else
  return fifth_bits(m);
#endif
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDSERVE_R8Q_ZMM 1
inline __m512i fifth512(const uint8_t* m0, const uint8_t* m1) {
  uint32_t lo, hi;
  std::memcpy(&lo, m0, 4);
  std::memcpy(&hi, m1, 4);
  return _mm512_maskz_mov_epi8(static_cast<__mmask64>(lo) | static_cast<__mmask64>(hi) << 32,
                               _mm512_set1_epi8(0x10));
}

// Groups g and g + 1 in 512-bit registers (lanes 0-7 group g, 8-15 group g + 1): every lane runs the
// 256-bit pass's integer sums (exact) and fp32 operations in the same order, so the bits are the same.
template <int64_t F, int M>
void int8_group_pair(const int8_t* q, const float* ad, const float* as, const int32_t* qsum, int64_t nb,
                     const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t g) {
  constexpr int64_t tb = kTileBytes<F>;
  const int64_t k_len = nb * kBlock;
  const uint8_t* tiles0 = w + g * nb * tb;
  const uint8_t* tiles1 = tiles0 + nb * tb;
  __m512 acc[M], macc[M];
  for (int m = 0; m < M; ++m) acc[m] = macc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t0 = tiles0 + b * tb;
    const uint8_t* t1 = tiles1 + b * tb;
    prefetch_ahead(t0, tb);
    prefetch_ahead(t1, tb);
    const __m512 dw = halves_to_ps(t0, t1);
    __m512i sums[M];
    for (int m = 0; m < M; ++m) sums[m] = _mm512_setzero_si512();
    const uint8_t* q0 = t0 + kQuantsAt<F>;
    const uint8_t* q1 = t1 + kQuantsAt<F>;
    if constexpr (F == kQuantQ8_0) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i u = _mm512_xor_si512(load_pair(q0 + 32 * j, q1 + 32 * j), _mm512_set1_epi8(-128));
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) {
          int32_t a4;
          std::memcpy(&a4, q + m * k_len + b * kBlock + 4 * j, 4);
          sums[m] = _mm512_dpbusd_epi32(sums[m], u, _mm512_set1_epi32(a4));
        }
      }
      for (int m = 0; m < M; ++m) sums[m] = _mm512_sub_epi32(sums[m], _mm512_set1_epi32(128 * qsum[m * nb + b]));
    } else {
      const uint8_t* k0 = t0 + kHeadBytes<F>;
      const uint8_t* k1 = t1 + kHeadBytes<F>;
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = load_pair(q0 + 32 * j, q1 + 32 * j);
        const __m512i lo = _mm512_or_si512(_mm512_and_si512(raw, _mm512_set1_epi8(0x0F)),
                                           fifth512(k0 + 4 * j, k1 + 4 * j));
        const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F)),
                                           fifth512(k0 + 16 + 4 * j, k1 + 16 + 4 * j));
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) {
          const int8_t* a = q + m * k_len + b * kBlock;
          int32_t lo4, hi4;
          std::memcpy(&lo4, a + 4 * j, 4);
          std::memcpy(&hi4, a + kBlock / 2 + 4 * j, 4);
          sums[m] = _mm512_dpbusd_epi32(sums[m], lo, _mm512_set1_epi32(lo4));
          sums[m] = _mm512_dpbusd_epi32(sums[m], hi, _mm512_set1_epi32(hi4));
        }
      }
    }
    const __m512 mw = F == kQuantQ5_1 ? halves_to_ps(t0 + 16, t1 + 16) : _mm512_mul_ps(dw, _mm512_set1_ps(-16.f));
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const __m512 dot = _mm512_cvtepi32_ps(sums[m]);
      acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(ad[m * nb + b])), acc[m]);
      if constexpr (F != kQuantQ8_0) macc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(as[m * nb + b]), macc[m]);
    }
  }
  const __m512 vb = bias != nullptr ? _mm512_loadu_ps(bias + g * kRows) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) {
    const __m512 sum = F == kQuantQ8_0 ? acc[m] : _mm512_add_ps(acc[m], macc[m]);
    _mm512_storeu_ps(out + m * ldo + g * kRows, _mm512_add_ps(sum, vb));
  }
}
#endif

#if defined(__AVX2__) && !defined(PAGEDSERVE_R8Q_DOT) && !defined(PAGEDSERVE_R8Q_ZMM)
#define PAGEDSERVE_R8Q_YMM_PAIR 1
// A Q5 tile's chunk i (0..7) as bytes 0..31, against activation quants 4i..4i+3: the low (i < 4) or high
// nibbles of quant chunk i % 4 with their fifth bits (mask i).
template <int64_t F>
inline __m256i q5_chunk_bytes(const uint8_t* tile, int i) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + kQuantsAt<F> + 32 * (i % 4)));
  const __m256i nibbles = _mm256_and_si256(i < 4 ? raw : _mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
  return _mm256_or_si256(nibbles, fifth256(tile + kHeadBytes<F> + 4 * i));
}

// Groups g and g + 1's Q5 quants as bytes, unpacked once for all of a step's row passes: block b's
// chunks 4h..4h+3 of group g + p at out + 512 b + 256 h + 128 p.
template <int64_t F>
void q5_expand_pair(const uint8_t* w, int64_t nb, int64_t g, uint8_t* out) {
  for (int64_t b = 0; b < nb; ++b)
    for (int p = 0; p < 2; ++p) {
      const uint8_t* tile = w + ((g + p) * nb + b) * kTileBytes<F>;
      for (int i = 0; i < 8; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 512 * b + 256 * (i / 4) + 128 * p + 32 * (i % 4)),
                            q5_chunk_bytes<F>(tile, i));
    }
}

// Groups g and g + 1 of a Q5 layout from their bytes (q5_expand_pair) on AVX2 without dot products: each
// activation broadcast serves both groups, and the fifth bits are not rebuilt per row pass. Integer sums
// are exact in any order and each row's fp32 operations are int8_groups' in its order (the same bits).
// The fp32 sums live in memory, as in quant_interleaved.cpp's int8_group_pair_ymm.
template <int64_t F, int M>
void int8_group_pair_q5(const int8_t* q, const float* ad, const float* as, int64_t nb, const uint8_t* w,
                        const uint8_t* bytes, const float* bias, float* out, int64_t ldo, int64_t g) {
  constexpr int64_t tb = kTileBytes<F>;
  const int64_t k_len = nb * kBlock;
  const uint8_t* tiles[2] = {w + g * nb * tb, w + (g + 1) * nb * tb};
  alignas(32) float acc[M][2][kRows] = {}, macc[M][2][kRows] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* u = bytes + 512 * b;
    const int8_t* a = q + b * kBlock;
    __m256i sums[M][2];
    for (int m = 0; m < M; ++m) sums[m][0] = sums[m][1] = _mm256_setzero_si256();
#if defined(PAGEDSERVE_R8_ASM_M4)
    if constexpr (M == 4) {  // the same sums, scheduled by hand (r8_asm.h)
      for (int h = 0; h < 2; ++h) {
        const int8_t* const rows[4] = {a + 16 * h, a + k_len + 16 * h, a + 2 * k_len + 16 * h, a + 3 * k_len + 16 * h};
        expanded_pair_sums_m4(u + 256 * h, u + 256 * h + 128, rows, kInt16Ones, sums);
      }
    } else
#endif
    {
#pragma GCC unroll 2
      for (int i = 0; i < 8; ++i) {
        const uint8_t* chunk = u + 256 * (i / 4) + 32 * (i % 4);
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 128));
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) {
          const __m256i av = broadcast4(a + m * k_len + 4 * i);
          sums[m][0] = accumulate32(sums[m][0], v0, av);
          sums[m][1] = accumulate32(sums[m][1], v1, av);
        }
      }
    }
    for (int p = 0; p < 2; ++p) {
      const uint8_t* tile = tiles[p] + b * tb;
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile)));
      const __m256 mw = F == kQuantQ5_1
                            ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 16)))
                            : _mm256_mul_ps(dw, _mm256_set1_ps(-16.f));
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const __m256 dot = _mm256_cvtepi32_ps(sums[m][p]);
        _mm256_store_ps(acc[m][p], _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(ad[m * nb + b])),
                                                   _mm256_load_ps(acc[m][p])));
        _mm256_store_ps(macc[m][p], _mm256_fmadd_ps(mw, _mm256_set1_ps(as[m * nb + b]), _mm256_load_ps(macc[m][p])));
      }
    }
    asm volatile("" ::: "memory");  // keeps acc and macc in memory (see above)
  }
  for (int p = 0; p < 2; ++p) {
    const __m256 vb = bias != nullptr ? _mm256_loadu_ps(bias + (g + p) * kRows) : _mm256_setzero_ps();
    for (int m = 0; m < M; ++m)
      _mm256_storeu_ps(out + m * ldo + (g + p) * kRows,
                       _mm256_add_ps(_mm256_add_ps(_mm256_load_ps(acc[m][p]), _mm256_load_ps(macc[m][p])), vb));
  }
}

// Q8_0r8 groups g and g + 1 on AVX2 without dot products: each activation broadcast serves both groups'
// |w| x (a with w's sign) multiply-adds, the tiles read once for a step's rows. Integer sums are exact
// and each row's fp32 operations are int8_groups' in its order (the same bits).
template <int M>
void int8_group_pair_q8(const int8_t* q, const float* ad, int64_t nb, const uint8_t* w, const float* bias,
                        float* out, int64_t ldo, int64_t g) {
  constexpr int64_t tb = kTileBytes<kQuantQ8_0>;
  const int64_t k_len = nb * kBlock;
  const uint8_t* tiles[2] = {w + g * nb * tb, w + (g + 1) * nb * tb};
  alignas(32) float acc[M][2][kRows] = {};
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t[2] = {tiles[0] + b * tb, tiles[1] + b * tb};
    const int8_t* a = q + b * kBlock;
    __m256i sums[M][2];
    for (int m = 0; m < M; ++m) sums[m][0] = sums[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int j = 0; j < 8; ++j) {
      const __m256i raw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[0] + kQuantsAt<kQuantQ8_0> + 32 * j));
      const __m256i raw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[1] + kQuantsAt<kQuantQ8_0> + 32 * j));
      const __m256i u0 = _mm256_abs_epi8(raw0), u1 = _mm256_abs_epi8(raw1);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const __m256i av = broadcast4(a + m * k_len + 4 * j);
        sums[m][0] = _mm256_add_epi32(sums[m][0], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(av, raw0)), ones));
        sums[m][1] = _mm256_add_epi32(sums[m][1], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(av, raw1)), ones));
      }
    }
    for (int p = 0; p < 2; ++p) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t[p])));
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m)
        _mm256_store_ps(acc[m][p], _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[m][p]),
                                                   _mm256_mul_ps(dw, _mm256_set1_ps(ad[m * nb + b])),
                                                   _mm256_load_ps(acc[m][p])));
    }
    asm volatile("" ::: "memory");  // keeps acc in memory (see int8_group_pair_q5)
  }
  for (int p = 0; p < 2; ++p) {
    const __m256 vb = bias != nullptr ? _mm256_loadu_ps(bias + (g + p) * kRows) : _mm256_setzero_ps();
    for (int m = 0; m < M; ++m)
      _mm256_storeu_ps(out + m * ldo + (g + p) * kRows, _mm256_add_ps(_mm256_load_ps(acc[m][p]), vb));
  }
}
#endif

// Groups [g_begin, g_end) of out[M][N] from M activation rows (quants q [M][nb * 32], block scales
// ad, scaled sums as and integer sums qsum [M][nb]).
template <int64_t F, int M>
void int8_groups(const int8_t* q, const float* ad, const float* as, const int32_t* qsum, int64_t nb,
                 const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t g_begin, int64_t g_end) {
  constexpr int64_t tb = kTileBytes<F>;
  const int64_t k_len = nb * kBlock;
#if defined(PAGEDSERVE_R8Q_ZMM)
  for (; g_begin + 1 < g_end; g_begin += 2) int8_group_pair<F, M>(q, ad, as, qsum, nb, w, bias, out, ldo, g_begin);
#endif
  for (int64_t g = g_begin; g < g_end; ++g) {
    const uint8_t* tiles = w + g * nb * tb;
#if defined(__AVX2__)
    __m256 acc[M], macc[M];
    for (int m = 0; m < M; ++m) acc[m] = macc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* tile = tiles + b * tb;
      prefetch_ahead(tile, tb);
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile)));
      __m256i sums[M];
      for (int m = 0; m < M; ++m) sums[m] = _mm256_setzero_si256();
      const uint8_t* quants = tile + kQuantsAt<F>;
      if constexpr (F == kQuantQ8_0) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * j));
#if defined(PAGEDSERVE_R8Q_DOT)
          const __m256i u = _mm256_xor_si256(raw, _mm256_set1_epi8(-128));
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m)
            sums[m] = dot_add(sums[m], u, broadcast4(q + m * k_len + b * kBlock + 4 * j));
#else
          const __m256i u = _mm256_abs_epi8(raw);
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            const __m256i s = _mm256_sign_epi8(broadcast4(q + m * k_len + b * kBlock + 4 * j), raw);
            sums[m] = _mm256_add_epi32(sums[m], _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
          }
#endif
        }
#if defined(PAGEDSERVE_R8Q_DOT)
        for (int m = 0; m < M; ++m) sums[m] = _mm256_sub_epi32(sums[m], _mm256_set1_epi32(128 * qsum[m * nb + b]));
#endif
      } else {
        const uint8_t* masks = tile + kHeadBytes<F>;
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * j));
          const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, _mm256_set1_epi8(0x0F)), fifth256(masks + 4 * j));
          const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F)),
                                             fifth256(masks + 16 + 4 * j));
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            const int8_t* a = q + m * k_len + b * kBlock;
#if defined(PAGEDSERVE_R8Q_DOT)
            sums[m] = dot_add(sums[m], lo, broadcast4(a + 4 * j));
            sums[m] = dot_add(sums[m], hi, broadcast4(a + kBlock / 2 + 4 * j));
#else
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(a + 4 * j)),
                                                   _mm256_maddubs_epi16(hi, broadcast4(a + kBlock / 2 + 4 * j)));
            sums[m] = _mm256_add_epi32(sums[m], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
          }
        }
      }
      const __m256 mw = F == kQuantQ5_1
                            ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 16)))
                            : _mm256_mul_ps(dw, _mm256_set1_ps(-16.f));
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const __m256 dot = _mm256_cvtepi32_ps(sums[m]);
        acc[m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(ad[m * nb + b])), acc[m]);
        if constexpr (F != kQuantQ8_0) macc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(as[m * nb + b]), macc[m]);
      }
    }
    const __m256 vb = bias != nullptr ? _mm256_loadu_ps(bias + g * kRows) : _mm256_setzero_ps();
    for (int m = 0; m < M; ++m) {
      const __m256 sum = F == kQuantQ8_0 ? acc[m] : _mm256_add_ps(acc[m], macc[m]);
      _mm256_storeu_ps(out + m * ldo + g * kRows, _mm256_add_ps(sum, vb));
    }
#else
    float acc[M][kRows] = {}, macc[M][kRows] = {};
    alignas(8) uint8_t blk[sizeof(BlockOf<F>)];
    for (int64_t b = 0; b < nb; ++b) {
      for (int r = 0; r < kRows; ++r) {
        tile_to_block<F>(tiles + b * tb, r, blk);
        float d, mn;
        block_affine<F>(blk, d, mn);
        for (int m = 0; m < M; ++m) {
          const int8_t* a = q + m * k_len + b * kBlock;
          int32_t sum = 0;
          for (int i = 0; i < kBlock; ++i) sum += block_q<F>(blk, i) * a[i];
          acc[m][r] += static_cast<float>(sum) * (d * ad[m * nb + b]);
          if constexpr (F != kQuantQ8_0) macc[m][r] += mn * as[m * nb + b];
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < kRows; ++r)
        out[m * ldo + g * kRows + r] = (F == kQuantQ8_0 ? acc[m][r] : acc[m][r] + macc[m][r]) +
                                       (bias != nullptr ? bias[g * kRows + r] : 0.f);
#endif
  }
}

// Activation rows [m_begin, m_len) over groups [g_begin, g_end), up to four rows per pass.
template <int64_t F>
void int8_chunk(const at::Tensor& out, const ActPlanes& act, const std::vector<int32_t>& qsum, int64_t m_len,
                const uint8_t* w, const float* bias, int64_t g_begin, int64_t g_end, int64_t m_begin = 0) {
  const int64_t nb = act.nb, ldo = out.stride(0);
#if defined(PAGEDSERVE_R8Q_YMM_PAIR)
  // Several row passes: one group pair at a time through all of them, its tiles kept in cache across
  // them; a Q5 layout's quants unpacked to bytes once for all of them (the same integers).
  if constexpr (kIsQ5<F>) {
    if (m_len - m_begin > 4) {
      thread_local std::vector<uint8_t> bytes;
      bytes.resize(nb * 512);
      for (; g_begin + 1 < g_end; g_begin += 2) {
        q5_expand_pair<F>(w, nb, g_begin, bytes.data());
        for_row_passes<false>(m_len - m_begin, [&](auto rows, int64_t pass_row) {
          const int64_t row0 = m_begin + pass_row;
          int8_group_pair_q5<F, decltype(rows)::value>(act.q.data() + row0 * nb * kBlock, act.d.data() + row0 * nb,
                                                       act.s.data() + row0 * nb, nb, w, bytes.data(), bias,
                                                       out.data_ptr<float>() + row0 * ldo, ldo, g_begin);
        });
      }
      if (g_begin == g_end) return;
    }
  }
  if constexpr (F == kQuantQ8_0) {
    if (m_len - m_begin > 4) {
      for (; g_begin + 1 < g_end; g_begin += 2)
        for_row_passes<false>(m_len - m_begin, [&](auto rows, int64_t pass_row) {
          const int64_t row0 = m_begin + pass_row;
          int8_group_pair_q8<decltype(rows)::value>(act.q.data() + row0 * nb * kBlock, act.d.data() + row0 * nb, nb,
                                                    w, bias, out.data_ptr<float>() + row0 * ldo, ldo, g_begin);
        });
      if (g_begin == g_end) return;
    }
  }
#endif
  for_row_passes<false>(m_len - m_begin, [&](auto rows, int64_t pass_row) {
    const int64_t row0 = m_begin + pass_row;
    int8_groups<F, decltype(rows)::value>(act.q.data() + row0 * nb * kBlock, act.d.data() + row0 * nb,
                                          act.s.data() + row0 * nb, qsum.data() + row0 * nb, nb, w, bias,
                                          out.data_ptr<float>() + row0 * ldo, ldo, g_begin, g_end);
  });
}

// fp32 activations: each group's blocks dequantized in GGUF order (dequant_block), eight rows a
// block, into the lanes of an fp32 panel (fp32_panels.h: one FMA chain per output over k).
template <int64_t F>
void fp32_groups(const float* x, int64_t ldx, int64_t m_len, int64_t nb, const uint8_t* w, const float* bias,
                 float* out, int64_t ldo, int64_t g_begin, int64_t g_end) {
  panels::fp32_groups(x, ldx, m_len, nb * kBlock, bias, out, ldo, g_begin, g_end,
                      [&](int64_t g, int64_t k0, int64_t k1, float* wide, int64_t stride) {
                        const uint8_t* tiles = w + g * nb * kTileBytes<F>;
                        panels::widen_blocks<kBlock>(k0, k1, wide, stride, [&](int64_t b, int r, float* dst) {
                          alignas(8) uint8_t blk[sizeof(BlockOf<F>)];
                          tile_to_block<F>(tiles + b * kTileBytes<F>, r, blk);
                          dequant_block<F>(blk, dst);
                        });
                      });
}

template <int64_t F>
void run_interleaved(const at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t n_len, int64_t k_len,
                     const float* bias, int64_t exact) {
  const int64_t m_len = x.size(0), nb = k_len / kBlock, groups = n_len / kRows;
  const at::Tensor out_int8 = out.narrow(0, exact, m_len - exact);
  std::optional<ActPlanes> act;
  std::vector<int32_t> qsum;  // each activation block's integer sum (Q8_0's w + 128 dot products)
  if (exact < m_len) {
    act.emplace(x.narrow(0, exact, m_len - exact), k_len);
    qsum.resize(act->d.size());
    if constexpr (F == kQuantQ8_0) {
      for (size_t b = 0; b < qsum.size(); ++b) {
        int32_t sum = 0;
        for (int i = 0; i < kBlock; ++i) sum += act->q[b * kBlock + i];
        qsum[b] = sum;
      }
    }
  }
  // Q8_0r8's int8 rows in 16-row tiles on AMX-INT8 where the CPU has it (quant_int8_amx.cpp, its split:
  // the same integer sums and fp32 operations, so the same bits), as for Q4 (quant_interleaved.cpp).
  const int64_t int8_rows = m_len - exact;
  const int64_t tile_rows = F == kQuantQ8_0 && act && groups >= 2 ? amx_int8::tile_rows(int8_rows) : 0;
  amx_int8::PackedRows packed;
  if (tile_rows) amx_int8::pack_rows(act->q.data(), act->d.data(), act->s.data(), tile_rows, k_len, packed);
  int64_t chunk = row_chunk(groups, nb * kTileBytes<F>, 64 * 1024, weight_chunks_per_thread(m_len));
  if (tile_rows) chunk += chunk % 2;
  if (exact) chunk = panels::whole_panels(chunk);
  parallel_chunks(groups, chunk, [&](int64_t g_begin, int64_t g_end) {
    if (exact) {
      fp32_groups<F>(x.data_ptr<float>(), x.stride(0), exact, nb, w, bias, out.data_ptr<float>(), out.stride(0),
                     g_begin, g_end);
    }
    if (!act) return;
    if (tile_rows) {
      const int64_t pairs_end = g_begin + (g_end - g_begin) / 2 * 2;
      amx_int8::groups(amx_int8::Kind::kQ8_0, packed, nb, w, bias, out_int8.data_ptr<float>(), out_int8.stride(0),
                       g_begin, pairs_end);
      if (tile_rows < int8_rows) int8_chunk<F>(out_int8, *act, qsum, int8_rows, w, bias, g_begin, pairs_end, tile_rows);
      g_begin = pairs_end;
    }
    if (g_begin < g_end) int8_chunk<F>(out_int8, *act, qsum, int8_rows, w, bias, g_begin, g_end);
  }, /*openmp=*/m_len >= openmp_rows());
}

// Groups [g_begin, g_end) as fp32 rows of out [N][K]: the GGUF-order blocks' values (dequant_block).
template <int64_t F>
void dequant_groups(const uint8_t* w, int64_t nb, float* out, int64_t k_len, int64_t g_begin, int64_t g_end) {
  alignas(8) uint8_t blk[sizeof(BlockOf<F>)];
  for (int64_t g = g_begin; g < g_end; ++g)
    for (int64_t b = 0; b < nb; ++b)
      for (int r = 0; r < kRows; ++r) {
        tile_to_block<F>(w + (g * nb + b) * kTileBytes<F>, r, blk);
        dequant_block<F>(blk, out + (g * kRows + r) * k_len + b * kBlock);
      }
}

template <class Fn>
void with_format(int64_t format, Fn&& fn) {
  switch (format) {
    case kQuantQ5_0R8: return fn(std::integral_constant<int64_t, kQuantQ5_0>{});
    case kQuantQ5_1R8: return fn(std::integral_constant<int64_t, kQuantQ5_1>{});
    case kQuantQ8_0R8: return fn(std::integral_constant<int64_t, kQuantQ8_0>{});
    default: TORCH_CHECK(false, "quant: format id ", format, " is not Q5_0r8, Q5_1r8 or Q8_0r8");
  }
}

}  // namespace

bool is_interleaved_q5q8(int64_t format) {
  return format == kQuantQ5_0R8 || format == kQuantQ5_1R8 || format == kQuantQ8_0R8;
}

void q5q8_interleaved_linear(const at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t format,
                             int64_t n_len, int64_t k_len, const float* bias, int64_t exact) {
  with_format(format, [&](auto f) { run_interleaved<decltype(f)::value>(out, x, w, n_len, k_len, bias, exact); });
}

void q5q8_interleaved_dequantize(float* out, const uint8_t* w, int64_t format, int64_t n_len, int64_t k_len) {
  const int64_t nb = k_len / kBlock, groups = n_len / kRows;
  const int64_t chunk = row_chunk(groups, kRows * k_len, 64 * 1024);
  with_format(format, [&](auto f) {
    // Runs just before a oneDNN GEMM: share OpenMP's threads (parallel.h).
    parallel_chunks(groups, chunk, [&](int64_t g_begin, int64_t g_end) {
      dequant_groups<decltype(f)::value>(w, nb, out, k_len, g_begin, g_end);
    }, /*openmp=*/true);
  });
}

void q5q8_interleaved_dequantize_rows(float* out, const uint8_t* w, int64_t format, int64_t k_len, int64_t n0,
                                      int64_t n1) {
  const int64_t nb = k_len / kBlock;
  with_format(format, [&](auto f) {
    constexpr int64_t F = decltype(f)::value;
    dequant_groups<F>(w + n0 / kRows * nb * kTileBytes<F>, nb, out, k_len, 0, (n1 - n0) / kRows);
  });
}

void q5q8_interleaved_to_gguf(uint8_t* out, const uint8_t* w, int64_t format, int64_t k_len, int64_t n0,
                              int64_t n1) {
  const int64_t nb = k_len / kBlock;
  with_format(format, [&](auto f) {
    constexpr int64_t F = decltype(f)::value;
    const int64_t row_bytes = nb * static_cast<int64_t>(sizeof(BlockOf<F>));
    for (int64_t g = n0 / kRows; g < n1 / kRows; ++g)
      group_to_gguf<F>(w + g * nb * kTileBytes<F>, nb, out + (g * kRows - n0) * row_bytes, row_bytes);
  });
}

}  // namespace pagedserve::cpu
