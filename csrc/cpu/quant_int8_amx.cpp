// AMX-INT8 tiles for the int8 rows of the Q4_0r8 / Q4_1r8 kernel (layout: quant_interleaved.cpp) and
// of Q8_0r8 (quant_interleaved_q5q8.cpp: eight chunks of signed quants, B as they are, no min term).
//
// Per 32-weight block b, a pair of groups (weight rows 8g..8g+15) and 16 activation rows:
//   A = the rows' 32 quants (s8, 16 x 32 bytes, packed once per call by pack_rows with their scales),
//   B = the 16 weight rows' 32 weights in the VNNI layout (8 x 64 bytes): for Q4 B row j (< 4) is
//       chunk j's low nibbles, row 4 + j its high ones, i.e. lane n holds weight row n's weights
//       4j..4j+3 (16 + 4j.. for the high half), the same K order as A's bytes; for Q8_0 row j is
//       chunk j. The r8 chunks already put the rows' 4-byte pieces side by side, so B is the
//       (masked) chunks stored as they are;
//   C = A . B (TDPBSSD: nibbles 0..15 are valid s8) = the exact int32 block sums, 16 activation
//       rows x 16 weight rows, the same integers the VNNI lanes hold.
// The fp32 epilogue then runs, per activation row and block in block order, the VNNI pair path's
// very operations on the same 16 lanes: acc = fma(float(sum), dw * ad, acc), macc = fma(mw, as, macc),
// out = (acc + macc) + bias_or_0 (Q8_0: acc + bias_or_0); C's rows are the output rows, so no
// transpose either. The epilogue,
// not the tiles, bounds the kernel (4 vector operations per 16 outputs and block, as in the VNNI
// path, against its 8 more dot products): the tile products of block b + 2 are issued while block
// b's sums are scaled (four C tiles in turn, their sums in a 4 KiB ring that stays in L1), the 16
// rows' acc in registers over all blocks, then macc in a second sweep.
#include "quant_int8_amx.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <c10/util/Exception.h>

#include "quant_blocks.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#define PAGEDSERVE_AMX_INT8 1
#include <cpuid.h>
#include <immintrin.h>
#include "amx_tiles.h"
#include "r8_lanes.h"
#endif

namespace pagedserve::cpu::amx_int8 {
namespace {

using quant::kBlock;
constexpr int64_t kTile = 16;                    // activation rows per tile
constexpr int64_t kTileBytes = kTile * kBlock;   // one A tile: 16 rows x 32 quants
constexpr int64_t kBBytes = 8 * 64;              // one B tile: 8 rows x 64 bytes
// From this many int8 rows the tiles beat the VNNI kernel (benchmarks/kernels/quant_rows_bench.py),
// and a last partial tile of kMinTail rows (it costs a whole one) those rows on it (the crossovers
// of SmolLM2's MLP shapes, one thread).
constexpr int64_t kMinRows = 16;
constexpr int64_t kMinTail = 8;

#if defined(PAGEDSERVE_AMX_INT8)
// The CPU reports AMX-TILE and AMX-INT8 (CPUID.(7,0):EDX bits 24, 25); Linux hands the tile state
// over only on request (arch_prctl, as quant_amx.cpp does), once per process.
bool granted() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    return amx::request_tile_state();
  }();
  return ok;
}

using amx::TileConfig;

// Tiles 0-3: C, 16 x 16 int32 (block b in tile b % 4); 4, 5: A, 16 rows x 32 s8; 6, 7: B, 8 rows x 64
// s8 (A and B of block b in tiles 4 + b % 2, 6 + b % 2).
const TileConfig& tile_config() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 4; ++t) {
      c.rows[t] = kTile;
      c.colsb[t] = 64;
    }
    for (int t = 4; t < 6; ++t) {
      c.rows[t] = kTile;
      c.colsb[t] = kBlock;
      c.rows[t + 2] = 8;
      c.colsb[t + 2] = 64;
    }
    return c;
  }();
  return config;
}

// 64-byte aligned room for n elements in a buffer.
template <typename T>
T* aligned(std::vector<T>& buf, int64_t n) {
  buf.resize(n + 64 / sizeof(T));
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
}

// Groups g and g + 1's B tiles bt [nb][8][64] and per-block scales [nb][dw 16, mw 16] (mw as the VNNI
// path computes it: the fp16 min, or dw * -8; none for Q8_0).
template <Kind K>
void prepare_pair(const uint8_t* w, int64_t nb, int64_t g, int8_t* bt, float* scales) {
  constexpr int64_t tb = 8 * (K == Kind::kQ4_1   ? sizeof(quant::BlockQ4_1)
                              : K == Kind::kQ4_0 ? sizeof(quant::BlockQ4_0)
                                                 : sizeof(quant::BlockQ8_0));
  constexpr int64_t qoff = K == Kind::kQ4_1 ? 32 : 16;
  const uint8_t* tiles0 = w + g * nb * tb;
  const uint8_t* tiles1 = tiles0 + nb * tb;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t0 = tiles0 + b * tb;
    const uint8_t* t1 = tiles1 + b * tb;
    const __m512 dw = r8::halves_to_ps(t0, t1);
    _mm512_store_ps(scales + 32 * b, dw);
    if constexpr (K == Kind::kQ8_0) {
      for (int j = 0; j < 8; ++j)  // chunk j: the rows' signed weights 4j..4j+3, B row j as it is
        _mm512_store_si512(bt + b * kBBytes + 64 * j, r8::load_pair(t0 + qoff + 32 * j, t1 + qoff + 32 * j));
    } else {
      _mm512_store_ps(scales + 32 * b + 16,
                      K == Kind::kQ4_1 ? r8::halves_to_ps(t0 + 16, t1 + 16) : _mm512_mul_ps(dw, _mm512_set1_ps(-8.f)));
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = r8::load_pair(t0 + qoff + 32 * j, t1 + qoff + 32 * j);
        _mm512_store_si512(bt + b * kBBytes + 64 * j, _mm512_and_si512(raw, _mm512_set1_epi8(0x0F)));
        _mm512_store_si512(bt + b * kBBytes + 64 * (4 + j),
                           _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F)));
      }
    }
  }
}

constexpr int64_t kRing = 4;       // C tiles (and ring slots) in turn
constexpr int64_t kLookahead = 2;  // blocks whose products are in flight ahead of the epilogue

// Block b's sums (activation tile a, B tiles bt) into ring slot b % kRing, through C tile b % kRing.
inline void issue(int64_t b, const int8_t* a, const int8_t* bt, int32_t* ring) {
  const int8_t* ab = a + b * kTileBytes;
  const int8_t* bb = bt + b * kBBytes;
  int32_t* cb = ring + (b % kRing) * kTile * kTile;
#define PAGEDSERVE_ISSUE(C, A, B) \
  _tile_zero(C);                  \
  _tile_loadd(A, ab, kBlock);     \
  _tile_loadd(B, bb, 64);         \
  _tile_dpbssd(C, A, B);          \
  _tile_stored(C, cb, 64);        \
  break;
  switch (b % kRing) {
    case 0: PAGEDSERVE_ISSUE(0, 4, 6)
    case 1: PAGEDSERVE_ISSUE(1, 5, 7)
    case 2: PAGEDSERVE_ISSUE(2, 4, 6)
    default: PAGEDSERVE_ISSUE(3, 5, 7)
  }
#undef PAGEDSERVE_ISSUE
}

template <Kind K>
void tile_groups(const PackedRows& rows, int64_t nb, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                 int64_t g_begin, int64_t g_end) {
  const int64_t m_len = rows.m_len, tiles = (m_len + kTile - 1) / kTile;
  thread_local std::vector<int8_t> b_buf;
  thread_local std::vector<float> s_buf;
  int8_t* const bt = aligned(b_buf, nb * kBBytes);
  float* const scales = aligned(s_buf, nb * 32);
  alignas(64) int32_t ring[kRing * kTile * kTile];
  alignas(64) float acc_out[kTile][16];
  _tile_loadconfig(&tile_config());
  for (int64_t g = g_begin; g < g_end; g += 2) {
    prepare_pair<K>(w, nb, g, bt, scales);
    const __m512 vb = bias != nullptr ? _mm512_loadu_ps(bias + g * 8) : _mm512_setzero_ps();
    for (int64_t t = 0; t < tiles; ++t) {
      const int8_t* a = rows.q + t * nb * kTileBytes;
      const float* ad = rows.ad + t * nb * kTile;
      const float* as = rows.as + t * nb * kTile;
      __m512 acc[kTile];
      for (int r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t b = 0; b < std::min(kLookahead, nb); ++b) issue(b, a, bt, ring);
      for (int64_t b = 0; b < nb; ++b) {
        if (b + kLookahead < nb) issue(b + kLookahead, a, bt, ring);
        const __m512 dw = _mm512_load_ps(scales + 32 * b);
        const int32_t* cb = ring + (b % kRing) * kTile * kTile;
#pragma GCC unroll 16
        for (int r = 0; r < kTile; ++r) {
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(cb + kTile * r));
          acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(ad[b * kTile + r])), acc[r]);
        }
      }
      for (int r = 0; r < kTile; ++r) _mm512_store_ps(acc_out[r], acc[r]);
      __m512 macc[kTile];
      for (int r = 0; r < kTile; ++r) macc[r] = _mm512_setzero_ps();
      if constexpr (K != Kind::kQ8_0) {
        for (int64_t b = 0; b < nb; ++b) {
          const __m512 mw = _mm512_load_ps(scales + 32 * b + 16);
#pragma GCC unroll 16
          for (int r = 0; r < kTile; ++r) macc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(as[b * kTile + r]), macc[r]);
        }
      }
      const int64_t valid = std::min(kTile, m_len - t * kTile);
      float* o = out + t * kTile * ldo + g * 8;
      for (int64_t r = 0; r < valid; ++r) {
        const __m512 a = _mm512_load_ps(acc_out[r]);  // Q8_0: acc + bias, Q4: (acc + macc) + bias
        _mm512_storeu_ps(o + r * ldo, _mm512_add_ps(K == Kind::kQ8_0 ? a : _mm512_add_ps(a, macc[r]), vb));
      }
    }
  }
  _tile_release();
}
#endif

}  // namespace

bool available() {
#if defined(PAGEDSERVE_AMX_INT8)
  return granted();
#else
  return false;
#endif
}

int64_t tile_rows(int64_t m) {
  if (!available()) return 0;
  const char* mode = std::getenv("PAGEDSERVE_INT8_AMX");
  if (mode != nullptr && std::strcmp(mode, "0") == 0) return 0;
  if (mode != nullptr && std::strcmp(mode, "all") == 0) return m;
  if (m < kMinRows) return 0;
  const int64_t whole = m / kTile * kTile;
  return m - whole >= kMinTail ? m : whole;
}

void pack_rows(const int8_t* q, const float* ad, const float* as, int64_t m_len, int64_t k_len, PackedRows& rows) {
  const int64_t nb = k_len / kBlock, tiles = (m_len + kTile - 1) / kTile;
  rows.m_len = m_len;
  rows.q_buf.assign(tiles * nb * kTileBytes + 64, 0);
  rows.s_buf.assign(2 * tiles * nb * kTile + 16, 0.f);
  int8_t* const dq = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(rows.q_buf.data()) + 63) & ~uintptr_t{63});
  float* const dd = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(rows.s_buf.data()) + 63) & ~uintptr_t{63});
  float* const ds = dd + tiles * nb * kTile;
  for (int64_t m = 0; m < m_len; ++m) {
    const int64_t t = m / kTile, r = m % kTile;
    for (int64_t b = 0; b < nb; ++b) {
      std::memcpy(dq + (t * nb + b) * kTileBytes + r * kBlock, q + m * k_len + b * kBlock, kBlock);
      dd[(t * nb + b) * kTile + r] = ad[m * nb + b];
      ds[(t * nb + b) * kTile + r] = as[m * nb + b];
    }
  }
  rows.q = dq;
  rows.ad = dd;
  rows.as = ds;
}

void groups(Kind kind, const PackedRows& rows, int64_t nb, const uint8_t* w, const float* bias, float* out,
            int64_t ldo, int64_t g_begin, int64_t g_end) {
  TORCH_CHECK((g_end - g_begin) % 2 == 0, "amx_int8::groups: an even number of groups");
#if defined(PAGEDSERVE_AMX_INT8)
  TORCH_CHECK(granted(), "amx_int8::groups: no AMX-INT8 tile state on this CPU");
  switch (kind) {
    case Kind::kQ4_0: return tile_groups<Kind::kQ4_0>(rows, nb, w, bias, out, ldo, g_begin, g_end);
    case Kind::kQ4_1: return tile_groups<Kind::kQ4_1>(rows, nb, w, bias, out, ldo, g_begin, g_end);
    case Kind::kQ8_0: return tile_groups<Kind::kQ8_0>(rows, nb, w, bias, out, ldo, g_begin, g_end);
  }
#else
  (void)kind, (void)rows, (void)nb, (void)w, (void)bias, (void)out, (void)ldo;
  TORCH_CHECK(false, "amx_int8::groups: this build has no AMX-INT8 (PAGEDSERVE_CPU_ISA below amx or no CPU support)");
#endif
}

}  // namespace pagedserve::cpu::amx_int8
