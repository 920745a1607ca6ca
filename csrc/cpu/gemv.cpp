// CPU fp32 small-M GEMM (M <= 3): y[M][N] = x[M][K] . W[N][K]^T (+ bias), for decode steps.
//
// At small M a linear layer is bound by reading W once from memory, so the loop streams each
// weight row exactly once, keeps the M input rows in L1 and the M dot products in registers.
// Threads take chunks of N rows. From 4 rows on, oneDNN's GEMM on a packed weight is faster.
#include <ATen/Parallel.h>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

using vec::Vec;
using vec::kWidth;

// One weight row at a time, front to back: a single sequential stream per thread is what the
// hardware prefetcher serves best (better than 8 rows interleaved, or software prefetch). U-way unrolling keeps M x U independent FMA chains.
template <int M, int U>
void rows_range(const float* x, int64_t ldx, const float* w, int64_t k_len, const float* bias, float* out,
                int64_t ldo, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const float* row = w + n * k_len;
    Vec acc[M][U] = {};
    int64_t k = 0;
    for (; k + U * kWidth <= k_len; k += U * kWidth) {
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const Vec wv = vec::load(row + k + u * kWidth);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) acc[m][u] += wv * vec::load(x + m * ldx + k + u * kWidth);
      }
    }
    for (; k + kWidth <= k_len; k += kWidth) {
      const Vec wv = vec::load(row + k);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[m][0] += wv * vec::load(x + m * ldx + k);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      Vec total = acc[m][0];
#pragma GCC unroll 8
      for (int u = 1; u < U; ++u) total += acc[m][u];
      float sum = vec::hsum(total);
      for (int64_t j = k; j < k_len; ++j) sum += x[m * ldx + j] * row[j];
      out[m * ldo + n] = sum + (bias != nullptr ? bias[n] : 0.f);
    }
  }
}

template <int M>
void run(const float* x, int64_t ldx, const float* w, int64_t n_len, int64_t k_len, const float* bias, float* out,
         int64_t ldo) {
  constexpr int U = M == 1 ? 4 : 2;
  // Chunks of at least ~256 KiB of weights (below that one thread is done before a second starts),
  // about four per thread.
  parallel_chunks(n_len, row_chunk(n_len, k_len, 64 * 1024), [&](int64_t begin, int64_t end) {
    rows_range<M, U>(x, ldx, w, k_len, bias, out, ldo, begin, end);
  });
}

}  // namespace

void small_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "small_gemm: fp32 only");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && weight.is_contiguous(), "small_gemm: rows must be contiguous");
  const int64_t m_len = x.size(0), n_len = weight.size(0), k_len = weight.size(1);
  TORCH_CHECK(m_len <= kSmallGemmMaxRows, "small_gemm: at most ", kSmallGemmMaxRows, " rows; got ", m_len);
  const float* b = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  switch (m_len) {
    case 0: return;
    case 1: return run<1>(xp, ldx, wp, n_len, k_len, b, op, ldo);
    case 2: return run<2>(xp, ldx, wp, n_len, k_len, b, op, ldo);
    default: return run<3>(xp, ldx, wp, n_len, k_len, b, op, ldo);
  }
}

}  // namespace pagedserve::cpu
