// Work sharing for the CPU kernels: a small pool of helper threads that take chunks of a range
// from an atomic counter while the calling thread works through them too.
//
// Why not at::parallel_for (OpenMP): a decode step runs many short parallel regions (one per
// linear layer), and an OpenMP region ends at a barrier that waits for every thread, including
// one that has not even been scheduled yet. On a machine shared with other processes that wait is
// a scheduler time slice, every region. Here the caller waits only for chunks a helper has actually started;
// chunks nobody claimed it runs itself. Helpers spin briefly between jobs (back-to-back layers
// reuse them at once), then sleep on a condition variable.
//
// Spinning is `pause` with a yield every 64 rounds (`spin_wait`), not a yield each round: on these
// 2-vCPU machines the two threads are SMT siblings of one core, and a sched_yield loop is a
// syscall loop that competes with the sibling doing the work.
//
// But a step of 4 or more rows runs its linear layers on oneDNN, that is on OpenMP's threads,
// which spin for milliseconds after each GEMM. Waking this pool beside them puts three busy
// threads on two cores, and the kernels after a GEMM slow down several times. Such steps pass `openmp` and share OpenMP's threads instead (chunks still
// claimed dynamically from one counter).
#pragma once

#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace pagedserve::cpu {

// One round of a spin-wait: a `pause` (the core's resources go to its SMT sibling), and every 64th
// round a yield (another runnable thread gets the CPU).
inline void spin_wait(uint32_t& spins) {
#if defined(__x86_64__) || defined(__i386__)
  if ((++spins & 63) != 0) {
    _mm_pause();
    return;
  }
#endif
  std::this_thread::yield();
}

class ChunkPool {
 public:
  // The process-wide pool (never destroyed: helper threads may outlive static destructors).
  static ChunkPool& instance() {
    static ChunkPool* pool = new ChunkPool();
    return *pool;
  }

  // Runs fn(chunk) for chunk in [0, num_chunks) on the caller and up to `helpers` pool threads.
  // Rethrows the first exception a chunk threw. Nested or concurrent calls run inline.
  void run(int64_t num_chunks, int helpers, const std::function<void(int64_t)>& fn) {
    static thread_local bool inside = false;
    std::unique_lock<std::mutex> owner(run_mutex_, std::try_to_lock);
    if (inside || !owner.owns_lock() || helpers <= 0 || num_chunks <= 1) {
      for (int64_t c = 0; c < num_chunks; ++c) fn(c);
      return;
    }
    inside = true;
    ensure_threads(helpers);
    // Each job has its own counters: a helper that wakes late, or is still leaving an older job,
    // only ever sees an exhausted counter and touches nothing else.
    auto job = std::make_shared<Job>(&fn, num_chunks, helpers);
    {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      current_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    job->work();
    // Chunks a helper claimed are finished by that helper; nothing else is waited for.
    uint32_t spins = 0;
    while (job->finished.load(std::memory_order_acquire) < num_chunks) spin_wait(spins);
    {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      current_.reset();
    }
    inside = false;
    if (job->error) std::rethrow_exception(job->error);
  }

 private:
  struct Job {
    Job(const std::function<void(int64_t)>* fn, int64_t num_chunks, int helpers)
        : fn(fn), num_chunks(num_chunks), helpers(helpers) {}

    void work() {
      for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < num_chunks;
           c = next.fetch_add(1, std::memory_order_relaxed)) {
        try {
          (*fn)(c);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!error) error = std::current_exception();
        }
        finished.fetch_add(1, std::memory_order_release);
      }
    }

    const std::function<void(int64_t)>* fn;  // called only for claimed chunks, while run() waits
    const int64_t num_chunks;
    const int helpers;
    std::atomic<int64_t> next{0}, finished{0};
    std::atomic<int> joined{0};
    std::mutex error_mutex;
    std::exception_ptr error;
  };

  ChunkPool() = default;

  void ensure_threads(int helpers) {
    while (static_cast<int>(threads_.size()) < helpers) {
      threads_.emplace_back([this] { helper_loop(); });
      threads_.back().detach();
    }
  }

  void helper_loop() {
    uint64_t seen = 0;
    for (;;) {
      // Spin briefly for the next job (the next layer's op usually follows within tens of us),
      // yielding the core now and then to anyone else who wants it, then sleep until woken.
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
      uint32_t spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen &&
             std::chrono::steady_clock::now() < spin_until)
        spin_wait(spins);
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(wake_mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        seen = generation_.load(std::memory_order_acquire);
        job = current_;
      }
      if (job && job->joined.fetch_add(1, std::memory_order_relaxed) < job->helpers) job->work();
    }
  }

  std::mutex run_mutex_, wake_mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> generation_{0};
  std::shared_ptr<Job> current_;
};

// Rows (tokens) from which a step's linear layers run on oneDNN: the step's kernels then pass
// `openmp` to parallel_chunks. 4 for fp32 weights (ops/linear.py: small_gemm up to 3 rows), 129 for
// quantized ones (ops/quant.py: quant_linear's own kernel up to 128); the engine sets it for its
// model (set_openmp_rows). With 4 for a Q4_1 model, a speculative row of 1 + 4 tokens would put
// every layer on OpenMP barriers, far slower under load (docs/speculative.md).
inline std::atomic<int64_t>& openmp_rows_setting() {
  static std::atomic<int64_t> rows{4};
  return rows;
}
inline int64_t openmp_rows() { return openmp_rows_setting().load(std::memory_order_relaxed); }

// Calls fn(begin, end) over [0, n) in chunks of `chunk` (the last may be shorter), on the caller
// and at most at::get_num_threads() - 1 helpers: the chunk pool's, or OpenMP's with `openmp`.
// Inline when there is a single chunk or thread.
template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& fn, bool openmp = false) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  const int helpers = static_cast<int>(std::min<int64_t>(at::get_num_threads(), num_chunks)) - 1;
  if (helpers <= 0) {
    fn(0, n);
    return;
  }
  if (openmp) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, helpers + 1, 1, [&](int64_t, int64_t) {
      for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < num_chunks;
           c = next.fetch_add(1, std::memory_order_relaxed))
        fn(c * chunk, std::min(n, (c + 1) * chunk));
    });
    return;
  }
  ChunkPool::instance().run(num_chunks, helpers, [&](int64_t c) { fn(c * chunk, std::min(n, (c + 1) * chunk)); });
}

// Rows per chunk for row-wise work of `row_elems` elements each: whole rows, at least
// `min_elems` elements per chunk (below that a second thread costs more than it saves), and
// otherwise about `per_thread` chunks per thread (small chunks: a helper preempted mid-chunk
// delays the caller by little).
inline int64_t row_chunk(int64_t rows, int64_t row_elems, int64_t min_elems, int64_t per_thread = 8) {
  const int64_t floor_rows = std::max<int64_t>(1, min_elems / std::max<int64_t>(1, row_elems));
  const int64_t parts = per_thread * at::get_num_threads();
  const int64_t spread = (rows + parts - 1) / parts;
  return std::max(floor_rows, spread);
}

// Chunks per thread for a pass that streams its weights once (a one-row GEMV): each chunk starts a
// new stream that the prefetchers must pick up again, so such a pass takes fewer, longer chunks than
// row_chunk's default, at the cost of a longer wait when a helper is preempted mid-chunk.
constexpr int64_t kStreamChunksPerThread = 2;

// Chunks per thread for an `m_len`-row pass over weights: kStreamChunksPerThread for one row, else
// row_chunk's default.
inline int64_t weight_chunks_per_thread(int64_t m_len) { return m_len == 1 ? kStreamChunksPerThread : 8; }

}  // namespace pagedserve::cpu
