// Multi-LoRA rows on the CPU: out[m] += (x[m] . A[s]^T) . B[s]^T with s = slot_of_row[m] (rows with
// s < 0 are left alone), every row through its own adapter slot in one call.
//
// Each sum has one fixed order, whatever M, the other rows' slots or the thread count: a dot product
// of length L runs eight accumulators, lane j taking i = j, j + 8, j + 16, ... (an fma chain each,
// the tail folded into the first lanes), then one fixed pairwise sum of the eight. The eight-lane
// array is written so the compiler may keep it in one vector register; that changes no rounding,
// since each lane's chain and the final sum are the same operations in the same order; with AVX2
// eight such sums run side by side (`eight_dots`), again with the same lanes and sum. So a row's
// bits depend only on its own x, its slot's A and B, and the shapes: the batch invariance of the
// deterministic mode holds with adapters.
//
// First every row's t = x . A^T ([M, R]), then out += t . B^T, each parallel over groups of rows
// with the same slot x blocks of A's rows or of output columns. lora_slices does the same for a
// linear whose output is several slices (q, k, v), each with its own B and its rank rows of A.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "lora.h"
#include "ops.h"
#include "parallel.h"

namespace pagedserve::cpu {
namespace {

constexpr int64_t kLanes = 8;
constexpr int64_t kColumnBlock = 64;          // output columns per unit of the second pass
constexpr int64_t kRankBlock = 8;             // rows of A per unit of the first pass (one eight_dots)
constexpr int64_t kGroupRows = 8;             // rows of one slot that share a unit (its block read once)
constexpr int64_t kMinChunkElems = 1 << 14;   // below this much work a second thread costs more than it saves

inline float fixed_dot(const float* __restrict a, const float* __restrict b, int64_t len) {
  float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  for (int64_t j = 0; i + j < len; ++j) acc[j] += a[i + j] * b[i + j];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

#if defined(__AVX2__) && defined(__FMA__)
// fixed_dot(v, rows + c * ld, len) for the eight rows c = 0..7 at once, in the same lanes and the same
// pairwise sum: lane j of accumulator c is that row's lane j (masked loads add exact zeros past
// len); two hadds and an add of the two halves give each row ((0+1)+(2+3))+((4+5)+(6+7)).
inline __m256 eight_dots(const float* v, const float* rows, int64_t ld, int64_t len) {
  __m256 acc[8];
  for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    const __m256 vv = _mm256_loadu_ps(v + i);
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(vv, _mm256_loadu_ps(rows + c * ld + i), acc[c]);
  }
  if (i < len) {
    const __m256i mask =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(len - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 vv = _mm256_maskload_ps(v + i, mask);
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(vv, _mm256_maskload_ps(rows + c * ld + i, mask), acc[c]);
  }
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}
#endif

// dst[c] (+)= fixed_dot(v, rows + c * ld, len) for c in [0, count): eight rows at a time where the
// CPU has the vectors (the same bits), one at a time for the rest.
inline void dots(const float* v, const float* rows, int64_t ld, int64_t count, int64_t len, float* dst,
                 bool accumulate) {
  int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; c + 8 <= count; c += 8) {
    const __m256 sums = eight_dots(v, rows + c * ld, ld, len);
    _mm256_storeu_ps(dst + c, accumulate ? _mm256_add_ps(_mm256_loadu_ps(dst + c), sums) : sums);
  }
#endif
  for (; c < count; ++c) {
    const float sum = fixed_dot(v, rows + c * ld, len);
    dst[c] = accumulate ? dst[c] + sum : sum;
  }
}

}  // namespace

void lora_slices(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a, at::TensorList bs,
                 const at::Tensor& slot_of_row) {
  TORCH_CHECK(!bs.empty(), "lora_rows: at least one slice");
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat,
              "lora_rows: out, x, a and b must be float32");
  TORCH_CHECK(slot_of_row.scalar_type() == at::kLong && slot_of_row.dim() == 1, "lora_rows: slot_of_row must be int64 [M]");
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && a.dim() == 3, "lora_rows: out [M, N], x [M, K], a [S, R, K], b [S, N, R]");
  const int64_t m_len = x.size(0), k_len = x.size(1), slots = a.size(0), n_len = out.size(1);
  const int64_t parts = static_cast<int64_t>(bs.size());
  TORCH_CHECK(a.size(1) % parts == 0, "lora_rows: a's rows must split evenly into the slices");
  const int64_t rank = a.size(1) / parts, rank_total = a.size(1);
  TORCH_CHECK(out.size(0) == m_len && slot_of_row.size(0) == m_len, "lora_rows: out, x and slot_of_row disagree on M");
  std::vector<int64_t> column(static_cast<size_t>(parts + 1), 0);  // slice i: out columns [column[i], column[i + 1])
  for (int64_t i = 0; i < parts; ++i) {
    const at::Tensor& b = bs[i];
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.dim() == 3, "lora_rows: out, x, a and b must be float32");
    TORCH_CHECK(b.size(0) == slots && b.size(2) == rank && b.stride(2) == 1,
                "lora_rows: shapes disagree (a [S, R, K], b [S, N, R])");
    column[i + 1] = column[i] + b.size(1);
  }
  TORCH_CHECK(a.size(2) == k_len && column[parts] == n_len, "lora_rows: shapes disagree (a [S, R, K], b [S, N, R])");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1 && a.stride(2) == 1,
              "lora_rows: the last dimension of out, x, a and b must be contiguous");
  if (m_len == 0 || n_len == 0 || rank == 0) return;
  const at::Tensor slot_c = slot_of_row.contiguous();
  const int64_t* slot = slot_c.data_ptr<int64_t>();
  for (int64_t m = 0; m < m_len; ++m)
    TORCH_CHECK(slot[m] < slots, "lora_rows: slot ", slot[m], " out of range for ", slots, " slots");

  // The rows grouped by slot (at most kGroupRows to a group, in row order), so that each unit of
  // work reads one slot's block of A or B once from memory and then from cache for every row of its
  // group: eight adapters' A and B at rank 16 outweigh a small model's quantized layers. The sums
  // are the same dots calls as row by row, so the grouping changes no bits; neither does taking
  // every slice's A rows in one pass (each t entry is its own sum).
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(m_len));
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t m = 0; m < m_len; ++m)
      if (slot[m] == s) order.push_back(m);
  std::vector<int64_t> group_start;  // group g: order[group_start[g], group_start[g + 1])
  for (size_t i = 0; i < order.size(); ++i)
    if (i == 0 || slot[order[i]] != slot[order[i - 1]] || (static_cast<int64_t>(i) - group_start.back()) % kGroupRows == 0)
      group_start.push_back(static_cast<int64_t>(i));
  const int64_t groups = static_cast<int64_t>(group_start.size());
  if (groups == 0) return;
  group_start.push_back(static_cast<int64_t>(order.size()));

  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), lda_s = a.stride(0), lda_r = a.stride(1), ldo = out.stride(0);
  const bool openmp = m_len >= openmp_rows();
  const int64_t threads = at::get_num_threads();
  // Units of at least kMinChunkElems multiply-adds where there are enough, about eight per thread.
  const auto chunk_of = [&](int64_t units, int64_t unit_elems) {
    return std::max<int64_t>(1, std::min<int64_t>(std::max<int64_t>(1, kMinChunkElems / std::max<int64_t>(1, unit_elems)),
                                                  (units + 8 * threads - 1) / (8 * threads)));
  };
  const int64_t group_rows = std::min<int64_t>(kGroupRows, static_cast<int64_t>(order.size()));

  // t = x . A^T over every slice's rows of A ([M, slices * rank]): units are (group, block of
  // kRankBlock rows of A).
  std::vector<float> t(static_cast<size_t>(m_len * rank_total));
  const int64_t rank_blocks = (rank_total + kRankBlock - 1) / kRankBlock;
  parallel_chunks(groups * rank_blocks, chunk_of(groups * rank_blocks, group_rows * kRankBlock * k_len),
                  [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g = u / rank_blocks, r0 = (u % rank_blocks) * kRankBlock;
      const int64_t r1 = std::min(rank_total, r0 + kRankBlock);
      const float* block = ap + slot[order[group_start[g]]] * lda_s + r0 * lda_r;
      for (int64_t i = group_start[g]; i < group_start[g + 1]; ++i) {
        const int64_t m = order[i];
        dots(xp + m * ldx, block, lda_r, r1 - r0, k_len, t.data() + m * rank_total + r0, false);
      }
    }
  }, openmp);

  // out += t_slice . B_slice^T: units are (group, block of kColumnBlock columns of one slice).
  std::vector<int64_t> block_start(static_cast<size_t>(parts + 1), 0);  // slice i: blocks [block_start[i], ...)
  for (int64_t i = 0; i < parts; ++i)
    block_start[i + 1] = block_start[i] + (column[i + 1] - column[i] + kColumnBlock - 1) / kColumnBlock;
  const int64_t blocks = block_start[parts];
  parallel_chunks(groups * blocks, chunk_of(groups * blocks, group_rows * kColumnBlock * rank),
                  [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g = u / blocks, block = u % blocks;
      const int64_t part = std::upper_bound(block_start.begin(), block_start.end(), block) - block_start.begin() - 1;
      const at::Tensor& b = bs[part];
      const int64_t width = column[part + 1] - column[part];
      const int64_t n0 = (block - block_start[part]) * kColumnBlock, n1 = std::min(width, n0 + kColumnBlock);
      const int64_t ldb_n = b.stride(1);
      const float* bblock = b.data_ptr<float>() + slot[order[group_start[g]]] * b.stride(0) + n0 * ldb_n;
      for (int64_t i = group_start[g]; i < group_start[g + 1]; ++i) {
        const int64_t m = order[i];
        dots(t.data() + m * rank_total + part * rank, bblock, ldb_n, n1 - n0, rank,
             op + m * ldo + column[part] + n0, true);
      }
    }
  }, openmp);
}

void lora_rows(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& slot_of_row) {
  TORCH_CHECK(b.dim() == 3, "lora_rows: out [M, N], x [M, K], a [S, R, K], b [S, N, R]");
  lora_slices(out, x, a, {b}, slot_of_row);
}

}  // namespace pagedserve::cpu
