// Dynamic work sharing for the CPU kernels on top of at::parallel_for (OpenMP).
//
// at::parallel_for splits a range statically, so one descheduled or slower thread holds up the
// whole region. Here the range is cut into chunks that threads take from an atomic counter: a
// thread that starts late, or shares its core with another process, simply takes fewer chunks.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace pagedserve::cpu {

// Calls fn(begin, end) over [0, n) in chunks of `chunk` (the last may be shorter). Runs inline,
// with no parallel region at all, when there is a single chunk or a single thread.
template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& fn) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_chunks);
  if (workers <= 1) {
    fn(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t c = next++; c < num_chunks; c = next++) fn(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

// Rows per chunk for row-wise work of `row_elems` elements each: whole rows, at least
// `min_elems` elements per chunk (below that a second thread costs more than it saves), and
// otherwise about four chunks per thread.
inline int64_t row_chunk(int64_t rows, int64_t row_elems, int64_t min_elems) {
  const int64_t floor_rows = std::max<int64_t>(1, min_elems / std::max<int64_t>(1, row_elems));
  const int64_t spread = (rows + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads());
  return std::max(floor_rows, spread);
}

}  // namespace pagedserve::cpu
