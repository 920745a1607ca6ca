// Greedy tokens of a quantized lm_head from its int8-activation logits, decided with fp32 activations
// (engine/model/quant_screen.py derives the bound).
//
// `approx` holds the int8-activation logits of each hidden row x (quant_linear with
// int8_activations). Token j's approx is within slack_j = (norm_slack |x_hat - x| + rounding |x|)
// norms[j] of its fp32-activation logit, x_hat being x as quantize_row rounds it (the same
// function the int8 kernel uses, so the error is measured on the very values the kernel saw). A
// token can be the maximum only if approx_j + slack_j reaches the row's largest approx_i - slack_i;
// those few get their fp32-activation logit from the same row dot products as quant_linear's fp32
// path, and the first maximum among them is the token. One fused pass per row, no [rows, vocab]
// temporaries: the torch version of this screen cost ten full-vocabulary elementwise ops a step.
// With row_scales the caller supplies each row's factor instead (approx from a bf16 GEMM on AMX,
// engine/model/quant_screen.py, taken as the GEMM's bf16 output); the candidates are decided the same way.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops.h"
#include "parallel.h"
#include "quant_blocks.h"

namespace pagedserve::cpu {
namespace {

using namespace quant;  // NOLINT: the block formats (quant_blocks.h)

// |x_hat - x| and |x| of one activation row, in double.
void activation_error(const float* x, int64_t k_len, double& error, double& norm) {
  const int64_t nb = k_len / kBlock;
  std::vector<int8_t> q(k_len);
  std::vector<float> d(nb), s(nb);
  quantize_row(x, k_len, q.data(), d.data(), s.data());
  double e = 0.0, n = 0.0;
  for (int64_t b = 0; b < nb; ++b)
    for (int i = 0; i < kBlock; ++i) {
      const double v = x[b * kBlock + i];
      const double diff = static_cast<double>(d[b] * static_cast<float>(q[b * kBlock + i])) - v;
      e += diff * diff;
      n += v * v;
    }
  error = std::sqrt(e);
  norm = std::sqrt(n);
}

// Token of one row; -1 when the row (or its approx) holds a non-finite value. `counted`: the
// tokens whose fp32-activation logit was computed.
template <int64_t F>
int64_t row_token(const float* approx, int64_t vocab, const float* norms, const float* x, int64_t k_len,
                  const uint8_t* w, float scale, int64_t& counted) {
  counted = 0;
  if (!std::isfinite(scale)) return -1;
  using vec::Vec;
  constexpr int64_t W = vec::kWidth;
  const int64_t body = vocab / W * W;
  const Vec vs = vec::splat(scale), big = vec::splat(std::numeric_limits<float>::max());
  Vec lows = vec::splat(-std::numeric_limits<float>::infinity()), bad = vec::splat(0.f);
  for (int64_t j = 0; j < body; j += W) {
    const Vec a = vec::load(approx + j);
    lows = vec::vmax(lows, a - vs * vec::load(norms + j));
    bad = (a <= big && a >= -big) ? bad : vec::splat(1.f);  // NaN and +-inf fail both tests
  }
  float floor = vec::hmax(lows);
  bool finite = vec::hmax(bad) == 0.f;
  for (int64_t j = body; j < vocab; ++j) {
    finite = finite && std::isfinite(approx[j]);
    floor = std::max(floor, approx[j] - scale * norms[j]);
  }
  if (!finite || !std::isfinite(floor)) return -1;
  const int64_t nb = k_len / kWeightsOf<F>, bsize = block_bytes(F), row_bytes = nb * bsize;
  int64_t best = -1;
  float best_logit = 0.f;
  const Vec vfloor = vec::splat(floor);
  for (int64_t j = 0; j < vocab; ++j) {
    if (j % W == 0 && j + W <= vocab) {  // skip eight tokens at once unless one reaches the floor
      const Vec highs = vec::load(approx + j) + vs * vec::load(norms + j);
      if (!vec::any(highs >= vfloor)) {  // one vector test, not a horizontal max per eight tokens
        j += W - 1;
        continue;
      }
    }
    if (approx[j] + scale * norms[j] < floor) continue;
    float logit;
    fp32_row_dots<F, 1>(x, k_len, nb, w + j * row_bytes, bsize, &logit);
    ++counted;
    if (best < 0 || logit > best_logit) best = j, best_logit = logit;
  }
  return best;
}

}  // namespace

void quant_screened_argmax(const at::Tensor& out, const at::Tensor& candidates, const at::Tensor& approx,
                           const at::Tensor& hidden, const at::Tensor& qweight, int64_t format,
                           const at::Tensor& norms, double rounding, double norm_slack,
                           const c10::optional<at::Tensor>& row_scales) {
  const bool bf16_approx = approx.scalar_type() == at::kBFloat16;
  TORCH_CHECK(approx.dim() == 2 && (approx.scalar_type() == at::kFloat || bf16_approx) && approx.is_contiguous(),
              "quant_screened_argmax: approx must be contiguous fp32 or bf16 [rows, vocab]");
  const int64_t rows = approx.size(0), vocab = approx.size(1);
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() &&
                  hidden.size(0) == rows && hidden.size(1) % kBlock == 0,
              "quant_screened_argmax: hidden must be contiguous fp32 [rows, K], K a multiple of 32");
  const int64_t k_len = hidden.size(1);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.size(0) == vocab,
              "quant_screened_argmax: qweight must be contiguous uint8 [vocab, row bytes]");
  TORCH_CHECK(format == kQuantQ8_0 || format == kQuantQ4_0 || format == kQuantQ4_1 || format == kQuantQ5_0 ||
                  format == kQuantQ5_1 || format == kQuantQ4_K || format == kQuantQ5_K || format == kQuantQ6_K ||
                  format == kQuantIQ4_NL || format == kQuantMXFP4 || format == kQuantIQ4_XS || format == kQuantQ3_K ||
                  format == kQuantQ2_K,
              "quant_screened_argmax: the lm_head must be in a GGUF block order (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, "
              "Q5_K, Q6_K, IQ4_NL, MXFP4, IQ4_XS, Q3_K, Q2_K); got ", format);
  TORCH_CHECK(k_len % block_weights(format) == 0 && qweight.size(1) == row_bytes_of(format, k_len),
              "quant_screened_argmax: qweight rows do not hold K = ", k_len, " weights");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.numel() == vocab,
              "quant_screened_argmax: norms must be fp32 [vocab]");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == rows &&
                  candidates.scalar_type() == at::kLong && candidates.is_contiguous() && candidates.numel() == rows,
              "quant_screened_argmax: out and candidates must be int64 [rows]");
  const float* given = nullptr;
  if (row_scales.has_value()) {
    TORCH_CHECK(row_scales->scalar_type() == at::kFloat && row_scales->is_contiguous() && row_scales->numel() == rows,
                "quant_screened_argmax: row_scales must be fp32 [rows]");
    given = row_scales->data_ptr<float>();
  }
  const float* ap = bf16_approx ? nullptr : approx.data_ptr<float>();
  const c10::BFloat16* bp = bf16_approx ? approx.data_ptr<c10::BFloat16>() : nullptr;
  const float* hp = hidden.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  int64_t* tokens = out.data_ptr<int64_t>();
  int64_t* counts = candidates.data_ptr<int64_t>();
  parallel_chunks(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = hp + r * k_len;
      float scale;
      if (given != nullptr) {
        scale = given[r];
      } else {
        double error, norm;
        activation_error(x, k_len, error, norm);
        scale = static_cast<float>(norm_slack * error + rounding * norm);
      }
      const float* a = nullptr;
      if (!bf16_approx) {
        a = ap + r * vocab;
      } else {  // a bf16 screen's row, widened where it stays in cache (no [rows, vocab] fp32 copy)
        thread_local std::vector<float> wide;
        wide.resize(vocab);
        vec::widen(wide.data(), bp + r * vocab, vocab);
        a = wide.data();
      }
      switch (format) {
        case kQuantQ8_0: tokens[r] = row_token<kQuantQ8_0>(a, vocab, np, x, k_len, w, scale, counts[r]); break;
        case kQuantQ4_0: tokens[r] = row_token<kQuantQ4_0>(a, vocab, np, x, k_len, w, scale, counts[r]); break;
        case kQuantQ4_1: tokens[r] = row_token<kQuantQ4_1>(a, vocab, np, x, k_len, w, scale, counts[r]); break;
        case kQuantQ5_0: tokens[r] = row_token<kQuantQ5_0>(a, vocab, np, x, k_len, w, scale, counts[r]); break;
        case kQuantQ5_1: tokens[r] = row_token<kQuantQ5_1>(a, vocab, np, x, k_len, w, scale, counts[r]); break;
        case kQuantIQ4_NL: tokens[r] = row_token<kQuantIQ4_NL>(a, vocab, np, x, k_len, w, scale, counts[r]); break;
        case kQuantMXFP4: tokens[r] = row_token<kQuantMXFP4>(a, vocab, np, x, k_len, w, scale, counts[r]); break;
        case kQuantQ2_K: tokens[r] = row_token<kQuantQ2_K>(a, vocab, np, x, k_len, w, scale, counts[r]); break;
        case kQuantQ3_K: tokens[r] = row_token<kQuantQ3_K>(a, vocab, np, x, k_len, w, scale, counts[r]); break;
        case kQuantQ4_K: tokens[r] = row_token<kQuantQ4_K>(a, vocab, np, x, k_len, w, scale, counts[r]); break;
        case kQuantQ5_K: tokens[r] = row_token<kQuantQ5_K>(a, vocab, np, x, k_len, w, scale, counts[r]); break;
        case kQuantQ6_K: tokens[r] = row_token<kQuantQ6_K>(a, vocab, np, x, k_len, w, scale, counts[r]); break;
        case kQuantIQ4_XS: tokens[r] = row_token<kQuantIQ4_XS>(a, vocab, np, x, k_len, w, scale, counts[r]); break;
        default: TORCH_CHECK(false, "quant_screened_argmax: format id ", format, " has no packed kernel");
      }
    }
  }, rows >= openmp_rows());
}

}  // namespace pagedserve::cpu
