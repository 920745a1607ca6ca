// Multi-LoRA rows over a linear whose output is several slices (csrc/cpu/lora.cpp).
#pragma once

#include <ATen/ATen.h>

namespace pagedserve::cpu {

// lora_rows (ops.h) for each slice i of out's columns in turn, in one call: bs[i] [S, N_i, R] and
// a's rows [i R, (i + 1) R) (a [S, slices * R, K]); the same bits as one lora_rows per slice.
void lora_slices(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a, at::TensorList bs,
                 const at::Tensor& slot_of_row);

}  // namespace pagedserve::cpu
