// Linear layers on GGUF-quantized weights (Q8_0, Q4_0, Q4_1), read in their packed blocks.
//
// Layout (ops/reference/quant.py): weight row n is K / 32 blocks of 32 consecutive weights along K.
// At small M a layer is bound by reading the weight, so the packed bytes (4.5-8.5 bits per weight
// instead of 32) are streamed once, row by row, like gemv.cpp does in fp32. Two inner loops:
//
// - int8 activations (the default): each activation row is quantized per 32-block to int8 with an
//   fp32 scale (and the block's scaled sum, for the Q4_0 offset and the Q4_1 min), then each block
//   pair is one integer dot product: VNNI dpbusd where the CPU has it, maddubs + madd on AVX2.
// - fp32 activations: each weight block is widened to fp32 and FMA'd with the fp32 activations.
//
// Large M (prefill) goes through `dequantize_weight` and oneDNN instead (ops/quant.py).
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

constexpr int kBlock = 32;

struct BlockQ8_0 {
  uint16_t d;
  int8_t q[kBlock];
};
struct BlockQ4_0 {
  uint16_t d;
  uint8_t q[kBlock / 2];
};
struct BlockQ4_1 {
  uint16_t d, m;
  uint8_t q[kBlock / 2];
};
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20,
              "GGUF block sizes");

// One activation block quantized: x ~= d * q; s = d * sum(q).
struct ActBlock {
  float d, s;
  int8_t q[kBlock];
};

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

int64_t block_bytes(int64_t format) {
  switch (format) {
    case kQuantQ8_0: return sizeof(BlockQ8_0);
    case kQuantQ4_0: return sizeof(BlockQ4_0);
    case kQuantQ4_1: return sizeof(BlockQ4_1);
    default: TORCH_CHECK(false, "quant: unknown format ", format, " (Q4_0=2, Q4_1=3, Q8_0=8)");
  }
  return 0;
}

void quantize_row(const float* x, int64_t k_len, ActBlock* out) {
  for (int64_t b = 0; b < k_len / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f;
    const float inv = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int q = static_cast<int>(std::nearbyint(xb[i] * inv));
      out[b].q[i] = static_cast<int8_t>(q);
      sum += q;
    }
    out[b].d = d;
    out[b].s = d * static_cast<float>(sum);
  }
}

// Unsigned 32 weights of a Q4 block in element order (low nibbles 0..15, high 16..31).
#if defined(__AVX2__)
inline __m256i unpack_nibbles(const uint8_t* q) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// Eight int32 partial sums of u8 x s8 products (u < 129, |s| < 128: no int16 saturation).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Integer dot of weight block b with activation block a (unscaled), in scalar code.
template <int64_t F>
inline int32_t block_idot(const void* wb, const ActBlock& a) {
  int32_t sum = 0;
  if constexpr (F == kQuantQ8_0) {
    const auto* w = static_cast<const BlockQ8_0*>(wb);
    for (int i = 0; i < kBlock; ++i) sum += w->q[i] * a.q[i];
  } else {
    const uint8_t* q = F == kQuantQ4_0 ? static_cast<const BlockQ4_0*>(wb)->q : static_cast<const BlockQ4_1*>(wb)->q;
    for (int i = 0; i < kBlock / 2; ++i) sum += (q[i] & 0x0F) * a.q[i] + (q[i] >> 4) * a.q[i + kBlock / 2];
  }
  return sum;
}

// Rows [begin, end) of out[M][N] with int8 activations `act` (M rows of nb blocks).
template <int64_t F, int M>
void int8_rows(const ActBlock* act, int64_t nb, const uint8_t* w, int64_t row_bytes, const float* bias, float* out,
               int64_t ldo, int64_t begin, int64_t end) {
  using Block = std::conditional_t<F == kQuantQ8_0, BlockQ8_0, std::conditional_t<F == kQuantQ4_0, BlockQ4_0, BlockQ4_1>>;
#if defined(__AVX2__)
  // Block b of a row into acc[m] / extra[m]; two interleaved sets of accumulators per row hide the
  // FMA latency (one chain per block pair: measured 4.4 -> fewer cycles per block).
  const auto step = [&](const Block& blk, int64_t b, __m256* acc, float* extra) {
    const float wd = half_to_float(blk.d);
    [[maybe_unused]] float wm = 0.f;
    if constexpr (F == kQuantQ4_0) wm = -8.f * wd;
    if constexpr (F == kQuantQ4_1) wm = half_to_float(blk.m);
    __m256i wu, wsign;
    if constexpr (F == kQuantQ8_0) {
      wsign = load32(blk.q);
      wu = _mm256_sign_epi8(wsign, wsign);  // |w|, and the sign moves onto the activations
    } else {
      wu = unpack_nibbles(blk.q);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const ActBlock& a = act[m * nb + b];
      __m256i xs = load32(a.q);
      if constexpr (F == kQuantQ8_0) xs = _mm256_sign_epi8(xs, wsign);
      const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wu, xs));
      acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(wd * a.d), acc[m]);
      if constexpr (F != kQuantQ8_0) extra[m] += wm * a.s;
    }
  };
#endif
  for (int64_t n = begin; n < end; ++n) {
    const Block* row = reinterpret_cast<const Block*>(w + n * row_bytes);
#if defined(__AVX2__)
    __m256 acc0[M], acc1[M];
    float extra0[M] = {}, extra1[M] = {};  // the Q4_0 offset and Q4_1 min terms
    for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
      step(row[b], b, acc0, extra0);
      step(row[b + 1], b + 1, acc1, extra1);
    }
    if (b < nb) step(row[b], b, acc0, extra0);
    for (int m = 0; m < M; ++m)
      out[m * ldo + n] = hsum(_mm256_add_ps(acc0[m], acc1[m])) + extra0[m] + extra1[m] +
                         (bias != nullptr ? bias[n] : 0.f);
#else
    float acc[M] = {}, extra[M] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const Block& blk = row[b];
      const float wd = half_to_float(blk.d);
      float wm = 0.f;
      if constexpr (F == kQuantQ4_0) wm = -8.f * wd;
      if constexpr (F == kQuantQ4_1) wm = half_to_float(blk.m);
      for (int m = 0; m < M; ++m) {
        const ActBlock& a = act[m * nb + b];
        acc[m] += wd * a.d * static_cast<float>(block_idot<F>(&blk, a));
        if constexpr (F != kQuantQ8_0) extra[m] += wm * a.s;
      }
    }
    for (int m = 0; m < M; ++m) out[m * ldo + n] = acc[m] + extra[m] + (bias != nullptr ? bias[n] : 0.f);
#endif
  }
}

// Scale d and offset m of a weight block (w = d * q + m, q unsigned for Q4, signed for Q8_0).
template <int64_t F>
inline void block_affine(const void* wb, float& d, float& m) {
  if constexpr (F == kQuantQ8_0) {
    d = half_to_float(static_cast<const BlockQ8_0*>(wb)->d);
    m = 0.f;
  } else if constexpr (F == kQuantQ4_0) {
    d = half_to_float(static_cast<const BlockQ4_0*>(wb)->d);
    m = -8.f * d;
  } else {
    d = half_to_float(static_cast<const BlockQ4_1*>(wb)->d);
    m = half_to_float(static_cast<const BlockQ4_1*>(wb)->m);
  }
}

template <int64_t F>
inline const uint8_t* block_quants(const void* wb) {
  if constexpr (F == kQuantQ8_0) return reinterpret_cast<const uint8_t*>(static_cast<const BlockQ8_0*>(wb)->q);
  if constexpr (F == kQuantQ4_0) return static_cast<const BlockQ4_0*>(wb)->q;
  return static_cast<const BlockQ4_1*>(wb)->q;
}

// fp32 values of weight block `wb` into dst[32].
template <int64_t F>
inline void dequant_block(const void* wb, float* dst) {
  float d, m;
  block_affine<F>(wb, d, m);
  const uint8_t* q = block_quants<F>(wb);
#if defined(__AVX2__)
  const __m256i bytes = F == kQuantQ8_0 ? load32(reinterpret_cast<const int8_t*>(q)) : unpack_nibbles(q);
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int u = 0; u < 4; ++u) {
    const __m128i part = parts[u];
    const __m256i wide = F == kQuantQ8_0 ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
    _mm256_storeu_ps(dst + 8 * u, _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), vd, vm));
  }
#else
  if constexpr (F == kQuantQ8_0) {
    for (int i = 0; i < kBlock; ++i) dst[i] = d * static_cast<float>(static_cast<int8_t>(q[i]));
  } else {
    for (int i = 0; i < kBlock / 2; ++i) {
      dst[i] = d * static_cast<float>(q[i] & 0x0F) + m;
      dst[i + kBlock / 2] = d * static_cast<float>(q[i] >> 4) + m;
    }
  }
#endif
}

// Rows [begin, end) of out with fp32 activations x[M][K]: each weight block widened, then FMA'd.
template <int64_t F, int M>
void fp32_rows(const float* x, int64_t ldx, int64_t nb, const uint8_t* w, int64_t row_bytes, int64_t bsize,
               const float* bias, float* out, int64_t ldo, int64_t begin, int64_t end) {
  using vec::Vec;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = w + n * row_bytes;
    constexpr int U = kBlock / vec::kWidth;
    Vec acc[M][U] = {};  // one FMA chain per eighth of a block
    alignas(32) float wf[kBlock];
    for (int64_t b = 0; b < nb; ++b) {
      dequant_block<F>(row + b * bsize, wf);
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        const Vec wv = vec::load(wf + u * vec::kWidth);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) acc[m][u] += wv * vec::load(x + m * ldx + b * kBlock + u * vec::kWidth);
      }
    }
    for (int m = 0; m < M; ++m)
      out[m * ldo + n] = vec::hsum((acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3])) + (bias != nullptr ? bias[n] : 0.f);
  }
}

// Output rows [begin, end) for every activation row, four activation rows per pass over the
// chunk's weight rows (which stay in cache between passes).
template <int64_t F, int M>
void rows_for_group(const at::Tensor& out, const at::Tensor& x, int64_t row0, const uint8_t* w, int64_t k_len,
                    const float* bias, bool int8_act, const ActBlock* act, int64_t begin, int64_t end) {
  const int64_t nb = k_len / kBlock, bsize = block_bytes(F), row_bytes = nb * bsize, ldo = out.stride(0);
  float* op = out.data_ptr<float>() + row0 * ldo;
  if (int8_act) {
    int8_rows<F, M>(act + row0 * nb, nb, w, row_bytes, bias, op, ldo, begin, end);
  } else {
    const float* xp = x.data_ptr<float>() + row0 * x.stride(0);
    fp32_rows<F, M>(xp, x.stride(0), nb, w, row_bytes, bsize, bias, op, ldo, begin, end);
  }
}

template <int64_t F>
void run_format(const at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t n_len, int64_t k_len,
                const float* bias, bool int8_act) {
  const int64_t m_len = x.size(0), nb = k_len / kBlock;
  std::vector<ActBlock> act;
  if (int8_act) {
    act.resize(m_len * nb);
    for (int64_t m = 0; m < m_len; ++m) quantize_row(x.data_ptr<float>() + m * x.stride(0), k_len, &act[m * nb]);
  }
  // Chunks of at least ~64 KiB of packed weights, about eight per thread.
  const int64_t chunk = row_chunk(n_len, nb * block_bytes(F), 64 * 1024);
  parallel_chunks(n_len, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t row0 = 0; row0 < m_len; row0 += 4) {
      switch (std::min<int64_t>(4, m_len - row0)) {
        case 1: rows_for_group<F, 1>(out, x, row0, w, k_len, bias, int8_act, act.data(), begin, end); break;
        case 2: rows_for_group<F, 2>(out, x, row0, w, k_len, bias, int8_act, act.data(), begin, end); break;
        case 3: rows_for_group<F, 3>(out, x, row0, w, k_len, bias, int8_act, act.data(), begin, end); break;
        default: rows_for_group<F, 4>(out, x, row0, w, k_len, bias, int8_act, act.data(), begin, end); break;
      }
    }
  }, /*openmp=*/m_len >= openmp_rows());
}

template <int64_t F>
void dequant_rows(const uint8_t* w, int64_t nb, float* out, int64_t k_len, int64_t begin, int64_t end) {
  const int64_t bsize = block_bytes(F);
  for (int64_t n = begin; n < end; ++n)
    for (int64_t b = 0; b < nb; ++b) dequant_block<F>(w + (n * nb + b) * bsize, out + n * k_len + b * kBlock);
}

void check_packed(const at::Tensor& qweight, int64_t format, int64_t k_len) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "quant: qweight must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(k_len % kBlock == 0, "quant: K must be a multiple of 32; got ", k_len);
  TORCH_CHECK(qweight.size(1) == k_len / kBlock * block_bytes(format), "quant: qweight has ", qweight.size(1),
              " bytes per row; K=", k_len, " needs ", k_len / kBlock * block_bytes(format));
}

}  // namespace

void quant_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t format,
                  const c10::optional<at::Tensor>& bias, bool int8_activations) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "quant_linear: fp32 x and out");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1, "quant_linear: rows must be contiguous");
  const int64_t k_len = x.size(1), n_len = qweight.size(0);
  check_packed(qweight, format, k_len);
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == n_len, "quant_linear: out must be [M, N]");
  const float* b = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  switch (format) {
    case kQuantQ8_0: return run_format<kQuantQ8_0>(out, x, w, n_len, k_len, b, int8_activations);
    case kQuantQ4_0: return run_format<kQuantQ4_0>(out, x, w, n_len, k_len, b, int8_activations);
    case kQuantQ4_1: return run_format<kQuantQ4_1>(out, x, w, n_len, k_len, b, int8_activations);
    default: TORCH_CHECK(false, "quant_linear: unknown format ", format);
  }
}

void dequantize_weight(const at::Tensor& out, const at::Tensor& qweight, int64_t format) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2, "dequantize: fp32 [N, K] out");
  const int64_t n_len = out.size(0), k_len = out.size(1), nb = k_len / kBlock;
  check_packed(qweight, format, k_len);
  TORCH_CHECK(qweight.size(0) == n_len, "dequantize: out has ", n_len, " rows, qweight ", qweight.size(0));
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t chunk = row_chunk(n_len, k_len, 64 * 1024);
  // Runs just before a oneDNN GEMM: share OpenMP's threads (parallel.h).
  parallel_chunks(n_len, chunk, [&](int64_t begin, int64_t end) {
    switch (format) {
      case kQuantQ8_0: return dequant_rows<kQuantQ8_0>(w, nb, op, k_len, begin, end);
      case kQuantQ4_0: return dequant_rows<kQuantQ4_0>(w, nb, op, k_len, begin, end);
      default: return dequant_rows<kQuantQ4_1>(w, nb, op, k_len, begin, end);
    }
  }, /*openmp=*/true);
}


}  // namespace pagedserve::cpu
