// AMX-INT8 tiles for the int8 rows of the Q4_0r8 / Q4_1r8 kernel (layout: quant_interleaved.cpp).
//
// Per 32-weight block b, a pair of groups (weight rows 8g..8g+15) and 16 activation rows:
//   A = the rows' 32 quants (s8, 16 x 32 bytes, packed once per call by pack_rows),
//   B = the 16 weight rows' 32 nibbles in the VNNI layout (8 x 64 bytes): B row j (< 4) is chunk
//       j's low nibbles, row 4 + j its high ones, i.e. lane n holds weight row n's weights 4j..4j+3
//       (16 + 4j.. for the high half), the same K order as A's bytes. The r8 chunks already put the
//       rows' 4-byte pieces side by side, so B is the masked chunks stored as they are;
//   C = A . B (TDPBSSD: the nibbles 0..15 are valid s8) = the exact int32 block sums, 16 activation
//       rows x 16 weight rows, the same integers the VNNI lanes hold.
// The fp32 epilogue then runs, per activation row and block in block order, the VNNI pair path's
// very operations on the same 16 lanes: acc = fma(float(sum), dw * ad, acc), macc = fma(mw, as, macc),
// out = (acc + macc) + bias_or_0; C's rows are the output rows, so no transpose either.
#include "quant_int8_amx.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <c10/util/Exception.h>

#include "quant_blocks.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#define PAGEDSERVE_AMX_INT8 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "r8_lanes.h"
#endif

namespace pagedserve::cpu::amx_int8 {
namespace {

using quant::kBlock;
constexpr int64_t kTile = 16;                    // activation rows per tile
constexpr int64_t kTileBytes = kTile * kBlock;   // one A tile: 16 rows x 32 quants
constexpr int64_t kBBytes = 8 * 64;              // one B tile: 8 rows x 64 bytes
// From this many int8 rows the tiles beat the VNNI kernel (benchmarks/kernels/quant_rows_bench.py).
constexpr int64_t kMinRows = 16;

#if defined(PAGEDSERVE_AMX_INT8)
// The CPU reports AMX-TILE and AMX-INT8 (CPUID.(7,0):EDX bits 24, 25); Linux hands the tile state
// over only on request (arch_prctl, as quant_amx.cpp does), once per process.
bool granted() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile 0: C, 16 x 16 int32; 1: A, 16 rows x 32 s8; 2: B, 8 rows x 64 s8.
const TileConfig& tile_config() {
  static const TileConfig config = [] {
    TileConfig c;
    c.rows[0] = kTile;
    c.colsb[0] = 64;
    c.rows[1] = kTile;
    c.colsb[1] = kBlock;
    c.rows[2] = 8;
    c.colsb[2] = 64;
    return c;
  }();
  return config;
}

template <bool kQ41>
void tile_groups(const int8_t* packed, const float* ad, const float* as, int64_t m_len, int64_t nb,
                 const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t g_begin, int64_t g_end) {
  constexpr int64_t tb = 8 * (kQ41 ? sizeof(quant::BlockQ4_1) : sizeof(quant::BlockQ4_0));
  constexpr int64_t qoff = kQ41 ? 32 : 16;
  const int64_t tiles = (m_len + kTile - 1) / kTile;
  thread_local std::vector<int8_t> b_buf;
  thread_local std::vector<float> scales;  // per block: dw[16], then mw[16]
  b_buf.resize(nb * kBBytes + 64);
  scales.resize(32 * nb);
  int8_t* const bt = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(b_buf.data()) + 63) & ~uintptr_t{63});
  alignas(64) int32_t c[kTile * kTile];
  _tile_loadconfig(&tile_config());
  for (int64_t g = g_begin; g < g_end; g += 2) {
    const uint8_t* tiles0 = w + g * nb * tb;
    const uint8_t* tiles1 = tiles0 + nb * tb;
    for (int64_t b = 0; b < nb; ++b) {  // this pair's B tiles and scales, once for every activation tile
      const uint8_t* t0 = tiles0 + b * tb;
      const uint8_t* t1 = tiles1 + b * tb;
      const __m512 dw = r8::halves_to_ps(t0, t1);
      _mm512_storeu_ps(&scales[32 * b], dw);
      _mm512_storeu_ps(&scales[32 * b + 16],
                       kQ41 ? r8::halves_to_ps(t0 + 16, t1 + 16) : _mm512_mul_ps(dw, _mm512_set1_ps(-8.f)));
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = r8::load_pair(t0 + qoff + 32 * j, t1 + qoff + 32 * j);
        _mm512_store_si512(bt + b * kBBytes + 64 * j, _mm512_and_si512(raw, _mm512_set1_epi8(0x0F)));
        _mm512_store_si512(bt + b * kBBytes + 64 * (4 + j),
                           _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F)));
      }
    }
    const __m512 vb = bias != nullptr ? _mm512_loadu_ps(bias + g * 8) : _mm512_setzero_ps();
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t m0 = t * kTile, rows = std::min(kTile, m_len - m0);
      const int8_t* a = packed + t * nb * kTileBytes;
      __m512 acc[kTile], macc[kTile];
      for (int m = 0; m < kTile; ++m) acc[m] = macc[m] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        _tile_zero(0);
        _tile_loadd(1, a + b * kTileBytes, kBlock);
        _tile_loadd(2, bt + b * kBBytes, 64);
        _tile_dpbssd(0, 1, 2);
        _tile_stored(0, c, 64);
        const __m512 dw = _mm512_loadu_ps(&scales[32 * b]), mw = _mm512_loadu_ps(&scales[32 * b + 16]);
        const float* adb = ad + m0 * nb + b;
        const float* asb = as + m0 * nb + b;
        for (int64_t m = 0; m < rows; ++m) {
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(c + kTile * m));
          acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(adb[m * nb])), acc[m]);
          macc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(asb[m * nb]), macc[m]);
        }
      }
      for (int64_t m = 0; m < rows; ++m)
        _mm512_storeu_ps(out + (m0 + m) * ldo + g * 8, _mm512_add_ps(_mm512_add_ps(acc[m], macc[m]), vb));
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

int64_t min_rows() {
  constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
  if (!available()) return kNever;
  const char* mode = std::getenv("PAGEDSERVE_INT8_AMX");
  if (mode != nullptr && std::strcmp(mode, "0") == 0) return kNever;
  if (mode != nullptr && std::strcmp(mode, "all") == 0) return 1;
  return kMinRows;
}

const int8_t* pack_rows(const int8_t* q, int64_t m_len, int64_t k_len, std::vector<int8_t>& buf) {
  const int64_t nb = k_len / kBlock, tiles = (m_len + kTile - 1) / kTile;
  buf.assign(tiles * nb * kTileBytes + 64, 0);
  int8_t* const dst = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  for (int64_t m = 0; m < m_len; ++m)
    for (int64_t b = 0; b < nb; ++b)
      std::memcpy(dst + ((m / kTile) * nb + b) * kTileBytes + (m % kTile) * kBlock, q + m * k_len + b * kBlock,
                  kBlock);
  return dst;
}

void groups(bool q4_1, const int8_t* packed, const float* ad, const float* as, int64_t m_len, int64_t nb,
            const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t g_begin, int64_t g_end) {
  TORCH_CHECK((g_end - g_begin) % 2 == 0, "amx_int8::groups: an even number of groups");
#if defined(PAGEDSERVE_AMX_INT8)
  TORCH_CHECK(granted(), "amx_int8::groups: no AMX-INT8 tile state on this CPU");
  if (q4_1) return tile_groups<true>(packed, ad, as, m_len, nb, w, bias, out, ldo, g_begin, g_end);
  tile_groups<false>(packed, ad, as, m_len, nb, w, bias, out, ldo, g_begin, g_end);
#else
  (void)q4_1, (void)packed, (void)ad, (void)as, (void)m_len, (void)nb, (void)w, (void)bias, (void)out, (void)ldo;
  TORCH_CHECK(false, "amx_int8::groups: this build has no AMX-INT8 (PAGEDSERVE_CPU_ISA below amx or no CPU support)");
#endif
}

}  // namespace pagedserve::cpu::amx_int8
