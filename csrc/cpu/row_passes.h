// Activation rows in register-blocked passes: the quantized kernels (quant_gemm.cpp,
// quant_interleaved.cpp) are templated on the rows M they carry through one sweep of a chunk's
// weights; this splits a step's rows into such passes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace pagedserve::cpu {

// Calls pass(std::integral_constant<int, M>{}, row0) for passes covering rows [0, m_len): M = 4
// while more than four are left, the remainder in one pass, and with `kFive` five rows at once
// when exactly five are left (a speculative verify row of 1 + 4 in one sweep of the weights).
template <bool kFive, class Pass>
void for_row_passes(int64_t m_len, Pass&& pass) {
  for (int64_t row0 = 0; row0 < m_len;) {
    const int64_t left = m_len - row0;
    const int64_t rows = kFive && left == 5 ? 5 : std::min<int64_t>(4, left);
    switch (rows) {
      case 1: pass(std::integral_constant<int, 1>{}, row0); break;
      case 2: pass(std::integral_constant<int, 2>{}, row0); break;
      case 3: pass(std::integral_constant<int, 3>{}, row0); break;
      case 5:
        if constexpr (kFive) pass(std::integral_constant<int, 5>{}, row0);
        break;
      default: pass(std::integral_constant<int, 4>{}, row0); break;
    }
    row0 += rows;
  }
}

}  // namespace pagedserve::cpu
