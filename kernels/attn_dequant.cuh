// fp4cache: NVFP4 -> f16 pairs in the attention kernels (decode_attention.cu,
// varlen_attention.cu): E2M1 codes by bit moves or, on sm_89+, E4M3 conversions, and the
// E4M3 scale pairs they are multiplied by.  FP4C_ATTN_BITMOVE (defined by the Spec of
// decode_attention_spec(..., decode_route="bitmove")) forces the bit route on any GPU.
#pragma once
#include "fp4_common.cuh"
#include "attn_ptx.cuh"

// Pair p (0..3) of a word x of 8 codes is the f16 pair (lo, hi) of the codes at nibbles
// pair_nibble(p, 0) and pair_nibble(p, 1), as e2m1 * 2^E; pair_scale of two E4M3 scale
// bytes is the f16 pair (sf_lo, sf_hi) * 2^(-S - E), S = FP4C_PAIR_SCALE_SHIFT (7), so one
// f16x2 multiply gives e2m1 * sf * 2^-S, exact (at most 6 significant bits, >= 2^-17).
// The 2^-S and the global scales are folded into the score scale (K) and the final
// rescale (V) on the host (fp4cache._abi.PAIR_SCALE_SHIFT).  Two routes:
//   sm_89+ (the E4M3 route): the codes become E4M3 bytes s 0 0 e1 e0 m 0 0 (= e2m1 * 2^-6,
//     code 1 is the subnormal 2^-7), the even nibbles in one word and the odd ones in
//     another (4 LOP3 + 3 shifts per 8 codes), and the conversion instruction makes f16
//     pairs of bytes 0, 1 and 2, 3: pairs (5, 7), (4, 6), (1, 3), (0, 2); E = -6.
//   else (bits): with the codes at nibbles n and n + 4 moved to bits 12..15 of each half,
//     (x & 0x80008000) | ((x >> 3) & 0x0E000E00) is an f16 pair whose values are e2m1 *
//     2^-14 (code 1 is the subnormal 2^-15): pairs (3, 7), (2, 6), (1, 5), (0, 4); E = -14.
// The V side pairs the same d of two tokens a, b: v_pair_word(a, b, hh) interleaves their
// bytes 2hh, 2hh + 1 so that pair p holds d-nibble 4hh + 3 - p of a (lo) and b (hi) on
// both routes.  Scale byte 0x7F decodes to NaN, so a group stored as NaN makes what
// attends it NaN.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(FP4C_ATTN_BITMOVE)
#define FP4C_ATTN_E4M3 1
#else
#define FP4C_ATTN_E4M3 0
#endif

FP4C_DEVICE constexpr int pair_nibble(int p, int half) {
  return FP4C_ATTN_E4M3 ? (p == 0 ? 5 : p == 1 ? 4 : p == 2 ? 1 : 0) + 2 * half
                        : (half ? 7 : 3) - p;
}

#if FP4C_ATTN_E4M3
// f16 pairs of E4M3 bytes (0, 1) and (2, 3) of x
FP4C_DEVICE void e4m3x4_to_f16(u32 x, u32& lo, u32& hi) {
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; "
      "cvt.rn.f16x2.e4m3x2 %1, h; }" : "=r"(lo), "=r"(hi) : "r"(x));
}
// The shifts as multiplies by values ptxas cannot see (constant memory, never written):
// IMAD runs on the FMA pipe, where SHF would take issue slots of the ALU pipe that the
// LOP3s and conversions fill (measured: 2 % faster at head_dim 128, docs/kernels.md).
__constant__ u32 c_e2m1_shift[3] = {4u, 16u, 1u << 30};  // x << 2, x << 4, hi(x << 30)
FP4C_DEVICE void e2m1_pairs(u32 x, u32* r) {
  const u32 even = ((x * c_e2m1_shift[0]) & 0x1C1C1C1Cu) |  // nibbles 0, 2, 4, 6
                   ((x * c_e2m1_shift[1]) & 0x80808080u);
  const u32 odd = (__umulhi(x, c_e2m1_shift[2]) & 0x1C1C1C1Cu) |  // nibbles 1, 3, 5, 7
                  (x & 0x80808080u);
  e4m3x4_to_f16(odd, r[2], r[0]);
  e4m3x4_to_f16(even, r[3], r[1]);
}
#define FP4C_V_SEL_LO 0x5140u  // a.b0, b.b0, a.b1, b.b1
#define FP4C_ROUTE_UNSCALE 0.5f  // 2^(S_route - S): pairs are e2m1 * sf * 2^-6 (pair_scale)
#define FP4C_V_SEL_HI 0x7362u  // a.b2, b.b2, a.b3, b.b3
#else
// All four pairs of x (pair p: the formula above on x << 4p), sharing the shifts: the masks
// are applied before the final shift.
FP4C_DEVICE void e2m1_pairs(u32 x, u32* r) {
  const u32 z = x >> 3;
  r[0] = (x & 0x80008000u) | (z & 0x0E000E00u);
  r[1] = ((x & 0x08000800u) | (z & 0x00E000E0u)) << 4;
  r[2] = ((x & 0x00800080u) | (z & 0x000E000Eu)) << 8;
  r[3] = (((x << 3) & 0x00400040u) | (x & 0x00070007u)) << 9;
}
#define FP4C_V_SEL_LO 0x5410u  // a.b0, a.b1, b.b0, b.b1
#define FP4C_ROUTE_UNSCALE 1.0f  // pairs are e2m1 * sf * 2^-S (pair_scale)
#define FP4C_V_SEL_HI 0x7632u  // a.b2, a.b3, b.b2, b.b3
#endif

// The word whose pairs are the V values of tokens a (lo) and b (hi) at d-nibbles 4hh + 3 - p
FP4C_DEVICE u32 v_pair_word(u32 a, u32 b, int hh) {
  return __byte_perm(a, b, hh ? FP4C_V_SEL_HI : FP4C_V_SEL_LO);
}

// pair_scale: the f16 pair of the two E4M3 bytes of x = 0xHHLL (any sign; 0x7F / 0xFF give
// NaN) times 2^(-S_route - E), exact.  sm_89+: the conversion instruction alone (S_route =
// 6: no multiply; the kernels take the route's 2^(S_route - S) = 2^-1 into their score
// and output scales, FP4C_ROUTE_UNSCALE, exact).  Else by bits: (b & 0x7F) << 7 is the f16
// of |sf| * 2^-8 (E4M3 and f16 subnormals line up) and the multiply by
// FP4C_PAIR_SCALE_BITS = 2^(22 - S) is exact (S_route = S).
FP4C_DEVICE u32 pair_scale(u32 x) {
#if FP4C_ATTN_E4M3
  u32 h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)x));
  return h;
#else
  x = __byte_perm(x, 0u, 0x4140u);  // 0x00HH00LL
  const u32 mag = x & 0x007F007Fu;
  const u32 nan = (mag + 0x00010001u) & 0x00800080u;  // bit 7 set where mag == 0x7F
  const u32 h = (mag << 7) | ((x & 0x00800080u) << 8) | (nan * 0xF8u);  // exp all ones
  return hmul2(h, FP4C_PAIR_SCALE_BITS);
#endif
}
