// CPU cache ops: write new K/V into their slots, copy blocks between ids, swap blocks between pools.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>

#include "kv_quant.h"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

// reshape_and_cache into an int8 cache: every row quantized with its own scale.
template <typename T>
void quantize_into_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1);
  const int64_t block_size = key_cache.size(2), row = key_cache.size(3), dim = row - kvq::kScaleBytes;
  const int64_t num_slots = key_cache.size(0) * block_size;
  const T* key_ptr = static_cast<const T*>(key.data_ptr());
  const T* value_ptr = static_cast<const T*>(value.data_ptr());
  auto* kc = static_cast<int8_t*>(key_cache.data_ptr());
  auto* vc = static_cast<int8_t*>(value_cache.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      TORCH_CHECK(slot < num_slots, "slot ", slot, " out of range for ", num_slots, " cache slots");
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * row;
        kvq::quantize_row(kc + dst, key_ptr + t * key.stride(0) + h * key.stride(1), dim);
        kvq::quantize_row(vc + dst, value_ptr + t * value.stride(0) + h * value.stride(1), dim);
      }
    }
  });
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  if (key_cache.scalar_type() == at::kChar) {
    switch (key.scalar_type()) {
      case at::kFloat: return quantize_into_cache<float>(key, value, key_cache, value_cache, slot_mapping);
      case at::kBFloat16:
        return quantize_into_cache<c10::BFloat16>(key, value, key_cache, value_cache, slot_mapping);
      case at::kHalf: return quantize_into_cache<c10::Half>(key, value, key_cache, value_cache, slot_mapping);
      default: TORCH_CHECK(false, "reshape_and_cache: unsupported dtype ", key.scalar_type());
    }
  }
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1);
  const int64_t block_size = key_cache.size(2), head_size = key_cache.size(3);
  const int64_t num_slots = key_cache.size(0) * block_size;
  const int64_t row_bytes = head_size * key_cache.element_size();
  const auto* key_ptr = static_cast<const char*>(key.data_ptr());
  const auto* value_ptr = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t esize = key.element_size();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding token: nothing to store
      TORCH_CHECK(slot < num_slots, "slot ", slot, " out of range for ", num_slots, " cache slots");
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * row_bytes;
        std::memcpy(kc + dst, key_ptr + (t * key.stride(0) + h * key.stride(1)) * esize, row_bytes);
        std::memcpy(vc + dst, value_ptr + (t * value.stride(0) + h * value.stride(1)) * esize, row_bytes);
      }
    }
  });
}

void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "key_caches and value_caches differ in length");
  const int64_t num_pairs = block_mapping.size(0);
  const int64_t num_caches = static_cast<int64_t>(key_caches.size()) * 2;
  if (num_pairs == 0 || num_caches == 0) return;
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  // Every (cache, pair) copy is independent; the two halves of the list are the K and V caches.
  at::parallel_for(0, num_caches * num_pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i / num_pairs, p = i % num_pairs, layer = c / 2;
      const at::Tensor& cache = (c % 2 == 0) ? key_caches[layer] : value_caches[layer];
      const int64_t block_bytes = cache.stride(0) * cache.element_size();
      const int64_t src = pairs[2 * p], dst = pairs[2 * p + 1];
      TORCH_CHECK(src >= 0 && src < cache.size(0) && dst >= 0 && dst < cache.size(0),
                  "copy_blocks: pair (", src, ", ", dst, ") out of range for ", cache.size(0), " blocks");
      auto* base = static_cast<char*>(cache.data_ptr());
      std::memcpy(base + dst * block_bytes, base + src * block_bytes, block_bytes);
    }
  });
}

void swap_blocks(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_mapping) {
  const int64_t num_pairs = block_mapping.size(0);
  const int64_t block_bytes = src.stride(0) * src.element_size();
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  const auto* src_base = static_cast<const char*>(src.data_ptr());
  auto* dst_base = static_cast<char*>(dst.data_ptr());
  at::parallel_for(0, num_pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t s = pairs[2 * p], d = pairs[2 * p + 1];
      TORCH_CHECK(s >= 0 && s < src.size(0) && d >= 0 && d < dst.size(0), "swap_blocks: pair (", s, ", ",
                  d, ") out of range");
      std::memcpy(dst_base + d * block_bytes, src_base + s * block_bytes, block_bytes);
    }
  });
}

}  // namespace pagedserve::cpu
