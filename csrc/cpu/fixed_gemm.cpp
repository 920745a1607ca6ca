// CPU fp32 GEMM with one fixed reduction order: y[M][N] = x[M][K] . W[N][K]^T (+ bias).
//
// Every output element is one fused multiply-add chain over k = 0, 1, ..., K-1 starting from 0,
// then one add of its bias: y = fma(x[K-1], w[K-1], ... fma(x[0], w[0], 0)) + b. Vector lanes
// hold different output columns, never parts of one sum, so an element's bits depend only on its
// own row of x and column of W: not on M, on the other rows of the step, on the thread count, on
// the blocking, or on the vector width (AVX-512, AVX2 and the scalar loop give the same bits).
// That is what makes a row's logits and K/V independent of its batch (ops/linear.py, mode fixed).
//
// The weight is packed once (ops/linear.py `pack_fixed`): fp32 [P][K][16], P = ceil(N / 16)
// rounded up to a multiple of kPanelGroup; panel p's lane j is weight row 16 p + j (zero beyond N).
// A register tile of MR rows x NR panels broadcasts x[r][k] and loads the panels' k-th 16 columns.
//
// `quant_fixed_gemm` runs the same tiles on a packed GGUF weight: each thread dequantizes one
// tile's rows of W at a time (the values `dequantize_weight` gives) into its own panels and sweeps
// every row of x over them, so y is bit for bit fixed_gemm(x, pack(dequantize(W))) at any M, with
// no fp32 copy of the weight.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <vector>

#include "ops.h"
#include "parallel.h"
#include "quant_blocks.h"
#include "quant_interleaved.h"

namespace pagedserve::cpu {
namespace {

using quant::block_bytes;
using quant::dequant_block;
using quant::kBlock;
constexpr int64_t kLanes = 16;  // columns of one packed panel

#if defined(__AVX512F__)
constexpr int kRowsPerTile = 6;
constexpr int kPanelsPerTile = 4;

template <int MR, int NR>
void tile(const float* x, int64_t ldx, const float* panels, int64_t k_len, float* out, int64_t ldo,
          int64_t n0, int64_t n_len, const float* bias) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NR; ++p) acc[r][p] = _mm512_setzero_ps();
  const int64_t stride = k_len * kLanes;
  for (int64_t k = 0; k < k_len; ++k) {
    __m512 w[NR];
    for (int p = 0; p < NR; ++p) w[p] = _mm512_loadu_ps(panels + p * stride + k * kLanes);
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      for (int p = 0; p < NR; ++p) acc[r][p] = _mm512_fmadd_ps(xb, w[p], acc[r][p]);
    }
  }
  for (int p = 0; p < NR; ++p) {
    const int64_t col = n0 + p * kLanes;
    if (col >= n_len) break;
    const int64_t valid = std::min<int64_t>(kLanes, n_len - col);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo + col, mask, _mm512_add_ps(acc[r][p], b));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kRowsPerTile = 3;
constexpr int kPanelsPerTile = 2;

template <int MR, int NR>
void tile(const float* x, int64_t ldx, const float* panels, int64_t k_len, float* out, int64_t ldo,
          int64_t n0, int64_t n_len, const float* bias) {
  __m256 acc[MR][NR][2];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NR; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  const int64_t stride = k_len * kLanes;
  for (int64_t k = 0; k < k_len; ++k) {
    __m256 w[NR][2];
    for (int p = 0; p < NR; ++p) {
      w[p][0] = _mm256_loadu_ps(panels + p * stride + k * kLanes);
      w[p][1] = _mm256_loadu_ps(panels + p * stride + k * kLanes + 8);
    }
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      for (int p = 0; p < NR; ++p) {
        acc[r][p][0] = _mm256_fmadd_ps(xb, w[p][0], acc[r][p][0]);
        acc[r][p][1] = _mm256_fmadd_ps(xb, w[p][1], acc[r][p][1]);
      }
    }
  }
  for (int p = 0; p < NR; ++p) {
    for (int r = 0; r < MR; ++r) {
      alignas(32) float lane[kLanes];
      _mm256_store_ps(lane, acc[r][p][0]);
      _mm256_store_ps(lane + 8, acc[r][p][1]);
      for (int64_t j = 0; j < kLanes; ++j) {
        const int64_t col = n0 + p * kLanes + j;
        if (col < n_len) out[r * ldo + col] = lane[j] + (bias != nullptr ? bias[col] : 0.f);
      }
    }
  }
}
#else
constexpr int kRowsPerTile = 2;
constexpr int kPanelsPerTile = 1;

template <int MR, int NR>
void tile(const float* x, int64_t ldx, const float* panels, int64_t k_len, float* out, int64_t ldo,
          int64_t n0, int64_t n_len, const float* bias) {
  const int64_t stride = k_len * kLanes;
  for (int r = 0; r < MR; ++r) {
    for (int p = 0; p < NR; ++p) {
      for (int64_t j = 0; j < kLanes; ++j) {
        const int64_t col = n0 + p * kLanes + j;
        if (col >= n_len) continue;
        float acc = 0.f;
        for (int64_t k = 0; k < k_len; ++k) acc = std::fma(x[r * ldx + k], panels[p * stride + k * kLanes + j], acc);
        out[r * ldo + col] = acc + (bias != nullptr ? bias[col] : 0.f);
      }
    }
  }
}
#endif

static_assert(kFixedGemmPanelGroup % kPanelsPerTile == 0, "panel padding must hold whole tiles");

// All M rows against panels [p0, p0 + NR): tiles of kRowsPerTile rows, then the leftover rows.
template <int NR>
void panel_rows(const float* x, int64_t ldx, int64_t m_len, const float* panels, int64_t k_len, float* out,
                int64_t ldo, int64_t n0, int64_t n_len, const float* bias) {
  int64_t m = 0;
  for (; m + kRowsPerTile <= m_len; m += kRowsPerTile)
    tile<kRowsPerTile, NR>(x + m * ldx, ldx, panels, k_len, out + m * ldo, ldo, n0, n_len, bias);
  const float* xr = x + m * ldx;
  float* o = out + m * ldo;
  switch (m_len - m) {  // the leftover rows as one shorter tile (same per-element arithmetic)
    case 0: return;
    case 1: return tile<1, NR>(xr, ldx, panels, k_len, o, ldo, n0, n_len, bias);
    case 2: return tile<2, NR>(xr, ldx, panels, k_len, o, ldo, n0, n_len, bias);
    case 3: return tile<std::min(3, kRowsPerTile), NR>(xr, ldx, panels, k_len, o, ldo, n0, n_len, bias);
    case 4: return tile<std::min(4, kRowsPerTile), NR>(xr, ldx, panels, k_len, o, ldo, n0, n_len, bias);
    default: return tile<std::min(5, kRowsPerTile), NR>(xr, ldx, panels, k_len, o, ldo, n0, n_len, bias);
  }
}

template <int64_t F>
void dequant_plain_rows(const uint8_t* w, int64_t k_len, int64_t n0, int64_t n1, float* out) {
  constexpr int64_t kW = quant::kWeightsOf<F>;
  const int64_t nb = k_len / kW, bsize = block_bytes(F);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < nb; ++b) dequant_block<F>(w + (n * nb + b) * bsize, out + (n - n0) * k_len + b * kW);
}

// Rows [n0, n1) of the packed weight as fp32 [n1 - n0][K].
void dequant_rows_of(const uint8_t* w, int64_t format, int64_t k_len, int64_t n0, int64_t n1, float* out) {
  if (is_interleaved(format)) return interleaved_dequantize_rows(out, w, format, k_len, n0, n1);
  switch (format) {
    case kQuantQ8_0: return dequant_plain_rows<kQuantQ8_0>(w, k_len, n0, n1, out);
    case kQuantQ4_0: return dequant_plain_rows<kQuantQ4_0>(w, k_len, n0, n1, out);
    case kQuantQ4_1: return dequant_plain_rows<kQuantQ4_1>(w, k_len, n0, n1, out);
    case kQuantQ5_0: return dequant_plain_rows<kQuantQ5_0>(w, k_len, n0, n1, out);
    case kQuantQ5_1: return dequant_plain_rows<kQuantQ5_1>(w, k_len, n0, n1, out);
    case kQuantIQ4_NL: return dequant_plain_rows<kQuantIQ4_NL>(w, k_len, n0, n1, out);
    case kQuantMXFP4: return dequant_plain_rows<kQuantMXFP4>(w, k_len, n0, n1, out);
    case kQuantQ2_K: return dequant_plain_rows<kQuantQ2_K>(w, k_len, n0, n1, out);
    case kQuantQ3_K: return dequant_plain_rows<kQuantQ3_K>(w, k_len, n0, n1, out);
    case kQuantQ4_K: return dequant_plain_rows<kQuantQ4_K>(w, k_len, n0, n1, out);
    case kQuantQ5_K: return dequant_plain_rows<kQuantQ5_K>(w, k_len, n0, n1, out);
    case kQuantQ6_K: return dequant_plain_rows<kQuantQ6_K>(w, k_len, n0, n1, out);
    case kQuantIQ4_XS: return dequant_plain_rows<kQuantIQ4_XS>(w, k_len, n0, n1, out);
    default: TORCH_CHECK(false, "quant_fixed_gemm: format id ", format, " has no packed kernel");
  }
}

}  // namespace

void fixed_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t n_len,
                const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "fixed_gemm: fp32 only");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 3 && packed.size(2) == kLanes && packed.is_contiguous(),
              "fixed_gemm: x [M, K], out [M, N], packed [P, K, 16] contiguous");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "fixed_gemm: rows must be contiguous");
  const int64_t m_len = x.size(0), k_len = x.size(1), num_panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k_len, "fixed_gemm: packed K ", packed.size(1), " != x K ", k_len);
  TORCH_CHECK(num_panels % kFixedGemmPanelGroup == 0 && num_panels * kLanes >= n_len && out.size(0) == m_len &&
                  out.size(1) == n_len,
              "fixed_gemm: packed panels do not match N = ", n_len);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_len,
                "fixed_gemm: bias must be fp32 [N]");
    b = bias->data_ptr<float>();
  }
  if (m_len == 0 || n_len == 0) return;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  const int64_t groups = (n_len + kPanelsPerTile * kLanes - 1) / (kPanelsPerTile * kLanes);
  // About four chunks per thread: a helper preempted mid-chunk delays the caller by little.
  const int64_t chunk = std::max<int64_t>(1, (groups + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads()));
  parallel_chunks(groups, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * kPanelsPerTile;
      panel_rows<kPanelsPerTile>(xp, ldx, m_len, wp + p0 * k_len * kLanes, k_len, op, ldo, p0 * kLanes, n_len, b);
    }
  }, m_len >= openmp_rows());
}

void quant_fixed_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t format,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "quant_fixed_gemm: fp32 x and out");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1,
              "quant_fixed_gemm: x [M, K], out [M, N], rows contiguous");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "quant_fixed_gemm: qweight must be a contiguous 2-D uint8 tensor");
  const int64_t m_len = x.size(0), k_len = x.size(1), n_len = qweight.size(0);
  TORCH_CHECK(k_len % quant::block_weights(format) == 0 && qweight.size(1) == quant::row_bytes_of(format, k_len),
              "quant_fixed_gemm: qweight rows do not hold K = ", k_len, " weights");
  TORCH_CHECK(!is_interleaved(format) || n_len % 8 == 0, "quant_fixed_gemm: an interleaved weight has 8n rows");
  TORCH_CHECK(out.size(0) == m_len && out.size(1) == n_len, "quant_fixed_gemm: out must be [M, N]");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_len,
                "quant_fixed_gemm: bias must be fp32 [N]");
    b = bias->data_ptr<float>();
  }
  if (m_len == 0 || n_len == 0) return;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  constexpr int64_t kTileRows = kPanelsPerTile * kLanes;  // weight rows one register tile covers
  const int64_t groups = (n_len + kTileRows - 1) / kTileRows;
  const int64_t chunk = std::max<int64_t>(1, (groups + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads()));
  parallel_chunks(groups, chunk, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> rows, panels;
    rows.resize(kTileRows * k_len);
    panels.resize(kTileRows * k_len);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kTileRows, n1 = std::min(n_len, n0 + kTileRows);
      dequant_rows_of(wp, format, k_len, n0, n1, rows.data());
      for (int64_t p = 0; p < kPanelsPerTile; ++p) {  // rows [16 p, 16 p + 16) -> panel p [K][16]
        float* panel = panels.data() + p * k_len * kLanes;
        for (int64_t j = 0; j < kLanes; ++j) {
          const int64_t r = p * kLanes + j;
          if (n0 + r < n1) {
            const float* src = rows.data() + r * k_len;
            for (int64_t k = 0; k < k_len; ++k) panel[k * kLanes + j] = src[k];
          } else {
            for (int64_t k = 0; k < k_len; ++k) panel[k * kLanes + j] = 0.f;
          }
        }
      }
      panel_rows<kPanelsPerTile>(xp, ldx, m_len, panels.data(), k_len, op, ldo, n0, n_len, b);
    }
  }, m_len >= openmp_rows());
}

}  // namespace pagedserve::cpu
