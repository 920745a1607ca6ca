// The bf16 linear layers on GGUF-quantized weights (quant_bf16.cpp): what the panel code shares
// with the two kernels that multiply on it, AMX tiles (quant_amx.cpp) and AVX512-BF16 dot products
// (quant_bf16_dot.cpp). Both read the same layouts, so a row's output differs between them only
// by the hardware's summation of each product pair.
//
// Layouts (bf16 values, each 64-byte aligned block 1 KiB):
// - activations, packed per call: [m tile of 16 rows][k block of 32][16 m][32 k]; rows past the
//   last to a multiple of kPanel are zeros;
// - a panel of kPanel weight rows, dequantized once per call and chunk: [n tile of 16][k block]
//   [16 k pairs][16 n][2] (the VNNI pair layout: one 64-byte line is pair p of 16 columns).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define PAGEDSERVE_BF16_PANELS 1
#endif
#if defined(PAGEDSERVE_BF16_PANELS) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define PAGEDSERVE_AMX_BF16 1
#endif

namespace pagedserve::cpu::bf16 {

constexpr int64_t kTile = 16;                     // rows of a tile; fp32 columns of a C tile
constexpr int64_t kPanel = 2 * kTile;             // weight rows per panel (two n tiles)
constexpr int64_t kPackedBlock = kTile * 32;      // bf16 values of one packed 16 x 32 block

// The signature both kernels share: output columns of panels [p_begin, p_end) for activation rows
// [0, rows) of a packed block (`packed`), plus `bias` (null: none), into out (row stride ldo).
using PanelKernel = void (*)(const uint8_t* w, int64_t format, int64_t n_len, int64_t k_len,
                             const c10::BFloat16* packed, int64_t rows, const float* bias, float* out,
                             int64_t ldo, int64_t p_begin, int64_t p_end);

#if defined(PAGEDSERVE_BF16_PANELS)
// `len` bf16 values of `buf` starting on a 64-byte boundary (grown as needed).
c10::BFloat16* aligned_buffer(std::vector<c10::BFloat16>& buf, size_t len);

// Panel [n0, n0 + kPanel) of weight w (N = n_len rows, K = k_len) in the panel layout; rows past
// n_len are zeros. Any format quant_linear takes; an unknown one is an error naming it.
void dequant_panel(const uint8_t* w, int64_t format, int64_t n0, int64_t n_len, int64_t k_len, c10::BFloat16* panel);

// The AVX512-BF16 kernel (quant_bf16_dot.cpp).
void dot_panels(const uint8_t* w, int64_t format, int64_t n_len, int64_t k_len, const c10::BFloat16* packed,
                int64_t rows, const float* bias, float* out, int64_t ldo, int64_t p_begin, int64_t p_end);
#endif

#if defined(PAGEDSERVE_AMX_BF16)
// Whether the OS granted this process the AMX tile state (asked once).
bool amx_granted();

// The AMX-BF16 kernel (quant_amx.cpp).
void amx_panels(const uint8_t* w, int64_t format, int64_t n_len, int64_t k_len, const c10::BFloat16* packed,
                int64_t rows, const float* bias, float* out, int64_t ldo, int64_t p_begin, int64_t p_end);
#endif

}  // namespace pagedserve::cpu::bf16
