// Random sampling by inverse CDF over softmax(logits * inv_temperature), one uniform per row, with
// or without top-k / top-p / min-p filters.
//
// The torch path (softmax, cumsum, searchsorted) writes and reads the [rows, vocab] matrix four
// times over; here each row is read once from memory (its max), then its exps live in a
// per-thread buffer that stays in L2 while they are summed and walked. The walk goes chunk by
// chunk over sums taken in one fixed order, so a row's token depends on its logits and uniform
// only: never on the batch, the thread, or the row's position.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
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


// The k-th largest of x (k <= n): a min-heap of the k largest seen, which a random order rarely
// changes after its first few hundred elements.
float kth_largest(const float* x, int64_t n, int64_t k, std::vector<float>& heap) {
  heap.assign(x, x + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());
  auto offer = [&](float v) {
    if (!(v > heap.front())) return;
    std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
    heap.back() = v;
    std::push_heap(heap.begin(), heap.end(), std::greater<float>());
  };
  int64_t i = k;
  for (; i + kW <= n; i += kW) {  // most groups of kW hold nothing above the heap's minimum
    const vec::IVec above = vec::load(x + i) > vec::splat(heap.front());
    uint64_t bits[kW * sizeof(int32_t) / sizeof(uint64_t)];
    std::memcpy(bits, &above, sizeof bits);
    uint64_t any = 0;
    for (uint64_t b : bits) any |= b;
    if (any)
      for (int64_t j = 0; j < kW; ++j) offer(x[i + j]);
  }
  for (; i < n; ++i) offer(x[i]);
  return heap.front();
}

// Buckets of the top-p search: by fp32 exponent and the top kMantissaBits of the mantissa, so a
// bucket spans a factor of at most 2^(1/8) and only the bucket the cut falls in is sorted.
constexpr int kMantissaBits = 3;
constexpr int kBuckets = 256 << kMantissaBits;

inline int bucket_of(float e) {
  uint32_t bits;
  std::memcpy(&bits, &e, sizeof bits);
  return static_cast<int>(bits >> (23 - kMantissaBits)) & (kBuckets - 1);  // e > 0: the sign bit is 0
}

// The smallest weight top-p keeps: walking the weights from the largest, the one at which the
// running mass first reaches p * total (every weight equal to it is kept too). Weights are
// exps[0, n); `order` is scratch.
float top_p_cut(const float* exps, int64_t n, double total, double p, std::vector<double>& mass,
                std::vector<float>& order) {
  // Four interleaved histograms: consecutive weights often share a bucket, and one histogram
  // would chain every add on the previous one.
  mass.assign(4 * kBuckets, 0.0);
  const int64_t body = n / 4 * 4;
  for (int64_t i = 0; i < body; i += 4)
    for (int64_t j = 0; j < 4; ++j) mass[j * kBuckets + bucket_of(exps[i + j])] += exps[i + j];
  for (int64_t i = body; i < n; ++i) mass[bucket_of(exps[i])] += exps[i];
  for (int b = 0; b < kBuckets; ++b) mass[b] += mass[kBuckets + b] + mass[2 * kBuckets + b] + mass[3 * kBuckets + b];
  mass[0] = 0.0;  // bucket 0 holds the zero weights (and denormals, which are never the cut)
  const double target = p * total;
  double above = 0.0;  // mass of the buckets above the one the cut falls in
  int cut_bucket = -1;
  for (int b = kBuckets - 1; b > 0; --b) {
    if (mass[b] == 0.0) continue;
    if (above + mass[b] >= target) {
      cut_bucket = b;
      break;
    }
    above += mass[b];
  }
  if (cut_bucket < 0) return std::numeric_limits<float>::min();  // rounding left the target out of reach: keep all
  order.clear();
  for (int64_t i = 0; i < n; ++i)
    if (bucket_of(exps[i]) == cut_bucket) order.push_back(exps[i]);
  std::sort(order.begin(), order.end(), std::greater<float>());
  double running = above;
  for (float e : order) {
    running += e;
    if (running >= target) return e;
  }
  return order.back();
}

// Zero the weights below `floor` and retake the chunk sums (kW lanes in a fixed order, as
// chunk_exps sums them).
void drop_below(float* exps, int64_t n, float floor, float* sums) {
  const Vec vf = vec::splat(floor), zero = vec::splat(0.f);
  for (int64_t c0 = 0, c = 0; c0 < n; c0 += kChunk, ++c) {
    const int64_t end = std::min(n, c0 + kChunk);
    const int64_t body = c0 + (end - c0) / kW * kW;
    Vec acc = zero;
    for (int64_t i = c0; i < body; i += kW) {
      const Vec e = vec::load(exps + i);
      const Vec kept = e < vf ? zero : e;
      vec::store(exps + i, kept);
      acc += kept;
    }
    float sum = vec::hsum(acc);
    for (int64_t i = body; i < end; ++i) {
      if (exps[i] < floor) exps[i] = 0.f;
      sum += exps[i];
    }
    sums[c] = sum;
  }
}

// Zero the weights of the logits below `kth` (top-k).
void drop_logits_below(const float* x, float* exps, int64_t n, float kth) {
  const Vec vk = vec::splat(kth), zero = vec::splat(0.f);
  const int64_t body = n / kW * kW;
  for (int64_t i = 0; i < body; i += kW) vec::store(exps + i, vec::load(x + i) < vk ? zero : vec::load(exps + i));
  for (int64_t i = body; i < n; ++i)
    if (x[i] < kth) exps[i] = 0.f;
}

// Per-row filters of sample_filtered; absent for sample_from_logits.
struct Filters {
  const int64_t* top_k;
  const float* top_p;
  const float* min_p;
};

void check_rows(const at::Tensor& t, at::ScalarType dtype, int64_t rows, const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype && t.numel() == rows && t.is_contiguous(), what, " must be ",
              c10::toString(dtype), " [rows], contiguous");
}

// Both kernels: per row the max, the exps and chunk sums, the filters if any, then the walk.
void draw(const at::Tensor& out, const at::Tensor& logits, const at::Tensor& inv_temperature,
          const at::Tensor& uniforms, const Filters* filters) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const float* inv_t = inv_temperature.data_ptr<float>();
  const float* u = uniforms.data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  parallel_chunks(
      rows, row_chunk(rows, n, 1 << 14),
      [&](int64_t begin, int64_t end) {
        std::vector<float> exps(n), sums(chunks), scratch;
        std::vector<double> mass;
        for (int64_t r = begin; r < end; ++r) {
          const float* row = x + r * stride;
          const float m = row_max(row, n);
          if (!std::isfinite(m)) {  // no finite logit: nothing to weigh, take the first maximum
            tokens[r] = std::find(row, row + n, m) - row;
            continue;
          }
          chunk_exps(row, n, m, inv_t[r], exps.data(), sums.data());
          if (filters) {
            const int64_t k = filters->top_k[r];
            const float p = filters->top_p[r], min_p = filters->min_p[r];
            if (k > 0 && k < n) {  // keep the logits reaching the k-th largest (ties kept)
              drop_logits_below(row, exps.data(), n, kth_largest(row, n, k, scratch));
              drop_below(exps.data(), n, 0.f, sums.data());
            }
            if (p < 1.f) {
              double total = 0.0;
              for (int64_t c = 0; c < chunks; ++c) total += sums[c];
              drop_below(exps.data(), n, top_p_cut(exps.data(), n, total, p, mass, scratch), sums.data());
            }
            if (min_p > 0.f)  // keep weights of at least min_p times the largest (exp(0) = 1)
              drop_below(exps.data(), n, min_p * *std::max_element(exps.begin(), exps.end()), sums.data());
          }
          tokens[r] = walk(exps.data(), sums.data(), n, static_cast<double>(u[r]));
        }
      },
      rows >= openmp_rows());
}

void check_logits(const at::Tensor& out, const at::Tensor& logits, const at::Tensor& inv_temperature,
                  const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be [rows, vocab] fp32, contiguous in its last dimension");
  TORCH_CHECK(logits.size(1) > 0, "the vocabulary is empty");
  const int64_t rows = logits.size(0);
  check_rows(out, at::kLong, rows, "out");
  check_rows(inv_temperature, at::kFloat, rows, "inv_temperature");
  check_rows(uniforms, at::kFloat, rows, "uniforms");
}

}  // namespace

void sample_from_logits(const at::Tensor& out, const at::Tensor& logits, const at::Tensor& inv_temperature,
                        const at::Tensor& uniforms) {
  check_logits(out, logits, inv_temperature, uniforms);
  draw(out, logits, inv_temperature, uniforms, nullptr);
}

void sample_filtered(const at::Tensor& out, const at::Tensor& logits, const at::Tensor& inv_temperature,
                     const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                     const at::Tensor& uniforms) {
  check_logits(out, logits, inv_temperature, uniforms);
  const int64_t rows = logits.size(0);
  check_rows(top_k, at::kLong, rows, "top_k");
  check_rows(top_p, at::kFloat, rows, "top_p");
  check_rows(min_p, at::kFloat, rows, "min_p");
  const Filters filters{top_k.data_ptr<int64_t>(), top_p.data_ptr<float>(), min_p.data_ptr<float>()};
  draw(out, logits, inv_temperature, uniforms, &filters);
}

}  // namespace pagedserve::cpu
