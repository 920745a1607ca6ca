// Greedy tokens from a cheap bf16 screen of the logits, decided in fp32.
//
// `approx` holds bf16 logits from a bf16 GEMM (faster than fp32 on CPUs with AVX512-BF16 or
// AMX). Each one is within `error_scale * |h| * norms[j] + output_slack * |approx|` of the fp32
// logit (ops/screen.py derives the constants), so a token can be the fp32 maximum only if its
// upper bound reaches the largest lower bound of the row. Those few candidates (a handful on
// SmolLM2) get their exact fp32 logit, a dot product of the hidden row and the weight row, and the
// first maximum among them is the token. A row with a non-finite value gets -1 (the caller takes
// the full path for it).
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

using vec::Vec;
constexpr int64_t kW = vec::kWidth;
constexpr int64_t kScan = 64;  // elements whose upper bounds are tested at once in the candidate pass
typedef uint16_t Bits __attribute__((vector_size(kW * sizeof(uint16_t))));
typedef uint32_t UVec __attribute__((vector_size(kW * sizeof(uint32_t))));

// kW bf16 values as fp32 (exact: a bf16 is the top half of an fp32).
inline Vec load_bf16(const uint16_t* p) {
  Bits b;
  std::memcpy(&b, p, sizeof b);
  const UVec wide = __builtin_convertvector(b, UVec) << 16;
  Vec v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

inline Vec vabs(Vec v) { return v < 0.f ? -v : v; }

// The fp32 logit: a dot product in one fixed order (two accumulators, then the tail).
float dot(const float* h, const float* w, int64_t k) {
  const int64_t body = k / (2 * kW) * (2 * kW);
  Vec a = vec::splat(0.f), b = vec::splat(0.f);
  for (int64_t i = 0; i < body; i += 2 * kW) {
    a += vec::load(h + i) * vec::load(w + i);
    b += vec::load(h + i + kW) * vec::load(w + i + kW);
  }
  float s = vec::hsum(a + b);
  for (int64_t i = body; i < k; ++i) s += h[i] * w[i];
  return s;
}

struct Bounds {
  const float* norms;
  float scale;  // error_scale * |h|: the GEMM error of token j is at most scale * norms[j] ...
  float slack;  // ... plus slack * |approx[j]| (rounding of the bf16 output)
};

// The largest lower bound of the row's logits; NaN when a value is not finite.
float lower_bound(const uint16_t* x, int64_t n, const Bounds& b) {
  const int64_t body = n / kW * kW;
  const Vec vs = vec::splat(b.scale), vd = vec::splat(b.slack), big = vec::splat(std::numeric_limits<float>::max());
  Vec best = vec::splat(-std::numeric_limits<float>::infinity());
  Vec finite = vec::splat(0.f);  // stays 0 while every |x| <= FLT_MAX (NaN and inf fail the test)
  for (int64_t i = 0; i < body; i += kW) {
    const Vec v = load_bf16(x + i);
    const Vec lo = v - (vs * vec::load(b.norms + i) + vd * vabs(v));
    best = vec::vmax(best, lo);
    finite = vabs(v) <= big ? finite : vec::splat(1.f);
  }
  float m = vec::hmax(best);
  bool ok = vec::hmax(finite) == 0.f;
  for (int64_t i = body; i < n; ++i) {
    const float v = bf16_to_float(x[i]);
    ok = ok && std::isfinite(v);
    m = std::max(m, v - (b.scale * b.norms[i] + b.slack * std::fabs(v)));
  }
  return ok ? m : std::numeric_limits<float>::quiet_NaN();
}

// The first j maximizing the exact logit among tokens whose upper bound reaches `floor`.
int64_t best_candidate(const uint16_t* x, int64_t n, const Bounds& b, float floor, const float* h,
                       const float* weight, int64_t k) {
  const Vec vs = vec::splat(b.scale), vd = vec::splat(b.slack);
  int64_t best = -1;
  float best_logit = 0.f;
  auto consider = [&](int64_t j, float v) {
    if (v + (b.scale * b.norms[j] + b.slack * std::fabs(v)) < floor) return;
    const float logit = dot(h, weight + j * k, k);
    if (best < 0 || logit > best_logit) best = j, best_logit = logit;
  };
  for (int64_t j0 = 0; j0 < n; j0 += kScan) {
    const int64_t end = std::min(n, j0 + kScan);
    if (end - j0 == kScan) {  // skip the block unless some upper bound reaches the floor
      Vec top = vec::splat(-std::numeric_limits<float>::infinity());
      for (int64_t i = j0; i < end; i += kW) {
        const Vec v = load_bf16(x + i);
        top = vec::vmax(top, v + (vs * vec::load(b.norms + i) + vd * vabs(v)));
      }
      if (vec::hmax(top) < floor) continue;
    }
    for (int64_t j = j0; j < end; ++j) consider(j, bf16_to_float(x[j]));
  }
  return best;
}

}  // namespace

void screened_argmax(const at::Tensor& out, const at::Tensor& approx, const at::Tensor& hidden,
                     const at::Tensor& weight, const at::Tensor& weight_norms, double error_scale,
                     double output_slack) {
  TORCH_CHECK(approx.dim() == 2 && approx.scalar_type() == at::kBFloat16 && approx.stride(1) == 1,
              "approx must be bf16 [rows, vocab], contiguous in its last dimension");
  const int64_t rows = approx.size(0), n = approx.size(1);
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() &&
                  hidden.size(0) == rows, "hidden must be contiguous fp32 [rows, hidden]");
  const int64_t k = hidden.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(0) == n && weight.size(1) == k, "weight must be contiguous fp32 [vocab, hidden]");
  TORCH_CHECK(weight_norms.scalar_type() == at::kFloat && weight_norms.is_contiguous() && weight_norms.numel() == n,
              "weight_norms must be fp32 [vocab]");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.numel() == rows && out.is_contiguous(), "out must be int64 [rows]");
  TORCH_CHECK(n > 0, "the vocabulary is empty");
  const auto* x = reinterpret_cast<const uint16_t*>(approx.data_ptr<at::BFloat16>());
  const int64_t stride = approx.stride(0);
  const float* h = hidden.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* norms = weight_norms.data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  parallel_chunks(
      rows, row_chunk(rows, n, 1 << 14),
      [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const float* hr = h + r * k;
          double sq = 0.0;
          for (int64_t i = 0; i < k; ++i) sq += static_cast<double>(hr[i]) * hr[i];
          const Bounds b{norms, static_cast<float>(error_scale * std::sqrt(sq) + 1e-30),
                       static_cast<float>(output_slack)};
          const float floor = std::isfinite(b.scale) ? lower_bound(x + r * stride, n, b) : NAN;
          tokens[r] = std::isnan(floor) ? -1 : best_candidate(x + r * stride, n, b, floor, hr, w, k);
        }
      },
      rows >= openmp_rows());
}

}  // namespace pagedserve::cpu
