// Hand-scheduled AVX2 sweeps of the eight-row ("r8") kernels' group pairs at four activation rows
// (quant_interleaved.cpp, quant_interleaved_k.cpp), for CPUs without VNNI.
//
// The sweep that feeds a batch of rows is `vpmaddubsw` + `vpaddw` per row, group and chunk. GCC's
// schedule of those intrinsics keeps an accumulator or the nibble mask on the stack and copies
// between registers, well short of the two multiply-adds a cycle the core issues; written out, the
// eight int16 sums, the two groups' nibbles, the mask and one broadcast stay in registers. The loop
// is kept short (two chunks a turn, one index register) so that it runs from the decoded-op cache:
// fully unrolled, its speed depended on where the compiler placed the code (docs/results-log.md).
// The integer sums are the same in any order, so every output bit is the intrinsics'.
#pragma once

#include <immintrin.h>

#include <cstdint>

#if defined(__AVX2__) && !((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define PAGEDSERVE_R8_ASM_M4 1

namespace pagedserve::cpu::r8 {

// Row R's broadcast of its activation quants at A(%[R], %[x]) against both groups' nibbles (ymm12,
// ymm13), into its sums S0 (group 0) and S1 (group 1).
#define PS_R8_ROW(A, R, S0, S1)                                      \
  "vpbroadcastd " #A "(%[" #R "], %[x]), %%ymm14\n\t"               \
  "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"                         \
  "vpaddw %%ymm15, %[" #S0 "], %[" #S0 "]\n\t"                       \
  "vpmaddubsw %%ymm14, %%ymm13, %%ymm14\n\t"                         \
  "vpaddw %%ymm14, %[" #S1 "], %[" #S1 "]\n\t"
#define PS_R8_ROWS(A) \
  PS_R8_ROW(A, a0, s00, s01) PS_R8_ROW(A, a1, s10, s11) PS_R8_ROW(A, a2, s20, s21) PS_R8_ROW(A, a3, s30, s31)
// A chunk's low / high nibbles of both groups: chunk bytes at W + 8 x (x counts activation bytes).
#define PS_R8_LOW(W)                                                 \
  "vpand " #W "(%[w0], %[x], 8), %[mask], %%ymm12\n\t"               \
  "vpand " #W "(%[w1], %[x], 8), %[mask], %%ymm13\n\t"
#define PS_R8_HIGH(W)                                                \
  "vmovdqu " #W "(%[w0], %[x], 8), %%ymm12\n\t"                      \
  "vmovdqu " #W "(%[w1], %[x], 8), %%ymm13\n\t"                      \
  "vpsrlw $4, %%ymm12, %%ymm12\n\t"                                  \
  "vpsrlw $4, %%ymm13, %%ymm13\n\t"                                  \
  "vpand %%ymm12, %[mask], %%ymm12\n\t"                              \
  "vpand %%ymm13, %[mask], %%ymm13\n\t"
// Two chunks a turn while x < END (x steps by 8 activation bytes).
#define PS_R8_LOOP(BODY, END)                                        \
  "xor %k[x], %k[x]\n\t"                                             \
  ".p2align 5\n\t"                                                   \
  "1:\n\t" BODY                                                      \
  "add $8, %[x]\n\t"                                                 \
  "cmp $" #END ", %[x]\n\t"                                          \
  "jb 1b\n\t"
#define PS_R8_OPERANDS                                                                                       \
  : [s00] "+x"(sums[0][0]), [s01] "+x"(sums[0][1]), [s10] "+x"(sums[1][0]), [s11] "+x"(sums[1][1]),        \
    [s20] "+x"(sums[2][0]), [s21] "+x"(sums[2][1]), [s30] "+x"(sums[3][0]), [s31] "+x"(sums[3][1]),         \
    [x] "=&r"(x)                                                                                           \
  : [w0] "r"(w0), [w1] "r"(w1), [a0] "r"(a[0]), [a1] "r"(a[1]), [a2] "r"(a[2]), [a3] "r"(a[3]),            \
    [mask] "x"(mask), "m"(*reinterpret_cast<const uint8_t(*)[256]>(w0)),                                    \
    "m"(*reinterpret_cast<const uint8_t(*)[256]>(w1)), "m"(*reinterpret_cast<const int8_t(*)[32]>(a[0])),   \
    "m"(*reinterpret_cast<const int8_t(*)[32]>(a[1])), "m"(*reinterpret_cast<const int8_t(*)[32]>(a[2])),   \
    "m"(*reinterpret_cast<const int8_t(*)[32]>(a[3]))                                                       \
  : "xmm12", "xmm13", "xmm14", "xmm15", "cc"

// Which nibbles of which chunks a sweep reads: kLow8 / kHigh8 the low / high nibbles of eight
// chunks at w + 32 i against activations a + 4 i (a Q4_K sub-block); kQ4_0 both nibbles of four
// chunks, low against a + 4 i and high against a + 16 + 4 i (a Q4_0 / Q4_1 block).
enum class Sweep { kLow8, kHigh8, kQ4_0 };

// sums[m][p] += the u8 x s8 pair sums (int16 lanes, as `accumulate`) of group p's chunks at w0 / w1
// against row m's activation quants at a[m], the chunks and nibbles `S` names.
template <Sweep S>
inline void pair_sums_m4(const uint8_t* w0, const uint8_t* w1, const int8_t* const (&a)[4], __m256i (&sums)[4][2]) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  int64_t x;
  if constexpr (S == Sweep::kLow8) {
    __asm__(PS_R8_LOOP(PS_R8_LOW(0) PS_R8_ROWS(0) PS_R8_LOW(32) PS_R8_ROWS(4), 32) PS_R8_OPERANDS);
  } else if constexpr (S == Sweep::kHigh8) {
    __asm__(PS_R8_LOOP(PS_R8_HIGH(0) PS_R8_ROWS(0) PS_R8_HIGH(32) PS_R8_ROWS(4), 32) PS_R8_OPERANDS);
  } else {  // x < 16: chunks 0..3; the high nibbles' activations are 16 bytes on
    __asm__(PS_R8_LOOP(PS_R8_LOW(0) PS_R8_ROWS(0) PS_R8_LOW(32) PS_R8_ROWS(4)
                       PS_R8_HIGH(0) PS_R8_ROWS(16) PS_R8_HIGH(32) PS_R8_ROWS(20), 16) PS_R8_OPERANDS);
  }
}

// Q6_Kr8 (quant_interleaved_k.cpp): a chunk's 6-bit quants of one group into register U,
// (low >> LS) & 15 | ((high >> HS) & 3) << 4, from ql / qh chunk bytes at W + 8 x (ymm12 a scratch).
// Shifts by zero are left out.
#define PS_R8_Q6_UNPACK(W, LSHIFT, HSHIFT, WL, WH, U)                 \
  "vmovdqu " #W "(%[" #WL "], %[x], 8), %%" #U "\n\t" LSHIFT(U)     \
  "vpand %[nib], %%" #U ", %%" #U "\n\t"                            \
  "vmovdqu " #W "(%[" #WH "], %[x], 8), %%ymm12\n\t" HSHIFT(ymm12) \
  "vpand %[three], %%ymm12, %%ymm12\n\t"                            \
  "vpsllw $4, %%ymm12, %%ymm12\n\t"                                 \
  "vpor %%ymm12, %%" #U ", %%" #U "\n\t"
#define PS_R8_SHIFT_NONE(U)
#define PS_R8_SHIFT_LS(U) "vpsrlw %[ls], %%" #U ", %%" #U "\n\t"
#define PS_R8_SHIFT_HS(U) "vpsrlw %[hs], %%" #U ", %%" #U "\n\t"
// Row R against two chunks (ymm8 / ymm9: the first chunk of groups 0 / 1, ymm10 / ymm11: the
// second): each group's two products summed in int16 (|sum| <= 4 * 63 * 128 < 32767), widened
// once into the int32 sums S0, S1 by a multiply-add with the group's int16 pairs at (%[sc]) / 32(%[sc])
// (ones, or each row's 16-weight scale twice: |sum| <= 2 * 32767 * 128).
#define PS_R8_Q6_ROW(R, S0, S1)                                      \
  "vpbroadcastd (%[" #R "], %[x]), %%ymm12\n\t"                     \
  "vpbroadcastd 4(%[" #R "], %[x]), %%ymm13\n\t"                    \
  "vpmaddubsw %%ymm12, %%ymm8, %%ymm14\n\t"                          \
  "vpmaddubsw %%ymm13, %%ymm10, %%ymm15\n\t"                         \
  "vpaddw %%ymm15, %%ymm14, %%ymm14\n\t"                             \
  "vpmaddwd (%[sc]), %%ymm14, %%ymm14\n\t"                           \
  "vpaddd %%ymm14, %[" #S0 "], %[" #S0 "]\n\t"                       \
  "vpmaddubsw %%ymm12, %%ymm9, %%ymm14\n\t"                          \
  "vpmaddubsw %%ymm13, %%ymm11, %%ymm15\n\t"                         \
  "vpaddw %%ymm15, %%ymm14, %%ymm14\n\t"                             \
  "vpmaddwd 32(%[sc]), %%ymm14, %%ymm14\n\t"                         \
  "vpaddd %%ymm14, %[" #S1 "], %[" #S1 "]\n\t"
#define PS_R8_Q6_TURN(LSHIFT, HSHIFT)                                 \
  PS_R8_Q6_UNPACK(0, LSHIFT, HSHIFT, wl0, wh0, ymm8)                  \
  PS_R8_Q6_UNPACK(0, LSHIFT, HSHIFT, wl1, wh1, ymm9)                  \
  PS_R8_Q6_UNPACK(32, LSHIFT, HSHIFT, wl0, wh0, ymm10)                \
  PS_R8_Q6_UNPACK(32, LSHIFT, HSHIFT, wl1, wh1, ymm11)                \
  PS_R8_Q6_ROW(a0, s00, s01) PS_R8_Q6_ROW(a1, s10, s11) PS_R8_Q6_ROW(a2, s20, s21) PS_R8_Q6_ROW(a3, s30, s31)
#define PS_R8_Q6_ASM(LSHIFT, HSHIFT)                                                                        \
  __asm__(PS_R8_LOOP(PS_R8_Q6_TURN(LSHIFT, HSHIFT), 16)                                                     \
          : [s00] "+x"(sums[0][0]), [s01] "+x"(sums[0][1]), [s10] "+x"(sums[1][0]), [s11] "+x"(sums[1][1]),  \
            [s20] "+x"(sums[2][0]), [s21] "+x"(sums[2][1]), [s30] "+x"(sums[3][0]), [s31] "+x"(sums[3][1]),   \
            [x] "=&r"(x)                                                                                     \
          : [wl0] "r"(low0), [wh0] "r"(high0), [wl1] "r"(low1), [wh1] "r"(high1), [a0] "r"(a[0]),            \
            [a1] "r"(a[1]), [a2] "r"(a[2]), [a3] "r"(a[3]), [nib] "m"(kQ6Consts[0]), [three] "m"(kQ6Consts[1]), \
            [sc] "r"(sc), [ls] "i"(kLow), [hs] "i"(kHigh)                                                     \
          : "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc",                     \
            "memory")  /* reads the chunks and rows: too many for "m" operands */

// The masks of q6_pair_sums_m4, as memory operands (every register is taken), and int16 ones for both
// groups (kInt16Ones: the multipliers of unscaled sums).
alignas(32) inline const __m256i kQ6Consts[4] = {_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3), _mm256_set1_epi16(1),
                                                 _mm256_set1_epi16(1)};
inline const __m256i* const kInt16Ones = &kQ6Consts[2];

// sums[m][p] (int32 lanes) += group p's four Q6_Kr8 chunks (ql at low_p, qh at high_p, shifted right by
// kLow and kHigh) against row m's 16 activation quants at a[m], each row's int16 pair sums times the int16
// pairs at sc[p] (kInt16Ones: `accumulate32`'s sums).
template <int kLow, int kHigh>
inline void q6_pair_sums_m4(const uint8_t* low0, const uint8_t* high0, const uint8_t* low1, const uint8_t* high1,
                            const int8_t* const (&a)[4], const __m256i* sc, __m256i (&sums)[4][2]) {
  int64_t x;
  if constexpr (kLow == 0 && kHigh == 0) {
    PS_R8_Q6_ASM(PS_R8_SHIFT_NONE, PS_R8_SHIFT_NONE);
  } else if constexpr (kLow == 0) {
    PS_R8_Q6_ASM(PS_R8_SHIFT_NONE, PS_R8_SHIFT_HS);
  } else if constexpr (kHigh == 0) {
    PS_R8_Q6_ASM(PS_R8_SHIFT_LS, PS_R8_SHIFT_NONE);
  } else {
    PS_R8_Q6_ASM(PS_R8_SHIFT_LS, PS_R8_SHIFT_HS);
  }
}

// sums[m][p] += group p's four chunks already expanded to bytes of at most 63 (four chunks of 32 at w_p:
// Q6_Kr8's quants from q6_expand_pair in quant_interleaved_k.cpp, Q5's from q5_expand_pair in
// quant_interleaved_q5q8.cpp) against row m's 16 activation quants at a[m], times sc[p] as above: the
// sweep above without its unpacking, which a batch of row passes does once per group pair.
inline void expanded_pair_sums_m4(const uint8_t* w0, const uint8_t* w1, const int8_t* const (&a)[4],
                                  const __m256i* sc, __m256i (&sums)[4][2]) {
  int64_t x;
  __asm__(PS_R8_LOOP("vmovdqu (%[w0], %[x], 8), %%ymm8\n\t"
                     "vmovdqu (%[w1], %[x], 8), %%ymm9\n\t"
                     "vmovdqu 32(%[w0], %[x], 8), %%ymm10\n\t"
                     "vmovdqu 32(%[w1], %[x], 8), %%ymm11\n\t"
                     PS_R8_Q6_ROW(a0, s00, s01) PS_R8_Q6_ROW(a1, s10, s11) PS_R8_Q6_ROW(a2, s20, s21)
                     PS_R8_Q6_ROW(a3, s30, s31), 16)
          : [s00] "+x"(sums[0][0]), [s01] "+x"(sums[0][1]), [s10] "+x"(sums[1][0]), [s11] "+x"(sums[1][1]),
            [s20] "+x"(sums[2][0]), [s21] "+x"(sums[2][1]), [s30] "+x"(sums[3][0]), [s31] "+x"(sums[3][1]),
            [x] "=&r"(x)
          : [w0] "r"(w0), [w1] "r"(w1), [a0] "r"(a[0]), [a1] "r"(a[1]), [a2] "r"(a[2]), [a3] "r"(a[3]),
            [sc] "r"(sc)
          : "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc",
            "memory");  /* reads the chunks, rows and scales: too many for "m" operands */
}

#undef PS_R8_Q6_UNPACK
#undef PS_R8_SHIFT_NONE
#undef PS_R8_SHIFT_LS
#undef PS_R8_SHIFT_HS
#undef PS_R8_Q6_ROW
#undef PS_R8_Q6_TURN
#undef PS_R8_Q6_ASM

#undef PS_R8_ROW
#undef PS_R8_ROWS
#undef PS_R8_LOW
#undef PS_R8_HIGH
#undef PS_R8_LOOP
#undef PS_R8_OPERANDS

}  // namespace pagedserve::cpu::r8

#endif
