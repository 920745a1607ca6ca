// Linear layers on Q4_K / Q6_K weights repacked eight rows at a time: Q4_Kr8, Q6_Kr8
// (ops/reference/quant_k_r8.py).
//
//   group g = weight rows 8g..8g+7; per 256-weight block one 1184-byte tile: d[8] and dmin[8] (fp16,
//   one per row), scales[j][r] and mins[j][r] (sub-block j's 6-bit fields unpacked to bytes), then 32
//   chunks of 32 bytes: chunk 8c + i holds, for row r at bytes 4r..4r+3, that row's GGUF quant bytes
//   32c + 4i..+3 (low nibbles: sub-block 2c, weights 4i..4i+3; high nibbles: sub-block 2c + 1).
//
// As for Q4_0r8 (quant_interleaved.cpp): one u8 x s8 multiply-add of a chunk's nibbles against four
// activation quants broadcast to every lane leaves each row's partial sum in its own lane, so eight rows
// need no horizontal reduction, and a sub-block's scales and mins are one byte vector each (no per-row
// 6-bit unpacking). Per sub-block j of activation block scale a_j and scaled sum s_j (quantize_row):
// acc += float(isum) * ((d sc_j) a_j), then acc -= (dmin m_j) s_j, in that order for every row on every
// path (256-bit, the AVX-512 two-group pass, scalar), so a row's bits do not depend on M or its place.
//
// Integer sums of a sub-block stay in int16 lanes on AVX2 (maddubs): each lane sums 8 chunks x 2
// products, |sum| <= 16 * 15 * 127 = 30480 < 32767.
//
// Q6_Kr8 (the same bytes as Q6_K): per block d[8] (fp16), scales[i][r] (int8, one per 16 weights),
// then ql in 32 chunks (chunk 16h + 8p + i: row r's ql bytes 64h + 32p + 4i..+3 at 4r) and qh in 16
// (chunk 8h + i: qh bytes 32h + 4i..+3). Sub-block s = 4h + g: unsigned q = nibble g / 2 of the ql
// chunks p = g % 2, bits 2g of the qh chunks above it (0..63, the - 32 applied through the activations'
// half-block sums). Per sub-block, in integers: dot = sc_0 (isum_0 - 32 asum_0) + sc_1 (isum_1 - 32 asum_1)
// over its two 16-weight halves (exact, |dot| < 2^24), then one fp32 step acc += float(dot) (d a), on
// every path. Integer sums in int32 (maddubs pairs widened at once on AVX2: 8 products of 63 x 127 would
// overflow int16).
//
// A batch of several four-row passes on AVX2 runs one group pair at a time through all of them: the pair's
// fp32 sub-block scales (and for Q6_Kr8 its quants unpacked to bytes) are computed once and shared, the
// same values every pass would compute, so the bits do not change.
//
// fp32 activations (exact rows) and dequantization rebuild the group's eight GGUF rows and dequantize
// them with the GGUF-order code (quant_blocks.h: dequant_block, the same values as Q4_K's / Q6_K's);
// the exact rows then run the fp32 panel kernel (fp32_panels.h).
#include "quant_interleaved_k.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <optional>
#include <vector>

#include "fp32_panels.h"
#include "ops.h"
#include "parallel.h"
#include "prefetch.h"
#include "quant_blocks.h"
#include "r8_asm.h"
#include "r8_lanes.h"
#include "row_passes.h"

namespace pagedserve::cpu {
namespace {

using namespace quant;  // NOLINT: the block formats (quant_blocks.h)
using namespace r8;     // NOLINT: the r8 lane helpers (r8_lanes.h)

constexpr int64_t kRows = 8;
constexpr int64_t kTileBytes = kQ4KR8TileBytes;
constexpr int64_t kMinOffset = 16, kScalesAt = 32, kMinsAt = 96, kQuantsAt = 160;
constexpr int kSubs = kSuperBlock / kBlock;  // sub-blocks of 32 per block
static_assert(kQuantsAt + kRows * static_cast<int64_t>(sizeof(BlockQ4_K::q)) == kTileBytes, "Q4_Kr8 tile");

constexpr int64_t kQ6TileBytes = kRows * static_cast<int64_t>(sizeof(BlockQ6_K));
constexpr int64_t kQ6ScalesAt = 16, kQ6LowAt = 144, kQ6HighAt = 1168;
static_assert(kQ6HighAt + kRows * static_cast<int64_t>(sizeof(BlockQ6_K::qh)) == kQ6TileBytes, "Q6_Kr8 tile");

template <int64_t F>
constexpr int64_t tile_bytes() {
  return F == kQuantQ4_K ? kTileBytes : kQ6TileBytes;
}

// The GGUF block of row r in tile `tile` (scales and mins packed back into their 12 bytes).
inline void gguf_block(const uint8_t* tile, int r, BlockQ6_K& blk) {
  std::memcpy(&blk.d, tile + 2 * r, 2);
  for (int i = 0; i < 16; ++i) blk.scales[i] = static_cast<int8_t>(tile[kQ6ScalesAt + 8 * i + r]);
  for (int k = 0; k < 32; ++k) std::memcpy(blk.ql + 4 * k, tile + kQ6LowAt + 32 * k + 4 * r, 4);
  for (int k = 0; k < 16; ++k) std::memcpy(blk.qh + 4 * k, tile + kQ6HighAt + 32 * k + 4 * r, 4);
}

inline void gguf_block(const uint8_t* tile, int r, BlockQ4_K& blk) {
  std::memcpy(&blk.d, tile + 2 * r, 2);
  std::memcpy(&blk.dmin, tile + kMinOffset + 2 * r, 2);
  const uint8_t* sc = tile + kScalesAt;
  const uint8_t* mn = tile + kMinsAt;
  for (int j = 0; j < 4; ++j) {
    const int s_lo = sc[8 * j + r], s_hi = sc[8 * (j + 4) + r], m_lo = mn[8 * j + r], m_hi = mn[8 * (j + 4) + r];
    blk.scales[j] = static_cast<uint8_t>(s_lo | ((s_hi >> 4) << 6));
    blk.scales[j + 4] = static_cast<uint8_t>(m_lo | ((m_hi >> 4) << 6));
    blk.scales[j + 8] = static_cast<uint8_t>((s_hi & 0x0F) | ((m_hi & 0x0F) << 4));
  }
  for (int k = 0; k < 32; ++k) std::memcpy(blk.q + 4 * k, tile + kQuantsAt + 32 * k + 4 * r, 4);
}

// The eight GGUF rows of group tiles `tiles` (nsb blocks): rows[r * nsb + b].
template <int64_t F>
inline void gguf_rows(const uint8_t* tiles, int64_t nsb, BlockOf<F>* rows) {
  for (int64_t b = 0; b < nsb; ++b)
    for (int r = 0; r < kRows; ++r) gguf_block(tiles + b * tile_bytes<F>(), r, rows[r * nsb + b]);
}

#if defined(__AVX2__)
// The eight rows' bytes of sub-block j (scales or mins) as fp32.
inline __m256 bytes_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDSERVE_R8K_ZMM 1
inline __m512 bytes_pair_ps(const uint8_t* lo_half, const uint8_t* hi_half) {
  const __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo_half)),
                                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(hi_half)));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(both));
}

// Groups g and g + 1 in 512-bit registers (lanes 0-7 group g, 8-15 group g + 1): every lane runs the
// 256-bit pass's integer sums and fp32 operations in the same order (the same bits).
template <int M>
void int8_group_pair(const int8_t* q, const float* ad, const float* as, int64_t nsb, const uint8_t* w,
                     const float* bias, float* out, int64_t ldo, int64_t g) {
  const int64_t k_len = nsb * kSuperBlock, nb = nsb * kSubs;
  const uint8_t* tiles0 = w + g * nsb * kTileBytes;
  const uint8_t* tiles1 = tiles0 + nsb * kTileBytes;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* t0 = tiles0 + b * kTileBytes;
    const uint8_t* t1 = tiles1 + b * kTileBytes;
    prefetch_ahead(t0, kTileBytes);
    prefetch_ahead(t1, kTileBytes);
    const __m512 dw = halves_to_ps(t0, t1), mw = halves_to_ps(t0 + kMinOffset, t1 + kMinOffset);
    for (int c = 0; c < kSubs / 2; ++c) {
      __m512i lo_sums[M], hi_sums[M];
      for (int m = 0; m < M; ++m) lo_sums[m] = hi_sums[m] = _mm512_setzero_si512();
      const uint8_t* q0 = t0 + kQuantsAt + 256 * c;
      const uint8_t* q1 = t1 + kQuantsAt + 256 * c;
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m512i raw = load_pair(q0 + 32 * i, q1 + 32 * i);
        const __m512i lo = _mm512_and_si512(raw, _mm512_set1_epi8(0x0F));
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F));
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) {
          const int8_t* a = q + m * k_len + b * kSuperBlock + 64 * c + 4 * i;
          int32_t lo4, hi4;
          std::memcpy(&lo4, a, 4);
          std::memcpy(&hi4, a + kBlock, 4);
          lo_sums[m] = _mm512_dpbusd_epi32(lo_sums[m], lo, _mm512_set1_epi32(lo4));
          hi_sums[m] = _mm512_dpbusd_epi32(hi_sums[m], hi, _mm512_set1_epi32(hi4));
        }
      }
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * c + h;
        const __m512 dj = _mm512_mul_ps(dw, bytes_pair_ps(t0 + kScalesAt + 8 * j, t1 + kScalesAt + 8 * j));
        const __m512 mj = _mm512_mul_ps(mw, bytes_pair_ps(t0 + kMinsAt + 8 * j, t1 + kMinsAt + 8 * j));
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) {
          const __m512 dot = _mm512_cvtepi32_ps(h ? hi_sums[m] : lo_sums[m]);
          acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dj, _mm512_set1_ps(ad[m * nb + b * kSubs + j])), acc[m]);
          acc[m] = _mm512_fnmadd_ps(mj, _mm512_set1_ps(as[m * nb + b * kSubs + j]), acc[m]);
        }
      }
    }
  }
  const __m512 vb = bias != nullptr ? _mm512_loadu_ps(bias + g * kRows) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * ldo + g * kRows, _mm512_add_ps(acc[m], vb));
}
#endif

#if defined(__AVX2__)
// Q6_Kr8's per-sub-block steps (every AVX2 pass; the AVX-512 pair does the same in 16 lanes).
// Row r's scale of sub-block s's 16-weight half `half` of tile `tile`, in int32 lane r.
inline __m256i q6_scales32(const uint8_t* tile, int s, int half) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + kQ6ScalesAt + 8 * (2 * s + half))));
}

// The eight rows' fp16 d of tile `tile`, in fp32.
inline __m256 q6_d(const uint8_t* tile) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile)));
}

// One half's share of a sub-block's integer dot product: sc (isum - 32 asum), isum the half's sum over the
// unsigned quants, off = 32 asum (ActPlanes::h32). Exact: |sc (isum - off)| <= 128 * 16 * 32 * 127.
inline __m256i q6_half_dot(__m256i isum, __m256i sc, int32_t off) {
  return _mm256_mullo_epi32(_mm256_sub_epi32(isum, _mm256_set1_epi32(off)), sc);
}

// A sub-block's fp32 step: acc + float(dot) (d a), dot its two halves' q6_half_dot (below 2^24: exact in fp32).
inline __m256 q6_step(__m256 acc, __m256i dot, __m256 dw, float a) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(a)), acc);
}
#endif

#if defined(__AVX2__) && !defined(PAGEDSERVE_R8K_ZMM)
#define PAGEDSERVE_R8K_YMM_PAIR 1
// Sub-block j's eight scales d sc_j and mins dmin m_j of Q4_Kr8 tile `tile`, in fp32.
inline void q4k_scales(const uint8_t* tile, int j, __m256& dj, __m256& mj) {
  dj = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile))),
                     bytes_ps(tile + kScalesAt + 8 * j));
  mj = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + kMinOffset))),
                     bytes_ps(tile + kMinsAt + 8 * j));
}

// Groups g and g + 1's q4k_scales for every block and sub-block, once for all of a step's row passes:
// out[8 * (4 * (b * 8 + j) + 2 * p + {0: scale, 1: min})]. nsb * 256 floats.
inline void q4k_pair_scales(const uint8_t* w, int64_t nsb, int64_t g, float* out) {
  for (int64_t b = 0; b < nsb; ++b)
    for (int p = 0; p < 2; ++p) {
      const uint8_t* tile = w + (g + p) * nsb * kTileBytes + b * kTileBytes;
      for (int j = 0; j < kSubs; ++j) {
        __m256 dj, mj;
        q4k_scales(tile, j, dj, mj);
        _mm256_storeu_ps(out + kRows * (4 * (b * kSubs + j) + 2 * p), dj);
        _mm256_storeu_ps(out + kRows * (4 * (b * kSubs + j) + 2 * p + 1), mj);
      }
    }
}

// Row r's 16-weight scale of sub-block s's half `half` twice, the int16 pair of lane r: the multiplier
// that widens the pair passes' int16 sums (r8_asm.h: PS_R8_Q6_ROW) into scaled int32 sums.
inline __m256i q6_scale_pairs16(const uint8_t* tile, int s, int half) {
  const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + kQ6ScalesAt + 8 * (2 * s + half)));
  return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8, sc8));
}

// Lane r's int16 pair (-32 sc_0, -32 sc_1) of sub-block s (|32 sc| <= 4096): against a row's half sums
// (asum_0, asum_1) (ActPlanes::hpair) one multiply-add gives the sub-block's - 32 term.
inline __m256i q6_offsets16(const uint8_t* tile, int s) {
  const __m128i both = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + kQ6ScalesAt + 16 * s));
  const __m256i pairs = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(both, _mm_srli_si128(both, 8)));
  return _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(pairs, 5));
}

// Groups g and g + 1's q6_scale_pairs16, q6_offsets16 and q6_d for every block, once for all of a step's
// row passes, as 32-bit words: the scale pairs of (b, s, half) at 8 * (2 * (b * 16 + 2 * s + half) + p),
// the offsets of (b, s) at nsb * 256 + 8 * (2 * (b * 8 + s) + p), d at nsb * 384 + 8 * (2 * b + p).
constexpr int64_t q6_table_words(int64_t nsb) { return nsb * 400; }
inline const __m256i* q6_table_scales(const int32_t* table, int64_t b, int s, int half, int p) {
  return reinterpret_cast<const __m256i*>(table + kRows * (2 * (b * 2 * kSubs + 2 * s + half) + p));
}
inline const __m256i* q6_table_offsets(const int32_t* table, int64_t nsb, int64_t b, int s, int p) {
  return reinterpret_cast<const __m256i*>(table + nsb * 256 + kRows * (2 * (b * kSubs + s) + p));
}
inline const float* q6_table_d(const int32_t* table, int64_t nsb, int64_t b, int p) {
  return reinterpret_cast<const float*>(table + nsb * 384 + kRows * (2 * b + p));
}
inline void q6_pair_scales(const uint8_t* w, int64_t nsb, int64_t g, int32_t* out) {
  for (int64_t b = 0; b < nsb; ++b)
    for (int p = 0; p < 2; ++p) {
      const uint8_t* tile = w + (g + p) * nsb * kQ6TileBytes + b * kQ6TileBytes;
      for (int s = 0; s < kSubs; ++s) {
        for (int half = 0; half < 2; ++half)
          _mm256_storeu_si256(const_cast<__m256i*>(q6_table_scales(out, b, s, half, p)),
                              q6_scale_pairs16(tile, s, half));
        _mm256_storeu_si256(const_cast<__m256i*>(q6_table_offsets(out, nsb, b, s, p)), q6_offsets16(tile, s));
      }
      _mm256_storeu_ps(const_cast<float*>(q6_table_d(out, nsb, b, p)), q6_d(tile));
    }
}

// Q6_Kr8 chunk i (of 8) of sub-block s's quants in tile `tile`, as bytes 0..63.
inline __m256i q6_chunk_bytes(const uint8_t* tile, int s, int i) {
  const int h = s / 4, gs = s % 4;
  const __m256i lraw = _mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(tile + kQ6LowAt + 32 * (16 * h + 8 * (gs % 2)) + 32 * i));
  const __m256i hraw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + kQ6HighAt + 32 * (8 * h) + 32 * i));
  return _mm256_or_si256(
      _mm256_and_si256(shift_right16(lraw, 4 * (gs / 2)), _mm256_set1_epi8(0x0F)),
      _mm256_slli_epi16(_mm256_and_si256(shift_right16(hraw, 2 * gs), _mm256_set1_epi8(3)), 4));
}

// Groups g and g + 1's Q6_Kr8 quants as bytes, unpacked once for all of a step's row passes:
// chunk 4 half + i of sub-block s, group p at out + 256 * (b * 16 + 2 * s + half) + 128 * p + 32 * i.
// nsb * 4096 bytes.
inline void q6_expand_pair(const uint8_t* w, int64_t nsb, int64_t g, uint8_t* out) {
  for (int64_t b = 0; b < nsb; ++b)
    for (int p = 0; p < 2; ++p) {
      const uint8_t* tile = w + (g + p) * nsb * kQ6TileBytes + b * kQ6TileBytes;
      for (int s = 0; s < kSubs; ++s)
        for (int i = 0; i < 8; ++i)
          _mm256_storeu_si256(
              reinterpret_cast<__m256i*>(out + 256 * (b * 2 * kSubs + 2 * s + i / 4) + 128 * p + 32 * (i % 4)),
              q6_chunk_bytes(tile, s, i));
    }
}
// Groups g and g + 1 in one sweep of 256-bit registers, one sub-block at a time: each activation
// broadcast (a load and a shuffle, dearer than the multiply-add it feeds on AMD cores) serves both
// groups' chunks, half as many per product as the one-group pass below. Integer sums are exact in
// any order, and every row's fp32 operations are the one-group pass's, in its order (the same bits).
//
// `scales`: the pair's sub-block scales and mins as q4k_pair_scales wrote them (the same fp32 values this
// pass would compute), or null to compute them here.
template <int M>
void int8_group_pair_ymm(const int8_t* q, const float* ad, const float* as, int64_t nsb, const uint8_t* w,
                         const float* bias, float* out, int64_t ldo, int64_t g, const float* scales = nullptr) {
  const int64_t k_len = nsb * kSuperBlock, nb = nsb * kSubs;
  const uint8_t* tiles[2] = {w + g * nsb * kTileBytes, w + (g + 1) * nsb * kTileBytes};
  // The fp32 sums live in memory, touched once per sub-block: held in registers across the integer
  // loop they would push its int16 sums onto the stack, a store-to-load chain on every chunk.
  alignas(32) float acc[M][2][kRows] = {};
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* t[2] = {tiles[0] + b * kTileBytes, tiles[1] + b * kTileBytes};
    prefetch_ahead(t[0], kTileBytes);
    prefetch_ahead(t[1], kTileBytes);
    for (int c = 0; c < kSubs / 2; ++c) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // low nibbles (sub-block 2c), then high (2c + 1): an immediate shift
        const int j = 2 * c + h;
        __m256i sums[M][2];
        for (int m = 0; m < M; ++m) sums[m][0] = sums[m][1] = _mm256_setzero_si256();
        const int8_t* a = q + b * kSuperBlock + kBlock * j;
#if defined(PAGEDSERVE_R8_ASM_M4)
        if constexpr (M == 4) {  // the same sums, scheduled by hand (r8_asm.h)
          const int8_t* const rows[4] = {a, a + k_len, a + 2 * k_len, a + 3 * k_len};
          const uint8_t* w0 = t[0] + kQuantsAt + 256 * c;
          const uint8_t* w1 = t[1] + kQuantsAt + 256 * c;
          if (h)
            pair_sums_m4<Sweep::kHigh8>(w0, w1, rows, sums);
          else
            pair_sums_m4<Sweep::kLow8>(w0, w1, rows, sums);
        } else
#endif
        {
#pragma GCC unroll 2
          for (int i = 0; i < 8; ++i) {
            __m256i wq[2];
            for (int p = 0; p < 2; ++p) {
              const __m256i raw =
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[p] + kQuantsAt + 256 * c + 32 * i));
              wq[p] = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, nibble);
            }
#pragma GCC unroll 4
            for (int m = 0; m < M; ++m) {
              const __m256i av = broadcast4(a + m * k_len + 4 * i);
              sums[m][0] = accumulate(sums[m][0], wq[0], av);
              sums[m][1] = accumulate(sums[m][1], wq[1], av);
            }
          }
        }
        for (int p = 0; p < 2; ++p) {
          __m256 dj, mj;
          if (scales != nullptr) {
            dj = _mm256_loadu_ps(scales + kRows * (4 * (b * kSubs + j) + 2 * p));
            mj = _mm256_loadu_ps(scales + kRows * (4 * (b * kSubs + j) + 2 * p + 1));
          } else {
            q4k_scales(t[p], j, dj, mj);
          }
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            const __m256 dot = _mm256_cvtepi32_ps(lanes_to_int32(sums[m][p]));
            __m256 sum = _mm256_load_ps(acc[m][p]);
            sum = _mm256_fmadd_ps(dot, _mm256_mul_ps(dj, _mm256_set1_ps(ad[m * nb + b * kSubs + j])), sum);
            sum = _mm256_fnmadd_ps(mj, _mm256_set1_ps(as[m * nb + b * kSubs + j]), sum);
            _mm256_store_ps(acc[m][p], sum);
          }
        }
        asm volatile("" ::: "memory");  // keeps acc in memory (see above)
      }
    }
  }
  for (int p = 0; p < 2; ++p) {
    const __m256 vb = bias != nullptr ? _mm256_loadu_ps(bias + (g + p) * kRows) : _mm256_setzero_ps();
    for (int m = 0; m < M; ++m)
      _mm256_storeu_ps(out + m * ldo + (g + p) * kRows, _mm256_add_ps(_mm256_load_ps(acc[m][p]), vb));
  }
}
#endif

// Groups [g_begin, g_end) of out[M][N] from M activation rows (quants q [M][K], block scales ad and
// scaled sums as [M][K / 32]).
template <int M>
void int8_groups(const int8_t* q, const float* ad, const float* as, int64_t nsb, const uint8_t* w,
                 const float* bias, float* out, int64_t ldo, int64_t g_begin, int64_t g_end) {
  const int64_t k_len = nsb * kSuperBlock, nb = nsb * kSubs;
#if defined(PAGEDSERVE_R8K_ZMM)
  for (; g_begin + 1 < g_end; g_begin += 2) int8_group_pair<M>(q, ad, as, nsb, w, bias, out, ldo, g_begin);
#elif defined(PAGEDSERVE_R8K_YMM_PAIR)
  if constexpr (M > 1)  // one row: memory-bound, where the one-group pass's single load of each chunk pays
    for (; g_begin + 1 < g_end; g_begin += 2) int8_group_pair_ymm<M>(q, ad, as, nsb, w, bias, out, ldo, g_begin);
#endif
  for (int64_t g = g_begin; g < g_end; ++g) {
    const uint8_t* tiles = w + g * nsb * kTileBytes;
#if defined(__AVX2__)
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
      const uint8_t* tile = tiles + b * kTileBytes;
      prefetch_ahead(tile, kTileBytes);
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile)));
      const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + kMinOffset)));
      for (int c = 0; c < kSubs / 2; ++c) {
        __m256i lo_sums[M], hi_sums[M];
        for (int m = 0; m < M; ++m) lo_sums[m] = hi_sums[m] = _mm256_setzero_si256();
        const uint8_t* quants = tile + kQuantsAt + 256 * c;
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * i));
          const __m256i lo = _mm256_and_si256(raw, _mm256_set1_epi8(0x0F));
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            const int8_t* a = q + m * k_len + b * kSuperBlock + 64 * c + 4 * i;
            lo_sums[m] = accumulate(lo_sums[m], lo, broadcast4(a));
            hi_sums[m] = accumulate(hi_sums[m], hi, broadcast4(a + kBlock));
          }
        }
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * c + h;
          const __m256 dj = _mm256_mul_ps(dw, bytes_ps(tile + kScalesAt + 8 * j));
          const __m256 mj = _mm256_mul_ps(mw, bytes_ps(tile + kMinsAt + 8 * j));
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            const __m256 dot = _mm256_cvtepi32_ps(lanes_to_int32(h ? hi_sums[m] : lo_sums[m]));
            acc[m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dj, _mm256_set1_ps(ad[m * nb + b * kSubs + j])), acc[m]);
            acc[m] = _mm256_fnmadd_ps(mj, _mm256_set1_ps(as[m * nb + b * kSubs + j]), acc[m]);
          }
        }
      }
    }
    const __m256 vb = bias != nullptr ? _mm256_loadu_ps(bias + g * kRows) : _mm256_setzero_ps();
    for (int m = 0; m < M; ++m) _mm256_storeu_ps(out + m * ldo + g * kRows, _mm256_add_ps(acc[m], vb));
#else
    float acc[M][kRows] = {};
    for (int64_t b = 0; b < nsb; ++b) {
      const uint8_t* tile = tiles + b * kTileBytes;
      for (int r = 0; r < kRows; ++r) {
        uint16_t h;
        std::memcpy(&h, tile + 2 * r, 2);
        const float d = half_to_float(h);
        std::memcpy(&h, tile + kMinOffset + 2 * r, 2);
        const float dmin = half_to_float(h);
        for (int j = 0; j < kSubs; ++j) {
          const float dj = d * static_cast<float>(tile[kScalesAt + 8 * j + r]);
          const float mj = dmin * static_cast<float>(tile[kMinsAt + 8 * j + r]);
          const int c = j / 2, shift = 4 * (j % 2);
          for (int m = 0; m < M; ++m) {
            const int8_t* a = q + m * k_len + b * kSuperBlock + kBlock * j;
            int32_t sum = 0;
            for (int l = 0; l < kBlock; ++l) {
              const uint8_t byte = tile[kQuantsAt + 256 * c + 32 * (l / 4) + 4 * r + l % 4];
              sum += ((byte >> shift) & 0x0F) * a[l];
            }
            const int64_t at = m * nb + b * kSubs + j;
            acc[m][r] = std::fma(static_cast<float>(sum), dj * ad[at], acc[m][r]);
            acc[m][r] = std::fma(-mj, as[at], acc[m][r]);
          }
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < kRows; ++r)
        out[m * ldo + g * kRows + r] = acc[m][r] + (bias != nullptr ? bias[g * kRows + r] : 0.f);
#endif
  }
}


#if defined(PAGEDSERVE_R8K_ZMM)
// Q6_Kr8 groups g and g + 1 in 512-bit registers: every lane runs the 256-bit pass's integer sums and fp32
// operations in the same order (the same bits).
template <int M>
void int8_group_pair_q6(const int8_t* q, const float* ad, const int32_t* ah, int64_t nsb, const uint8_t* w,
                        const float* bias, float* out, int64_t ldo, int64_t g) {
  const int64_t k_len = nsb * kSuperBlock, nb = nsb * kSubs;
  const uint8_t* tiles0 = w + g * nsb * kQ6TileBytes;
  const uint8_t* tiles1 = tiles0 + nsb * kQ6TileBytes;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* t0 = tiles0 + b * kQ6TileBytes;
    const uint8_t* t1 = tiles1 + b * kQ6TileBytes;
    prefetch_ahead(t0, kQ6TileBytes);
    prefetch_ahead(t1, kQ6TileBytes);
    const __m512 dw = halves_to_ps(t0, t1);
    for (int s = 0; s < kSubs; ++s) {
      const int h = s / 4, gs = s % 4;
      const int64_t low = kQ6LowAt + 32 * (16 * h + 8 * (gs % 2)), high = kQ6HighAt + 32 * (8 * h);
      const __m128i low_shift = _mm_cvtsi32_si128(4 * (gs / 2)), high_shift = _mm_cvtsi32_si128(2 * gs);
      __m512i dots[M];
      for (int half = 0; half < 2; ++half) {
        __m512i sums[M];
        for (int m = 0; m < M; ++m) sums[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 4 * half; i < 4 * half + 4; ++i) {
          const __m512i lraw = load_pair(t0 + low + 32 * i, t1 + low + 32 * i);
          const __m512i hraw = load_pair(t0 + high + 32 * i, t1 + high + 32 * i);
          const __m512i lo = _mm512_and_si512(_mm512_srl_epi16(lraw, low_shift), _mm512_set1_epi8(0x0F));
          const __m512i hi =
              _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(hraw, high_shift), _mm512_set1_epi8(3)), 4);
          const __m512i u = _mm512_or_si512(lo, hi);
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            int32_t a4;
            std::memcpy(&a4, q + m * k_len + b * kSuperBlock + kBlock * s + 4 * i, 4);
            sums[m] = _mm512_dpbusd_epi32(sums[m], u, _mm512_set1_epi32(a4));
          }
        }
        const int64_t sc_at = kQ6ScalesAt + 8 * (2 * s + half);
        const __m128i sc8 = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t0 + sc_at)),
                                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t1 + sc_at)));
        const __m512i sc = _mm512_cvtepi8_epi32(sc8);
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) {  // q6_half_dot
          const __m512i part = _mm512_mullo_epi32(
              _mm512_sub_epi32(sums[m], _mm512_set1_epi32(ah[2 * (m * nb + b * kSubs + s) + half])), sc);
          dots[m] = half == 0 ? part : _mm512_add_epi32(dots[m], part);
        }
      }
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m)  // q6_step
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[m]),
                                 _mm512_mul_ps(dw, _mm512_set1_ps(ad[m * nb + b * kSubs + s])), acc[m]);
    }
  }
  const __m512 vb = bias != nullptr ? _mm512_loadu_ps(bias + g * kRows) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * ldo + g * kRows, _mm512_add_ps(acc[m], vb));
}
#endif

#if defined(__AVX2__)
// The integer sums of one activation row against one Q6_Kr8 tile: sums[2 * s + half] for sub-block s's
// 16-weight half `half`. Each ql and qh chunk is loaded once and yields the four sub-blocks it holds (the
// general pass below reloads them per sub-block, which a one-row GEMV cannot hide behind other rows).
// Integer sums are exact in any order, so the fp32 steps that follow give the general pass's bits.
inline void q6_row_sums(const uint8_t* tile, const int8_t* a, __m256i* sums) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* low0 = tile + kQ6LowAt + 32 * (16 * h);
    const uint8_t* low1 = low0 + 32 * 8;
    const uint8_t* high = tile + kQ6HighAt + 32 * (8 * h);
    for (int half = 0; half < 2; ++half) {
      __m256i s4[4];
      for (int gs = 0; gs < 4; ++gs) s4[gs] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int i = 4 * half; i < 4 * half + 4; i += 2) {
        __m256i t[4];
#pragma GCC unroll 2
        for (int k = 0; k < 2; ++k) {
          const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low0 + 32 * (i + k)));
          const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low1 + 32 * (i + k)));
          const __m256i hq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + 32 * (i + k)));
          const __m256i u[4] = {
              _mm256_or_si256(_mm256_and_si256(l0, nibble), _mm256_and_si256(_mm256_slli_epi16(hq, 4), top)),
              _mm256_or_si256(_mm256_and_si256(l1, nibble), _mm256_and_si256(_mm256_slli_epi16(hq, 2), top)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nibble), _mm256_and_si256(hq, top)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nibble),
                              _mm256_and_si256(_mm256_srli_epi16(hq, 2), top))};
#pragma GCC unroll 4
          for (int gs = 0; gs < 4; ++gs) {
            const __m256i av = broadcast4(a + kBlock * (4 * h + gs) + 4 * (i + k));
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
            s4[gs] = accumulate(s4[gs], u[gs], av);
#else
            // Two chunks' u8 x s8 pairs summed in int16 (|sum| <= 4 * 63 * 128 < 32767), widened once.
            const __m256i p = _mm256_maddubs_epi16(u[gs], av);
            t[gs] = k == 0 ? p : _mm256_add_epi16(t[gs], p);
#endif
          }
        }
#if !((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
        for (int gs = 0; gs < 4; ++gs) s4[gs] = _mm256_add_epi32(s4[gs], _mm256_madd_epi16(t[gs], _mm256_set1_epi16(1)));
#else
        (void)t;
#endif
      }
      for (int gs = 0; gs < 4; ++gs) sums[2 * (4 * h + gs) + half] = s4[gs];
    }
  }
}
#endif

#if defined(PAGEDSERVE_R8K_YMM_PAIR)
// Q6_Kr8 groups g and g + 1 in one sweep of 256-bit registers (as int8_group_pair_ymm for Q4_Kr8):
// each activation broadcast serves both groups; each 16-weight half's int16 sums are widened by a
// multiply-add with the rows' scales (q6_scale_pairs16), so a sub-block's scaled sum builds up in int32
// and its - 32 term is one more multiply-add (q6_offsets16 against ActPlanes::hpair). The fp32 sums stay
// in memory. The same integers and fp32 steps as the one-group pass (the same bits).
template <int M>
void int8_group_pair_q6_ymm(const int8_t* q, const float* ad, const int32_t* hpair, int64_t nsb, const uint8_t* w,
                            const float* bias, float* out, int64_t ldo, int64_t g, const int32_t* table = nullptr,
                            const uint8_t* expanded = nullptr) {
  const int64_t k_len = nsb * kSuperBlock, nb = nsb * kSubs;
  const uint8_t* tiles[2] = {w + g * nsb * kQ6TileBytes, w + (g + 1) * nsb * kQ6TileBytes};
  alignas(32) float acc[M][2][kRows] = {};
  alignas(32) __m256i own[2][2];  // the pair's scale pairs of one half when there is no table
  const __m256i nibble = _mm256_set1_epi8(0x0F), two_bits = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* t[2] = {tiles[0] + b * kQ6TileBytes, tiles[1] + b * kQ6TileBytes};
    prefetch_ahead(t[0], kQ6TileBytes);
    prefetch_ahead(t[1], kQ6TileBytes);
    for (int s = 0; s < kSubs; ++s) {
      const int h = s / 4, gs = s % 4;
      const int64_t low = kQ6LowAt + 32 * (16 * h + 8 * (gs % 2)), high = kQ6HighAt + 32 * (8 * h);
      const __m128i low_shift = _mm_cvtsi32_si128(4 * (gs / 2)), high_shift = _mm_cvtsi32_si128(2 * gs);
      __m256i sums[M][2];
      for (int m = 0; m < M; ++m) sums[m][0] = sums[m][1] = _mm256_setzero_si256();
      const int8_t* a = q + b * kSuperBlock + kBlock * s;
      for (int half = 0; half < 2; ++half) {
        // Both groups' scale pairs, side by side (r8_asm.h reads group 1's 32 bytes after group 0's).
        const __m256i* sc = own[half];
        if (table != nullptr) {
          sc = q6_table_scales(table, b, s, half, 0);
        } else {
          for (int p = 0; p < 2; ++p) own[half][p] = q6_scale_pairs16(t[p], s, half);
        }
        const uint8_t* bytes = expanded != nullptr ? expanded + 256 * (b * 2 * kSubs + 2 * s + half) : nullptr;
#if defined(PAGEDSERVE_R8_ASM_M4)
        if constexpr (M == 4) {  // the same sums, scheduled by hand (r8_asm.h)
          const int8_t* const rows[4] = {a + 16 * half, a + 16 * half + k_len, a + 16 * half + 2 * k_len,
                                         a + 16 * half + 3 * k_len};
          if (bytes != nullptr) {
            expanded_pair_sums_m4(bytes, bytes + 128, rows, sc, sums);
          } else {
            const int64_t at = 128 * half;
            const uint8_t *l0 = t[0] + low + at, *h0 = t[0] + high + at, *l1 = t[1] + low + at,
                          *h1 = t[1] + high + at;
            switch (gs) {
              case 0: q6_pair_sums_m4<0, 0>(l0, h0, l1, h1, rows, sc, sums); break;
              case 1: q6_pair_sums_m4<0, 2>(l0, h0, l1, h1, rows, sc, sums); break;
              case 2: q6_pair_sums_m4<4, 4>(l0, h0, l1, h1, rows, sc, sums); break;
              default: q6_pair_sums_m4<4, 6>(l0, h0, l1, h1, rows, sc, sums); break;
            }
          }
          continue;
        }
#endif
        const __m256i scale[2] = {_mm256_loadu_si256(sc), _mm256_loadu_si256(sc + 1)};
#pragma GCC unroll 2
        for (int i = 4 * half; i < 4 * half + 4; ++i) {
          __m256i u[2];
          for (int p = 0; p < 2; ++p) {
            if (bytes != nullptr) {
              u[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 128 * p + 32 * (i % 4)));
              continue;
            }
            const __m256i lraw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[p] + low + 32 * i));
            const __m256i hraw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[p] + high + 32 * i));
            u[p] = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi16(lraw, low_shift), nibble),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hraw, high_shift), two_bits), 4));
          }
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            const __m256i av = broadcast4(a + m * k_len + 4 * i);
            for (int p = 0; p < 2; ++p)  // |pair sum| <= 2 * 63 * 127: times the scale, exact in int32
              sums[m][p] = _mm256_add_epi32(sums[m][p], _mm256_madd_epi16(_mm256_maddubs_epi16(u[p], av), scale[p]));
          }
        }
      }
      for (int p = 0; p < 2; ++p) {
        const __m256i off = table != nullptr ? _mm256_loadu_si256(q6_table_offsets(table, nsb, b, s, p))
                                             : q6_offsets16(t[p], s);
        const __m256 dw = table != nullptr ? _mm256_loadu_ps(q6_table_d(table, nsb, b, p)) : q6_d(t[p]);
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) {
          const int64_t at = m * nb + b * kSubs + s;
          const __m256i dot = _mm256_add_epi32(sums[m][p], _mm256_madd_epi16(off, _mm256_set1_epi32(hpair[at])));
          _mm256_store_ps(acc[m][p], q6_step(_mm256_load_ps(acc[m][p]), dot, dw, ad[at]));
        }
      }
      asm volatile("" ::: "memory");  // keeps acc in memory (int8_group_pair_ymm)
    }
  }
  for (int p = 0; p < 2; ++p) {
    const __m256 vb = bias != nullptr ? _mm256_loadu_ps(bias + (g + p) * kRows) : _mm256_setzero_ps();
    for (int m = 0; m < M; ++m)
      _mm256_storeu_ps(out + m * ldo + (g + p) * kRows, _mm256_add_ps(_mm256_load_ps(acc[m][p]), vb));
  }
}
#endif

// Q6_Kr8 groups [g_begin, g_end) of out[M][N] (quants q [M][K], block scales ad [M][K / 32], 32 x the
// half-block sums ah [M][K / 16] and the same sums as int16 pairs hpair [M][K / 32]: ActPlanes::h32, hpair).
template <int M>
void int8_groups_q6(const int8_t* q, const float* ad, const int32_t* ah, [[maybe_unused]] const int32_t* hpair,
                    int64_t nsb, const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t g_begin,
                    int64_t g_end) {
  const int64_t k_len = nsb * kSuperBlock, nb = nsb * kSubs;
#if defined(PAGEDSERVE_R8K_ZMM)
  for (; g_begin + 1 < g_end; g_begin += 2) int8_group_pair_q6<M>(q, ad, ah, nsb, w, bias, out, ldo, g_begin);
#elif defined(PAGEDSERVE_R8K_YMM_PAIR)
  if constexpr (M > 1)  // one row: q6_row_sums below loads each chunk once, which a memory-bound pass needs
    for (; g_begin + 1 < g_end; g_begin += 2)
      int8_group_pair_q6_ymm<M>(q, ad, hpair, nsb, w, bias, out, ldo, g_begin);
#endif
  for (int64_t g = g_begin; g < g_end; ++g) {
    const uint8_t* tiles = w + g * nsb * kQ6TileBytes;
#if defined(__AVX2__)
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
      const uint8_t* tile = tiles + b * kQ6TileBytes;
      prefetch_ahead(tile, kQ6TileBytes);
      const __m256 dw = q6_d(tile);
      if constexpr (M == 1) {
        __m256i sums[2 * kSubs];
        q6_row_sums(tile, q + b * kSuperBlock, sums);
        for (int s = 0; s < kSubs; ++s) {
          const int64_t at = b * kSubs + s;
          const __m256i dot = _mm256_add_epi32(q6_half_dot(sums[2 * s], q6_scales32(tile, s, 0), ah[2 * at]),
                                               q6_half_dot(sums[2 * s + 1], q6_scales32(tile, s, 1), ah[2 * at + 1]));
          acc[0] = q6_step(acc[0], dot, dw, ad[at]);
        }
        continue;
      }
      for (int s = 0; s < kSubs; ++s) {
        const int h = s / 4, gs = s % 4;
        const uint8_t* low = tile + kQ6LowAt + 32 * (16 * h + 8 * (gs % 2));
        const uint8_t* high = tile + kQ6HighAt + 32 * (8 * h);
        __m256i dots[M];
        for (int half = 0; half < 2; ++half) {
          __m256i sums[M];
          for (int m = 0; m < M; ++m) sums[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
          for (int i = 4 * half; i < 4 * half + 4; ++i) {
            const __m256i lraw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + 32 * i));
            const __m256i hraw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + 32 * i));
            const __m256i lo = _mm256_and_si256(shift_right16(lraw, 4 * (gs / 2)), _mm256_set1_epi8(0x0F));
            const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(shift_right16(hraw, 2 * gs), _mm256_set1_epi8(3)), 4);
            const __m256i u = _mm256_or_si256(lo, hi);
#pragma GCC unroll 4
            for (int m = 0; m < M; ++m)
              sums[m] = accumulate32(sums[m], u, broadcast4(q + m * k_len + b * kSuperBlock + kBlock * s + 4 * i));
          }
          const __m256i sc = q6_scales32(tile, s, half);
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            const __m256i part = q6_half_dot(sums[m], sc, ah[2 * (m * nb + b * kSubs + s) + half]);
            dots[m] = half == 0 ? part : _mm256_add_epi32(dots[m], part);
          }
        }
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) acc[m] = q6_step(acc[m], dots[m], dw, ad[m * nb + b * kSubs + s]);
      }
    }
    const __m256 vb = bias != nullptr ? _mm256_loadu_ps(bias + g * kRows) : _mm256_setzero_ps();
    for (int m = 0; m < M; ++m) _mm256_storeu_ps(out + m * ldo + g * kRows, _mm256_add_ps(acc[m], vb));
#else
    float acc[M][kRows] = {};
    for (int64_t b = 0; b < nsb; ++b) {
      const uint8_t* tile = tiles + b * kQ6TileBytes;
      for (int r = 0; r < kRows; ++r) {
        uint16_t hd;
        std::memcpy(&hd, tile + 2 * r, 2);
        const float d = half_to_float(hd);
        for (int s = 0; s < kSubs; ++s) {
          const int h = s / 4, gs = s % 4;
          for (int m = 0; m < M; ++m) {
            const int8_t* a = q + m * k_len + b * kSuperBlock + kBlock * s;
            const int64_t at = m * nb + b * kSubs + s;
            int32_t dot = 0;
            for (int half = 0; half < 2; ++half) {
              const int sc = static_cast<int8_t>(tile[kQ6ScalesAt + 8 * (2 * s + half) + r]);
              int32_t sum = 0;
              for (int l = 16 * half; l < 16 * half + 16; ++l) {
                const int byte = 32 * (l / 4) + 4 * r + l % 4;
                const int lo = (tile[kQ6LowAt + 32 * (16 * h + 8 * (gs % 2)) + byte] >> (4 * (gs / 2))) & 0x0F;
                const int hi = (tile[kQ6HighAt + 32 * (8 * h) + byte] >> (2 * gs)) & 3;
                sum += (lo | (hi << 4)) * a[l];
              }
              dot += sc * (sum - ah[2 * at + half]);
            }
            acc[m][r] = std::fma(static_cast<float>(dot), d * ad[at], acc[m][r]);
          }
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < kRows; ++r)
        out[m * ldo + g * kRows + r] = acc[m][r] + (bias != nullptr ? bias[g * kRows + r] : 0.f);
#endif
  }
}

// Every int8 activation row over groups [g_begin, g_end), four rows per pass.
void int8_chunk(int64_t format, const at::Tensor& out, const ActPlanes& act, int64_t m_len, int64_t nsb,
                const uint8_t* w, const float* bias, int64_t g_begin, int64_t g_end) {
  const int64_t nb = act.nb, ldo = out.stride(0);
  const bool q6 = format == kQuantQ6_KR8;
  // Every row pass over groups [g0, g1); `scales`: the pair g0, g0 + 1's table (then g1 = g0 + 2).
  const auto passes = [&](int64_t g0, int64_t g1, [[maybe_unused]] const float* scales,
                          [[maybe_unused]] const uint8_t* expanded) {
    for_row_passes<false>(m_len, [&](auto rows, int64_t row0) {
      constexpr int M = decltype(rows)::value;
      const int8_t* q = act.q.data() + row0 * nb * kBlock;
      const float* ad = act.d.data() + row0 * nb;
      float* o = out.data_ptr<float>() + row0 * ldo;
#if defined(PAGEDSERVE_R8K_YMM_PAIR)
      if constexpr (M > 1) {
        if (scales != nullptr) {
          if (q6)
            int8_group_pair_q6_ymm<M>(q, ad, act.hpair.data() + row0 * nb, nsb, w, bias, o, ldo, g0,
                                      reinterpret_cast<const int32_t*>(scales), expanded);
          else
            int8_group_pair_ymm<M>(q, ad, act.s.data() + row0 * nb, nsb, w, bias, o, ldo, g0, scales);
          return;
        }
      }
#endif
      if (q6)
        int8_groups_q6<M>(q, ad, act.h32.data() + row0 * 2 * nb, act.hpair.data() + row0 * nb, nsb, w, bias, o,
                          ldo, g0, g1);
      else
        int8_groups<M>(q, ad, act.s.data() + row0 * nb, nsb, w, bias, o, ldo, g0, g1);
    });
  };
#if defined(PAGEDSERVE_R8K_YMM_PAIR)
  // Several row passes: one group pair at a time, its scales computed once for all of them (the same
  // fp32 values each pass would compute), Q6_K's quants unpacked to bytes once (the same integers; Q4_K's
  // nibbles cost the sweep less than reading twice the bytes would), its tiles kept in cache across them.
  if (m_len > 4) {
    thread_local std::vector<float> table;
    thread_local std::vector<uint8_t> bytes;
    table.resize(q6 ? q6_table_words(nsb) : nsb * 256);  // Q6_Kr8's words: int16 pairs and fp32 d
    if (q6) bytes.resize(nsb * 4096);
    int64_t g = g_begin;
    for (; g + 1 < g_end; g += 2) {
      if (q6) {
        q6_pair_scales(w, nsb, g, reinterpret_cast<int32_t*>(table.data()));
        q6_expand_pair(w, nsb, g, bytes.data());
      } else {
        q4k_pair_scales(w, nsb, g, table.data());
      }
      passes(g, g + 2, table.data(), q6 ? bytes.data() : nullptr);
    }
    if (g < g_end) passes(g, g_end, nullptr, nullptr);
    return;
  }
#endif
  passes(g_begin, g_end, nullptr, nullptr);
}

// Rows [0, m_len) of x with fp32 activations over groups [g_begin, g_end): each group's GGUF rows
// rebuilt, their super-blocks dequantized (dequant_block) into the lanes of an fp32 panel
// (fp32_panels.h: one FMA chain per output over k).
template <int64_t F>
void fp32_chunk(const float* x, int64_t ldx, int64_t m_len, int64_t nsb, const uint8_t* w, const float* bias,
                float* out, int64_t ldo, int64_t g_begin, int64_t g_end) {
  panels::fp32_groups(x, ldx, m_len, nsb * kSuperBlock, bias, out, ldo, g_begin, g_end,
                      [&](int64_t g, int64_t k0, int64_t k1, float* wide, int64_t stride) {
                        const uint8_t* tiles = w + g * nsb * tile_bytes<F>();
                        panels::widen_blocks<kSuperBlock>(k0, k1, wide, stride, [&](int64_t b, int r, float* dst) {
                          BlockOf<F> block;
                          gguf_block(tiles + b * tile_bytes<F>(), r, block);
                          dequant_block<F>(&block, dst);
                        });
                      });
}

template <int64_t F>
void dequant_groups(const uint8_t* w, int64_t nsb, float* out, int64_t k_len, int64_t g_begin, int64_t g_end) {
  thread_local std::vector<BlockOf<F>> rows;
  rows.resize(kRows * nsb);
  for (int64_t g = g_begin; g < g_end; ++g) {
    gguf_rows<F>(w + g * nsb * tile_bytes<F>(), nsb, rows.data());
    for (int r = 0; r < kRows; ++r)
      for (int64_t b = 0; b < nsb; ++b)
        dequant_block<F>(&rows[r * nsb + b], out + ((g - g_begin) * kRows + r) * k_len + b * kSuperBlock);
  }
}

void dequant_any(int64_t format, const uint8_t* w, int64_t nsb, float* out, int64_t k_len, int64_t g_begin,
                 int64_t g_end) {
  if (format == kQuantQ4_KR8) return dequant_groups<kQuantQ4_K>(w, nsb, out, k_len, g_begin, g_end);
  dequant_groups<kQuantQ6_K>(w, nsb, out, k_len, g_begin, g_end);
}

void check_format(int64_t format) {
  TORCH_CHECK(format == kQuantQ4_KR8 || format == kQuantQ6_KR8, "quant: format id ", format,
              " is no eight-row K-quant layout (Q4_Kr8=", kQuantQ4_KR8, ", Q6_Kr8=", kQuantQ6_KR8, ")");
}

}  // namespace

bool is_interleaved_k(int64_t format) { return format == kQuantQ4_KR8 || format == kQuantQ6_KR8; }

void interleaved_k_linear(const at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t format,
                          int64_t n_len, int64_t k_len, const float* bias, int64_t exact) {
  check_format(format);
  TORCH_CHECK(n_len % kRows == 0, "quant_linear: an interleaved weight has a multiple of 8 rows; got ", n_len);
  const int64_t m_len = x.size(0), nsb = k_len / kSuperBlock, groups = n_len / kRows;
  const at::Tensor out_int8 = out.narrow(0, exact, m_len - exact);
  const bool q6 = format == kQuantQ6_KR8;
  std::optional<ActPlanes> act;
  if (exact < m_len) act.emplace(x.narrow(0, exact, m_len - exact), k_len);
  if (act && q6) act->add_half_sums32();
  int64_t chunk = row_chunk(groups, nsb * (q6 ? kQ6TileBytes : kTileBytes), 64 * 1024,
                            weight_chunks_per_thread(m_len));
  if (exact) chunk = panels::whole_panels(chunk);
  parallel_chunks(groups, chunk, [&](int64_t g_begin, int64_t g_end) {
    if (exact) {
      const auto exact_rows = q6 ? fp32_chunk<kQuantQ6_K> : fp32_chunk<kQuantQ4_K>;
      exact_rows(x.data_ptr<float>(), x.stride(0), exact, nsb, w, bias, out.data_ptr<float>(), out.stride(0),
                 g_begin, g_end);
    }
    if (act) int8_chunk(format, out_int8, *act, m_len - exact, nsb, w, bias, g_begin, g_end);
  }, /*openmp=*/m_len >= openmp_rows());
}

void interleaved_k_dequantize_rows(float* out, const uint8_t* w, int64_t format, int64_t k_len, int64_t n0,
                                   int64_t n1) {
  check_format(format);
  TORCH_CHECK(n0 % kRows == 0 && n1 % kRows == 0, "dequantize: interleaved rows come in groups of 8");
  const int64_t nsb = k_len / kSuperBlock;
  dequant_any(format, w, nsb, out, k_len, n0 / kRows, n1 / kRows);
}

void interleaved_k_dequantize(float* out, const uint8_t* w, int64_t format, int64_t n_len, int64_t k_len) {
  check_format(format);
  TORCH_CHECK(n_len % kRows == 0, "dequantize: an interleaved weight has a multiple of 8 rows; got ", n_len);
  const int64_t nsb = k_len / kSuperBlock, groups = n_len / kRows;
  const int64_t chunk = row_chunk(groups, kRows * k_len, 64 * 1024);
  parallel_chunks(groups, chunk, [&](int64_t g_begin, int64_t g_end) {
    dequant_any(format, w, nsb, out + g_begin * kRows * k_len, k_len, g_begin, g_end);
  }, /*openmp=*/true);
}

}  // namespace pagedserve::cpu
