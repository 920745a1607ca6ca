// Lane helpers of the eight-row ("r8") kernels (quant_interleaved.cpp, quant_interleaved_q5q8.cpp,
// quant_interleaved_k.cpp): an r8 chunk puts eight rows' 4-byte pieces side by side, so one u8 x s8
// multiply-add against four activation quants broadcast to every lane leaves each row's partial
// sum in its own lane.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace pagedserve::cpu::r8 {

#if defined(__AVX2__)
// Four activation quants (one 32-bit lane) in every lane.
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc + the u8 x s8 products of each 4-byte lane (int16 pairs on AVX2, int32 with VNNI).
inline __m256i accumulate(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
#endif
}

// acc + the u8 x s8 products of each 4-byte lane in int32 lanes (VNNI, or maddubs pairs widened at
// once on AVX2), for sums whose int16 pairs could overflow (Q6_K's 6-bit quants).
inline __m256i accumulate32(__m256i acc, __m256i u, __m256i s) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  return accumulate(acc, u, s);  // VNNI's lanes are int32 already
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// `accumulate`'s lanes as int32 (its int16 pairs summed on AVX2; as they are with VNNI).
inline __m256i lanes_to_int32(__m256i acc) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  return acc;
#else
  return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
#endif
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Two groups' 32-byte chunks in one 512-bit register (group g low, g + 1 high).
inline __m512i load_pair(const uint8_t* lo_half, const uint8_t* hi_half) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo_half))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi_half)), 1);
}

// Two groups' eight fp16 values as sixteen fp32 lanes.
inline __m512 halves_to_ps(const uint8_t* lo_half, const uint8_t* hi_half) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo_half))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi_half)), 1));
}
#endif

}  // namespace pagedserve::cpu::r8
