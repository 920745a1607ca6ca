// GGUF block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4; Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS in
// 256-weight blocks) as the CPU kernels read them: the block structs, the
// activation blocks of the int8 path, fp16 scales, dequantizing one block, and the fp32-activation
// dot products of one packed weight row. Shared by quant_gemm.cpp (the linear layers) and
// quant_screen.cpp (the exact logits of a screened quantized lm_head), so both compute a logit
// with the same arithmetic.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "ops.h"
#include "vec.h"

namespace pagedserve::cpu::quant {

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
// Q5: qh bit j is element j's fifth bit (element j < 16: low nibble of q[j], else high of q[j - 16]).
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t q[kBlock / 2];
};
struct BlockQ5_1 {
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t q[kBlock / 2];
};
// IQ4_NL: Q4_0's nibbles index kIQ4Values (ops/reference/formats.py: IQ4_VALUES); w = d v[q].
struct BlockIQ4_NL {
  uint16_t d;
  uint8_t q[kBlock / 2];
};
inline constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4: an E8M0 exponent byte e, then Q4_0's nibbles indexing the E2M1 values doubled (kMXFP4Values,
// ops/reference/formats.py: MXFP4_VALUES); w = d v[q] with d = 2^(e - 128), half the block scale
// 2^(e - 127) (mxfp4_scale). Run as IQ4_NL: a signed table format of scale d.
struct BlockMXFP4 {
  uint8_t e;
  uint8_t q[kBlock / 2];
};
inline constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// 2^(e - 128) as ggml's ggml_e8m0_to_fp32_half computes it: subnormal for e < 2, 2^127 for e = 255.
inline float mxfp4_scale(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float d;
  std::memcpy(&d, &bits, sizeof(d));
  return d;
}
// K-quants: 256 weights a block, read as eight sub-blocks of 32 (one activation block each).
// Q4_K sub-block j: weights are the nibbles of q[32 (j / 2) + l] (low for even j), w = d sc_j q - dmin m_j,
// sc_j / m_j the 6-bit fields of `scales` (ops/reference/formats.py: _scales_mins_k4).
// Q5_K sub-block j: Q4_K's nibble with bit j of qh[l] as its fifth bit (q up to 31), same scales and mins.
// Q2_K sub-block s (h = s / 4, g = s % 4): q bits 2g..2g+1 of qs[32 h + l] (unsigned, 0..3); w = d sc_i q -
// dmin m_i with sc_i / m_i the low / high nibble of scales[i], i = 2s + l / 16 (a scale and a min per 16).
// Q3_K sub-block s (h = s / 4, g = s % 4): q = low - 4 (hmask bit clear) or low, low bits 2g..2g+1 of
// qs[32 h + l], the bit bit 4h + g of hmask[l]; w = d (sc_i - 32) q, sc_i (i = 2s + l / 16) 6 bits: the low
// nibble of scales[i] (i < 8) or the high one of scales[i - 8], and bits 2 (i / 4) of scales[8 + i % 4] above.
// IQ4_XS sub-block j: nibbles of q[16 j + l] (low: l < 16) indexing kIQ4Values; w = d (ls_j - 32) v, ls_j the
// low nibble j % 2 of scales_l[j / 2] with bits 2j..2j+1 of scales_h above it.
// Q6_K sub-block s (half h = s / 4, g = s % 4): q = low | high << 4 with low the nibble g / 2 of
// ql[64 h + 32 (g % 2) + l], high bits 2g..2g+1 of qh[32 h + l]; w = d scales[2 s + l / 16] (q - 32).
constexpr int kSuperBlock = 256;
struct BlockQ4_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t q[kSuperBlock / 2];
};
struct BlockQ5_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[kSuperBlock / 8];
  uint8_t q[kSuperBlock / 2];
};
struct BlockQ2_K {
  uint8_t scales[kSuperBlock / 16];
  uint8_t qs[kSuperBlock / 4];
  uint16_t d, dmin;
};
struct BlockQ3_K {
  uint8_t hmask[kSuperBlock / 8];
  uint8_t qs[kSuperBlock / 4];
  uint8_t scales[12];
  uint16_t d;
};
struct BlockIQ4_XS {
  uint16_t d, scales_h;
  uint8_t scales_l[kSuperBlock / 64];
  uint8_t q[kSuperBlock / 2];
};
struct BlockQ6_K {
  uint8_t ql[kSuperBlock / 2];
  uint8_t qh[kSuperBlock / 4];
  int8_t scales[kSuperBlock / 16];
  uint16_t d;
};
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110 && sizeof(BlockQ4_K) == 144 &&
                  sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210 && sizeof(BlockIQ4_XS) == 136,
              "GGUF K-quant block sizes");
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 &&
                  sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24 && sizeof(BlockIQ4_NL) == 18 && sizeof(BlockMXFP4) == 17,
              "GGUF block sizes");

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

inline int64_t block_bytes(int64_t format) {
  switch (format) {
    case kQuantQ8_0: case kQuantQ8_0R8: return sizeof(BlockQ8_0);
    case kQuantQ4_0: case kQuantQ4_0R8: return sizeof(BlockQ4_0);
    case kQuantQ4_1: case kQuantQ4_1R8: return sizeof(BlockQ4_1);
    case kQuantQ5_0: case kQuantQ5_0R8: return sizeof(BlockQ5_0);
    case kQuantQ5_1: case kQuantQ5_1R8: return sizeof(BlockQ5_1);
    case kQuantIQ4_NL: return sizeof(BlockIQ4_NL);
    case kQuantMXFP4: return sizeof(BlockMXFP4);
    case kQuantIQ4_XS: return sizeof(BlockIQ4_XS);
    case kQuantQ2_K: return sizeof(BlockQ2_K);
    case kQuantQ3_K: return sizeof(BlockQ3_K);
    case kQuantQ4_K: return sizeof(BlockQ4_K);
    case kQuantQ4_KR8: return sizeof(BlockQ4_K) + 4;  // a row's share of a 1184-byte eight-row tile
    case kQuantQ5_K: return sizeof(BlockQ5_K);
    case kQuantQ6_K: case kQuantQ6_KR8: return sizeof(BlockQ6_K);
    default:
      TORCH_CHECK(false, "quant: format id ", format, " has no packed kernel (Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, ",
                  "Q2_K=10, Q3_K=11, Q4_K=12, Q5_K=13, Q6_K=14, IQ4_NL=20, IQ4_XS=23, MXFP4=39, Q4_0r8=1002, Q4_1r8=1003, ",
                  "Q5_0r8=1006, Q5_1r8=1007, Q8_0r8=1008, Q4_Kr8=1012, Q6_Kr8=1014)");
  }
  return 0;
}

// Weights per block of `format` (256 for the K-quants, else 32; block_bytes refuses unknown ids).
inline int64_t block_weights(int64_t format) {
  return format == kQuantQ2_K || format == kQuantQ3_K || format == kQuantQ4_K || format == kQuantQ5_K ||
                 format == kQuantQ6_K || format == kQuantIQ4_XS || format == kQuantQ4_KR8 ||
                 format == kQuantQ6_KR8
             ? kSuperBlock
             : kBlock;
}

// Packed bytes of a row of k_len weights (k_len a multiple of block_weights(format)).
inline int64_t row_bytes_of(int64_t format, int64_t k_len) { return k_len / block_weights(format) * block_bytes(format); }

// Activation row x[K] quantized per 32-block for the int8 path: x ~= d[b] * q[b * 32 + i], with
// d = max|x| / 127 and q rounded to nearest even (ops/reference/quant.py: int8_activations), and
// s[b] = d[b] * sum(q of block b) (the Q4_0 offset and Q4_1 min terms). Quants, scales and sums
// are three planes, so the per-block terms of many blocks are vector operations.
inline void quantize_row(const float* x, int64_t k_len, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < k_len / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    int8_t* qb = q + b * kBlock;
#if defined(__AVX2__)
    __m256 v[4], top = _mm256_setzero_ps();
    for (int u = 0; u < 4; ++u) {
      v[u] = _mm256_loadu_ps(xb + 8 * u);
      top = _mm256_max_ps(top, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[u]));
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    t = _mm_max_ss(t, _mm_movehdup_ps(t));
    const float scale = _mm_cvtss_f32(t) / 127.f;
    const __m256 inv = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
    __m256i i[4];  // rounded to nearest even, as nearbyint in the default rounding mode
    for (int u = 0; u < 4; ++u) i[u] = _mm256_cvtps_epi32(_mm256_mul_ps(v[u], inv));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    const int sum = _mm_cvtsi128_si32(h);
#else
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    int sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
      qb[i] = static_cast<int8_t>(v);
      sum += v;
    }
#endif
    d[b] = scale;
    s[b] = scale * static_cast<float>(sum);
  }
}

// Activation rows quantized for the int8 path (quantize_row): quants [M][K], block scales and
// scaled sums [M][nb]; for Q2_K's mins (one per 16 weights) also the halves' scaled sums (add_half_sums).
struct ActPlanes {
  int64_t nb = 0;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<float> h;  // [M][2 nb]: d[b] * sum of quants 0..15, then 16..31, of each block b
  std::vector<int32_t> h32;  // [M][2 nb]: 32 * the sum of quants 0..15, then 16..31, of each block b (exact)
  std::vector<int32_t> hpair;  // [M][nb]: the same two sums as the int16 pair (low, high) of one int32

  // The integer sums of block b's quants 0..15 (lo) and 16..31 (hi).
  void half_sums(size_t b, int& lo, int& hi) const {
    const int8_t* qb = &q[b * kBlock];
    lo = hi = 0;
    for (int i = 0; i < kBlock / 2; ++i) {
      lo += qb[i];
      hi += qb[i + kBlock / 2];
    }
  }

  // Fills h from the quants (each half's integer sum, scaled as s is: one rounding).
  void add_half_sums() {
    h.resize(2 * d.size());
    for (size_t b = 0; b < d.size(); ++b) {
      int lo, hi;
      half_sums(b, lo, hi);
      h[2 * b] = d[b] * static_cast<float>(lo);
      h[2 * b + 1] = d[b] * static_cast<float>(hi);
    }
  }

  // Fills h32 and hpair from the quants (Q6_Kr8's - 32 offset, applied in integers).
  void add_half_sums32() {
    h32.resize(2 * d.size());
    hpair.resize(d.size());
    for (size_t b = 0; b < d.size(); ++b) {
      int lo, hi;
      half_sums(b, lo, hi);
      h32[2 * b] = 32 * lo;
      h32[2 * b + 1] = 32 * hi;
      hpair[b] = static_cast<int32_t>((static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16) |
                                      static_cast<uint16_t>(lo));  // |sum| <= 16 * 127
    }
  }

  ActPlanes(const at::Tensor& x, int64_t k_len) : nb(k_len / kBlock) {
    const int64_t m_len = x.size(0);
    q.resize(m_len * k_len);
    d.resize(m_len * nb);
    s.resize(m_len * nb);
    for (int64_t m = 0; m < m_len; ++m)
      quantize_row(x.data_ptr<float>() + m * x.stride(0), k_len, &q[m * k_len], &d[m * nb], &s[m * nb]);
  }
};

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

// The block struct of format F; void (no build) for an id without one. Every per-format helper
// below names each format it handles and fails to compile for any other: none defaults.
template <int64_t F>
using BlockOf = std::conditional_t<
    F == kQuantQ8_0, BlockQ8_0,
    std::conditional_t<
        F == kQuantQ4_0, BlockQ4_0,
        std::conditional_t<F == kQuantQ4_1, BlockQ4_1,
                           std::conditional_t<
                               F == kQuantQ5_0, BlockQ5_0,
                               std::conditional_t<
                                   F == kQuantQ5_1, BlockQ5_1,
                                   std::conditional_t<
                                       F == kQuantQ4_K, BlockQ4_K,
                                       std::conditional_t<
                                           F == kQuantQ5_K, BlockQ5_K,
                                           std::conditional_t<
                                               F == kQuantQ6_K, BlockQ6_K,
                                               std::conditional_t<
                                                   F == kQuantIQ4_NL, BlockIQ4_NL,
                                                   std::conditional_t<
                                                       F == kQuantMXFP4, BlockMXFP4,
                                                   std::conditional_t<
                                                       F == kQuantIQ4_XS, BlockIQ4_XS,
                                                       std::conditional_t<F == kQuantQ3_K, BlockQ3_K,
                                                                          std::conditional_t<F == kQuantQ2_K, BlockQ2_K,
                                                                                             void>>>>>>>>>>>>>;

template <int64_t F>
inline constexpr bool kIsQ5 = F == kQuantQ5_0 || F == kQuantQ5_1;
template <int64_t F>
inline constexpr bool kSignedQuants = F == kQuantQ8_0 || F == kQuantIQ4_NL || F == kQuantMXFP4;  // w = d q, q a signed byte
// The 16 int8 values a 32-weight table format's nibbles index (IQ4_NL, MXFP4).
template <int64_t F>
inline constexpr const int8_t* kTableOf = F == kQuantMXFP4 ? kMXFP4Values : kIQ4Values;
template <int64_t F>
inline constexpr bool kIsK =
    F == kQuantQ2_K || F == kQuantQ3_K || F == kQuantQ4_K || F == kQuantQ5_K || F == kQuantQ6_K || F == kQuantIQ4_XS;
template <int64_t F>
inline constexpr bool kHasMins = F == kQuantQ4_K || F == kQuantQ5_K;  // K-quants of w = d sc q - dmin m
template <int64_t F>
inline constexpr bool kHalfMins = F == kQuantQ2_K;  // w = d sc q - dmin m with a scale and a min per 16 weights
template <int64_t F>
inline constexpr int64_t kWeightsOf = kIsK<F> ? kSuperBlock : kBlock;  // weights per block
template <int64_t F>
inline constexpr bool kNoFormat = false;  // static_assert(kNoFormat<F>): an id with no block

// Scale d and offset m of a weight block (w = d * q + m, q unsigned for Q4 / Q5, signed for Q8_0).
template <int64_t F>
inline void block_affine(const void* wb, float& d, float& m) {
  static_assert(!std::is_void_v<BlockOf<F>>, "block_affine: no block for this format id");
  const auto* blk = static_cast<const BlockOf<F>*>(wb);
  if constexpr (F == kQuantMXFP4) {
    d = mxfp4_scale(blk->e);
  } else {
    d = half_to_float(blk->d);
  }
  if constexpr (kSignedQuants<F>) {
    m = 0.f;
  } else if constexpr (F == kQuantQ4_0) {
    m = -8.f * d;
  } else if constexpr (F == kQuantQ5_0) {
    m = -16.f * d;
  } else if constexpr (F == kQuantQ4_1 || F == kQuantQ5_1) {
    m = half_to_float(blk->m);
  } else {
    static_assert(kNoFormat<F>, "block_affine: unhandled format");
  }
}

template <int64_t F>
inline const uint8_t* block_quants(const void* wb) {
  static_assert(!std::is_void_v<BlockOf<F>>, "block_quants: no block for this format id");
  return reinterpret_cast<const uint8_t*>(static_cast<const BlockOf<F>*>(wb)->q);
}

// Quant i of a block: unsigned (Q4: a nibble, Q5: a nibble and its fifth bit) or signed (Q8_0; IQ4_NL,
// MXFP4: the table value its nibble indexes).
template <int64_t F>
inline int block_q(const void* wb, int i) {
  const uint8_t* q = block_quants<F>(wb);
  if constexpr (F == kQuantQ8_0) {
    return static_cast<int8_t>(q[i]);
  } else {
    const int nibble = i < kBlock / 2 ? (q[i] & 0x0F) : (q[i - kBlock / 2] >> 4);
    if constexpr (F == kQuantIQ4_NL || F == kQuantMXFP4) {
      return kTableOf<F>[nibble];
    } else if constexpr (kIsQ5<F>) {
      uint32_t qh;
      std::memcpy(&qh, static_cast<const BlockOf<F>*>(wb)->qh, sizeof(qh));
      return nibble | static_cast<int>(((qh >> i) & 1u) << 4);
    } else {
      return nibble;
    }
  }
}

#if defined(__AVX2__)
// The fifth bits of a Q5 block as 0x10 in byte j where qh bit j is set.
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof(bits));
  // byte j <- qh byte j / 8 (each 128-bit lane holds all four bytes), then test bit j % 8
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// The 32 signed quants of a Q8_0 / IQ4_NL / MXFP4 block in element order (IQ4_NL, MXFP4: one table lookup
// per nibble).
template <int64_t F>
inline __m256i signed_quants(const void* wb) {
  static_assert(kSignedQuants<F>, "signed_quants: Q8_0, IQ4_NL, MXFP4");
  if constexpr (F == kQuantQ8_0) {
    return load32(reinterpret_cast<const int8_t*>(block_quants<F>(wb)));
  } else {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kTableOf<F>)));
    return _mm256_shuffle_epi8(table, unpack_nibbles(block_quants<F>(wb)));
  }
}

// The 32 unsigned quants of a Q4 / Q5 block in element order.
template <int64_t F>
inline __m256i unsigned_quants(const void* wb) {
  static_assert(F == kQuantQ4_0 || F == kQuantQ4_1 || kIsQ5<F>, "unsigned_quants: Q4_0, Q4_1, Q5_0, Q5_1");
  const __m256i low = unpack_nibbles(block_quants<F>(wb));
  if constexpr (kIsQ5<F>) {
    return _mm256_or_si256(low, fifth_bits(static_cast<const BlockOf<F>*>(wb)->qh));
  } else {
    return low;
  }
}
#endif

// Scale d and offset m of Q4_K / Q5_K sub-block j (w = d q + m, q the unsigned quant).
template <typename Block>
inline void q4k_sub_affine(const Block& blk, int j, float& d, float& m) {
  const uint8_t* s = blk.scales;
  int sc, mn;
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
  d = half_to_float(blk.d) * static_cast<float>(sc);  // exact: an fp16 times a 6-bit integer
  m = -(half_to_float(blk.dmin) * static_cast<float>(mn));
}

// q4k_sub_affine of all eight sub-blocks (the fp16 fields converted once).
template <typename Block>
inline void q4k_affines(const Block& blk, float* d, float* m) {
  const float scale = half_to_float(blk.d), min_scale = half_to_float(blk.dmin);
  const uint8_t* s = blk.scales;
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    d[j] = scale * static_cast<float>(sc);
    m[j] = -(min_scale * static_cast<float>(mn));
  }
}

// Q3_K's 6-bit scale i (of weights 16 i..16 i + 15), before its - 32.
inline int q3k_scale(const BlockQ3_K& blk, int i) {
  const int low = i < 8 ? blk.scales[i] & 0x0F : blk.scales[i - 8] >> 4;
  return low | (((blk.scales[8 + i % 4] >> (2 * (i / 4))) & 3) << 4);
}

// The scales of a K-quant's sub-block j with a scale per 16 or 32 weights (Q2_K, Q3_K, Q6_K, IQ4_XS),
// `scale` its fp16 d: lo for its weights 0..15, hi for 16..31 (Q2_K: d sc, its mins from q2k_sub_mins;
// Q3_K: d (sc - 32), Q6_K: d sc of each 16; IQ4_XS: d (ls_j - 32) for all 32). Exact products.
template <int64_t F>
inline void ksub_scales(const BlockOf<F>& blk, float scale, int j, float& lo, float& hi) {
  if constexpr (F == kQuantQ6_K) {
    lo = scale * static_cast<float>(blk.scales[2 * j]);
    hi = scale * static_cast<float>(blk.scales[2 * j + 1]);
  } else if constexpr (F == kQuantQ2_K) {
    lo = scale * static_cast<float>(blk.scales[2 * j] & 0x0F);
    hi = scale * static_cast<float>(blk.scales[2 * j + 1] & 0x0F);
  } else if constexpr (F == kQuantQ3_K) {
    lo = scale * static_cast<float>(q3k_scale(blk, 2 * j) - 32);
    hi = scale * static_cast<float>(q3k_scale(blk, 2 * j + 1) - 32);
  } else if constexpr (F == kQuantIQ4_XS) {
    const int ls = ((blk.scales_l[j / 2] >> (4 * (j % 2))) & 0x0F) | (((blk.scales_h >> (2 * j)) & 3) << 4);
    lo = hi = scale * static_cast<float>(ls - 32);
  } else {
    static_assert(kNoFormat<F>, "ksub_scales: Q2_K, Q3_K, Q6_K, IQ4_XS");
  }
}

// Q2_K's min terms of sub-block j, `min_scale` its fp16 dmin: lo = -(dmin m) of its weights 0..15, hi of
// 16..31 (exact products: an fp16 times a 4-bit integer).
inline void q2k_sub_mins(const BlockQ2_K& blk, float min_scale, int j, float& lo, float& hi) {
  lo = -(min_scale * static_cast<float>(blk.scales[2 * j] >> 4));
  hi = -(min_scale * static_cast<float>(blk.scales[2 * j + 1] >> 4));
}

// Quant l of sub-block j: Q4_K's unsigned nibble, Q5_K's unsigned 5-bit quant, Q6_K's signed q - 32,
// IQ4_XS's table value, Q3_K's signed 3-bit quant, Q2_K's unsigned 2-bit quant.
template <int64_t F>
inline int ksub_q(const BlockOf<F>& blk, int j, int l) {
  if constexpr (F == kQuantQ4_K) {
    const uint8_t byte = blk.q[32 * (j / 2) + l];
    return j % 2 ? byte >> 4 : byte & 0x0F;
  } else if constexpr (F == kQuantQ5_K) {
    const uint8_t byte = blk.q[32 * (j / 2) + l];
    return (j % 2 ? byte >> 4 : byte & 0x0F) | (((blk.qh[l] >> j) & 1) << 4);
  } else if constexpr (F == kQuantQ6_K) {
    const int h = j / 4, g = j % 4;
    const int low = (blk.ql[64 * h + 32 * (g % 2) + l] >> (4 * (g / 2))) & 0x0F;
    const int high = (blk.qh[32 * h + l] >> (2 * g)) & 3;
    return (low | (high << 4)) - 32;
  } else if constexpr (F == kQuantQ3_K) {
    const int h = j / 4, g = j % 4;
    const int low = (blk.qs[32 * h + l] >> (2 * g)) & 3;
    return ((blk.hmask[l] >> (4 * h + g)) & 1) ? low : low - 4;
  } else if constexpr (F == kQuantQ2_K) {
    return (blk.qs[32 * (j / 4) + l] >> (2 * (j % 4))) & 3;
  } else if constexpr (F == kQuantIQ4_XS) {
    const uint8_t byte = blk.q[16 * j + l % 16];
    return kIQ4Values[l < 16 ? byte & 0x0F : byte >> 4];
  } else {
    static_assert(kNoFormat<F>, "ksub_q: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS");
  }
}

#if defined(__AVX2__)
inline __m256i shift_right16(__m256i v, int bits) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(bits)); }

// The 32 quants of sub-block j in element order (ksub_q), as bytes: Q2_K / Q4_K / Q5_K unsigned, Q3_K / Q6_K /
// IQ4_XS signed.
template <int64_t F>
inline __m256i ksub_quants(const BlockOf<F>& blk, int j) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  if constexpr (F == kQuantQ4_K) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.q + 32 * (j / 2)));
    return _mm256_and_si256(shift_right16(raw, 4 * (j % 2)), nibble);
  } else if constexpr (F == kQuantQ5_K) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.q + 32 * (j / 2)));
    const __m256i hraw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qh));
    const __m256i high = _mm256_slli_epi16(_mm256_and_si256(shift_right16(hraw, j), _mm256_set1_epi8(1)), 4);
    return _mm256_or_si256(_mm256_and_si256(shift_right16(raw, 4 * (j % 2)), nibble), high);
  } else if constexpr (F == kQuantQ6_K) {
    const int h = j / 4, g = j % 4;
    const __m256i lraw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.ql + 64 * h + 32 * (g % 2)));
    const __m256i hraw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qh + 32 * h));
    const __m256i low = _mm256_and_si256(shift_right16(lraw, 4 * (g / 2)), nibble);
    const __m256i high = _mm256_slli_epi16(_mm256_and_si256(shift_right16(hraw, 2 * g), _mm256_set1_epi8(3)), 4);
    return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
  } else if constexpr (F == kQuantQ3_K) {
    const int h = j / 4, g = j % 4;
    const __m256i qraw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs + 32 * h));
    const __m256i hraw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.hmask));
    const __m256i low = _mm256_and_si256(shift_right16(qraw, 2 * g), _mm256_set1_epi8(3));
    const __m256i high = _mm256_slli_epi16(_mm256_and_si256(shift_right16(hraw, 4 * h + g), _mm256_set1_epi8(1)), 2);
    return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(4));
  } else if constexpr (F == kQuantQ2_K) {
    const __m256i qraw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs + 32 * (j / 4)));
    return _mm256_and_si256(shift_right16(qraw, 2 * (j % 4)), _mm256_set1_epi8(3));
  } else if constexpr (F == kQuantIQ4_XS) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
    return _mm256_shuffle_epi8(table, unpack_nibbles(blk.q + 16 * j));
  } else {
    static_assert(kNoFormat<F>, "ksub_quants: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS");
  }
}
#endif

// fp32 values of K-quant block `wb` into dst[256]: Q2_K / Q4_K / Q5_K d_j q + m_j (d_j q exact: one rounding),
// Q3_K / Q6_K / IQ4_XS (d sc) q (one rounding of the exact product): the reference's values.
template <int64_t F>
inline void dequant_kblock(const void* wb, float* dst) {
  const auto& blk = *static_cast<const BlockOf<F>*>(wb);
  constexpr bool kMins = kHasMins<F> || kHalfMins<F>;
  for (int j = 0; j < kSuperBlock / kBlock; ++j) {
    float d[2], m[2] = {0.f, 0.f};  // [0]: weights 0..15 of the sub-block, [1]: 16..31
    if constexpr (kHasMins<F>) {
      q4k_sub_affine(blk, j, d[0], m[0]);
      d[1] = d[0];
      m[1] = m[0];
    } else {
      ksub_scales<F>(blk, half_to_float(blk.d), j, d[0], d[1]);
      if constexpr (kHalfMins<F>) q2k_sub_mins(blk, half_to_float(blk.dmin), j, m[0], m[1]);
    }
    float* out = dst + j * kBlock;
#if defined(__AVX2__)
    const __m256i bytes = ksub_quants<F>(blk, j);
    const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int u = 0; u < 4; ++u) {
      const __m256 vd = _mm256_set1_ps(d[u / 2]);
      if constexpr (kMins) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[u]));
        _mm256_storeu_ps(out + 8 * u, _mm256_fmadd_ps(q, vd, _mm256_set1_ps(m[u / 2])));
      } else {
        _mm256_storeu_ps(out + 8 * u, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[u])), vd));
      }
    }
#else
    for (int l = 0; l < kBlock; ++l) out[l] = d[l / 16] * static_cast<float>(ksub_q<F>(blk, j, l)) + m[l / 16];
#endif
  }
}

// fp32 values of weight block `wb` into dst[kWeightsOf<F>]: d q + m with d q exact in fp32 (an fp16 d times a
// quant of at most 8 bits), so fused or not it is one rounding: the reference's values.
template <int64_t F>
inline void dequant_block32(const void* wb, float* dst) {
  float d, m;
  block_affine<F>(wb, d, m);
#if defined(__AVX2__)
  __m256i bytes;
  if constexpr (kSignedQuants<F>) {
    bytes = signed_quants<F>(wb);
  } else {
    bytes = unsigned_quants<F>(wb);
  }
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int u = 0; u < 4; ++u) {
    const __m128i part = parts[u];
    const __m256i wide = kSignedQuants<F> ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
    _mm256_storeu_ps(dst + 8 * u, _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), vd, vm));
  }
#else
  for (int i = 0; i < kBlock; ++i) dst[i] = d * static_cast<float>(block_q<F>(wb, i)) + m;
#endif
}

// fp32 values of any format's block `wb` into dst[kWeightsOf<F>].
template <int64_t F>
inline void dequant_block(const void* wb, float* dst) {
  if constexpr (kIsK<F>) {
    dequant_kblock<F>(wb, dst);
  } else {
    dequant_block32<F>(wb, dst);
  }
}

// The M fp32-activation dot products of packed weight row `row` (nb blocks of `bsize` bytes, each
// kWeightsOf<F> weights) with x[m][K] (row stride ldx), before any bias: each weight block widened,
// then FMA'd 32 weights at a time (one FMA chain per eighth of 32, whatever the block size).
template <int64_t F, int M>
inline void fp32_row_dots(const float* x, int64_t ldx, int64_t nb, const uint8_t* row, int64_t bsize, float* dots) {
  using vec::Vec;
  constexpr int U = kBlock / vec::kWidth;
  constexpr int64_t kW = kWeightsOf<F>;
  static_assert(U == 4, "fp32_row_dots sums four vectors per block");
  Vec acc[M][U] = {};  // one FMA chain per eighth of a block
  alignas(32) float wf[kW];
  for (int64_t b = 0; b < nb; ++b) {
    dequant_block<F>(row + b * bsize, wf);
    for (int64_t c = 0; c < kW; c += kBlock) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        const Vec wv = vec::load(wf + c + u * vec::kWidth);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) acc[m][u] += wv * vec::load(x + m * ldx + b * kW + c + u * vec::kWidth);
      }
    }
  }
  for (int m = 0; m < M; ++m) dots[m] = vec::hsum((acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3]));
}

}  // namespace pagedserve::cpu::quant
