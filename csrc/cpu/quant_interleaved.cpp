// Linear layers on Q4_0 / Q4_1 weights repacked eight rows at a time ("r8" formats,
// ops/reference/quant.py: interleave). Same bytes as the GGUF blocks, another order:
//
//   group g = weight rows 8g..8g+7; per 32-weight block b of the group one tile of
//   d[8] (fp16, one per row), m[8] (fp16, Q4_1 only), then four 32-byte chunks: chunk j holds,
//   for row r at bytes 4r..4r+3, that row's packed bytes 4j..4j+3 (low nibbles: weights
//   4j..4j+3; high nibbles: weights 16+4j..16+4j+3).
//
// Why: in the GGUF order a one-row GEMV spends ~17 instructions per 32-weight block (two scalar
// fp16 conversions, an unpack, a dot product, its reduction lanes, a broadcast scale, the min
// term) and is bound by that arithmetic, not by memory. Here one chunk's nibbles, masked or
// shifted, are eight rows times four weights: one u8 x s8 multiply-add against four activation
// quants broadcast to every lane leaves each row's partial sum in its own lane, so a block of
// eight rows needs no horizontal reduction, and its scales and mins are one fp16 vector each.
//
// Integer sums of a block stay in int16 lanes on AVX2 (maddubs): |sum| <= 8 * 2 * 15 * 127 =
// 30480 < 32767, since activation quants lie in [-127, 127]. A row's result depends only on its
// own weights and activation row (not on M or the row's place in the batch).
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
#include "quant_interleaved.h"
#include "quant_interleaved_q5q8.h"
#include "quant_interleaved_k.h"
#include "r8_lanes.h"
#include "row_passes.h"

namespace pagedserve::cpu {
namespace {

using namespace quant;  // NOLINT: the block formats (quant_blocks.h)
using namespace r8;     // NOLINT: the r8 lane helpers (r8_lanes.h)

constexpr int64_t kRows = 8;  // weight rows per group

template <int64_t F>
constexpr int64_t tile_bytes() {
  return kRows * (F == kQuantQ4_1 ? sizeof(BlockQ4_1) : sizeof(BlockQ4_0));
}
template <int64_t F>
constexpr int64_t quants_offset() {
  return F == kQuantQ4_1 ? 32 : 16;
}

// Packed byte i (0..15) of row r in a tile's quant chunks.
inline uint8_t tile_byte(const uint8_t* quants, int r, int i) { return quants[(i / 4) * 32 + r * 4 + i % 4]; }

template <int64_t F>
inline void tile_affine(const uint8_t* tile, int r, float& d, float& m) {
  uint16_t h;
  std::memcpy(&h, tile + 2 * r, 2);
  d = half_to_float(h);
  if constexpr (F == kQuantQ4_1) {
    std::memcpy(&h, tile + 16 + 2 * r, 2);
    m = half_to_float(h);
  } else {
    m = -8.f * d;
  }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDSERVE_R8_ZMM 1

// Groups g and g + 1 (output rows 8g..8g+15) in 512-bit registers: lanes 0-7 hold group g's rows,
// 8-15 group g + 1's, and every lane runs exactly the 256-bit pass's integer sums and fp32
// operations in the same order, so a row's result is bit for bit the same on either path (half
// the dot-product and unpack instructions per row here, where the one-row GEMV is bound by them).
template <int64_t F, int M>
void int8_group_pair(const int8_t* q, const float* ad, const float* as, int64_t nb, const uint8_t* w,
                     const float* bias, float* out, int64_t ldo, int64_t g) {
  constexpr int64_t tb = tile_bytes<F>();
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
    const __m512 mw = F == kQuantQ4_1 ? halves_to_ps(t0 + 16, t1 + 16) : _mm512_mul_ps(dw, _mm512_set1_ps(-8.f));
    __m512i sums[M];
    for (int m = 0; m < M; ++m) sums[m] = _mm512_setzero_si512();
    const uint8_t* q0 = t0 + quants_offset<F>();
    const uint8_t* q1 = t1 + quants_offset<F>();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = load_pair(q0 + 32 * j, q1 + 32 * j);
      const __m512i lo = _mm512_and_si512(raw, _mm512_set1_epi8(0x0F));
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F));
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const int8_t* a = q + m * k_len + b * kBlock;
        int32_t lo4, hi4;
        std::memcpy(&lo4, a + 4 * j, 4);
        std::memcpy(&hi4, a + kBlock / 2 + 4 * j, 4);
        sums[m] = _mm512_dpbusd_epi32(sums[m], lo, _mm512_set1_epi32(lo4));
        sums[m] = _mm512_dpbusd_epi32(sums[m], hi, _mm512_set1_epi32(hi4));
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 dot = _mm512_cvtepi32_ps(sums[m]);
      acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(ad[m * nb + b])), acc[m]);
      macc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(as[m * nb + b]), macc[m]);
    }
  }
  const __m512 vb = bias != nullptr ? _mm512_loadu_ps(bias + g * kRows) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m)
    _mm512_storeu_ps(out + m * ldo + g * kRows, _mm512_add_ps(_mm512_add_ps(acc[m], macc[m]), vb));
}
#endif

#if defined(__AVX2__) && !defined(PAGEDSERVE_R8_ZMM)
#define PAGEDSERVE_R8_YMM_PAIR 1
// Groups g and g + 1 in one sweep of 256-bit registers, low nibbles then high ones: each activation
// broadcast (a load and a shuffle, dearer than the multiply-add it feeds on AMD cores) serves both
// groups' chunks, half as many per product as the one-group pass below. The fp32 sums live in
// memory, touched once per block: held in registers across the integer loop they would push its
// int16 sums onto the stack, a store-to-load chain on every chunk. Integer sums are exact in any
// order and every row's fp32 operations are the one-group pass's, in its order (the same bits).
template <int64_t F, int M>
void int8_group_pair_ymm(const int8_t* q, const float* ad, const float* as, int64_t nb, const uint8_t* w,
                         const float* bias, float* out, int64_t ldo, int64_t g) {
  constexpr int64_t tb = tile_bytes<F>();
  const int64_t k_len = nb * kBlock;
  const uint8_t* tiles[2] = {w + g * nb * tb, w + (g + 1) * nb * tb};
  alignas(32) float acc[M][2][kRows] = {}, macc[M][2][kRows] = {};
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t[2] = {tiles[0] + b * tb, tiles[1] + b * tb};
    prefetch_ahead(t[0], tb);
    prefetch_ahead(t[1], tb);
    __m256i sums[M][2];
    for (int m = 0; m < M; ++m) sums[m][0] = sums[m][1] = _mm256_setzero_si256();
    const int8_t* a = q + b * kBlock;
#if defined(PAGEDSERVE_R8_ASM_M4)
    if constexpr (M == 4) {  // the same sums, scheduled by hand (r8_asm.h)
      const int8_t* const rows[4] = {a, a + k_len, a + 2 * k_len, a + 3 * k_len};
      pair_sums_m4<Sweep::kQ4_0>(t[0] + quants_offset<F>(), t[1] + quants_offset<F>(), rows, sums);
    } else
#endif
    {
#pragma GCC unroll 1
      for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 2
        for (int j = 0; j < 4; ++j) {
          __m256i wq[2];
          for (int p = 0; p < 2; ++p) {
            const __m256i raw =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[p] + quants_offset<F>() + 32 * j));
            wq[p] = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, nibble);
          }
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            const __m256i av = broadcast4(a + m * k_len + kBlock / 2 * h + 4 * j);
            sums[m][0] = accumulate(sums[m][0], wq[0], av);
            sums[m][1] = accumulate(sums[m][1], wq[1], av);
          }
        }
      }
    }
    for (int p = 0; p < 2; ++p) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t[p])));
      const __m256 mw = F == kQuantQ4_1
                            ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t[p] + 16)))
                            : _mm256_mul_ps(dw, _mm256_set1_ps(-8.f));
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const __m256 dot = _mm256_cvtepi32_ps(lanes_to_int32(sums[m][p]));
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
#endif

// Groups [g_begin, g_end) of out[M][N] from M activation rows (quants q [M][nb * 32], block scales
// ad and scaled sums as [M][nb]).
template <int64_t F, int M>
void int8_groups(const int8_t* q, const float* ad, const float* as, int64_t nb, const uint8_t* w,
                 const float* bias, float* out, int64_t ldo, int64_t g_begin, int64_t g_end) {
  constexpr int64_t tb = tile_bytes<F>();
  const int64_t k_len = nb * kBlock;
#if defined(PAGEDSERVE_R8_ZMM)
  for (; g_begin + 1 < g_end; g_begin += 2) int8_group_pair<F, M>(q, ad, as, nb, w, bias, out, ldo, g_begin);
#elif defined(PAGEDSERVE_R8_YMM_PAIR)
  if constexpr (M > 1)  // one row: memory-bound, where the one-group pass's single load of each chunk pays
    for (; g_begin + 1 < g_end; g_begin += 2) int8_group_pair_ymm<F, M>(q, ad, as, nb, w, bias, out, ldo, g_begin);
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
      const __m256 mw = F == kQuantQ4_1
                            ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 16)))
                            : _mm256_mul_ps(dw, _mm256_set1_ps(-8.f));
      __m256i sums[M];
      for (int m = 0; m < M; ++m) sums[m] = _mm256_setzero_si256();
      const uint8_t* quants = tile + quants_offset<F>();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * j));
        const __m256i lo = _mm256_and_si256(raw, _mm256_set1_epi8(0x0F));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const int8_t* a = q + m * k_len + b * kBlock;
          sums[m] = accumulate(sums[m], lo, broadcast4(a + 4 * j));
          sums[m] = accumulate(sums[m], hi, broadcast4(a + kBlock / 2 + 4 * j));
        }
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m256 dot = _mm256_cvtepi32_ps(lanes_to_int32(sums[m]));
        acc[m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(ad[m * nb + b])), acc[m]);
        macc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(as[m * nb + b]), macc[m]);
      }
    }
    const __m256 vb = bias != nullptr ? _mm256_loadu_ps(bias + g * kRows) : _mm256_setzero_ps();
    for (int m = 0; m < M; ++m)
      _mm256_storeu_ps(out + m * ldo + g * kRows, _mm256_add_ps(_mm256_add_ps(acc[m], macc[m]), vb));
#else
    float acc[M][kRows] = {}, macc[M][kRows] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* tile = tiles + b * tb;
      const uint8_t* quants = tile + quants_offset<F>();
      for (int r = 0; r < kRows; ++r) {
        float d, mn;
        tile_affine<F>(tile, r, d, mn);
        for (int m = 0; m < M; ++m) {
          const int8_t* a = q + m * k_len + b * kBlock;
          int32_t sum = 0;
          for (int i = 0; i < kBlock / 2; ++i) {
            const uint8_t byte = tile_byte(quants, r, i);
            sum += (byte & 0x0F) * a[i] + (byte >> 4) * a[i + kBlock / 2];
          }
          acc[m][r] += static_cast<float>(sum) * (d * ad[m * nb + b]);
          macc[m][r] += mn * as[m * nb + b];
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < kRows; ++r)
        out[m * ldo + g * kRows + r] = acc[m][r] + macc[m][r] + (bias != nullptr ? bias[g * kRows + r] : 0.f);
#endif
  }
}

// fp32 activations: each group widened into its lanes of an fp32 panel (fp32_panels.h).
// Group `tiles` widened into lanes [0, 8) of wide[k][stride] (k < nb * 32): d * q + m per weight.
template <int64_t F>
void widen_group(const uint8_t* tiles, int64_t nb, float* wide, int64_t stride) {
  constexpr int64_t tb = tile_bytes<F>();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tile = tiles + b * tb;
    const uint8_t* quants = tile + quants_offset<F>();
    float* dst = wide + b * kBlock * stride;
#if defined(__AVX2__)
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile)));
    const __m256 mw = F == kQuantQ4_1
                          ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 16)))
                          : _mm256_mul_ps(dw, _mm256_set1_ps(-8.f));
    // Chunk j holds row r's packed byte 4j + t at 4r + t; reorder to 8t + r (rows 0-3 from the low
    // 128-bit lane, 4-7 from the high one), so each t is eight rows' bytes in a row.
    const __m256i by_t = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                          0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i halves = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * j));
      const __m256i t_major = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(raw, by_t), halves);
      const __m256i nibbles[2] = {_mm256_and_si256(t_major, _mm256_set1_epi8(0x0F)),
                                  _mm256_and_si256(_mm256_srli_epi16(t_major, 4), _mm256_set1_epi8(0x0F))};
      for (int half = 0; half < 2; ++half) {
        const __m128i lo = _mm256_castsi256_si128(nibbles[half]), hi = _mm256_extracti128_si256(nibbles[half], 1);
        const __m128i bytes[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int t = 0; t < 4; ++t) {
          const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes[t]));
          _mm256_storeu_ps(dst + (half * (kBlock / 2) + 4 * j + t) * stride, _mm256_fmadd_ps(q, dw, mw));
        }
      }
    }
#else
    for (int r = 0; r < kRows; ++r) {
      float d, m;
      tile_affine<F>(tile, r, d, m);
      for (int i = 0; i < kBlock / 2; ++i) {
        const uint8_t byte = tile_byte(quants, r, i);
        dst[i * stride + r] = d * static_cast<float>(byte & 0x0F) + m;
        dst[(kBlock / 2 + i) * stride + r] = d * static_cast<float>(byte >> 4) + m;
      }
    }
#endif
  }
}

// Groups [g_begin, g_end) of out[M][N] with fp32 activations x[M][K].
template <int64_t F>
void fp32_groups(const float* x, int64_t ldx, int64_t m_len, int64_t nb, const uint8_t* w, const float* bias,
                 float* out, int64_t ldo, int64_t g_begin, int64_t g_end) {
  panels::fp32_groups(x, ldx, m_len, nb * kBlock, bias, out, ldo, g_begin, g_end,
                      [&](int64_t g, int64_t k0, int64_t k1, float* wide, int64_t stride) {
                        widen_group<F>(w + (g * nb + k0 / kBlock) * tile_bytes<F>(), (k1 - k0) / kBlock, wide, stride);
                      });
}

template <int64_t F, int M>
void int8_pass(const at::Tensor& out, const ActPlanes& act, int64_t row0, const uint8_t* w, const float* bias,
               int64_t g_begin, int64_t g_end) {
  const int64_t nb = act.nb, ldo = out.stride(0);
  int8_groups<F, M>(act.q.data() + row0 * nb * kBlock, act.d.data() + row0 * nb, act.s.data() + row0 * nb, nb,
                    w, bias, out.data_ptr<float>() + row0 * ldo, ldo, g_begin, g_end);
}

// Activation rows [m_begin, m_len) over groups [g_begin, g_end), four rows per pass (the chunk's tiles stay
// in cache between passes). No pass of five for a verify row of 1 + 4 here: five rows spill
// registers, so a pass of five saves nothing over four and one.
template <int64_t F>
void int8_chunk(const at::Tensor& out, const ActPlanes& act, int64_t m_len, const uint8_t* w, const float* bias,
                int64_t g_begin, int64_t g_end, int64_t m_begin = 0) {
  for_row_passes<false>(m_len - m_begin, [&](auto rows, int64_t row0) {
    int8_pass<F, decltype(rows)::value>(out, act, m_begin + row0, w, bias, g_begin, g_end);
  });
}

// Rows [0, exact) of x with fp32 activations, the others with int8 ones.
template <int64_t F>
void run_interleaved(const at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t n_len, int64_t k_len,
                     const float* bias, int64_t exact) {
  const int64_t m_len = x.size(0), nb = k_len / kBlock, groups = n_len / kRows, int8_rows = m_len - exact;
  const at::Tensor out_int8 = out.narrow(0, exact, int8_rows);
  std::optional<ActPlanes> act;
  if (exact < m_len) act.emplace(x.narrow(0, exact, int8_rows), k_len);
  // Many int8 rows: the group pairs of whole 16-row tiles (and of a last partial one where it pays)
  // on AMX-INT8 tiles (quant_int8_amx.cpp, the same bits); the other rows, and an odd chunk's last
  // group, here.
  const int64_t tile_rows = act && groups >= 2 ? amx_int8::tile_rows(int8_rows) : 0;
  amx_int8::PackedRows packed;
  if (tile_rows) amx_int8::pack_rows(act->q.data(), act->d.data(), act->s.data(), tile_rows, k_len, packed);
  // Chunks of at least ~64 KiB of packed weights, about eight per thread, two for one row
  // (weight_chunks_per_thread; whole pairs for the tiles).
  int64_t chunk = row_chunk(groups, nb * tile_bytes<F>(), 64 * 1024, weight_chunks_per_thread(m_len));
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
      constexpr auto kind = F == kQuantQ4_1 ? amx_int8::Kind::kQ4_1 : amx_int8::Kind::kQ4_0;
      amx_int8::groups(kind, packed, nb, w, bias, out_int8.data_ptr<float>(), out_int8.stride(0), g_begin, pairs_end);
      if (tile_rows < int8_rows) int8_chunk<F>(out_int8, *act, int8_rows, w, bias, g_begin, pairs_end, tile_rows);
      g_begin = pairs_end;
    }
    if (g_begin < g_end) int8_chunk<F>(out_int8, *act, int8_rows, w, bias, g_begin, g_end);
  }, /*openmp=*/m_len >= openmp_rows());
}

template <int64_t F>
void dequant_groups(const uint8_t* w, int64_t nb, float* out, int64_t k_len, int64_t g_begin, int64_t g_end) {
  thread_local std::vector<float> wide;
  wide.resize(nb * kBlock * kRows);
  for (int64_t g = g_begin; g < g_end; ++g) {
    widen_group<F>(w + g * nb * tile_bytes<F>(), nb, wide.data(), kRows);
    for (int r = 0; r < kRows; ++r) {
      float* row = out + (g * kRows + r) * k_len;
      for (int64_t k = 0; k < k_len; ++k) row[k] = wide[k * kRows + r];
    }
  }
}

}  // namespace

bool is_interleaved(int64_t format) {
  return format == kQuantQ4_0R8 || format == kQuantQ4_1R8 || is_interleaved_q5q8(format) || is_interleaved_k(format);
}

void interleaved_linear(const at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t format,
                        int64_t n_len, int64_t k_len, const float* bias, int64_t exact) {
  if (is_interleaved_k(format)) return interleaved_k_linear(out, x, w, format, n_len, k_len, bias, exact);
  TORCH_CHECK(n_len % kRows == 0, "quant_linear: an interleaved weight has a multiple of 8 rows; got ", n_len);
  if (is_interleaved_q5q8(format)) return q5q8_interleaved_linear(out, x, w, format, n_len, k_len, bias, exact);
  if (format == kQuantQ4_0R8) return run_interleaved<kQuantQ4_0>(out, x, w, n_len, k_len, bias, exact);
  return run_interleaved<kQuantQ4_1>(out, x, w, n_len, k_len, bias, exact);
}

void interleaved_dequantize(float* out, const uint8_t* w, int64_t format, int64_t n_len, int64_t k_len) {
  if (is_interleaved_k(format)) return interleaved_k_dequantize(out, w, format, n_len, k_len);
  TORCH_CHECK(n_len % kRows == 0, "dequantize: an interleaved weight has a multiple of 8 rows; got ", n_len);
  if (is_interleaved_q5q8(format)) return q5q8_interleaved_dequantize(out, w, format, n_len, k_len);
  const int64_t nb = k_len / kBlock, groups = n_len / kRows;
  const int64_t chunk = row_chunk(groups, kRows * k_len, 64 * 1024);
  // Runs just before a oneDNN GEMM: share OpenMP's threads (parallel.h).
  parallel_chunks(groups, chunk, [&](int64_t g_begin, int64_t g_end) {
    if (format == kQuantQ4_0R8) return dequant_groups<kQuantQ4_0>(w, nb, out, k_len, g_begin, g_end);
    dequant_groups<kQuantQ4_1>(w, nb, out, k_len, g_begin, g_end);
  }, /*openmp=*/true);
}

void interleaved_dequantize_rows(float* out, const uint8_t* w, int64_t format, int64_t k_len, int64_t n0, int64_t n1) {
  if (is_interleaved_k(format)) return interleaved_k_dequantize_rows(out, w, format, k_len, n0, n1);
  TORCH_CHECK(n0 % kRows == 0 && n1 % kRows == 0, "dequantize: interleaved rows come in groups of 8");
  if (is_interleaved_q5q8(format)) return q5q8_interleaved_dequantize_rows(out, w, format, k_len, n0, n1);
  const int64_t nb = k_len / kBlock, groups = (n1 - n0) / kRows;
  if (format == kQuantQ4_0R8) {
    return dequant_groups<kQuantQ4_0>(w + n0 / kRows * nb * tile_bytes<kQuantQ4_0>(), nb, out, k_len, 0, groups);
  }
  dequant_groups<kQuantQ4_1>(w + n0 / kRows * nb * tile_bytes<kQuantQ4_1>(), nb, out, k_len, 0, groups);
}

}  // namespace pagedserve::cpu
