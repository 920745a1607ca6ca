// Linear layers on GGUF-quantized weights for many rows at once, on AMX-BF16 tiles.
//
// The int8 row passes (quant_gemm.cpp, quant_interleaved.cpp) run ~50 GMAC/s a thread: right for
// a few rows, where a step is bound by reading the weights, far from what a CPU with AMX does for
// a prefill or a large decode batch. Here, per panel of 32 output rows, the packed blocks are
// dequantized once into bf16 (each value as the fp32 dequantization gives it, rounded to nearest
// even: what `dequantize(w).bfloat16()` holds) and multiplied by every activation row on the tiles,
// with fp32 accumulation: no per-32-block epilogue (the AMX-INT8 pass tried before paid one, and
// lost to the VNNI pass), and no fp32 or bf16 copy of the weight kept anywhere.
//
// Tiles (2 x 2 blocking, eight tile registers): C[m][n] += X[m][k] . W[n][k] with the activations
// as A (16 rows x 32 bf16; packed once per call into one contiguous KiB per tile: [m tile][k
// block][16 m][32 k]) and the panel's weights as B in the VNNI pair layout ([n tile][k block][16
// k pairs][16 n][2]; the r8 layouts are dequantized straight into it, GGUF-order rows transposed
// per 16 x 16 block), so a full C tile is the output itself: stored straight into it, no
// transpose, no staging copy (a transposed C epilogue cost ~40% of the kernel). Each thread
// dequantizes a chunk of panels once per block of activation rows (up to 1,024) and sweeps them
// 128 rows at a time. A 16-row tile load costs ~3 products here and straddling cache lines doubles
// it: every tile buffer is 64-byte aligned.
#include "ops.h"
#include "parallel.h"
#include "quant_blocks.h"
#include "quant_interleaved.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define PAGEDSERVE_AMX_BF16 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstring>
#include <vector>

namespace pagedserve::cpu {

#if defined(PAGEDSERVE_AMX_BF16)
namespace {

using namespace quant;  // NOLINT: the block formats (quant_blocks.h)

constexpr int64_t kTile = 16;         // rows of a tile; fp32 columns of a C tile
constexpr int64_t kPanel = 2 * kTile;  // weight rows per panel (two A tiles)
constexpr int64_t kPackedBlock = kTile * kBlock;  // bf16 values of one packed B tile

// `len` bf16 values of `buf` starting on a 64-byte boundary (grown as needed). Tile loads of rows
// that straddle cache lines run at less than half speed: a std::vector's own 16-byte-aligned data
// cost the whole kernel ~2x.
c10::BFloat16* aligned_buffer(std::vector<c10::BFloat16>& buf, size_t len) {
  constexpr size_t kSlack = 64 / sizeof(c10::BFloat16);
  if (buf.size() < len + kSlack) buf.resize(len + kSlack);
  const auto at = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<c10::BFloat16*>((at + 63) / 64 * 64);
}

// Linux hands a process the AMX tile state only on request (arch_prctl); once per process.
bool request_amx() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

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

// In-register transpose of a 16 x 16 matrix of 32-bit values (r[i] is row i on entry, column i on exit).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[16];  // u[4a + c], 128-bit lane L: column 4L + c of rows 4a..4a+3
  for (int a = 0; a < 16; a += 4) {
    u[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
    u[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
    u[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
    u[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i s0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), s1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

// 32 fp32 (lo = values 0..15, hi = 16..31) as 32 bf16, round to nearest even.
inline void store_bf16(c10::BFloat16* dst, __m512 lo, __m512 hi) {
  _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
}

// Rows [0, rows) of x (fp32, row stride ldx) as A tiles: packed[t][b] holds rows 16t..16t+15, k
// block b, as bf16 (row-major, 64 bytes a row); rows past `rows` (to a multiple of kPanel) are zeros.
void pack_activations(const float* x, int64_t ldx, int64_t rows, int64_t nb, c10::BFloat16* packed) {
  const int64_t tiles = (rows + kPanel - 1) / kPanel * (kPanel / kTile);
  parallel_chunks(tiles, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      for (int64_t b = 0; b < nb; ++b) {
        c10::BFloat16* dst = packed + (t * nb + b) * kPackedBlock;
        for (int i = 0; i < kTile; ++i) {
          const int64_t m = t * kTile + i;
          if (m < rows) {
            const float* src = x + m * ldx + b * kBlock;
            store_bf16(dst + i * kBlock, _mm512_loadu_ps(src), _mm512_loadu_ps(src + 16));
          } else {
            _mm512_storeu_si512(dst + i * kBlock, _mm512_setzero_si512());
          }
        }
      }
    }
  }, /*openmp=*/rows >= openmp_rows());
}

// Weight row n of a GGUF-order weight (F = Q8_0, Q4_0, Q4_1) as K bf16, block b at dst + b * kPackedBlock.
template <int64_t F>
void dequant_row_bf16(const uint8_t* row, int64_t nb, c10::BFloat16* dst) {
  alignas(64) float wide[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    dequant_block<F>(row + b * block_bytes(F), wide);
    store_bf16(dst + b * kPackedBlock, _mm512_load_ps(wide), _mm512_load_ps(wide + 16));
  }
}

// Sixteen rows of an r8 weight (groups g0 and g1 of eight; quant_interleaved.cpp has the layout;
// g1 null: those rows are zeros) straight into B tiles: block b's pair p at dst + b * kPackedBlock
// + p * 32, word 2n + e = weight (n, 2p + e). Each value is the fp32 dequantization, fma(q, d, m)
// as dequant_block computes it, rounded to bf16 (nearest even). Per tile the bytes of both k of a
// pair are gathered for all eight rows with one byte permute (the pair's k sit side by side in a
// row's packed bytes: low nibbles for pairs 0-7, high for 8-15), so no transpose is needed.
template <int64_t F>
void dequant_tile_vnni(const uint8_t* g0, const uint8_t* g1, int64_t nb, c10::BFloat16* dst) {
  constexpr int64_t tile_len = 8 * (F == kQuantQ4_1 ? sizeof(BlockQ4_1) : sizeof(BlockQ4_0));
  constexpr int64_t quants_at = F == kQuantQ4_1 ? 32 : 16;
  // Output byte 16 p' + 2 r + e (pair p' of the low nibbles, row r, k 2p' + e) <- packed byte i =
  // 2p' + e of row r, at chunk i / 4, byte 4r + i % 4; p' = 0..3 in the first half, 4..7 the second.
  alignas(64) uint8_t index[2][64];
  for (int half = 0; half < 2; ++half)
    for (int pp = 0; pp < 4; ++pp)
      for (int r = 0; r < 8; ++r)
        for (int e = 0; e < 2; ++e) {
          const int i = 2 * (pp + 4 * half) + e;
          index[half][16 * pp + 2 * r + e] = static_cast<uint8_t>((i / 4) * 32 + 4 * r + i % 4);
        }
  const __m512i idx[2] = {_mm512_load_si512(index[0]), _mm512_load_si512(index[1])};
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);  // row n of lane 2n + e
  alignas(64) uint8_t q[2][2][128] = {};  // [group][low, high nibbles][p' * 16 + 2r + e]
  for (int64_t b = 0; b < nb; ++b) {
    __m512 d[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, m[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int g = 0; g < 2; ++g) {
      const uint8_t* group = g == 0 ? g0 : g1;
      if (group == nullptr) continue;
      const uint8_t* tile = group + b * tile_len;
      const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile)));
      const __m256 m8 = F == kQuantQ4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 16)))
                                        : _mm256_mul_ps(d8, _mm256_set1_ps(-8.f));
      d[g] = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(d8));
      m[g] = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(m8));
      const __m512i q0 = _mm512_loadu_si512(tile + quants_at), q1 = _mm512_loadu_si512(tile + quants_at + 64);
      for (int half = 0; half < 2; ++half) {
        const __m512i bytes = _mm512_permutex2var_epi8(q0, idx[half], q1);
        _mm512_store_si512(q[g][0] + 64 * half, _mm512_and_si512(bytes, nibble));
        _mm512_store_si512(q[g][1] + 64 * half, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble));
      }
    }
    c10::BFloat16* out = dst + b * kPackedBlock;
    for (int p = 0; p < kTile; ++p) {
      const int at = 16 * (p % 8), high = p / 8;
      const __m512 lo = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q[0][high] + at)))),
          d[0], m[0]);
      const __m512 hi = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q[1][high] + at)))),
          d[1], m[1]);
      store_bf16(out + p * 2 * kTile, lo, hi);
    }
  }
}

// Where dequantization writes weight row n0 + r's block b: [r / 16][b][r % 16][32], one contiguous
// KiB per 16 rows and k block (then transposed in place into the B tile's pair layout).
inline c10::BFloat16* panel_at(c10::BFloat16* panel, int64_t nb, int64_t r) {
  return panel + (r / kTile) * nb * kPackedBlock + (r % kTile) * kBlock;
}

void dequant_panel(const uint8_t* w, int64_t format, int64_t n0, int64_t n_len, int64_t k_len, c10::BFloat16* panel) {
  const int64_t nb = k_len / kBlock, row_bytes = nb * block_bytes(format);
  const int64_t rows = std::min(kPanel, n_len - n0);
  if (is_interleaved(format)) {  // n0 and n_len are multiples of 8: whole groups, B tiles directly
    for (int64_t t = 0; t < 2; ++t) {
      c10::BFloat16* dst = panel + t * nb * kPackedBlock;
      if (kTile * t >= rows) {
        std::fill_n(dst, nb * kPackedBlock, c10::BFloat16(0.f));
        continue;
      }
      const uint8_t* g0 = w + (n0 + kTile * t) * row_bytes;
      const uint8_t* g1 = kTile * t + 8 < rows ? g0 + 8 * row_bytes : nullptr;
      if (format == kQuantQ4_0R8) {
        dequant_tile_vnni<kQuantQ4_0>(g0, g1, nb, dst);
      } else {  // is_interleaved: the other eight-row layout
        dequant_tile_vnni<kQuantQ4_1>(g0, g1, nb, dst);
      }
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {  // GGUF order: rows dequantized, then each 16 x 16 block transposed
    const uint8_t* row = w + (n0 + r) * row_bytes;
    switch (format) {
      case kQuantQ8_0: dequant_row_bf16<kQuantQ8_0>(row, nb, panel_at(panel, nb, r)); break;
      case kQuantQ4_0: dequant_row_bf16<kQuantQ4_0>(row, nb, panel_at(panel, nb, r)); break;
      case kQuantQ4_1: dequant_row_bf16<kQuantQ4_1>(row, nb, panel_at(panel, nb, r)); break;
      case kQuantQ5_0: dequant_row_bf16<kQuantQ5_0>(row, nb, panel_at(panel, nb, r)); break;
      case kQuantQ5_1: dequant_row_bf16<kQuantQ5_1>(row, nb, panel_at(panel, nb, r)); break;
      default: TORCH_CHECK(false, "quant_linear_bf16: unknown format ", format);
    }
  }
  for (int64_t r = rows; r < kPanel; ++r)
    for (int64_t b = 0; b < nb; ++b) std::fill_n(panel_at(panel, nb, r) + b * kPackedBlock, kBlock, c10::BFloat16(0.f));
  for (int64_t block = 0; block < 2 * nb; ++block) {  // 16 rows x 16 pairs -> 16 pairs x 16 rows
    c10::BFloat16* tile = panel + block * kPackedBlock;
    __m512i r[16];
    for (int i = 0; i < kTile; ++i) r[i] = _mm512_load_si512(tile + i * kBlock);
    transpose16(r);
    for (int i = 0; i < kTile; ++i) _mm512_store_si512(tile + i * kBlock, r[i]);
  }
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
// 32-column strip of every row (one panel at a time over all rows) cost ~35% of the kernel.
void panels(const uint8_t* w, int64_t format, int64_t n_len, int64_t k_len, const c10::BFloat16* packed,
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
        // Tile loads, not the dot products, bound this loop (a 16-row load costs ~3x a tdpbf16ps
        // here): each load is issued right before the first product that needs it, and a pair
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

bool amx_bf16_available() { return request_amx(); }

void quant_linear_bf16(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t format,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(request_amx(), "quant_linear_bf16: the kernel could not get AMX tile state from the OS");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "quant_linear_bf16: fp32 x and out");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1,
              "quant_linear_bf16: rows must be contiguous");
  const int64_t m_len = x.size(0), k_len = x.size(1), n_len = qweight.size(0);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "quant_linear_bf16: qweight must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(k_len % kBlock == 0 && qweight.size(1) == k_len / kBlock * block_bytes(format),
              "quant_linear_bf16: qweight has ", qweight.size(1), " bytes per row; K=", k_len, " needs ",
              k_len / kBlock * block_bytes(format));
  TORCH_CHECK(!is_interleaved(format) || n_len % 8 == 0, "quant_linear_bf16: an r8 weight has a multiple of 8 rows");
  TORCH_CHECK(out.size(0) == m_len && out.size(1) == n_len, "quant_linear_bf16: out must be [M, N]");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_len,
                "quant_linear_bf16: bias must be contiguous fp32 [N]");
    b = bias->data_ptr<float>();
  }
  if (m_len == 0 || n_len == 0) return;
  const int64_t nb = k_len / kBlock;
  // Activation rows per block (each block dequantizes every panel once): a packed copy of up to
  // ~3 MiB, whole pairs of tiles. Only a row block's tiles need stay in L2 beside a chunk's panels.
  const int64_t block_rows = std::clamp<int64_t>((3 << 20) / (k_len * 2) / kPanel * kPanel, kPanel, 1024);
  const int64_t num_panels = (n_len + kPanel - 1) / kPanel;
  // Panels per chunk: their dequantized bf16 (kept for the whole row loop) within ~1 MiB, and
  // whole rounds of chunks for the threads.
  const int64_t max_chunk = std::max<int64_t>(1, (1 << 20) / (kPanel * k_len * 2));
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t rounds = (num_panels + max_chunk * threads - 1) / (max_chunk * threads);
  const int64_t chunk = (num_panels + rounds * threads - 1) / (rounds * threads);
  // Kept per calling thread: a fresh buffer each call paid its page faults (~0.1 ms at 1,024 rows).
  thread_local std::vector<c10::BFloat16> packed;
  // The caller's buffer (a thread_local named in the lambda would be each thread's own).
  c10::BFloat16* const pk =
      aligned_buffer(packed, (std::min(block_rows, m_len) + kPanel - 1) / kPanel * kPanel * k_len);
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m0 = 0; m0 < m_len; m0 += block_rows) {
    const int64_t rows = std::min(block_rows, m_len - m0);
    pack_activations(xp + m0 * x.stride(0), x.stride(0), rows, nb, pk);
    parallel_chunks(num_panels, chunk, [&](int64_t begin, int64_t end) {
      panels(w, format, n_len, k_len, pk, rows, b, op + m0 * out.stride(0), out.stride(0), begin, end);
    }, /*openmp=*/m_len >= openmp_rows());
  }
}

#else  // no AMX-BF16 in this build's target

bool amx_bf16_available() { return false; }

void quant_linear_bf16(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                       const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "quant_linear_bf16: this CPU (or build) has no AMX-BF16; use quant_linear");
}

#endif

}  // namespace pagedserve::cpu
