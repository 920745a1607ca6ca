// The AVX512-BF16 kernel of quant_linear_bf16, for CPUs with bf16 dot products but no AMX (AMD Zen 4
// and 5, Intel Cooper Lake): the same panels and packed activations as the AMX kernel (quant_bf16.h),
// multiplied with `vdpbf16ps`. A micro-tile is 8 activation rows by a panel's 32 columns (16 fp32
// accumulators, two weight vectors per k pair, each activation pair broadcast from memory), so each
// k pair costs 2 vector loads and 8 broadcasts for 16 dot products. A row's sum runs over k in
// order, one pair at a time, whatever the row count or the row's place in the step: its output is
// the same bits alone and in any batch.
#include "quant_bf16.h"

#if defined(PAGEDSERVE_BF16_PANELS)
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "quant_blocks.h"

namespace pagedserve::cpu::bf16 {
namespace {

constexpr int kRows = 8;            // activation rows per micro-tile: half an activation tile

// Out rows [m0, m0 + R) (within one 16-row activation tile), columns [n0, n0 + 32) of the panel
// (w0, w1: its two n tiles), plus bias. Row m0 + r's k block b: `rows` + b * kPackedBlock + r * 32.
template <int R>
void micro_tile(const c10::BFloat16* packed, int64_t nb, int64_t m0, const c10::BFloat16* w0,
                const c10::BFloat16* w1, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n_len) {
  const c10::BFloat16* rows = packed + (m0 / kTile) * nb * kPackedBlock + (m0 % kTile) * 32;
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const c10::BFloat16* b0 = w0 + b * kPackedBlock;
    const c10::BFloat16* b1 = w1 + b * kPackedBlock;
    const int32_t* a = reinterpret_cast<const int32_t*>(rows + b * kPackedBlock);
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
      const __m512bh v0 = (__m512bh)_mm512_load_si512(b0 + p * 32);
      const __m512bh v1 = (__m512bh)_mm512_load_si512(b1 + p * 32);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(a[r * 16 + p]);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], v0, x);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], v1, x);
      }
    }
  }
  for (int t = 0; t < 2; ++t) {
    const int64_t col = n0 + t * kTile, cols = std::min<int64_t>(kTile, n_len - col);
    if (cols <= 0) break;
    const __mmask16 mask = cols == kTile ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    const __m512 add = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out + (m0 + r) * ldo + col, mask, _mm512_add_ps(acc[r][t], add));
  }
}

using MicroTile = void (*)(const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*, const c10::BFloat16*,
                           const float*, float*, int64_t, int64_t, int64_t);

template <int... R>
constexpr std::array<MicroTile, sizeof...(R)> micro_tiles(std::integer_sequence<int, R...>) {
  return {&micro_tile<R + 1>...};
}

// micro_tile<R> for R = 1..kRows (index R - 1): the last rows of a block take the one of their count.
constexpr auto kMicroTiles = micro_tiles(std::make_integer_sequence<int, kRows>{});

}  // namespace

void dot_panels(const uint8_t* w, int64_t format, int64_t n_len, int64_t k_len, const c10::BFloat16* packed,
                int64_t rows, const float* bias, float* out, int64_t ldo, int64_t p_begin, int64_t p_end) {
  const int64_t nb = k_len / quant::kBlock, panel_len = kPanel * k_len;
  thread_local std::vector<c10::BFloat16> panel_buf;
  c10::BFloat16* const panel = aligned_buffer(panel_buf, panel_len);
  // One panel at a time over every row: dequantized just before, its bf16 (36 KiB at K = 576) stays
  // in L1/L2 while the packed rows stream past. Sweeping a chunk's panels per block of rows (the AMX
  // order, whose cost is its tile stores) halved this kernel at 1,024 rows: ~1 MiB of panels left L2.
  for (int64_t p = p_begin; p < p_end; ++p) {
    dequant_panel(w, format, p * kPanel, n_len, k_len, panel);
    const c10::BFloat16* w1 = panel + nb * kPackedBlock;
    for (int64_t m0 = 0; m0 < rows; m0 += kRows) {
      const int64_t count = std::min<int64_t>(kRows, rows - m0);
      kMicroTiles[count - 1](packed, nb, m0, panel, w1, bias, out, ldo, p * kPanel, n_len);
    }
  }
}

}  // namespace pagedserve::cpu::bf16

#endif  // PAGEDSERVE_BF16_PANELS
