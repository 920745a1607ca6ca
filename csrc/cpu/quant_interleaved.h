// Linear layers on Q4_0 / Q4_1 weights repacked eight rows at a time (quant_interleaved.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pagedserve::cpu {

// Whether `format` is an eight-row interleaved one (kQuantQ4_0R8, kQuantQ4_1R8; the Q5_0 / Q5_1 / Q8_0
// ones of quant_interleaved_q5q8.h and kQuantQ4_KR8 / kQuantQ6_KR8 of quant_interleaved_k.h, which the
// entry points below hand on).
bool is_interleaved(int64_t format);

// out fp32 [M, N] = x fp32 [M, K] . W^T (+ bias [N]) for an interleaved weight `w` of N rows (a
// multiple of 8) and K / 32 blocks per row, checked by the caller: rows [0, exact) of x with fp32
// activations, the others with int8 ones.
void interleaved_linear(const at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t format,
                        int64_t n_len, int64_t k_len, const float* bias, int64_t exact);

// out fp32 [N, K] (contiguous) = the weights of interleaved `w`.
void interleaved_dequantize(float* out, const uint8_t* w, int64_t format, int64_t n_len, int64_t k_len);

// out fp32 [n1 - n0, K] (contiguous) = rows [n0, n1) of interleaved `w` (multiples of 8), on the
// calling thread (the same values as interleaved_dequantize).
void interleaved_dequantize_rows(float* out, const uint8_t* w, int64_t format, int64_t k_len, int64_t n0, int64_t n1);

}  // namespace pagedserve::cpu
