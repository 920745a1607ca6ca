// AMX-INT8 tiles for the int8 activation rows of the Q4_0r8 / Q4_1r8 / Q8_0r8 kernels
// (quant_int8_amx.cpp): the same integer block sums and the same fp32 operations in the same order as
// the VNNI paths of quant_interleaved.cpp / quant_interleaved_q5q8.cpp, so every output is bit for bit
// theirs.
#pragma once

#include <cstdint>
#include <vector>

namespace pagedserve::cpu::amx_int8 {

// Whether this build targets AMX-INT8, the CPU has it and the OS granted the tile state.
bool available();

// How many of a call's first m int8 rows go to the tiles: PAGEDSERVE_INT8_AMX, read at every call,
// "0" turns the tiles off (0: the VNNI path, for tests and benchmarks), "all" sends every row
// (partial tiles too); by default whole 16-row tiles from 16 rows on, plus a last partial tile of
// 8 rows or more (fewer cost less on the VNNI kernel). 0 where the tiles are not available.
int64_t tile_rows(int64_t m);

// A call's int8 activation rows in 16-row tiles, zero rows padding the last one (64-byte aligned
// inside the owner's buffers): quants [tile][block][16][32], block scales ad and scaled sums as
// [tile][block][16].
struct PackedRows {
  const int8_t* q = nullptr;
  const float* ad = nullptr;
  const float* as = nullptr;
  int64_t m_len = 0;
  std::vector<int8_t> q_buf;
  std::vector<float> s_buf;
};

// Packs q [m_len][k_len], ad and as [m_len][k_len / 32] (ActPlanes' planes) into `rows`.
void pack_rows(const int8_t* q, const float* ad, const float* as, int64_t m_len, int64_t k_len, PackedRows& rows);

enum class Kind { kQ4_0, kQ4_1, kQ8_0 };  // the r8 weight layout

// Groups [g_begin, g_end) (an even count) of out [m_len][N] (row stride ldo) from the packed rows
// (nb blocks each) and an r8 weight of layout `kind`.
void groups(Kind kind, const PackedRows& rows, int64_t nb, const uint8_t* w, const float* bias, float* out,
            int64_t ldo, int64_t g_begin, int64_t g_end);

}  // namespace pagedserve::cpu::amx_int8
