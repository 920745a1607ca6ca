// Software prefetch for the kernels that read their weights once, in order (the r8 GEMV/GEMM passes).
//
// A one-row pass alternates between waiting for a tile and computing on it: the hardware prefetcher
// does not run far enough ahead of such a stream, so the two add up instead of overlapping. Asking for
// the bytes a fixed distance ahead of the tile being read keeps DRAM busy while the tile is computed.
#pragma once

#include <cstdint>

namespace pagedserve::cpu {

// How far ahead of the tile being read its successors are requested: a few tiles of every r8 format.
constexpr int64_t kPrefetchAhead = 8192;

// Requests the `bytes` bytes that start kPrefetchAhead past `p`, one cache line at a time. A prefetch is
// a hint: an address past the end of the weights is never read and cannot fault.
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + kPrefetchAhead + line, 0, 3);
}

}  // namespace pagedserve::cpu
