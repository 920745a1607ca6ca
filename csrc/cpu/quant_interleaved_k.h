// Linear layers on Q4_K weights repacked eight rows at a time, Q4_Kr8 (quant_interleaved_k.cpp). The
// dispatch of the eight-row layouts (quant_interleaved.cpp) hands this format here.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pagedserve::cpu {

// Bytes of one group's tile per 256-weight block (eight rows of 148) of Q4_Kr8.
constexpr int64_t kQ4KR8TileBytes = 1184;

// Whether `format` is an eight-row K-quant layout (kQuantQ4_KR8, kQuantQ6_KR8).
bool is_interleaved_k(int64_t format);

// As interleaved_linear (quant_interleaved.h) for an eight-row K-quant weight.
void interleaved_k_linear(const at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t format,
                          int64_t n_len, int64_t k_len, const float* bias, int64_t exact);

// out fp32 [n1 - n0, K] (contiguous) = rows [n0, n1) of the weight (multiples of 8), on the calling
// thread: dequant_block's values of the GGUF blocks (the reference's bits).
void interleaved_k_dequantize_rows(float* out, const uint8_t* w, int64_t format, int64_t k_len, int64_t n0,
                                   int64_t n1);

// out fp32 [N, K] (contiguous) = the whole weight, over the threads.
void interleaved_k_dequantize(float* out, const uint8_t* w, int64_t format, int64_t n_len, int64_t k_len);

}  // namespace pagedserve::cpu
