// fp32 activations against eight-row weight groups widened to fp32 "panels": the exact (prompt)
// rows of every eight-row layout (quant_interleaved*.cpp).
//
// A chunk's groups are widened a panel at a time: kPanelGroups groups (fewer at a chunk's end) side
// by side, wide[k][lane] for every weight index k of a row (GGUF order) and lane 8i + r = row r of
// the panel's group i. Each activation row's x[k] is broadcast and FMA'd into its lanes, k = 0, 1,
// ..., K - 1 in turn: output n of activation row m is one sequential FMA chain over k (then + bias),
// whatever M, the panel's width, the register blocking or the ISA level is (AVX2 and AVX-512 give
// the same bits). The blocking is a GEMM micro-kernel's: AVX2 carries 6 rows x 16 lanes in 12
// accumulators, AVX-512 12 rows x 32 lanes in 24, the weights' loads and the rows' broadcasts shared.
// A long row's panel is widened in depths of at most kMaxPanelDepth weights of k (128 / 256 KiB, held
// in L2 while every row pass reads it); between depths each output's running sum waits in `out` (an
// exact fp32 store and reload, so the chain and its bits are the same), and the bias joins after the
// last. Depths of 512 would split K = 576 into 512 + 64, a short tail pass that slows short rows.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace pagedserve::cpu::panels {

constexpr int64_t kGroupRows = 8;  // weight rows per group: 8 lanes of a panel
#if defined(__AVX512F__)
constexpr int64_t kPanelGroups = 4;
constexpr int kPanelRows = 12;
#else
constexpr int64_t kPanelGroups = 2;
constexpr int kPanelRows = 6;
#endif

constexpr int64_t kMaxPanelDepth = 2048;  // weights of k per widening, at most
constexpr int64_t kDepthStep = 256;       // depth boundaries: a multiple of every block size

// The depth of each widening for rows of k_len weights: K split evenly, rounded up to kDepthStep.
inline int64_t panel_depth(int64_t k_len) {
  const int64_t parts = (k_len + kMaxPanelDepth - 1) / kMaxPanelDepth;
  return (k_len + parts * kDepthStep - 1) / (parts * kDepthStep) * kDepthStep;
}

// A chunk of `groups` groups rounded up to whole panels (a partial panel runs narrower).
inline int64_t whole_panels(int64_t groups) { return (groups + kPanelGroups - 1) / kPanelGroups * kPanelGroups; }

// Rows [0, M) of x (stride ldx) against a panel of V groups (wide[k][8V], k < k_len): out[m * ldo + l]
// for its 8V rows l, each one FMA chain over k, starting from 0 (`first`) or from the sum `out` holds,
// + bias when `last`.
template <int M, int V>
inline void panel_rows(const float* x, int64_t ldx, int64_t k_len, const float* wide, const float* bias, float* out,
                       int64_t ldo, bool first, bool last) {
  if (!last) bias = nullptr;
  constexpr int64_t kLanes = kGroupRows * V;
#if defined(__AVX512F__)
  constexpr int Z = V / 2;      // 16-lane columns
  constexpr bool kOdd = V % 2;  // and one of 8 lanes
  __m512 acc[M][Z > 0 ? Z : 1];
  __m256 acc8[M];
  for (int m = 0; m < M; ++m) {
    const float* o = out + m * ldo;
    for (int z = 0; z < Z; ++z) acc[m][z] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o + 16 * z);
    acc8[m] = first || !kOdd ? _mm256_setzero_ps() : _mm256_loadu_ps(o + 16 * Z);
  }
  for (int64_t k = 0; k < k_len; ++k) {
    const float* wk = wide + k * kLanes;
    __m512 wz[Z > 0 ? Z : 1];
    for (int z = 0; z < Z; ++z) wz[z] = _mm512_loadu_ps(wk + 16 * z);
    const __m256 w8 = kOdd ? _mm256_loadu_ps(wk + 16 * Z) : _mm256_setzero_ps();
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) {
      const float xv = x[m * ldx + k];
      for (int z = 0; z < Z; ++z) acc[m][z] = _mm512_fmadd_ps(wz[z], _mm512_set1_ps(xv), acc[m][z]);
      if constexpr (kOdd) acc8[m] = _mm256_fmadd_ps(w8, _mm256_set1_ps(xv), acc8[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    float* o = out + m * ldo;
    for (int z = 0; z < Z; ++z) {
      const __m512 a = acc[m][z];
      _mm512_storeu_ps(o + 16 * z, bias != nullptr ? _mm512_add_ps(a, _mm512_loadu_ps(bias + 16 * z)) : a);
    }
    if constexpr (kOdd) {
      const __m256 a = acc8[m];
      _mm256_storeu_ps(o + 16 * Z, bias != nullptr ? _mm256_add_ps(a, _mm256_loadu_ps(bias + 16 * Z)) : a);
    }
  }
#else
  using vec::Vec;
  Vec acc[M][V] = {};
  if (!first)
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < V; ++v) acc[m][v] = vec::load(out + m * ldo + 8 * v);
  for (int64_t k = 0; k < k_len; ++k) {
    const float* wk = wide + k * kLanes;
    Vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = vec::load(wk + 8 * v);
#pragma GCC unroll 6
    for (int m = 0; m < M; ++m) {
      const Vec xb = vec::broadcast(x + m * ldx + k);
      for (int v = 0; v < V; ++v) acc[m][v] = vec::fma(wv[v], xb, acc[m][v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v)
      vec::store(out + m * ldo + 8 * v, bias != nullptr ? acc[m][v] + vec::load(bias + 8 * v) : acc[m][v]);
#endif
}

// Every row of x against one panel of V groups: kPanelRows rows a pass, the rest in passes of
// (8,) 4, 2 and 1 (each pass streams the panel once more; the bits do not depend on the split).
template <int V>
inline void panel_passes(const float* x, int64_t ldx, int64_t m_len, int64_t k_len, const float* wide,
                         const float* bias, float* out, int64_t ldo, bool first, bool last) {
  const auto pass = [&](auto rows, int64_t m) {
    panel_rows<decltype(rows)::value, V>(x + m * ldx, ldx, k_len, wide, bias, out + m * ldo, ldo, first, last);
  };
  int64_t m = 0;
  for (; m + kPanelRows <= m_len; m += kPanelRows) pass(std::integral_constant<int, kPanelRows>{}, m);
#if defined(__AVX512F__)
  for (; m + 8 <= m_len; m += 8) pass(std::integral_constant<int, 8>{}, m);
#endif
  for (; m + 4 <= m_len; m += 4) pass(std::integral_constant<int, 4>{}, m);
  for (; m + 2 <= m_len; m += 2) pass(std::integral_constant<int, 2>{}, m);
  for (; m < m_len; ++m) pass(std::integral_constant<int, 1>{}, m);
}

// Groups [g_begin, g_end) of out[M][N] (N = 8 x groups) with fp32 activations x[M][K], a panel and
// panel_depth(k_len) weights of k at a time. widen(g, k0, k1, wide, stride) writes group g's eight rows'
// weights [k0, k1) as fp32, row r's weight k at wide[(k - k0) * stride + r].
template <class Widen>
void fp32_groups(const float* x, int64_t ldx, int64_t m_len, int64_t k_len, const float* bias, float* out,
                 int64_t ldo, int64_t g_begin, int64_t g_end, Widen&& widen) {
  thread_local std::vector<float> wide;
  const int64_t step = panel_depth(k_len);
  for (int64_t g = g_begin; g < g_end; g += kPanelGroups) {
    const int64_t groups = std::min(kPanelGroups, g_end - g), lanes = kGroupRows * groups;
    const float* pb = bias != nullptr ? bias + g * kGroupRows : nullptr;
    float* po = out + g * kGroupRows;
    for (int64_t k0 = 0; k0 < k_len; k0 += step) {
      const int64_t k1 = std::min(k_len, k0 + step), depth = k1 - k0;
      const bool first = k0 == 0, last = k1 == k_len;
      wide.resize(depth * lanes);
      for (int64_t i = 0; i < groups; ++i) widen(g + i, k0, k1, wide.data() + kGroupRows * i, lanes);
      switch (groups) {
        case 1: panel_passes<1>(x + k0, ldx, m_len, depth, wide.data(), pb, po, ldo, first, last); break;
#if defined(__AVX512F__)
        case 2: panel_passes<2>(x + k0, ldx, m_len, depth, wide.data(), pb, po, ldo, first, last); break;
        case 3: panel_passes<3>(x + k0, ldx, m_len, depth, wide.data(), pb, po, ldo, first, last); break;
        default: panel_passes<4>(x + k0, ldx, m_len, depth, wide.data(), pb, po, ldo, first, last); break;
#else
        default: panel_passes<2>(x + k0, ldx, m_len, depth, wide.data(), pb, po, ldo, first, last); break;
#endif
      }
    }
  }
}

// Eight fp32 rows rows[r * ld + k] (k < k_len) into lanes [0, 8) of wide[k][stride]: for layouts
// whose rows are dequantized whole (the K-quants, Q5, Q8) before the panel pass.
inline void transpose_rows(const float* rows, int64_t ld, int64_t k_len, float* wide, int64_t stride) {
  int64_t k = 0;
#if defined(__AVX2__)
  for (; k + 8 <= k_len; k += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows + i * ld + k);
    // 8x8 transpose: unpack pairs, shuffle quads, then swap 128-bit halves.
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    const __m256 cols[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                            _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                            _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                            _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(wide + (k + i) * stride, cols[i]);
  }
#endif
  for (; k < k_len; ++k)
    for (int r = 0; r < 8; ++r) wide[k * stride + r] = rows[r * ld + k];
}

// Weights [k0, k1) of a group whose rows are dequantized a block at a time (the K-quants, Q5, Q8):
// row_block(b, r, dst) writes row r's block b (kBlockLen fp32 values) to dst; each block's eight
// rows are then transposed into lanes [0, 8) of wide[k][stride]. k0 and k1 are multiples of kBlockLen.
template <int64_t kBlockLen, class RowBlock>
inline void widen_blocks(int64_t k0, int64_t k1, float* wide, int64_t stride, RowBlock&& row_block) {
  float rows[kGroupRows * kBlockLen];
  for (int64_t b = k0 / kBlockLen; b < k1 / kBlockLen; ++b) {
    for (int r = 0; r < kGroupRows; ++r) row_block(b, r, rows + r * kBlockLen);
    transpose_rows(rows, kBlockLen, kBlockLen, wide + (b * kBlockLen - k0) * stride, stride);
  }
}

}  // namespace pagedserve::cpu::panels
