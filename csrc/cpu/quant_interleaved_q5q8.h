// Linear layers on Q5_0 / Q5_1 / Q8_0 weights repacked eight rows at a time (quant_interleaved_q5q8.cpp),
// reached through quant_interleaved.h's entry points (is_interleaved is true for them).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pagedserve::cpu {

// Whether `format` is kQuantQ5_0R8, kQuantQ5_1R8 or kQuantQ8_0R8.
bool is_interleaved_q5q8(int64_t format);

// interleaved_linear, interleaved_dequantize and interleaved_dequantize_rows (quant_interleaved.h)
// for these layouts; the caller has checked the shapes.
void q5q8_interleaved_linear(const at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t format,
                             int64_t n_len, int64_t k_len, const float* bias, int64_t exact);
void q5q8_interleaved_dequantize(float* out, const uint8_t* w, int64_t format, int64_t n_len, int64_t k_len);
void q5q8_interleaved_dequantize_rows(float* out, const uint8_t* w, int64_t format, int64_t k_len, int64_t n0,
                                      int64_t n1);

// out uint8 [n1 - n0, row bytes] = rows [n0, n1) (multiples of 8) of `w` in GGUF order (the base
// format's blocks), for the code that reads that order (the bf16 panels).
void q5q8_interleaved_to_gguf(uint8_t* out, const uint8_t* w, int64_t format, int64_t k_len, int64_t n0, int64_t n1);

}  // namespace pagedserve::cpu
