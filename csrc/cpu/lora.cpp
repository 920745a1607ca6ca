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
// First every row's t = x . A^T ([M, R]), parallel over rows; then out += t . B^T, parallel over
// rows x blocks of output columns.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "ops.h"
#include "parallel.h"

namespace pagedserve::cpu {
namespace {

constexpr int64_t kLanes = 8;
constexpr int64_t kColumnBlock = 64;          // output columns per chunk of the second pass
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

void lora_rows(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& slot_of_row) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
                  b.scalar_type() == at::kFloat,
              "lora_rows: out, x, a and b must be float32");
  TORCH_CHECK(slot_of_row.scalar_type() == at::kLong && slot_of_row.dim() == 1, "lora_rows: slot_of_row must be int64 [M]");
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && a.dim() == 3 && b.dim() == 3, "lora_rows: out [M, N], x [M, K], a [S, R, K], b [S, N, R]");
  const int64_t m_len = x.size(0), k_len = x.size(1), slots = a.size(0), rank = a.size(1), n_len = out.size(1);
  TORCH_CHECK(out.size(0) == m_len && slot_of_row.size(0) == m_len, "lora_rows: out, x and slot_of_row disagree on M");
  TORCH_CHECK(a.size(2) == k_len && b.size(0) == slots && b.size(1) == n_len && b.size(2) == rank,
              "lora_rows: shapes disagree (a [S, R, K], b [S, N, R])");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1 && a.stride(2) == 1 && b.stride(2) == 1,
              "lora_rows: the last dimension of out, x, a and b must be contiguous");
  if (m_len == 0 || n_len == 0 || rank == 0) return;
  const at::Tensor slot_c = slot_of_row.contiguous();
  const int64_t* slot = slot_c.data_ptr<int64_t>();
  for (int64_t m = 0; m < m_len; ++m)
    TORCH_CHECK(slot[m] < slots, "lora_rows: slot ", slot[m], " out of range for ", slots, " slots");

  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), lda_s = a.stride(0), lda_r = a.stride(1);
  const int64_t ldb_s = b.stride(0), ldb_n = b.stride(1), ldo = out.stride(0);
  const bool openmp = m_len >= openmp_rows();

  std::vector<float> t(static_cast<size_t>(m_len * rank));
  parallel_chunks(m_len, row_chunk(m_len, rank * k_len, kMinChunkElems), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (slot[m] < 0) continue;
      dots(xp + m * ldx, ap + slot[m] * lda_s, lda_r, rank, k_len, t.data() + m * rank, false);
    }
  }, openmp);

  const int64_t blocks = (n_len + kColumnBlock - 1) / kColumnBlock;
  const int64_t units = m_len * blocks;
  const int64_t unit_elems = kColumnBlock * rank;
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(
      std::max<int64_t>(1, kMinChunkElems / unit_elems), (units + 8 * at::get_num_threads() - 1) / (8 * at::get_num_threads())));
  parallel_chunks(units, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t m = u / blocks;
      if (slot[m] < 0) continue;
      const int64_t n0 = (u % blocks) * kColumnBlock, n1 = std::min(n_len, n0 + kColumnBlock);
      const float* bs = bp + slot[m] * ldb_s;
      const float* tm = t.data() + m * rank;
      float* row = op + m * ldo;
      dots(tm, bs + n0 * ldb_n, ldb_n, n1 - n0, rank, row + n0, true);
    }
  }, openmp);
}

}  // namespace pagedserve::cpu
