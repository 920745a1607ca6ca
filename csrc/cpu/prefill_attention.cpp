// CPU varlen paged prefill attention: every prefill sequence of a step in one call, queries
// attending causally over the sequence's whole context read straight from its block table
// (cached prefix, earlier chunks and this chunk, whose K/V reshape_and_cache already wrote).
//
// Flash-style: a task is (sequence, KV head, tile of query rows), where the rows of a sequence
// are its (token, head-of-the-GQA-group) pairs, so one K/V load serves every query head of the
// group. The task's queries are transposed once (dims x rows) and the context is walked in key
// tiles of whole blocks (about 64 tokens) whose K and V rows are used where they lie in the cache
// (fp32; other dtypes are widened once per tile). Scores are kept keys x rows, so every step
// vectorizes across query rows: S^T = K Q^T with 12-key x 16-row register tiles (one K value
// broadcast per key and dim), the online softmax (running max and sum per row, fp32) lane-wise
// with no horizontal reductions, then acc += P V with 4-row x 32-dim tiles. Each 16-row chunk of
// the task stops at the last key its rows can see, so causal work past the diagonal is skipped at
// that granularity. Tasks differ in cost (causal rows near the end see more keys), so they are
// sorted longest first and handed out from an atomic counter. An int8 cache (kv_quant.h) is
// dequantized into the tile's K and V buffers, as bf16/fp16 rows are widened.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv_quant.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

using vec::Vec;
using vec::kWidth;

constexpr int64_t kRows = 64;       // query rows per task: Q^T and acc stay in L2 up to head 256
constexpr int64_t kChunk = 16;      // query rows per score tile column: two vectors
constexpr int64_t kTileKeys = 64;   // keys per softmax step, rounded up to whole blocks
constexpr int64_t kKeys = 12;       // keys per S^T register tile
constexpr int64_t kPvRows = 4;      // query rows per P V register tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
static_assert(kChunk == 2 * kWidth && kRows % kChunk == 0 && kChunk % kPvRows == 0, "tile shapes");

struct Shape {
  int64_t num_heads, num_kv_heads, group, head_size, row_elems, dim_pad, block_size, tile_keys, num_blocks, max_blocks;
  int64_t q_stride_token, q_stride_head, out_stride_token, out_stride_head;
  float scale;
  int64_t window;  // tokens a query sees, itself included; 0: its whole causal context
  const float* sinks;  // [num_heads] fp32 logits that join each head's softmax denominator; null: none
};

struct Task {
  int64_t seq, kv_head, row_begin, row_end, cost;
};

// One thread's scratch, reused across tasks and calls of the same shape.
struct Workspace {
  int64_t head_size, dim_pad, tile_keys;
  std::vector<float> qt;    // [head_size][kRows]: scaled queries, transposed
  std::vector<float> acc;   // [kRows][dim_pad]: unnormalized outputs
  std::vector<float> st;    // [tile_keys][kRows]: a tile's scores, then its softmax weights
  std::vector<float> kbuf;  // [tile_keys][dim_pad]: K rows widened to fp32 (non-fp32 caches)
  std::vector<float> vbuf;  // [tile_keys][dim_pad]: V rows widened or padded to whole vectors
  std::vector<const float*> krow, vrow;  // [tile_keys]: where each key's K and V rows are read
  std::vector<float> maxes, sums, pos;   // [kRows]: running max and sum, and the position, per row

  explicit Workspace(const Shape& s)
      : head_size(s.head_size), dim_pad(s.dim_pad), tile_keys(s.tile_keys), qt(s.head_size * kRows),
        acc(kRows * s.dim_pad), st(s.tile_keys * kRows), kbuf(s.tile_keys * s.dim_pad),
        vbuf(s.tile_keys * s.dim_pad), krow(s.tile_keys), vrow(s.tile_keys), maxes(kRows), sums(kRows),
        pos(kRows) {}

  bool fits(const Shape& s) const {
    return head_size == s.head_size && dim_pad == s.dim_pad && tile_keys == s.tile_keys;
  }
};

// st[i][0 .. 16) = sum_d k[i][d] * qt[d][0 .. 16) for NK keys: NK x 2 accumulators in registers,
// one K value broadcast per key and dim. `qt` and `st` rows are kRows apart.
template <int NK>
inline void qk_tile(const float* const* k, int64_t dim, const float* qt, float* st) {
  Vec acc[NK][2] = {};
  for (int64_t d = 0; d < dim; ++d) {
    const Vec q0 = vec::load(qt + d * kRows), q1 = vec::load(qt + d * kRows + kWidth);
#pragma GCC unroll 16
    for (int i = 0; i < NK; ++i) {
      const Vec x = vec::splat(k[i][d]);
      acc[i][0] += q0 * x;
      acc[i][1] += q1 * x;
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NK; ++i) {
    vec::store(st + i * kRows, acc[i][0]);
    vec::store(st + i * kRows + kWidth, acc[i][1]);
  }
}

// S^T for keys [0, n) of one 16-row chunk (`qt`, `st` already offset to the chunk's columns).
void scores(const float* const* k, int64_t n, int64_t dim, const float* qt, float* st) {
  int64_t t = 0;
  for (; t + kKeys <= n; t += kKeys) qk_tile<kKeys>(k + t, dim, qt, st + t * kRows);
  if (t + 8 <= n) qk_tile<8>(k + t, dim, qt, st + t * kRows), t += 8;
  if (t + 4 <= n) qk_tile<4>(k + t, dim, qt, st + t * kRows), t += 4;
  if (t + 2 <= n) qk_tile<2>(k + t, dim, qt, st + t * kRows), t += 2;
  if (t < n) qk_tile<1>(k + t, dim, qt, st + t * kRows);
}

// Online softmax over keys [0, n) for 8 rows (lane r of every vector is row r): masks keys past
// each row's position and, with a sliding window of W tokens, keys at or before position - W
// (transformers' sliding mask: key p is seen from query q when q - W < p <= q), turns scores into
// weights in place, rescales the rows' sums and accumulators when their max grows.
void softmax_rows(float* st, int64_t n, int64_t key0, const float* pos, int64_t window, float* maxes, float* sums,
                  float* acc, int64_t dim_pad) {
  const Vec row_pos = vec::load(pos), neg_inf = vec::splat(kNegInf);
  // the last key each row does not see: position - W, or -1 without a window
  const Vec row_before = window > 0 ? row_pos - vec::splat(static_cast<float>(window)) : vec::splat(-1.f);
  Vec tile_max = neg_inf;
  for (int64_t t = 0; t < n; ++t) {
    Vec s = vec::load(st + t * kRows);
    const Vec key = vec::splat(static_cast<float>(key0 + t));
    s = key <= row_pos ? s : neg_inf;
    s = key > row_before ? s : neg_inf;
    vec::store(st + t * kRows, s);
    tile_max = vec::vmax(tile_max, s);
  }
  const Vec old_max = vec::load(maxes), new_max = vec::vmax(old_max, tile_max);
  const auto seen = new_max > neg_inf;  // rows that have seen a key: the others keep 0 weights
  const Vec shift = seen ? new_max : Vec{};
  const Vec alpha = seen ? vec::exp(old_max - shift) : vec::splat(1.f);  // ~0 on a row's first keys
  Vec total{};
  for (int64_t t = 0; t < n; ++t) {
    const Vec s = vec::load(st + t * kRows);
    Vec e = vec::exp(s - shift);
    e = s > neg_inf ? e : Vec{};  // exp() of a huge negative is ~1e-38, not 0
    vec::store(st + t * kRows, e);
    total += e;
  }
  vec::store(sums, vec::load(sums) * alpha + total);
  vec::store(maxes, new_max);
  for (int64_t r = 0; r < kWidth; ++r) {
    if (alpha[r] == 1.f) continue;
    const Vec a = vec::splat(alpha[r]);
    float* row = acc + r * dim_pad;
    for (int64_t d = 0; d < dim_pad; d += kWidth) vec::store(row + d, vec::load(row + d) * a);
  }
}

// acc[i][d0 .. d0 + 8 NC) += sum_{t < n} st[t][i] * v[t][d0 ..] for kPvRows rows: 4 x NC
// accumulators in registers, one weight broadcast per row and key.
template <int NC>
inline void pv_tile(const float* st, const float* const* v, int64_t d0, int64_t n, float* acc, int64_t dim_pad) {
  Vec a[kPvRows][NC];
#pragma GCC unroll 4
  for (int i = 0; i < kPvRows; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) a[i][j] = vec::load(acc + i * dim_pad + d0 + j * kWidth);
  for (int64_t t = 0; t < n; ++t) {
    Vec x[NC];
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) x[j] = vec::load(v[t] + d0 + j * kWidth);
#pragma GCC unroll 4
    for (int i = 0; i < kPvRows; ++i) {
      const Vec w = vec::splat(st[t * kRows + i]);
#pragma GCC unroll 4
      for (int j = 0; j < NC; ++j) a[i][j] += x[j] * w;
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < kPvRows; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) vec::store(acc + i * dim_pad + d0 + j * kWidth, a[i][j]);
}

// acc[0 .. 4)[:] += P V over keys [0, n) and all dim_pad dims (a multiple of 8).
void weighted_values(const float* st, const float* const* v, int64_t n, int64_t dim_pad, float* acc) {
  int64_t d = 0;
  for (; d + 4 * kWidth <= dim_pad; d += 4 * kWidth) pv_tile<4>(st, v, d, n, acc, dim_pad);
  for (; d + 2 * kWidth <= dim_pad; d += 2 * kWidth) pv_tile<2>(st, v, d, n, acc, dim_pad);
  if (d < dim_pad) pv_tile<1>(st, v, d, n, acc, dim_pad);
}

// Keys [key0, key0 + n) of the tile that rows up to `last` (inclusive, a real row) can see.
inline int64_t visible(const float* pos, int64_t last, int64_t key0, int64_t n) {
  return std::clamp<int64_t>(static_cast<int64_t>(pos[last]) - key0 + 1, 0, n);
}

// T: the query/out dtype; C: the cache element (T, or int8_t for a quantized cache).
template <typename T, typename C>
void run_task(const Task& task, const T* query, const C* key_cache, const C* value_cache, const int32_t* table,
              int64_t first_pos, int64_t q_begin, T* out, const Shape& s, Workspace& w) {
  const int64_t rows = task.row_end - task.row_begin;
  const int64_t rows_pad = vec::round_up(rows, kChunk);
  const int64_t dim = s.head_size, dp = s.dim_pad, bs = s.block_size;
  // fp32 K rows are read in place; V rows too when they are whole vectors.
  constexpr bool kFloat = std::is_same_v<C, float>;
  const bool v_in_place = kFloat && dim == dp;
  std::fill(w.qt.begin(), w.qt.end(), 0.f);  // padding rows stay zero
  std::fill(w.acc.begin(), w.acc.begin() + rows_pad * dp, 0.f);
  for (int64_t r = 0; r < rows_pad; ++r) {
    w.maxes[r] = kNegInf;
    w.sums[r] = 0.f;
    if (r >= rows) {  // padding rows see what the last row sees, with zero queries: never output
      w.pos[r] = w.pos[rows - 1];
      continue;
    }
    const int64_t row = task.row_begin + r, token = row / s.group, head = task.kv_head * s.group + row % s.group;
    const T* src = query + (q_begin + token) * s.q_stride_token + head * s.q_stride_head;
    for (int64_t d = 0; d < dim; ++d) w.qt[d * kRows + r] = static_cast<float>(src[d]) * s.scale;
    w.pos[r] = static_cast<float>(first_pos + token);
  }
  const int64_t kv_end = static_cast<int64_t>(w.pos[rows - 1]) + 1;  // rows are in token order
  TORCH_CHECK((kv_end + bs - 1) / bs <= s.max_blocks, "context of ", kv_end, " tokens exceeds the block table");
  // A sliding window: keys before the first row's window are never read (their blocks may be freed)
  const int64_t kv_begin = s.window > 0 ? std::max<int64_t>(0, static_cast<int64_t>(w.pos[0]) - s.window + 1) : 0;
  if (!v_in_place) std::fill(w.vbuf.begin(), w.vbuf.end(), 0.f);  // padding dims stay zero
  for (int64_t start = kv_begin; start < kv_end; start += s.tile_keys) {
    const int64_t n = std::min(s.tile_keys, kv_end - start);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t token = start + t, block = table[token / bs];
      TORCH_CHECK(block >= 0 && block < s.num_blocks, "block table entry ", block, " out of range [0, ",
                  s.num_blocks, ")");
      const int64_t offset = ((block * s.num_kv_heads + task.kv_head) * bs + token % bs) * s.row_elems;
      if constexpr (kFloat) {
        w.krow[t] = key_cache + offset;
        if (v_in_place) {
          w.vrow[t] = value_cache + offset;
          continue;
        }
      } else {
        kvq::load_row(w.kbuf.data() + t * dp, key_cache + offset, dim);
        w.krow[t] = w.kbuf.data() + t * dp;
      }
      kvq::load_row(w.vbuf.data() + t * dp, value_cache + offset, dim);
      w.vrow[t] = w.vbuf.data() + t * dp;
    }
    for (int64_t c = 0; c < rows_pad; c += kChunk) {
      const int64_t n_chunk = visible(w.pos.data(), std::min(c + kChunk, rows) - 1, start, n);
      if (n_chunk == 0) continue;  // the chunk's rows all lie before this tile
      if (s.window > 0 && static_cast<int64_t>(w.pos[c]) - s.window + 1 >= start + n_chunk)
        continue;  // the tile lies wholly before the chunk's windows (the chunk's first row sees the earliest)
      scores(w.krow.data(), n_chunk, dim, w.qt.data() + c, w.st.data() + c);
      for (int64_t h = c; h < c + kChunk; h += kWidth)
        softmax_rows(w.st.data() + h, n_chunk, start, w.pos.data() + h, s.window, w.maxes.data() + h,
                     w.sums.data() + h, w.acc.data() + h * dp, dp);
      for (int64_t r = c; r < c + kChunk; r += kPvRows) {
        const int64_t n_rows = visible(w.pos.data(), std::min(r + kPvRows, rows_pad) - 1, start, n_chunk);
        if (n_rows) weighted_values(w.st.data() + r, w.vrow.data(), n_rows, dp, w.acc.data() + r * dp);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = task.row_begin + r, token = row / s.group, head = task.kv_head * s.group + row % s.group;
    float inv = w.sums[r] > 0.f ? 1.f / w.sums[r] : 0.f;
    if (s.sinks) {  // the sink's logit joins the denominator (no value): rescale to max(max, sink)
      const float sink = s.sinks[head], m = std::max(w.maxes[r], sink);
      const float a = std::exp(w.maxes[r] - m);  // 0 for a row that saw no key (max -inf)
      inv = a / (w.sums[r] * a + std::exp(sink - m));
    }
    float* a = w.acc.data() + r * dp;
    for (int64_t d = 0; d < dim; ++d) a[d] *= inv;
    vec::narrow(out + (q_begin + token) * s.out_stride_token + head * s.out_stride_head, a, dim);
  }
}

template <typename T, typename C>
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
      const int64_t last = first_pos + (end - 1) / s.group + 1;  // the keys its rows see end here
      const int64_t first_key = s.window > 0 ? std::max<int64_t>(0, first_pos + begin / s.group - s.window + 1) : 0;
      const int64_t cost = (end - begin) * (last - first_key);
      for (int64_t h = 0; h < s.num_kv_heads; ++h) tasks.push_back({seq, h, begin, end, cost});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const T* q_ptr = static_cast<const T*>(query.data_ptr());
  const C* k_ptr = static_cast<const C*>(key_cache.data_ptr());
  const C* v_ptr = static_cast<const C*>(value_cache.data_ptr());
  T* out_ptr = static_cast<T*>(out.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  parallel_chunks(static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<Workspace> cache;  // one workspace per thread, reused across calls
    if (cache.empty() || !cache[0].fits(s)) cache.assign(1, Workspace(s));
    for (int64_t i = begin; i < end; ++i) {
      const Task& t = tasks[i];
      const int64_t q_len = starts[t.seq + 1] - starts[t.seq];
      run_task<T, C>(t, q_ptr, k_ptr, v_ptr, tables + t.seq * table_stride, lens[t.seq] - q_len, starts[t.seq],
                  out_ptr, s, cache[0]);
    }
  }, query.size(0) >= openmp_rows());
}

}  // namespace

void paged_prefill_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_start_loc, const at::Tensor& context_lens, double scale,
                             int64_t window, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out head dim must be contiguous");
  TORCH_CHECK_VALUE(window >= -1, "window must be -1 or 0 (none) or the tokens a query sees; got ", window);
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  const int64_t num_heads = query.size(1), num_kv_heads = key_cache.size(1);
  const int64_t head_size = query.size(2), block_size = key_cache.size(2);
  const int64_t tile_keys = vec::round_up(kTileKeys, block_size);
  const bool quantized = key_cache.scalar_type() == at::kChar;
  const Shape s{num_heads, num_kv_heads, num_heads / num_kv_heads, head_size, key_cache.size(3),
                vec::round_up(head_size, kWidth),
                block_size, tile_keys, key_cache.size(0), block_tables.size(1),
                query.stride(0), query.stride(1), out.stride(0), out.stride(1), static_cast<float>(scale),
                std::max<int64_t>(window, 0), check_sinks(sinks, num_heads)};
  if (query.size(0) == 0 || context_lens.size(0) == 0) return;
  const auto go = [&](auto tag) {
    using T = decltype(tag);
    if (quantized)
      return run<T, int8_t>(out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens, s);
    return run<T, T>(out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens, s);
  };
  switch (query.scalar_type()) {
    case at::kFloat: return go(float{});
    case at::kBFloat16: return go(c10::BFloat16{});
    case at::kHalf: return go(c10::Half{});
    default: TORCH_CHECK(false, "paged_prefill_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace pagedserve::cpu
