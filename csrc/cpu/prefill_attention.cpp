// CPU varlen paged prefill attention: every prefill sequence of a step in one call, queries
// attending causally over the sequence's whole context read straight from its block table
// (cached prefix, earlier chunks and this chunk, whose K/V reshape_and_cache already wrote).
//
// Flash-style: a task is (sequence, KV head, tile of query rows), where the rows of a sequence
// are its (token, head-of-the-GQA-group) pairs, so one K/V load serves every query head of the
// group. The context is walked in key tiles of whole blocks (about 64 tokens: the softmax
// bookkeeping is paid once per tile, not per block). Per tile: scores = Q K^T with 4-row x
// 16-column register tiles, an online softmax (running max and sum per row, fp32), then
// acc += P V with 4-row x 16-dim tiles. Tasks differ in cost (causal rows near the end see more
// keys), so they are sorted longest first and handed out from an atomic counter.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

using vec::Vec;
using vec::kWidth;

constexpr int64_t kRows = 64;       // query rows per task: Q and acc tiles stay in L2 up to head 256
constexpr int64_t kTileKeys = 64;   // keys per softmax step, rounded up to whole blocks

struct Shape {
  int64_t num_heads, num_kv_heads, group, head_size, dim_pad, block_size, tile_keys, cols_pad, num_blocks,
      max_blocks;
  int64_t q_stride_token, q_stride_head, out_stride_token, out_stride_head;
  float scale;
};

struct Task {
  int64_t seq, kv_head, row_begin, row_end, cost;
};

struct Workspace {
  int64_t dim_pad, cols_pad, head_size, tile_keys;
  std::vector<float> q, acc, scores, kt, v, maxes, sums;
  std::vector<int64_t> pos;

  explicit Workspace(const Shape& s)
      : dim_pad(s.dim_pad), cols_pad(s.cols_pad), head_size(s.head_size), tile_keys(s.tile_keys),
        q(kRows * s.dim_pad), acc(kRows * s.dim_pad), scores(kRows * s.cols_pad), kt(s.head_size * s.cols_pad),
        v(s.tile_keys * s.dim_pad), maxes(kRows), sums(kRows), pos(kRows) {}

  bool fits(const Shape& s) const {
    return dim_pad == s.dim_pad && cols_pad == s.cols_pad && head_size == s.head_size && tile_keys == s.tile_keys;
  }
};

// scores[r][c..c + 8 * NC) = sum_d q[r][d] * kt[d][c..] for four rows from r: NC 8-wide column
// chunks held in 4 x NC registers, one q value broadcast per row and d.
template <int NC>
inline void qk_block(const float* q, int64_t dim, int64_t dim_pad, const float* kt, int64_t cols_pad, float* s) {
  Vec acc[4][NC] = {};
  for (int64_t d = 0; d < dim; ++d) {
    Vec k[NC];
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) k[j] = vec::load(kt + d * cols_pad + j * kWidth);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const float x = q[i * dim_pad + d];
#pragma GCC unroll 4
      for (int j = 0; j < NC; ++j) acc[i][j] += k[j] * x;
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) vec::store(s + i * cols_pad + j * kWidth, acc[i][j]);
}

// scores[r][c] = sum_d q[r][d] * kt[d][c] for rows [0, rows) (a multiple of 4) and cols_pad columns.
void qk_tile(const float* q, int64_t rows, int64_t dim, int64_t dim_pad, const float* kt, int64_t cols_pad,
             float* scores) {
  int64_t c = 0;
  for (; c + 2 * kWidth <= cols_pad; c += 2 * kWidth)
    for (int64_t r = 0; r < rows; r += 4)
      qk_block<2>(q + r * dim_pad, dim, dim_pad, kt + c, cols_pad, scores + r * cols_pad + c);
  if (c < cols_pad)
    for (int64_t r = 0; r < rows; r += 4)
      qk_block<1>(q + r * dim_pad, dim, dim_pad, kt + c, cols_pad, scores + r * cols_pad + c);
}

// acc[r..r + 4)[d..d + 8 * NC) += sum_{t < n} p[r][t] * v[t][d..]: 4 x NC accumulators in registers.
template <int NC>
inline void pv_block(const float* p, int64_t cols_pad, const float* v, int64_t n, int64_t dim_pad, float* acc) {
  Vec a[4][NC];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) a[i][j] = vec::load(acc + i * dim_pad + j * kWidth);
  for (int64_t t = 0; t < n; ++t) {
    Vec vv[NC];
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) vv[j] = vec::load(v + t * dim_pad + j * kWidth);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const float w = p[i * cols_pad + t];
#pragma GCC unroll 4
      for (int j = 0; j < NC; ++j) a[i][j] += vv[j] * w;
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) vec::store(acc + i * dim_pad + j * kWidth, a[i][j]);
}

// acc[r][:] += sum_{t < n} p[r][t] * v[t][:] over dim_pad dims (a multiple of 8), rows a multiple of 4.
void pv_tile(const float* p, int64_t rows, int64_t cols_pad, const float* v, int64_t n, int64_t dim_pad,
             float* acc) {
  int64_t d = 0;
  for (; d + 2 * kWidth <= dim_pad; d += 2 * kWidth)
    for (int64_t r = 0; r < rows; r += 4)
      pv_block<2>(p + r * cols_pad, cols_pad, v + d, n, dim_pad, acc + r * dim_pad + d);
  if (d < dim_pad)
    for (int64_t r = 0; r < rows; r += 4)
      pv_block<1>(p + r * cols_pad, cols_pad, v + d, n, dim_pad, acc + r * dim_pad + d);
}

// Turns one block's scores of a row into weights (zero past `valid`), rescaling the row's
// running sum and accumulator when its max grows. Returns false when the row sees no key here.
bool softmax_row(float* scores, int64_t valid, int64_t cols_pad, float& running_max, float& running_sum,
                 float* acc, int64_t dim_pad) {
  if (valid <= 0) {
    std::fill(scores, scores + cols_pad, 0.f);
    return false;
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  Vec tile_max = vec::splat(neg_inf);
  int64_t c = 0;
  for (; c + kWidth <= valid; c += kWidth) tile_max = vec::vmax(tile_max, vec::load(scores + c));
  float block_max = vec::hmax(tile_max);
  for (; c < valid; ++c) block_max = std::max(block_max, scores[c]);
  const float new_max = std::max(running_max, block_max);
  if (new_max > running_max) {
    const float alpha = std::exp(running_max - new_max);  // 0 on the row's first block
    running_sum *= alpha;
    const Vec a = vec::splat(alpha);
    for (int64_t d = 0; d < dim_pad; d += kWidth) vec::store(acc + d, vec::load(acc + d) * a);
    running_max = new_max;
  }
  Vec total{};
  const Vec m = vec::splat(new_max);
  const Vec limit = vec::splat(static_cast<float>(valid));
  Vec idx = {0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f};
  for (c = 0; c < cols_pad; c += kWidth, idx += static_cast<float>(kWidth)) {
    Vec e = vec::exp(vec::load(scores + c) - m);
    e = idx < limit ? e : Vec{};
    total += e;
    vec::store(scores + c, e);
  }
  running_sum += vec::hsum(total);
  return true;
}

template <typename T>
void run_task(const Task& task, const T* query, const T* key_cache, const T* value_cache, const int32_t* table,
              int64_t first_pos, int64_t q_begin, T* out, const Shape& s, Workspace& w) {
  const int64_t rows = task.row_end - task.row_begin;
  const int64_t rows_pad = vec::round_up(rows, 4);
  const int64_t dim = s.head_size, dp = s.dim_pad, bs = s.block_size, cp = s.cols_pad;
  std::fill(w.q.begin(), w.q.begin() + rows_pad * dp, 0.f);
  std::fill(w.acc.begin(), w.acc.begin() + rows_pad * dp, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = task.row_begin + r, token = row / s.group, head = task.kv_head * s.group + row % s.group;
    const T* src = query + (q_begin + token) * s.q_stride_token + head * s.q_stride_head;
    for (int64_t d = 0; d < dim; ++d) w.q[r * dp + d] = static_cast<float>(src[d]) * s.scale;
    w.pos[r] = first_pos + token;
    w.maxes[r] = -std::numeric_limits<float>::infinity();
    w.sums[r] = 0.f;
  }
  const int64_t kv_end = w.pos[rows - 1] + 1;  // rows are in token order: the last sees the most
  TORCH_CHECK((kv_end + bs - 1) / bs <= s.max_blocks, "context of ", kv_end, " tokens exceeds the block table");
  std::fill(w.kt.begin(), w.kt.end(), 0.f);  // padding columns stay zero
  std::fill(w.v.begin(), w.v.end(), 0.f);    // padding dims stay zero
  for (int64_t start = 0; start < kv_end; start += s.tile_keys) {
    const int64_t n = std::min(s.tile_keys, kv_end - start);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t token = start + t, block = table[token / bs];
      TORCH_CHECK(block >= 0 && block < s.num_blocks, "block table entry ", block, " out of range [0, ",
                  s.num_blocks, ")");
      const int64_t row = ((block * s.num_kv_heads + task.kv_head) * bs + token % bs) * dim;
      const T* k = key_cache + row;
      for (int64_t d = 0; d < dim; ++d) w.kt[d * cp + t] = static_cast<float>(k[d]);
      vec::widen(w.v.data() + t * dp, value_cache + row, dim);
    }
    // Slots past the context are never read; columns past n keep the previous tile's keys but
    // are masked in softmax_row, and pv_tile reads only the first n V rows.
    qk_tile(w.q.data(), rows_pad, dim, dp, w.kt.data(), cp, w.scores.data());
    for (int64_t r = 0; r < rows_pad; ++r) {
      const int64_t valid = r < rows ? std::min(n, w.pos[r] - start + 1) : 0;
      float* sc = w.scores.data() + r * cp;
      if (r < rows) {
        softmax_row(sc, valid, cp, w.maxes[r], w.sums[r], w.acc.data() + r * dp, dp);
      } else {
        std::fill(sc, sc + cp, 0.f);
      }
    }
    pv_tile(w.scores.data(), rows_pad, cp, w.v.data(), n, dp, w.acc.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = task.row_begin + r, token = row / s.group, head = task.kv_head * s.group + row % s.group;
    const float inv = w.sums[r] > 0.f ? 1.f / w.sums[r] : 0.f;
    float* a = w.acc.data() + r * dp;
    for (int64_t d = 0; d < dim; ++d) a[d] *= inv;
    vec::narrow(out + (q_begin + token) * s.out_stride_token + head * s.out_stride_head, a, dim);
  }
}

template <typename T>
void run(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& context_lens,
         const Shape& s) {
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t num_seqs = context_lens.size(0), capacity = s.max_blocks * s.block_size;
  // Checked here, not in Python: no per-layer tensor ops on the hot path.
  TORCH_CHECK_VALUE(starts[0] >= 0 && starts[num_seqs] <= query.size(0), "query_start_loc must be non-decreasing ",
                    "within [0, ", query.size(0), "] (num_tokens); got ", starts[0], " .. ", starts[num_seqs]);
  for (int64_t seq = 0; seq < num_seqs; ++seq)
    TORCH_CHECK_VALUE(starts[seq + 1] >= starts[seq], "query_start_loc must be non-decreasing; sequence ", seq,
                      " has ", starts[seq + 1] - starts[seq], " tokens");
  std::vector<Task> tasks;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t q_len = starts[seq + 1] - starts[seq];
    TORCH_CHECK_VALUE(q_len <= lens[seq] && lens[seq] <= capacity, "each context_len must cover its query tokens ",
                      "and fit the block table (", capacity, " slots); sequence ", seq, " has ", q_len,
                      " query tokens and context_len ", lens[seq]);
    const int64_t rows = q_len * s.group, first_pos = lens[seq] - q_len;
    for (int64_t begin = 0; begin < rows; begin += kRows) {
      const int64_t end = std::min(rows, begin + kRows);
      const int64_t cost = (end - begin) * (first_pos + (end - 1) / s.group + 1);
      for (int64_t h = 0; h < s.num_kv_heads; ++h) tasks.push_back({seq, h, begin, end, cost});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const T* q_ptr = static_cast<const T*>(query.data_ptr());
  const T* k_ptr = static_cast<const T*>(key_cache.data_ptr());
  const T* v_ptr = static_cast<const T*>(value_cache.data_ptr());
  T* out_ptr = static_cast<T*>(out.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  parallel_chunks(static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<Workspace> cache;  // one workspace per thread, reused across calls
    if (cache.empty() || !cache[0].fits(s)) cache.assign(1, Workspace(s));
    for (int64_t i = begin; i < end; ++i) {
      const Task& t = tasks[i];
      const int64_t q_len = starts[t.seq + 1] - starts[t.seq];
      run_task<T>(t, q_ptr, k_ptr, v_ptr, tables + t.seq * table_stride, lens[t.seq] - q_len, starts[t.seq],
                  out_ptr, s, cache[0]);
    }
  }, query.size(0) >= kOpenMPRows);
}

}  // namespace

void paged_prefill_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_start_loc, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out head dim must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  const int64_t num_heads = query.size(1), num_kv_heads = key_cache.size(1);
  const int64_t head_size = key_cache.size(3), block_size = key_cache.size(2);
  const int64_t tile_keys = vec::round_up(kTileKeys, block_size);
  const Shape s{num_heads, num_kv_heads, num_heads / num_kv_heads, head_size, vec::round_up(head_size, kWidth),
                block_size, tile_keys, vec::round_up(tile_keys, kWidth), key_cache.size(0), block_tables.size(1),
                query.stride(0), query.stride(1), out.stride(0), out.stride(1), static_cast<float>(scale)};
  if (query.size(0) == 0 || context_lens.size(0) == 0) return;
  switch (query.scalar_type()) {
    case at::kFloat:
      return run<float>(out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens, s);
    case at::kBFloat16:
      return run<c10::BFloat16>(out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens, s);
    case at::kHalf:
      return run<c10::Half>(out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens, s);
    default: TORCH_CHECK(false, "paged_prefill_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace pagedserve::cpu
