// CPU fused elementwise ops of the decoder layer: RMSNorm (with the residual add folded in),
// SiLU-and-mul on the fused gate/up output, and rotary embedding fused with the K/V cache write.
//
// Math is fp32; results are rounded to the tensor dtype where HF Llama rounds (the residual sum,
// the normalized row before the weight, SiLU before the product), so bf16/fp16 models see the
// same values as with the unfused torch code. Rows are split across threads only when there is
// enough work to pay for waking them (decode at small batch runs inline).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kv_quant.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

using vec::Vec;
using vec::kWidth;

// Below ~64k elements a row-wise op takes tens of microseconds: one thread, no parallel region.
constexpr int64_t kMinChunkElems = 64 * 1024;

template <typename T>
float as_f(T x) {
  return static_cast<float>(x);
}

template <typename T>
T round_to(float x) {
  return static_cast<T>(x);
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)) for one row already widened to fp32.
template <typename T>
void norm_row(T* out, const float* x, const T* weight, int64_t hidden, float eps) {
  Vec acc{};
  int64_t i = 0;
  for (; i + kWidth <= hidden; i += kWidth) {
    const Vec v = vec::load(x + i);
    acc += v * v;
  }
  float sum = vec::hsum(acc);
  for (; i < hidden; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  for (int64_t j = 0; j < hidden; ++j) out[j] = round_to<T>(as_f(weight[j]) * as_f(round_to<T>(x[j] * inv)));
}

template <typename T>
void rms_norm_impl(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* x_ptr = static_cast<const T*>(x.data_ptr());
  const T* w_ptr = static_cast<const T*>(weight.data_ptr());
  T* out_ptr = static_cast<T*>(out.data_ptr());
  parallel_chunks(rows, row_chunk(rows, hidden, kMinChunkElems), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(hidden);
    for (int64_t r = begin; r < end; ++r) {
      vec::widen(buf.data(), x_ptr + r * x.stride(0), hidden);
      norm_row<T>(out_ptr + r * out.stride(0), buf.data(), w_ptr, hidden, static_cast<float>(eps));
    }
  }, rows >= openmp_rows());
}

template <typename T>
void fused_add_rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  T* x_ptr = static_cast<T*>(x.data_ptr());
  T* r_ptr = static_cast<T*>(residual.data_ptr());
  const T* w_ptr = static_cast<const T*>(weight.data_ptr());
  parallel_chunks(rows, row_chunk(rows, hidden, kMinChunkElems), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(hidden);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x_ptr + r * x.stride(0);
      T* rr = r_ptr + r * residual.stride(0);
      for (int64_t j = 0; j < hidden; ++j) {
        const T sum = round_to<T>(as_f(xr[j]) + as_f(rr[j]));  // the residual stream is kept in T
        rr[j] = sum;
        buf[j] = as_f(sum);
      }
      norm_row<T>(xr, buf.data(), w_ptr, hidden, static_cast<float>(eps));
    }
  }, rows >= openmp_rows());
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), width = out.size(1);
  const T* x_ptr = static_cast<const T*>(x.data_ptr());
  T* out_ptr = static_cast<T*>(out.data_ptr());
  parallel_chunks(rows, row_chunk(rows, 2 * width, kMinChunkElems), [&](int64_t begin, int64_t end) {
    std::vector<float> gate(width), up(width);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x_ptr + r * x.stride(0);
      if constexpr (std::is_same_v<T, float>) {  // no rounding steps in fp32: one pass, no buffers
        float* o = out_ptr + r * out.stride(0);
        int64_t i = 0;
        for (; i + kWidth <= width; i += kWidth) {
          const Vec g = vec::load(xr + i);
          vec::store(o + i, g / (1.f + vec::exp(-g)) * vec::load(xr + width + i));
        }
        for (; i < width; ++i) o[i] = xr[i] / (1.f + std::exp(-xr[i])) * xr[width + i];
        continue;
      }
      vec::widen(gate.data(), xr, width);
      vec::widen(up.data(), xr + width, width);
      int64_t i = 0;
      for (; i + kWidth <= width; i += kWidth) {
        const Vec g = vec::load(gate.data() + i);
        vec::store(gate.data() + i, g / (1.f + vec::exp(-g)));
      }
      for (; i < width; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i]));
      T* o = out_ptr + r * out.stride(0);
      for (int64_t j = 0; j < width; ++j) o[j] = round_to<T>(as_f(round_to<T>(gate[j])) * up[j]);
    }
  }, rows >= openmp_rows());
}

struct RopeShape {
  int64_t num_heads, num_kv_heads, head_size, row_elems, block_size, num_slots, table_rows;
  int64_t q_token, q_head, k_token, k_head, v_token, v_head;
  bool write_cache;
};

// Rotate one head in place: (x[i], x[i + h]) by the angle whose cos/sin sit at cos[i], sin[i].
template <typename T>
void rotate(T* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = as_f(x[i]), b = as_f(x[i + half]);
    x[i] = round_to<T>(a * cos[i] - b * sin[i]);
    x[i + half] = round_to<T>(b * cos[i] + a * sin[i]);
  }
}

// C: the cache element, T for a float cache or int8_t (rows quantized on write).
template <typename T, typename C>
void rope_impl(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
               const at::Tensor& cos_sin, const at::Tensor& key_cache, const at::Tensor& value_cache,
               const at::Tensor& slot_mapping, const RopeShape& s) {
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = s.write_cache ? slot_mapping.data_ptr<int64_t>() : nullptr;
  const float* table = cos_sin.data_ptr<float>();
  T* q_ptr = static_cast<T*>(query.data_ptr());
  T* k_ptr = static_cast<T*>(key.data_ptr());
  const T* v_ptr = static_cast<const T*>(value.data_ptr());
  C* kc = s.write_cache ? static_cast<C*>(key_cache.data_ptr()) : nullptr;
  C* vc = s.write_cache ? static_cast<C*>(value_cache.data_ptr()) : nullptr;
  const int64_t dim = s.head_size, half = dim / 2, num_tokens = positions.size(0);
  const int64_t token_elems = (s.num_heads + 2 * s.num_kv_heads) * dim;
  parallel_chunks(num_tokens, row_chunk(num_tokens, token_elems, kMinChunkElems), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = pos[t];
      TORCH_CHECK(p >= 0 && p < s.table_rows, "position ", p, " outside the cos/sin table of ", s.table_rows,
                  " rows");
      const float* cos = table + p * dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < s.num_heads; ++h) rotate(q_ptr + t * s.q_token + h * s.q_head, cos, sin, half);
      for (int64_t h = 0; h < s.num_kv_heads; ++h) rotate(k_ptr + t * s.k_token + h * s.k_head, cos, sin, half);
      if (!s.write_cache || slots[t] < 0) continue;  // no cache (profiling pass) or a padding token
      const int64_t slot = slots[t];
      TORCH_CHECK(slot < s.num_slots, "slot ", slot, " out of range for ", s.num_slots, " cache slots");
      const int64_t block = slot / s.block_size, offset = slot % s.block_size;
      for (int64_t h = 0; h < s.num_kv_heads; ++h) {
        const int64_t dst = ((block * s.num_kv_heads + h) * s.block_size + offset) * s.row_elems;
        kvq::store_row(kc + dst, k_ptr + t * s.k_token + h * s.k_head, dim);
        kvq::store_row(vc + dst, v_ptr + t * s.v_token + h * s.v_head, dim);
      }
    }
  }, num_tokens >= openmp_rows());
}

template <typename F>
void dispatch(const at::Tensor& t, const char* op, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t.scalar_type());
  }
}

}  // namespace

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && weight.is_contiguous(), "rms_norm: rows must be contiguous");
  dispatch(x, "rms_norm", [&](auto tag) { rms_norm_impl<decltype(tag)>(out, x, weight, eps); });
}

void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.stride(1) == 1 && residual.stride(1) == 1 && weight.is_contiguous(),
              "fused_add_rms_norm: rows must be contiguous");
  dispatch(x, "fused_add_rms_norm", [&](auto tag) { fused_add_rms_norm_impl<decltype(tag)>(x, residual, weight, eps); });
}

void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "silu_and_mul: rows must be contiguous");
  dispatch(x, "silu_and_mul", [&](auto tag) { silu_and_mul_impl<decltype(tag)>(out, x); });
}

void rotary_embedding_and_cache(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const at::Tensor& cos_sin, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1 && cos_sin.is_contiguous(),
              "rotary_embedding_and_cache: head dims must be contiguous");
  const bool write_cache = key_cache.numel() > 0;
  const RopeShape s{query.size(1), key.size(1), query.size(2), write_cache ? key_cache.size(3) : query.size(2),
                    write_cache ? key_cache.size(2) : 1,
                    write_cache ? key_cache.size(0) * key_cache.size(2) : 0, cos_sin.size(0),
                    query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                    write_cache};
  const bool quantized = key_cache.scalar_type() == at::kChar;
  dispatch(query, "rotary_embedding_and_cache", [&](auto tag) {
    using T = decltype(tag);
    if (quantized)
      rope_impl<T, int8_t>(positions, query, key, value, cos_sin, key_cache, value_cache, slot_mapping, s);
    else
      rope_impl<T, T>(positions, query, key, value, cos_sin, key_cache, value_cache, slot_mapping, s);
  });
}

}  // namespace pagedserve::cpu
