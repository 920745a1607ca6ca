// The AMX-BF16 kernel of quant_linear_bf16 (quant_bf16.cpp has the entry and the panels; layouts in
// quant_bf16.h).
//
// Tiles (2 x 2 blocking, eight tile registers): C[m][n] += X[m][k] . W[n][k] with the activations
// as A (16 rows x 32 bf16, one contiguous KiB per tile) and the panel's weights as B in the VNNI
// pair layout, so a full C tile is the output itself: stored straight into it, no transpose, no
// staging copy (a transposed C epilogue costs a large share of the kernel). Each thread sweeps its chunk's
// panels 128 rows at a time. A 16-row tile load costs several products and straddling cache lines
// doubles it: every tile buffer is 64-byte aligned.
#include "quant_bf16.h"

#if defined(PAGEDSERVE_AMX_BF16)
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "amx_tiles.h"
#include "quant_blocks.h"

namespace pagedserve::cpu::bf16 {
namespace {

using quant::kBlock;

using amx::TileConfig;

// Every tile used here is 16 rows of 64 bytes: C (0-3) 16 x 16 fp32, A (4, 5) 16 x 32 bf16, B (6,
// 7) 16 pairs x 16 columns x 2 bf16.
const TileConfig& tile_config() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = kTile;
      c.colsb[t] = 64;
    }
    return c;
  }();
  return config;
}

// A staged C tile (16 m x 16 n, fp32, row stride 16) into out rows [0, m_rows), columns [n0, n0 +
// n_cols), plus the bias: the path of partial tiles and biased layers.
void store_partial(const float* c, float* out, int64_t ldo, int64_t m_rows, int64_t n0, int64_t n_cols,
                   const float* bias) {
  const __mmask16 mask = n_cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n_cols) - 1);
  const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t m = 0; m < m_rows; ++m)
    _mm512_mask_storeu_ps(out + m * ldo + n0, mask, _mm512_add_ps(_mm512_load_ps(c + 16 * m), b));
}

constexpr int64_t kRowBlockPairs = 4;  // activation tile pairs per row block (128 rows)

// Output columns of panels [p_begin, p_end) for activation rows [0, rows) of a packed block. The
// panels are dequantized once, then the rows are taken a block of kRowBlockPairs tile pairs at a
// time across all of them, so each output row is written left to right: tile stores down a
// 32-column strip of every row (one panel at a time over all rows) costs a large share of the kernel.
void tile_panels(const uint8_t* w, int64_t format, int64_t n_len, int64_t k_len, const c10::BFloat16* packed,
            int64_t rows, const float* bias, float* out, int64_t ldo, int64_t p_begin, int64_t p_end) {
  const int64_t nb = k_len / kBlock, pairs = (rows + kPanel - 1) / kPanel, panel_len = kPanel * k_len;
  thread_local std::vector<c10::BFloat16> panel_buf;
  c10::BFloat16* const panel_base = aligned_buffer(panel_buf, (p_end - p_begin) * panel_len);
  alignas(64) float c[kTile * kTile];
  for (int64_t p = p_begin; p < p_end; ++p)
    dequant_panel(w, format, p * kPanel, n_len, k_len, panel_base + (p - p_begin) * panel_len);
  _tile_loadconfig(&tile_config());
  for (int64_t rb = 0; rb < pairs; rb += kRowBlockPairs) {
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t n0 = p * kPanel;
      const c10::BFloat16* w0 = panel_base + (p - p_begin) * panel_len;
      const c10::BFloat16* w1 = w0 + nb * kPackedBlock;
      for (int64_t mp = rb; mp < std::min(pairs, rb + kRowBlockPairs); ++mp) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const c10::BFloat16* a0 = packed + (2 * mp) * nb * kPackedBlock;
        const c10::BFloat16* a1 = a0 + nb * kPackedBlock;
        // Tile loads, not the dot products, bound this loop (a 16-row load costs more than a
        // tdpbf16ps): each load is issued right before the first product that needs it, and a pair
        // whose second m tile is all padding skips that tile.
        const bool second = rows - mp * kPanel > kTile;
        for (int64_t b = 0; b < nb; ++b) {
          _tile_loadd(4, a0 + b * kPackedBlock, 64);
          _tile_loadd(6, w0 + b * kPackedBlock, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, w1 + b * kPackedBlock, 64);
          _tile_dpbf16ps(1, 4, 7);
          if (second) {  // the same every iteration: predicted
            _tile_loadd(5, a1 + b * kPackedBlock, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        // C tile 2 * mt + nt: rows mp * 32 + mt * 16, columns n0 + nt * 16. Full tiles of an
        // unbiased layer go straight to the output; the rest through `c`.
        const int64_t m_base = mp * kPanel;
        const int64_t rows0 = std::min<int64_t>(kTile, rows - m_base);
        const int64_t rows1 = std::min<int64_t>(kTile, rows - m_base - kTile);
        const int64_t cols0 = std::min<int64_t>(kTile, n_len - n0);
        const int64_t cols1 = std::min<int64_t>(kTile, n_len - n0 - kTile);
        const bool direct0 = bias == nullptr && rows0 == kTile, direct1 = bias == nullptr && rows1 == kTile;
        const int64_t ldo_bytes = ldo * static_cast<int64_t>(sizeof(float));
        float* o0 = out + m_base * ldo + n0;
        float* o1 = o0 + kTile * ldo;
#define PAGEDSERVE_STORE_C(T, O, ROWS, COLS, COL0, DIRECT)                    \
  if ((ROWS) > 0 && (COLS) > 0) {                                             \
    if ((DIRECT) && (COLS) == kTile) {                                        \
      _tile_stored(T, (O) + (COL0), ldo_bytes);                               \
    } else {                                                                  \
      _tile_stored(T, c, 64);                                                 \
      store_partial(c, (O) - n0, ldo, ROWS, n0 + (COL0), COLS, bias);         \
    }                                                                         \
  }
        PAGEDSERVE_STORE_C(0, o0, rows0, cols0, 0, direct0)
        PAGEDSERVE_STORE_C(1, o0, rows0, cols1, kTile, direct0)
        if (second) {
          PAGEDSERVE_STORE_C(2, o1, rows1, cols0, 0, direct1)
          PAGEDSERVE_STORE_C(3, o1, rows1, cols1, kTile, direct1)
        }
#undef PAGEDSERVE_STORE_C
      }
    }
  }
  _tile_release();
}

}  // namespace

bool amx_granted() { return amx::request_tile_state(); }

void amx_panels(const uint8_t* w, int64_t format, int64_t n_len, int64_t k_len, const c10::BFloat16* packed,
                int64_t rows, const float* bias, float* out, int64_t ldo, int64_t p_begin, int64_t p_end) {
  tile_panels(w, format, n_len, k_len, packed, rows, bias, out, ldo, p_begin, p_end);
}

}  // namespace pagedserve::cpu::bf16

#endif  // PAGEDSERVE_AMX_BF16
