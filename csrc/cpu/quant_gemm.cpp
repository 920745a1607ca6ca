// Linear layers on GGUF-quantized weights (Q8_0, Q4_0, Q4_1), read in their packed blocks.
//
// Layout (ops/reference/quant.py): weight row n is K / 32 blocks of 32 consecutive weights along K.
// At small M a layer is bound by reading the weight, so the packed bytes (4.5-8.5 bits per weight
// instead of 32) are streamed once, row by row, like gemv.cpp does in fp32. Two inner loops:
//
// - int8 activations (the default): each activation row is quantized per 32-block to int8 with an
//   fp32 scale (and the block's scaled sum, for the Q4_0 offset and the Q4_1 min), then each block
//   pair is one integer dot product: VNNI dpbusd where the CPU has it, maddubs + madd on AVX2.
// - fp32 activations: each weight block is widened to fp32 and FMA'd with the fp32 activations.
//
// Large M (prefill) goes through `dequantize_weight` and oneDNN instead (ops/quant.py).
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "ops.h"
#include "parallel.h"
#include "quant_blocks.h"

namespace pagedserve::cpu {
namespace {

using namespace quant;  // NOLINT: the block formats (quant_blocks.h)

// Integer dot of weight block b with activation block a (unscaled), in scalar code.
template <int64_t F>
inline int32_t block_idot(const void* wb, const ActBlock& a) {
  int32_t sum = 0;
  if constexpr (F == kQuantQ8_0) {
    const auto* w = static_cast<const BlockQ8_0*>(wb);
    for (int i = 0; i < kBlock; ++i) sum += w->q[i] * a.q[i];
  } else {
    const uint8_t* q = F == kQuantQ4_0 ? static_cast<const BlockQ4_0*>(wb)->q : static_cast<const BlockQ4_1*>(wb)->q;
    for (int i = 0; i < kBlock / 2; ++i) sum += (q[i] & 0x0F) * a.q[i] + (q[i] >> 4) * a.q[i + kBlock / 2];
  }
  return sum;
}

// Rows [begin, end) of out[M][N] with int8 activations `act` (M rows of nb blocks).
template <int64_t F, int M>
void int8_rows(const ActBlock* act, int64_t nb, const uint8_t* w, int64_t row_bytes, const float* bias, float* out,
               int64_t ldo, int64_t begin, int64_t end) {
  using Block = std::conditional_t<F == kQuantQ8_0, BlockQ8_0, std::conditional_t<F == kQuantQ4_0, BlockQ4_0, BlockQ4_1>>;
#if defined(__AVX2__)
  // Block b of a row into acc[m] / extra[m]; two interleaved sets of accumulators per row hide the
  // FMA latency (one chain per block pair: measured 4.4 -> fewer cycles per block).
  const auto step = [&](const Block& blk, int64_t b, __m256* acc, float* extra) {
    const float wd = half_to_float(blk.d);
    [[maybe_unused]] float wm = 0.f;
    if constexpr (F == kQuantQ4_0) wm = -8.f * wd;
    if constexpr (F == kQuantQ4_1) wm = half_to_float(blk.m);
    __m256i wu, wsign;
    if constexpr (F == kQuantQ8_0) {
      wsign = load32(blk.q);
      wu = _mm256_sign_epi8(wsign, wsign);  // |w|, and the sign moves onto the activations
    } else {
      wu = unpack_nibbles(blk.q);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const ActBlock& a = act[m * nb + b];
      __m256i xs = load32(a.q);
      if constexpr (F == kQuantQ8_0) xs = _mm256_sign_epi8(xs, wsign);
      const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wu, xs));
      acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(wd * a.d), acc[m]);
      if constexpr (F != kQuantQ8_0) extra[m] += wm * a.s;
    }
  };
#endif
  for (int64_t n = begin; n < end; ++n) {
    const Block* row = reinterpret_cast<const Block*>(w + n * row_bytes);
#if defined(__AVX2__)
    __m256 acc0[M], acc1[M];
    float extra0[M] = {}, extra1[M] = {};  // the Q4_0 offset and Q4_1 min terms
    for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
      step(row[b], b, acc0, extra0);
      step(row[b + 1], b + 1, acc1, extra1);
    }
    if (b < nb) step(row[b], b, acc0, extra0);
    for (int m = 0; m < M; ++m)
      out[m * ldo + n] = hsum(_mm256_add_ps(acc0[m], acc1[m])) + extra0[m] + extra1[m] +
                         (bias != nullptr ? bias[n] : 0.f);
#else
    float acc[M] = {}, extra[M] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const Block& blk = row[b];
      const float wd = half_to_float(blk.d);
      float wm = 0.f;
      if constexpr (F == kQuantQ4_0) wm = -8.f * wd;
      if constexpr (F == kQuantQ4_1) wm = half_to_float(blk.m);
      for (int m = 0; m < M; ++m) {
        const ActBlock& a = act[m * nb + b];
        acc[m] += wd * a.d * static_cast<float>(block_idot<F>(&blk, a));
        if constexpr (F != kQuantQ8_0) extra[m] += wm * a.s;
      }
    }
    for (int m = 0; m < M; ++m) out[m * ldo + n] = acc[m] + extra[m] + (bias != nullptr ? bias[n] : 0.f);
#endif
  }
}

// Rows [begin, end) of out with fp32 activations x[M][K].
template <int64_t F, int M>
void fp32_rows(const float* x, int64_t ldx, int64_t nb, const uint8_t* w, int64_t row_bytes, int64_t bsize,
               const float* bias, float* out, int64_t ldo, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    float dots[M];
    fp32_row_dots<F, M>(x, ldx, nb, w + n * row_bytes, bsize, dots);
    for (int m = 0; m < M; ++m) out[m * ldo + n] = dots[m] + (bias != nullptr ? bias[n] : 0.f);
  }
}

// Output rows [begin, end) for every activation row, four activation rows per pass over the
// chunk's weight rows (which stay in cache between passes).
template <int64_t F, int M>
void rows_for_group(const at::Tensor& out, const at::Tensor& x, int64_t row0, const uint8_t* w, int64_t k_len,
                    const float* bias, bool int8_act, const ActBlock* act, int64_t begin, int64_t end) {
  const int64_t nb = k_len / kBlock, bsize = block_bytes(F), row_bytes = nb * bsize, ldo = out.stride(0);
  float* op = out.data_ptr<float>() + row0 * ldo;
  if (int8_act) {
    int8_rows<F, M>(act + row0 * nb, nb, w, row_bytes, bias, op, ldo, begin, end);
  } else {
    const float* xp = x.data_ptr<float>() + row0 * x.stride(0);
    fp32_rows<F, M>(xp, x.stride(0), nb, w, row_bytes, bsize, bias, op, ldo, begin, end);
  }
}

template <int64_t F>
void run_format(const at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t n_len, int64_t k_len,
                const float* bias, bool int8_act) {
  const int64_t m_len = x.size(0), nb = k_len / kBlock;
  std::vector<ActBlock> act;
  if (int8_act) {
    act.resize(m_len * nb);
    for (int64_t m = 0; m < m_len; ++m) quantize_row(x.data_ptr<float>() + m * x.stride(0), k_len, &act[m * nb]);
  }
  // Chunks of at least ~64 KiB of packed weights, about eight per thread.
  const int64_t chunk = row_chunk(n_len, nb * block_bytes(F), 64 * 1024);
  parallel_chunks(n_len, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t row0 = 0; row0 < m_len; row0 += 4) {
      switch (std::min<int64_t>(4, m_len - row0)) {
        case 1: rows_for_group<F, 1>(out, x, row0, w, k_len, bias, int8_act, act.data(), begin, end); break;
        case 2: rows_for_group<F, 2>(out, x, row0, w, k_len, bias, int8_act, act.data(), begin, end); break;
        case 3: rows_for_group<F, 3>(out, x, row0, w, k_len, bias, int8_act, act.data(), begin, end); break;
        default: rows_for_group<F, 4>(out, x, row0, w, k_len, bias, int8_act, act.data(), begin, end); break;
      }
    }
  }, /*openmp=*/m_len >= openmp_rows());
}

template <int64_t F>
void dequant_rows(const uint8_t* w, int64_t nb, float* out, int64_t k_len, int64_t begin, int64_t end) {
  const int64_t bsize = block_bytes(F);
  for (int64_t n = begin; n < end; ++n)
    for (int64_t b = 0; b < nb; ++b) dequant_block<F>(w + (n * nb + b) * bsize, out + n * k_len + b * kBlock);
}

void check_packed(const at::Tensor& qweight, int64_t format, int64_t k_len) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "quant: qweight must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(k_len % kBlock == 0, "quant: K must be a multiple of 32; got ", k_len);
  TORCH_CHECK(qweight.size(1) == k_len / kBlock * block_bytes(format), "quant: qweight has ", qweight.size(1),
              " bytes per row; K=", k_len, " needs ", k_len / kBlock * block_bytes(format));
}

}  // namespace

void quant_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t format,
                  const c10::optional<at::Tensor>& bias, bool int8_activations) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "quant_linear: fp32 x and out");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1, "quant_linear: rows must be contiguous");
  const int64_t k_len = x.size(1), n_len = qweight.size(0);
  check_packed(qweight, format, k_len);
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == n_len, "quant_linear: out must be [M, N]");
  const float* b = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  switch (format) {
    case kQuantQ8_0: return run_format<kQuantQ8_0>(out, x, w, n_len, k_len, b, int8_activations);
    case kQuantQ4_0: return run_format<kQuantQ4_0>(out, x, w, n_len, k_len, b, int8_activations);
    case kQuantQ4_1: return run_format<kQuantQ4_1>(out, x, w, n_len, k_len, b, int8_activations);
    default: TORCH_CHECK(false, "quant_linear: unknown format ", format);
  }
}

void dequantize_weight(const at::Tensor& out, const at::Tensor& qweight, int64_t format) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2, "dequantize: fp32 [N, K] out");
  const int64_t n_len = out.size(0), k_len = out.size(1), nb = k_len / kBlock;
  check_packed(qweight, format, k_len);
  TORCH_CHECK(qweight.size(0) == n_len, "dequantize: out has ", n_len, " rows, qweight ", qweight.size(0));
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t chunk = row_chunk(n_len, k_len, 64 * 1024);
  // Runs just before a oneDNN GEMM: share OpenMP's threads (parallel.h).
  parallel_chunks(n_len, chunk, [&](int64_t begin, int64_t end) {
    switch (format) {
      case kQuantQ8_0: return dequant_rows<kQuantQ8_0>(w, nb, op, k_len, begin, end);
      case kQuantQ4_0: return dequant_rows<kQuantQ4_0>(w, nb, op, k_len, begin, end);
      default: return dequant_rows<kQuantQ4_1>(w, nb, op, k_len, begin, end);
    }
  }, /*openmp=*/true);
}


}  // namespace pagedserve::cpu
