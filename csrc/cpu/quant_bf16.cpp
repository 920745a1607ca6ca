// Linear layers on GGUF-quantized weights for many rows at once, in bf16: the panels both bf16
// kernels multiply on, and the entry that picks one.
//
// The int8 row passes (quant_gemm.cpp, quant_interleaved.cpp) run ~50 GMAC/s a thread: right for
// a few rows, where a step is bound by reading the weights, far from what a CPU with bf16 dot
// products does for a prefill or a large decode batch. Here, per panel of 32 output rows, the packed
// blocks are dequantized once into bf16 (each value as the fp32 dequantization gives it, rounded to
// nearest even: what `dequantize(w).bfloat16()` holds) and multiplied by every activation row with
// fp32 accumulation, on AMX tiles where the CPU has them (quant_amx.cpp), else with AVX512-BF16
// `vdpbf16ps` (quant_bf16_dot.cpp): no per-32-block epilogue, and no fp32 or bf16 copy of the
// weight kept anywhere. Layouts: quant_bf16.h. Each thread dequantizes a chunk of panels once per
// block of activation rows (up to 1,024) and sweeps them.
#include "quant_bf16.h"

#include "ops.h"
#include "parallel.h"
#include "quant_blocks.h"
#include "quant_interleaved.h"
#include "quant_interleaved_q5q8.h"
#include "quant_interleaved_k.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace pagedserve::cpu {

#if defined(PAGEDSERVE_BF16_PANELS)
namespace bf16 {
namespace {

using namespace quant;  // NOLINT: the block formats (quant_blocks.h)

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

// Weight row n of a GGUF-order weight (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
// IQ4_XS) as K bf16, 32-weight
// block b at dst + b * kPackedBlock (nb of them: a K-quant block fills eight). Each value is
// dequant_block's fp32 (the reference's bits) rounded to nearest even.
template <int64_t F>
void dequant_row_bf16(const uint8_t* row, int64_t nb, c10::BFloat16* dst) {
  constexpr int64_t kSubs = kWeightsOf<F> / kBlock;  // 32-weight blocks per format block
  alignas(64) float wide[kWeightsOf<F>];
  for (int64_t b = 0; b < nb / kSubs; ++b) {
    dequant_block<F>(row + b * block_bytes(F), wide);
    for (int64_t j = 0; j < kSubs; ++j)
      store_bf16(dst + (b * kSubs + j) * kPackedBlock, _mm512_load_ps(wide + j * kBlock),
                 _mm512_load_ps(wide + j * kBlock + 16));
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

}  // namespace

// `len` bf16 values of `buf` starting on a 64-byte boundary (grown as needed). Tile loads of rows
// that straddle cache lines run at less than half speed, a std::vector's own data is only
// 16-byte aligned.
c10::BFloat16* aligned_buffer(std::vector<c10::BFloat16>& buf, size_t len) {
  constexpr size_t kSlack = 64 / sizeof(c10::BFloat16);
  if (buf.size() < len + kSlack) buf.resize(len + kSlack);
  const auto at = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<c10::BFloat16*>((at + 63) / 64 * 64);
}

void dequant_panel(const uint8_t* w, int64_t format, int64_t n0, int64_t n_len, int64_t k_len, c10::BFloat16* panel) {
  const int64_t nb = k_len / kBlock, row_bytes = row_bytes_of(format, k_len);
  const int64_t rows = std::min(kPanel, n_len - n0);
  if (is_interleaved_q5q8(format)) {  // back to GGUF order, then that order's panel: the same bf16 values
    thread_local std::vector<uint8_t> gguf;
    gguf.resize(rows * row_bytes);
    q5q8_interleaved_to_gguf(gguf.data(), w, format, k_len, n0, n0 + rows);
    return dequant_panel(gguf.data(), format - kQuantInterleaved, 0, rows, k_len, panel);
  }
  if (is_interleaved_k(format)) {  // dequantized to fp32 (dequant_block's bits), then rounded as GGUF order is
    thread_local std::vector<float> wide;
    wide.resize(rows * k_len);
    interleaved_k_dequantize_rows(wide.data(), w, format, k_len, n0, n0 + rows);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const float* src = wide.data() + r * k_len + b * kBlock;
        store_bf16(panel_at(panel, nb, r) + b * kPackedBlock, _mm512_loadu_ps(src), _mm512_loadu_ps(src + 16));
      }
  } else if (is_interleaved(format)) {  // n0 and n_len are multiples of 8: whole groups, B tiles directly
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
  } else {
    for (int64_t r = 0; r < rows; ++r) {  // GGUF order: rows dequantized, then each 16 x 16 block transposed
      const uint8_t* row = w + (n0 + r) * row_bytes;
      switch (format) {
        case kQuantQ8_0: dequant_row_bf16<kQuantQ8_0>(row, nb, panel_at(panel, nb, r)); break;
        case kQuantQ4_0: dequant_row_bf16<kQuantQ4_0>(row, nb, panel_at(panel, nb, r)); break;
        case kQuantQ4_1: dequant_row_bf16<kQuantQ4_1>(row, nb, panel_at(panel, nb, r)); break;
        case kQuantQ5_0: dequant_row_bf16<kQuantQ5_0>(row, nb, panel_at(panel, nb, r)); break;
        case kQuantQ5_1: dequant_row_bf16<kQuantQ5_1>(row, nb, panel_at(panel, nb, r)); break;
        case kQuantIQ4_NL: dequant_row_bf16<kQuantIQ4_NL>(row, nb, panel_at(panel, nb, r)); break;
        case kQuantMXFP4: dequant_row_bf16<kQuantMXFP4>(row, nb, panel_at(panel, nb, r)); break;
        case kQuantQ2_K: dequant_row_bf16<kQuantQ2_K>(row, nb, panel_at(panel, nb, r)); break;
        case kQuantQ3_K: dequant_row_bf16<kQuantQ3_K>(row, nb, panel_at(panel, nb, r)); break;
        case kQuantQ4_K: dequant_row_bf16<kQuantQ4_K>(row, nb, panel_at(panel, nb, r)); break;
        case kQuantQ5_K: dequant_row_bf16<kQuantQ5_K>(row, nb, panel_at(panel, nb, r)); break;
        case kQuantQ6_K: dequant_row_bf16<kQuantQ6_K>(row, nb, panel_at(panel, nb, r)); break;
        case kQuantIQ4_XS: dequant_row_bf16<kQuantIQ4_XS>(row, nb, panel_at(panel, nb, r)); break;
        default: TORCH_CHECK(false, "quant_linear_bf16: unknown format ", format);
      }
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


}  // namespace bf16

namespace {

// The kernel quant_linear_bf16 runs here: AMX where built for it and the OS grants the tiles, else
// the AVX512-BF16 dot products.
bf16::PanelKernel panel_kernel() {
#if defined(PAGEDSERVE_AMX_BF16)
  if (bf16::amx_granted()) return &bf16::amx_panels;
#endif
  return &bf16::dot_panels;
}

}  // namespace

void quant_linear_bf16(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t format,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "quant_linear_bf16: fp32 x and out");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1,
              "quant_linear_bf16: rows must be contiguous");
  const int64_t m_len = x.size(0), k_len = x.size(1), n_len = qweight.size(0);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "quant_linear_bf16: qweight must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(format == kQuantQ8_0 || format == kQuantQ4_0 || format == kQuantQ4_1 || format == kQuantQ5_0 ||
                  format == kQuantQ5_1 || format == kQuantQ4_K || format == kQuantQ5_K || format == kQuantQ6_K ||
                  format == kQuantIQ4_NL || format == kQuantMXFP4 || format == kQuantIQ4_XS || format == kQuantQ3_K ||
                  format == kQuantQ2_K ||
                  is_interleaved(format),
              "quant_linear_bf16: format id ", format, " has no bf16 panels (ops.quant.BF16_FORMATS)");
  TORCH_CHECK(k_len % quant::block_weights(format) == 0, "quant_linear_bf16: K must be a multiple of ",
              quant::block_weights(format), "; got ", k_len);
  TORCH_CHECK(qweight.size(1) == quant::row_bytes_of(format, k_len), "quant_linear_bf16: qweight has ",
              qweight.size(1), " bytes per row; K=", k_len, " needs ", quant::row_bytes_of(format, k_len));
  TORCH_CHECK(!is_interleaved(format) || n_len % 8 == 0, "quant_linear_bf16: an r8 weight has a multiple of 8 rows");
  TORCH_CHECK(out.size(0) == m_len && out.size(1) == n_len, "quant_linear_bf16: out must be [M, N]");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_len,
                "quant_linear_bf16: bias must be contiguous fp32 [N]");
    b = bias->data_ptr<float>();
  }
  if (m_len == 0 || n_len == 0) return;
  using bf16::kPanel;
  const int64_t nb = k_len / quant::kBlock;
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
  // Kept per calling thread: a fresh buffer each call would pay its page faults every time.
  thread_local std::vector<c10::BFloat16> packed;
  // The caller's buffer (a thread_local named in the lambda would be each thread's own).
  c10::BFloat16* const pk =
      bf16::aligned_buffer(packed, (std::min(block_rows, m_len) + kPanel - 1) / kPanel * kPanel * k_len);
  const bf16::PanelKernel panels = panel_kernel();
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m0 = 0; m0 < m_len; m0 += block_rows) {
    const int64_t rows = std::min(block_rows, m_len - m0);
    bf16::pack_activations(xp + m0 * x.stride(0), x.stride(0), rows, nb, pk);
    parallel_chunks(num_panels, chunk, [&](int64_t begin, int64_t end) {
      panels(w, format, n_len, k_len, pk, rows, b, op + m0 * out.stride(0), out.stride(0), begin, end);
    }, /*openmp=*/m_len >= openmp_rows());
  }
}

int64_t bf16_linear_kernel() {
#if defined(PAGEDSERVE_AMX_BF16)
  if (bf16::amx_granted()) return 2;
#endif
  return 1;
}

bool amx_bf16_available() { return bf16_linear_kernel() == 2; }

#else  // no AVX512-BF16 in this build's target

int64_t bf16_linear_kernel() { return 0; }

bool amx_bf16_available() { return false; }

void quant_linear_bf16(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                       const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "quant_linear_bf16: this CPU (or build) has no AVX512-BF16; use quant_linear");
}

#endif

}  // namespace pagedserve::cpu
