// Linear layers on GGUF-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4; Q2_K, Q3_K, Q4_K, Q5_K,
// Q6_K, IQ4_XS), read in their packed blocks.
//
// Layout (ops/reference/quant.py): weight row n is K / 32 blocks of 32 consecutive weights along K.
// At small M a layer is bound by reading the weight, so the packed bytes (4.5-8.5 bits per weight
// instead of 32) are streamed once, row by row, like gemv.cpp does in fp32. Two inner loops:
//
// - int8 activations (the default): each activation row is quantized per 32-block to int8 with an
//   fp32 scale (and the block's scaled sum, for the Q4_0 / Q5_0 offset and the Q4_1 / Q5_1 min),
//   then each block pair is one integer dot product (unsigned Q4 / Q5 quants, at most 31, so AVX2's
//   int16 pair sums stay below 2 * 31 * 127): VNNI dpbusd where the CPU has it, maddubs + madd on AVX2.
// - fp32 activations: each weight block is widened to fp32 and FMA'd with the fp32 activations.
//
// Large M (prefill) goes through `dequantize_weight` and oneDNN instead (ops/quant.py).
#include <ATen/Parallel.h>

#include <cstring>
#include <optional>
#include <vector>

#include "ops.h"
#include "parallel.h"
#include "quant_blocks.h"
#include "quant_interleaved.h"
#include "row_passes.h"

namespace pagedserve::cpu {
namespace {

using namespace quant;  // NOLINT: the block formats (quant_blocks.h)

// Integer dot of weight block `blk` with 32 activation quants, in scalar code.
template <int64_t F>
inline int32_t block_idot(const BlockOf<F>& blk, const int8_t* a) {
  int32_t sum = 0;
  for (int i = 0; i < kBlock; ++i) sum += block_q<F>(&blk, i) * a[i];
  return sum;
}

// Rows [begin, end) of out[M][N] from M activation rows (quants q [M][nb * 32], scales ad and sums
// as [M][nb]). Per weight block and activation row: one integer dot product (maddubs + madd on
// AVX2, dpbusd with VNNI), its conversion and one FMA; two interleaved sets of accumulators per row
// (even and odd blocks) hide the FMA latency (one chain per block pair would wait on it). A row's arithmetic does not depend on M or on the row's place in the batch.
template <int64_t F, int M>
void int8_rows(const int8_t* q, const float* ad, const float* as, int64_t nb, const uint8_t* w, int64_t row_bytes,
               const float* bias, float* out, int64_t ldo, int64_t begin, int64_t end) {
  using Block = BlockOf<F>;
  const int64_t k_len = nb * kBlock;
#if defined(__AVX2__)
  const auto step = [&](const Block& blk, int64_t b, __m256* acc, float* extra) {
    float wd, wm;
    block_affine<F>(&blk, wd, wm);
    __m256i wu, wsign;
    if constexpr (kSignedQuants<F>) {  // Q8_0, IQ4_NL's / MXFP4's table values (|v| <= 127)
      wsign = signed_quants<F>(&blk);
      wu = _mm256_sign_epi8(wsign, wsign);  // |w|, and the sign moves onto the activations
    } else {
      wu = unsigned_quants<F>(&blk);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      __m256i xs = load32(q + m * k_len + b * kBlock);
      if constexpr (kSignedQuants<F>) xs = _mm256_sign_epi8(xs, wsign);
      const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wu, xs));
      acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(wd * ad[m * nb + b]), acc[m]);
      if constexpr (!kSignedQuants<F>) extra[m] += wm * as[m * nb + b];
    }
  };
#endif
  for (int64_t n = begin; n < end; ++n) {
    const Block* row = reinterpret_cast<const Block*>(w + n * row_bytes);
#if defined(__AVX2__)
    __m256 acc0[M], acc1[M];
    float extra0[M] = {}, extra1[M] = {};  // the Q4_0 / Q5_0 offset and Q4_1 / Q5_1 min terms
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
      float wd, wm;
      block_affine<F>(&row[b], wd, wm);
      for (int m = 0; m < M; ++m) {
        acc[m] += wd * ad[m * nb + b] * static_cast<float>(block_idot<F>(row[b], q + m * k_len + b * kBlock));
        if constexpr (!kSignedQuants<F>) extra[m] += wm * as[m * nb + b];
      }
    }
    for (int m = 0; m < M; ++m) out[m * ldo + n] = acc[m] + extra[m] + (bias != nullptr ? bias[n] : 0.f);
#endif
  }
}

// int8_rows for a K-quant weight (256-weight blocks of eight 32-weight sub-blocks, each against
// one activation block): per sub-block one integer dot product and one FMA, as a Q4_1 (Q4_K / Q5_K:
// its scale d sc_j and min term; Q5_K's quants up to 31, as Q5_1's) or Q8_0 block (Q6_K: the signed
// q - 32; Q3_K: q - 4 or q; IQ4_XS: its table values; the sign moved onto the activations; the dot product's lanes 0-3
// are the sub-block's first 16 weights, 4-7 the next 16, each lane scaled by its 16 weights' scale). Q2_K
// (a scale and a min per 16 weights) is Q4_K's case with lanes split so: its unsigned 2-bit quants' dot
// scaled per half, each half's min times that half's scaled activation sum (`as` is then ActPlanes::h,
// [M][2 nb]). Sub-blocks alternate between two accumulator sets.
template <int64_t F, int M>
void int8_rows_k(const int8_t* q, const float* ad, const float* as, int64_t nb, const uint8_t* w, int64_t row_bytes,
                 const float* bias, float* out, int64_t ldo, int64_t begin, int64_t end) {
  using Block = BlockOf<F>;
  constexpr int kSubs = kSuperBlock / kBlock;
  const int64_t k_len = nb * kBlock, nsb = nb / kSubs;
  [[maybe_unused]] const int64_t lds = 2 * nb;  // Q2_K: the row stride of the half sums
  for (int64_t n = begin; n < end; ++n) {
    const Block* row = reinterpret_cast<const Block*>(w + n * row_bytes);
#if defined(__AVX2__)
    __m256 acc[2][M];
    float extra[2][M] = {};  // the Q2_K / Q4_K / Q5_K min terms
    for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const Block& blk = row[sb];
      [[maybe_unused]] float wd[kSubs], wm[kSubs];
      [[maybe_unused]] float scale = 0.f, min_scale = 0.f;
      if constexpr (kHasMins<F>) {
        q4k_affines(blk, wd, wm);
      } else {
        scale = half_to_float(blk.d);
        if constexpr (kHalfMins<F>) min_scale = half_to_float(blk.dmin);
      }
      for (int j = 0; j < kSubs; ++j) {
        const int64_t b = sb * kSubs + j;
        const int par = j & 1;
        if constexpr (kHasMins<F>) {
          const __m256i wu = ksub_quants<F>(blk, j);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wu, load32(q + m * k_len + b * kBlock)));
            acc[par][m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(wd[j] * ad[m * nb + b]), acc[par][m]);
            extra[par][m] += wm[j] * as[m * nb + b];
          }
        } else if constexpr (kHalfMins<F>) {
          float lo, hi, mlo, mhi;
          ksub_scales<F>(blk, scale, j, lo, hi);
          q2k_sub_mins(blk, min_scale, j, mlo, mhi);
          const __m256 sv = _mm256_setr_m128(_mm_set1_ps(lo), _mm_set1_ps(hi));
          const __m256i wu = ksub_quants<F>(blk, j);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wu, load32(q + m * k_len + b * kBlock)));
            acc[par][m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(sv, _mm256_set1_ps(ad[m * nb + b])), acc[par][m]);
            extra[par][m] += mlo * as[m * lds + 2 * b] + mhi * as[m * lds + 2 * b + 1];
          }
        } else {
          float lo, hi;
          ksub_scales<F>(blk, scale, j, lo, hi);
          const __m256 sv = _mm256_setr_m128(_mm_set1_ps(lo), _mm_set1_ps(hi));
          const __m256i ws = ksub_quants<F>(blk, j);
          const __m256i wu = _mm256_sign_epi8(ws, ws);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            const __m256i xs = _mm256_sign_epi8(load32(q + m * k_len + b * kBlock), ws);
            const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wu, xs));
            acc[par][m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(sv, _mm256_set1_ps(ad[m * nb + b])), acc[par][m]);
          }
        }
      }
    }
    for (int m = 0; m < M; ++m)
      out[m * ldo + n] = hsum(_mm256_add_ps(acc[0][m], acc[1][m])) + extra[0][m] + extra[1][m] +
                         (bias != nullptr ? bias[n] : 0.f);
#else
    float acc[M] = {}, extra[M] = {};
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const Block& blk = row[sb];
      for (int j = 0; j < kSubs; ++j) {
        const int64_t b = sb * kSubs + j;
        for (int m = 0; m < M; ++m) {
          const int8_t* a = q + m * k_len + b * kBlock;
          if constexpr (kHasMins<F>) {
            float wd, wm;
            q4k_sub_affine(blk, j, wd, wm);
            int32_t sum = 0;
            for (int l = 0; l < kBlock; ++l) sum += ksub_q<F>(blk, j, l) * a[l];
            acc[m] += wd * ad[m * nb + b] * static_cast<float>(sum);
            extra[m] += wm * as[m * nb + b];
          } else {
            float sd[2], sm[2] = {0.f, 0.f};
            ksub_scales<F>(blk, half_to_float(blk.d), j, sd[0], sd[1]);
            if constexpr (kHalfMins<F>) q2k_sub_mins(blk, half_to_float(blk.dmin), j, sm[0], sm[1]);
            for (int half = 0; half < 2; ++half) {
              int32_t sum = 0;
              for (int l = 16 * half; l < 16 * half + 16; ++l) sum += ksub_q<F>(blk, j, l) * a[l];
              acc[m] += sd[half] * ad[m * nb + b] * static_cast<float>(sum);
              if constexpr (kHalfMins<F>) extra[m] += sm[half] * as[m * lds + 2 * b + half];
            }
          }
        }
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
// chunk's weight rows (which stay in cache between passes), five when exactly five are left: a
// speculative verify row of 1 + 4 then unpacks each weight block once, cheaper than a pass of
// four and one of one (a row's bits do not change).
template <int64_t F, int M>
void int8_group(const at::Tensor& out, const ActPlanes& act, int64_t row0, const uint8_t* w, const float* bias,
                int64_t begin, int64_t end) {
  const int64_t nb = act.nb, ldo = out.stride(0);
  const auto rows = [&] {
    if constexpr (kIsK<F>) return int8_rows_k<F, M>;
    else return int8_rows<F, M>;
  }();
  const float* sums = kHalfMins<F> ? act.h.data() + row0 * 2 * nb : act.s.data() + row0 * nb;
  rows(act.q.data() + row0 * nb * kBlock, act.d.data() + row0 * nb, sums, nb, w, row_bytes_of(F, nb * kBlock), bias,
       out.data_ptr<float>() + row0 * ldo, ldo, begin, end);
}

template <int64_t F, int M>
void fp32_group(const at::Tensor& out, const at::Tensor& x, int64_t row0, const uint8_t* w, int64_t k_len,
                const float* bias, int64_t begin, int64_t end) {
  const int64_t nb = k_len / kWeightsOf<F>, bsize = block_bytes(F), ldo = out.stride(0);
  fp32_rows<F, M>(x.data_ptr<float>() + row0 * x.stride(0), x.stride(0), nb, w, nb * bsize, bsize, bias,
                  out.data_ptr<float>() + row0 * ldo, ldo, begin, end);
}

template <int64_t F>
void int8_chunk(const at::Tensor& out, const ActPlanes& act, int64_t m_len, const uint8_t* w, const float* bias,
                int64_t begin, int64_t end) {
  for_row_passes<true>(m_len, [&](auto rows, int64_t row0) {
    int8_group<F, decltype(rows)::value>(out, act, row0, w, bias, begin, end);
  });
}

template <int64_t F>
void fp32_chunk(const at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t k_len, const float* bias,
                int64_t begin, int64_t end) {
  for_row_passes<false>(x.size(0), [&](auto rows, int64_t row0) {
    fp32_group<F, decltype(rows)::value>(out, x, row0, w, k_len, bias, begin, end);
  });
}

// Rows [0, exact) of x with fp32 activations, the others with int8 ones (ops.h: quant_linear).
template <int64_t F>
void run_format(const at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t n_len, int64_t k_len,
                const float* bias, int64_t exact) {
  const int64_t m_len = x.size(0);
  const at::Tensor x_exact = x.narrow(0, 0, exact), out_exact = out.narrow(0, 0, exact);
  const at::Tensor x_int8 = x.narrow(0, exact, m_len - exact), out_int8 = out.narrow(0, exact, m_len - exact);
  std::optional<ActPlanes> act;
  if (exact < m_len) act.emplace(x_int8, k_len);
  if constexpr (kHalfMins<F>) {
    if (act) act->add_half_sums();
  }
  // Chunks of at least ~64 KiB of packed weights, about eight per thread.
  const int64_t chunk = row_chunk(n_len, row_bytes_of(F, k_len), 64 * 1024);
  parallel_chunks(n_len, chunk, [&](int64_t begin, int64_t end) {
    if (exact) fp32_chunk<F>(out_exact, x_exact, w, k_len, bias, begin, end);
    if (act) int8_chunk<F>(out_int8, *act, m_len - exact, w, bias, begin, end);
  }, /*openmp=*/m_len >= openmp_rows());
}

template <int64_t F>
void dequant_rows(const uint8_t* w, float* out, int64_t k_len, int64_t begin, int64_t end) {
  const int64_t bsize = block_bytes(F), nb = k_len / kWeightsOf<F>;
  for (int64_t n = begin; n < end; ++n)
    for (int64_t b = 0; b < nb; ++b) dequant_block<F>(w + (n * nb + b) * bsize, out + n * k_len + b * kWeightsOf<F>);
}

void check_packed(const at::Tensor& qweight, int64_t format, int64_t k_len) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "quant: qweight must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(k_len % block_weights(format) == 0, "quant: K must be a multiple of ", block_weights(format), "; got ",
              k_len);
  TORCH_CHECK(qweight.size(1) == row_bytes_of(format, k_len), "quant: qweight has ", qweight.size(1),
              " bytes per row; K=", k_len, " needs ", row_bytes_of(format, k_len));
}

}  // namespace

void quant_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t format,
                  const c10::optional<at::Tensor>& bias, bool int8_activations, int64_t exact_rows) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "quant_linear: fp32 x and out");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1, "quant_linear: rows must be contiguous");
  const int64_t k_len = x.size(1), n_len = qweight.size(0);
  check_packed(qweight, format, k_len);
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == n_len, "quant_linear: out must be [M, N]");
  const float* b = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const int64_t exact = int8_activations ? std::clamp<int64_t>(exact_rows, 0, x.size(0)) : x.size(0);
  if (is_interleaved(format)) return interleaved_linear(out, x, w, format, n_len, k_len, b, exact);
  switch (format) {
    case kQuantQ8_0: return run_format<kQuantQ8_0>(out, x, w, n_len, k_len, b, exact);
    case kQuantQ4_0: return run_format<kQuantQ4_0>(out, x, w, n_len, k_len, b, exact);
    case kQuantQ4_1: return run_format<kQuantQ4_1>(out, x, w, n_len, k_len, b, exact);
    case kQuantQ5_0: return run_format<kQuantQ5_0>(out, x, w, n_len, k_len, b, exact);
    case kQuantQ5_1: return run_format<kQuantQ5_1>(out, x, w, n_len, k_len, b, exact);
    case kQuantIQ4_NL: return run_format<kQuantIQ4_NL>(out, x, w, n_len, k_len, b, exact);
    case kQuantMXFP4: return run_format<kQuantMXFP4>(out, x, w, n_len, k_len, b, exact);
    case kQuantQ2_K: return run_format<kQuantQ2_K>(out, x, w, n_len, k_len, b, exact);
    case kQuantQ3_K: return run_format<kQuantQ3_K>(out, x, w, n_len, k_len, b, exact);
    case kQuantQ4_K: return run_format<kQuantQ4_K>(out, x, w, n_len, k_len, b, exact);
    case kQuantQ5_K: return run_format<kQuantQ5_K>(out, x, w, n_len, k_len, b, exact);
    case kQuantQ6_K: return run_format<kQuantQ6_K>(out, x, w, n_len, k_len, b, exact);
    case kQuantIQ4_XS: return run_format<kQuantIQ4_XS>(out, x, w, n_len, k_len, b, exact);
    default: TORCH_CHECK(false, "quant_linear: format id ", format, " has no packed kernel");
  }
}

void dequantize_weight(const at::Tensor& out, const at::Tensor& qweight, int64_t format) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2, "dequantize: fp32 [N, K] out");
  const int64_t n_len = out.size(0), k_len = out.size(1);
  check_packed(qweight, format, k_len);
  TORCH_CHECK(qweight.size(0) == n_len, "dequantize: out has ", n_len, " rows, qweight ", qweight.size(0));
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (is_interleaved(format)) return interleaved_dequantize(op, w, format, n_len, k_len);
  const int64_t chunk = row_chunk(n_len, k_len, 64 * 1024);
  // Runs just before a oneDNN GEMM: share OpenMP's threads (parallel.h).
  parallel_chunks(n_len, chunk, [&](int64_t begin, int64_t end) {
    switch (format) {
      case kQuantQ8_0: return dequant_rows<kQuantQ8_0>(w, op, k_len, begin, end);
      case kQuantQ4_0: return dequant_rows<kQuantQ4_0>(w, op, k_len, begin, end);
      case kQuantQ4_1: return dequant_rows<kQuantQ4_1>(w, op, k_len, begin, end);
      case kQuantQ5_0: return dequant_rows<kQuantQ5_0>(w, op, k_len, begin, end);
      case kQuantQ5_1: return dequant_rows<kQuantQ5_1>(w, op, k_len, begin, end);
      case kQuantIQ4_NL: return dequant_rows<kQuantIQ4_NL>(w, op, k_len, begin, end);
      case kQuantMXFP4: return dequant_rows<kQuantMXFP4>(w, op, k_len, begin, end);
      case kQuantQ2_K: return dequant_rows<kQuantQ2_K>(w, op, k_len, begin, end);
      case kQuantQ3_K: return dequant_rows<kQuantQ3_K>(w, op, k_len, begin, end);
      case kQuantQ4_K: return dequant_rows<kQuantQ4_K>(w, op, k_len, begin, end);
      case kQuantQ5_K: return dequant_rows<kQuantQ5_K>(w, op, k_len, begin, end);
      case kQuantQ6_K: return dequant_rows<kQuantQ6_K>(w, op, k_len, begin, end);
      case kQuantIQ4_XS: return dequant_rows<kQuantIQ4_XS>(w, op, k_len, begin, end);
      default: TORCH_CHECK(false, "dequantize: format id ", format, " has no packed kernel");
    }
  }, /*openmp=*/true);
}


}  // namespace pagedserve::cpu
