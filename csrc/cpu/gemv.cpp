// CPU fp32 small-M GEMM (M <= 8): y[M][N] = x[M][K] . W[N][K]^T (+ bias), for decode steps.
//
// At small M a linear layer is bound by reading W once from memory, so the loop streams each
// weight row exactly once, keeps the M input rows in L1 and holds M x R dot products in
// registers (R weight rows at a time: more independent FMA chains and more concurrent memory
// streams for small M, fewer accumulators when M is larger). Threads take chunks of N rows.
#include <ATen/Parallel.h>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

using vec::Vec;
using vec::kWidth;

// Software prefetch distance in floats along a weight row: the hardware prefetcher restarts at
// every row when R rows are read in an interleaved way.
constexpr int64_t kAhead = 128;

template <int M, int R>
void rows_block(const float* x, int64_t ldx, const float* w, int64_t k_len, const float* bias, float* out,
                int64_t ldo, int64_t n) {
  Vec acc[M][R] = {};
  const float* rows[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) rows[r] = w + (n + r) * k_len;
  int64_t k = 0;
  for (; k + kWidth <= k_len; k += kWidth) {
    Vec xv[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) xv[m] = vec::load(x + m * ldx + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __builtin_prefetch(rows[r] + k + kAhead);
      const Vec wv = vec::load(rows[r] + k);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[m][r] += wv * xv[m];
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float sum = vec::hsum(acc[m][r]);
      for (int64_t j = k; j < k_len; ++j) sum += x[m * ldx + j] * rows[r][j];
      out[m * ldo + n + r] = sum + (bias != nullptr ? bias[n + r] : 0.f);
    }
  }
}

template <int M, int R>
void gemm_range(const float* x, int64_t ldx, const float* w, int64_t k_len, const float* bias, float* out,
                int64_t ldo, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + R <= end; n += R) rows_block<M, R>(x, ldx, w, k_len, bias, out, ldo, n);
  for (; n < end; ++n) rows_block<M, 1>(x, ldx, w, k_len, bias, out, ldo, n);
}

template <int M>
void run(const float* x, int64_t ldx, const float* w, int64_t n_len, int64_t k_len, const float* bias, float* out,
         int64_t ldo) {
  constexpr int R = M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 2 : 1;
  // Chunks of at least ~256 KiB of weights (below that one thread is done before a second starts),
  // whole register blocks of R rows, about four per thread.
  const int64_t chunk = vec::round_up(row_chunk(n_len, k_len, 64 * 1024), R);
  parallel_chunks(n_len, chunk, [&](int64_t begin, int64_t end) {
    gemm_range<M, R>(x, ldx, w, k_len, bias, out, ldo, begin, end);
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
    case 3: return run<3>(xp, ldx, wp, n_len, k_len, b, op, ldo);
    case 4: return run<4>(xp, ldx, wp, n_len, k_len, b, op, ldo);
    case 5: return run<5>(xp, ldx, wp, n_len, k_len, b, op, ldo);
    case 6: return run<6>(xp, ldx, wp, n_len, k_len, b, op, ldo);
    case 7: return run<7>(xp, ldx, wp, n_len, k_len, b, op, ldo);
    default: return run<8>(xp, ldx, wp, n_len, k_len, b, op, ldo);
  }
}

}  // namespace pagedserve::cpu
