// TORCH_LIBRARY registration of the CPU paged ops: call them as torch.ops.pagedserve_cpu.<op>.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor context_lens, float scale) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def("copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("paged_attention", &pagedserve::cpu::paged_attention);
  m.impl("reshape_and_cache", &pagedserve::cpu::reshape_and_cache);
  m.impl("copy_blocks", &pagedserve::cpu::copy_blocks);
  m.impl("swap_blocks", &pagedserve::cpu::swap_blocks);
}
