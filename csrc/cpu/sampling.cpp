// Random sampling by inverse CDF over softmax(logits * inv_temperature), one uniform per row.
//
// The torch path (softmax, cumsum, searchsorted) writes and reads the [rows, vocab] matrix four
// times over; here each row is read once from memory (its max), then its exps live in a
// per-thread buffer that stays in L2 while they are summed and walked. The walk goes chunk by
// chunk over sums taken in one fixed order, so a row's token depends on its logits and uniform
// only: never on the batch, the thread, or the row's position.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

using vec::Vec;
constexpr int64_t kW = vec::kWidth;
constexpr int64_t kChunk = 256;           // elements per partial sum (a multiple of kW)
constexpr float kNegligible = -87.0f;     // exp below this counts as exactly 0 (masked tokens stay unpickable)

float row_max(const float* x, int64_t n) {
  const int64_t body = n / kW * kW;
  float m = -std::numeric_limits<float>::infinity();
  if (body) {
    Vec acc = vec::load(x);
    for (int64_t i = kW; i < body; i += kW) acc = vec::vmax(acc, vec::load(x + i));
    m = vec::hmax(acc);
  }
  for (int64_t i = body; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// exps[i] = exp((x[i] - m) * scale) (0 below kNegligible); sums[c] = their sum over chunk c.
void chunk_exps(const float* x, int64_t n, float m, float scale, float* exps, float* sums) {
  const Vec vm = vec::splat(m), vs = vec::splat(scale), zero = vec::splat(0.f);
  for (int64_t c0 = 0, c = 0; c0 < n; c0 += kChunk, ++c) {
    const int64_t end = std::min(n, c0 + kChunk);
    const int64_t body = c0 + (end - c0) / kW * kW;
    Vec acc = zero;
    for (int64_t i = c0; i < body; i += kW) {
      const Vec t = (vec::load(x + i) - vm) * vs;
      const Vec e = t < kNegligible ? zero : vec::exp(t);
      vec::store(exps + i, e);
      acc += e;
    }
    float sum = vec::hsum(acc);
    for (int64_t i = body; i < end; ++i) {
      const float t = (x[i] - m) * scale;
      exps[i] = t < kNegligible ? 0.f : std::exp(t);
      sum += exps[i];
    }
    sums[c] = sum;
  }
}

// The first index whose running sum exceeds u * total. The chunk sums are added in the same order
// for the total and for the prefix, so some chunk always crosses the target (u < 1); inside it, a
// walk that rounds short of the target takes the chunk's last token that has any weight.
int64_t walk(const float* exps, const float* sums, int64_t n, double u) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) total += sums[c];
  const double target = u * total;
  double prefix = 0.0;
  int64_t chosen = -1;
  for (int64_t c = 0; c < chunks && chosen < 0; ++c) {
    if (prefix + sums[c] <= target) {
      prefix += sums[c];
      continue;
    }
    for (int64_t i = c * kChunk, end = std::min(n, (c + 1) * kChunk); i < end; ++i) {
      if (exps[i] <= 0.f) continue;
      chosen = i;
      prefix += exps[i];
      if (prefix > target) return i;
    }
  }
  for (int64_t i = n - 1; chosen < 0 && i >= 0; --i)  // unreachable for u < 1; never a weightless token
    if (exps[i] > 0.f) chosen = i;
  return std::max<int64_t>(chosen, 0);
}

}  // namespace

void sample_from_logits(const at::Tensor& out, const at::Tensor& logits, const at::Tensor& inv_temperature,
                        const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be [rows, vocab] fp32, contiguous in its last dimension");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(out.scalar_type() == at::kLong && out.numel() == rows && out.is_contiguous(), "out must be int64 [rows]");
  TORCH_CHECK(inv_temperature.scalar_type() == at::kFloat && inv_temperature.numel() == rows &&
                  inv_temperature.is_contiguous(), "inv_temperature must be fp32 [rows]");
  TORCH_CHECK(uniforms.scalar_type() == at::kFloat && uniforms.numel() == rows && uniforms.is_contiguous(),
              "uniforms must be fp32 [rows]");
  TORCH_CHECK(n > 0, "the vocabulary is empty");
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const float* inv_t = inv_temperature.data_ptr<float>();
  const float* u = uniforms.data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  parallel_chunks(
      rows, row_chunk(rows, n, 1 << 14),
      [&](int64_t begin, int64_t end) {
        std::vector<float> exps(n), sums(chunks);
        for (int64_t r = begin; r < end; ++r) {
          const float* row = x + r * stride;
          const float m = row_max(row, n);
          if (!std::isfinite(m)) {  // no finite logit: nothing to weigh, take the first maximum
            tokens[r] = std::find(row, row + n, m) - row;
            continue;
          }
          chunk_exps(row, n, m, inv_t[r], exps.data(), sums.data());
          tokens[r] = walk(exps.data(), sums.data(), n, static_cast<double>(u[r]));
        }
      },
      rows >= kOpenMPRows);
}

}  // namespace pagedserve::cpu
