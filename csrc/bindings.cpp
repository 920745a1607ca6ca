// TORCH_LIBRARY bindings of the CUDA ops (torch.ops.pagedserve_cuda.<op>).
// Host code only: unpacks tensors into raw pointers and calls the launchers in ops.h on the
// current stream. Shapes and dtypes were checked in Python (ops/checks.py) before we get here;
// what only the device can see (indices inside index tensors) the kernels flag in an 8-byte error
// flag in mapped, pinned host memory, which Python reads without a sync (ops/device_errors.py).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "ops.h"

namespace {

namespace pc = pagedserve::cuda;

pc::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return pc::DType::kFloat32;
    case at::kHalf: return pc::DType::kFloat16;
    case at::kBFloat16: return pc::DType::kBFloat16;
    default: TORCH_CHECK(false, "pagedserve CUDA ops: unsupported dtype ", t.scalar_type());
  }
}

void check(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "pagedserve ", op, " failed: ", cudaGetErrorString(err));
}

// The error flag: 8 bytes of portable, mapped pinned host memory, allocated once per process
// (every device writes the same bytes: with unified addressing the device pointer is the host one).
unsigned char* error_flag_host() {
  static unsigned char* flag = [] {
    void* p = nullptr;
    check(cudaHostAlloc(&p, pc::kErrorFlagBytes, cudaHostAllocPortable | cudaHostAllocMapped),
          "error flag allocation");
    std::memset(p, 0, pc::kErrorFlagBytes);
    return static_cast<unsigned char*>(p);
  }();
  return flag;
}

unsigned char* error_flag_device() {
  static unsigned char* device = [] {
    void* p = nullptr;
    check(cudaHostGetDevicePointer(&p, error_flag_host(), 0), "error flag mapping");
    return static_cast<unsigned char*>(p);
  }();
  return device;
}

// Host address of the flag, for ops/device_errors.py to read and clear with ctypes.
int64_t error_flag_address() { return reinterpret_cast<int64_t>(error_flag_host()); }

bool is_int8(const at::Tensor& cache) { return cache.scalar_type() == at::kChar; }

// The device data of optional attention sinks (fp32, contiguous, [num_heads], on the query's device), or null.
const float* sinks_of(const std::optional<at::Tensor>& sinks, const at::Tensor& query) {
  if (!sinks.has_value() || !sinks->defined()) return nullptr;
  TORCH_CHECK_VALUE(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == query.size(1) &&
                        sinks->is_contiguous() && sinks->device() == query.device(),
                    "sinks must be a contiguous fp32 tensor of num_heads values on the query's device");
  return sinks->data_ptr<float>();
}

void paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, double scale, int64_t window,
                     const std::optional<at::Tensor>& sinks) {
  const c10::cuda::CUDAGuard guard(query.device());
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(2), max_blocks = block_tables.size(1);
  // Bounded by the table width, so no device->host sync is needed to size the split.
  const int64_t max_parts = std::max<int64_t>(1, (max_blocks * block_size + pc::kPartitionSize - 1) /
                                                     pc::kPartitionSize);
  at::Tensor tmp_out, max_logits, exp_sums;
  if (max_parts > 1) {
    const auto fp32 = query.options().dtype(at::kFloat);
    tmp_out = query.new_empty({num_seqs, num_heads, max_parts, head_size}, fp32);
    max_logits = query.new_empty({num_seqs, num_heads, max_parts}, fp32);
    exp_sums = query.new_empty({num_seqs, num_heads, max_parts}, fp32);
  }
  pc::PagedAttentionArgs args{};
  args.out = out.data_ptr();
  args.query = query.data_ptr();
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.block_tables = block_tables.data_ptr<int32_t>();
  args.context_lens = context_lens.data_ptr<int32_t>();
  args.tmp_out = max_parts > 1 ? tmp_out.data_ptr<float>() : nullptr;
  args.max_logits = max_parts > 1 ? max_logits.data_ptr<float>() : nullptr;
  args.exp_sums = max_parts > 1 ? exp_sums.data_ptr<float>() : nullptr;
  args.num_seqs = static_cast<int>(num_seqs);
  args.num_heads = static_cast<int>(num_heads);
  args.num_kv_heads = static_cast<int>(key_cache.size(1));
  args.head_size = static_cast<int>(head_size);
  args.block_size = static_cast<int>(block_size);
  args.max_blocks_per_seq = static_cast<int>(max_blocks);  // tables are contiguous (ops/attention.py)
  args.max_num_partitions = static_cast<int>(max_parts);
  args.num_blocks = key_cache.size(0);
  args.q_stride_seq = query.stride(0);
  args.q_stride_head = query.stride(1);
  args.out_stride_seq = out.stride(0);
  args.out_stride_head = out.stride(1);
  args.scale = static_cast<float>(scale);
  args.dtype = dtype_of(query);
  args.kv_int8 = is_int8(key_cache);
  args.errors = error_flag_device();
  args.seq_begin = 0;
  args.window = static_cast<int>(std::max<int64_t>(window, 0));
  args.sinks = sinks_of(sinks, query);
  check(pc::paged_attention(args, c10::cuda::getCurrentCUDAStream().stream()), "paged_attention");
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const c10::cuda::CUDAGuard guard(key_cache.device());
  pc::CacheWriteArgs args{};
  args.key = key.data_ptr();
  args.value = value.data_ptr();
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.slot_mapping = slot_mapping.data_ptr<int64_t>();
  args.num_tokens = key.size(0);
  args.num_blocks = key_cache.size(0);
  args.num_kv_heads = static_cast<int>(key.size(1));
  args.head_size = static_cast<int>(key.size(2));
  args.block_size = static_cast<int>(key_cache.size(2));
  args.key_stride_token = key.stride(0);
  args.key_stride_head = key.stride(1);
  args.value_stride_token = value.stride(0);
  args.value_stride_head = value.stride(1);
  args.dtype = dtype_of(key);
  args.kv_int8 = is_int8(key_cache);
  args.errors = error_flag_device();
  check(pc::reshape_and_cache(args, c10::cuda::getCurrentCUDAStream().stream()), "reshape_and_cache");
}

void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "key_caches and value_caches differ in length");
  if (key_caches.empty() || block_mapping.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(key_caches[0].device());
  const int64_t num_caches = static_cast<int64_t>(key_caches.size()) * 2;
  at::Tensor ptrs = block_mapping.new_empty({num_caches}, block_mapping.options().device(at::kCPU));
  int64_t* host = ptrs.data_ptr<int64_t>();
  for (size_t i = 0; i < key_caches.size(); ++i) {
    host[i] = reinterpret_cast<int64_t>(key_caches[i].data_ptr());
    host[key_caches.size() + i] = reinterpret_cast<int64_t>(value_caches[i].data_ptr());
  }
  const at::Tensor device_ptrs = ptrs.to(key_caches[0].device());
  const int64_t block_bytes = key_caches[0].stride(0) * key_caches[0].element_size();
  check(pc::copy_blocks(device_ptrs.data_ptr<int64_t>(), block_mapping.data_ptr<int64_t>(),
                        static_cast<int>(num_caches), static_cast<int>(block_mapping.size(0)), block_bytes,
                        c10::cuda::getCurrentCUDAStream().stream()),
        "copy_blocks");
}

void swap_blocks(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_mapping) {
  TORCH_CHECK(block_mapping.device().is_cpu(), "swap_blocks: block_mapping must be on the CPU");
  const bool src_cuda = src.is_cuda(), dst_cuda = dst.is_cuda();
  const cudaMemcpyKind kind = src_cuda && dst_cuda ? cudaMemcpyDeviceToDevice
                              : src_cuda           ? cudaMemcpyDeviceToHost
                              : dst_cuda           ? cudaMemcpyHostToDevice
                                                   : cudaMemcpyHostToHost;
  const c10::cuda::CUDAGuard guard(src_cuda ? src.device() : dst.device());
  check(pc::swap_blocks(src.data_ptr(), dst.data_ptr(), block_mapping.data_ptr<int64_t>(),
                        static_cast<int>(block_mapping.size(0)), src.stride(0) * src.element_size(), kind,
                        c10::cuda::getCurrentCUDAStream().stream()),
        "swap_blocks");
}

void paged_prefill_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_start_loc, const at::Tensor& context_lens, double scale,
                             int64_t window, int64_t rows_per_warp, const std::optional<at::Tensor>& sinks) {
  const c10::cuda::CUDAGuard guard(query.device());
  pc::PrefillAttentionArgs args{};
  args.out = out.data_ptr();
  args.query = query.data_ptr();
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.block_tables = block_tables.data_ptr<int32_t>();
  args.query_start_loc = query_start_loc.data_ptr<int32_t>();
  args.context_lens = context_lens.data_ptr<int32_t>();
  args.num_seqs = static_cast<int>(context_lens.size(0));
  args.num_tokens = static_cast<int>(query.size(0));
  args.num_heads = static_cast<int>(query.size(1));
  args.num_kv_heads = static_cast<int>(key_cache.size(1));
  args.head_size = static_cast<int>(query.size(2));
  args.block_size = static_cast<int>(key_cache.size(2));
  args.max_blocks_per_seq = static_cast<int>(block_tables.size(1));
  args.num_blocks = key_cache.size(0);
  args.q_stride_token = query.stride(0);
  args.q_stride_head = query.stride(1);
  args.out_stride_token = out.stride(0);
  args.out_stride_head = out.stride(1);
  args.scale = static_cast<float>(scale);
  args.dtype = dtype_of(query);
  args.kv_int8 = is_int8(key_cache);
  args.rows_per_warp = static_cast<int>(rows_per_warp);
  args.window = static_cast<int>(std::max<int64_t>(window, 0));
  args.sinks = sinks_of(sinks, query);
  args.errors = error_flag_device();
  check(pc::paged_prefill_attention(args, c10::cuda::getCurrentCUDAStream().stream()), "paged_prefill_attention");
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  check(pc::rms_norm(out.data_ptr(), x.data_ptr(), nullptr, weight.data_ptr(), x.size(0),
                     static_cast<int>(x.size(1)), out.stride(0), x.stride(0), 0, static_cast<float>(eps),
                     dtype_of(x), c10::cuda::getCurrentCUDAStream().stream()),
        "rms_norm");
}

void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  check(pc::rms_norm(x.data_ptr(), x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.size(0),
                     static_cast<int>(x.size(1)), x.stride(0), x.stride(0), residual.stride(0),
                     static_cast<float>(eps), dtype_of(x), c10::cuda::getCurrentCUDAStream().stream()),
        "fused_add_rms_norm");
}

void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  const c10::cuda::CUDAGuard guard(x.device());
  check(pc::silu_and_mul(out.data_ptr(), x.data_ptr(), x.size(0), static_cast<int>(out.size(1)), out.stride(0),
                         x.stride(0), dtype_of(x), c10::cuda::getCurrentCUDAStream().stream()),
        "silu_and_mul");
}

void rotary_embedding_and_cache(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const at::Tensor& cos_sin, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const c10::cuda::CUDAGuard guard(query.device());
  const bool write_cache = key_cache.numel() > 0;
  pc::RotaryArgs args{};
  args.positions = positions.data_ptr<int64_t>();
  args.query = query.data_ptr();
  args.key = key.data_ptr();
  args.value = value.data_ptr();
  args.cos_sin = cos_sin.data_ptr<float>();
  args.key_cache = write_cache ? key_cache.data_ptr() : nullptr;
  args.value_cache = write_cache ? value_cache.data_ptr() : nullptr;
  args.slot_mapping = write_cache ? slot_mapping.data_ptr<int64_t>() : nullptr;
  args.num_tokens = positions.size(0);
  args.table_rows = cos_sin.size(0);
  args.num_blocks = write_cache ? key_cache.size(0) : 0;
  args.num_heads = static_cast<int>(query.size(1));
  args.num_kv_heads = static_cast<int>(key.size(1));
  args.head_size = static_cast<int>(query.size(2));
  args.block_size = write_cache ? static_cast<int>(key_cache.size(2)) : 1;
  args.q_stride_token = query.stride(0);
  args.q_stride_head = query.stride(1);
  args.k_stride_token = key.stride(0);
  args.k_stride_head = key.stride(1);
  args.v_stride_token = value.stride(0);
  args.v_stride_head = value.stride(1);
  args.dtype = dtype_of(query);
  args.kv_int8 = write_cache && is_int8(key_cache);
  args.errors = error_flag_device();
  check(pc::rotary_embedding_and_cache(args, c10::cuda::getCurrentCUDAStream().stream()),
        "rotary_embedding_and_cache");
}

}  // namespace

TORCH_LIBRARY(pagedserve_cuda, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor context_lens, float scale, int window=0, Tensor? sinks=None) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def("copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor query_start_loc, Tensor context_lens, float scale, int window, int rows_per_warp, "
      "Tensor? sinks=None) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def(
      "rotary_embedding_and_cache(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor value, "
      "Tensor cos_sin, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping) -> ()");
  m.def("error_flag_address() -> int", &error_flag_address);  // no tensors: a catch-all kernel
}

TORCH_LIBRARY_IMPL(pagedserve_cuda, CUDA, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("copy_blocks", &copy_blocks);
  m.impl("swap_blocks", &swap_blocks);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding_and_cache", &rotary_embedding_and_cache);
}
