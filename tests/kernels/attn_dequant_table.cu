// fp4cache tests: a table of the attention kernels' NVFP4 -> f16 decode (attn_dequant.cuh),
// checked on the host against ml_dtypes by tests/test_kernel_tables.py.  A test-only
// kernel: built from this folder by tests/kernel_tables.py (attn_dequant_table_spec), never
// part of a shipped module.  FP4C_ATTN_BITMOVE (decode_route="bitmove") takes the bit route
// on any GPU, as for the attention kernels.
#include "fp4_common.cuh"
#include "attn_ptx.cuh"
#include "attn_dequant.cuh"

// Pair p of the word x of 8 codes, one pair at a time: the same value as e2m1_pairs(x, r)[p]
// by a second form (the table's cross-check).
#if FP4C_ATTN_E4M3
FP4C_DEVICE u32 e2m1_pair(u32 x, int p) {
  const u32 y = x >> (4 * pair_nibble(p, 0));  // the pair's nibbles n, n + 2 at bits 0, 8
  const u32 b = ((y << 2) & 0x1C1Cu) | ((y << 4) & 0x8080u);
  u32 h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)b));
  return h;
}
#else
FP4C_DEVICE u32 e2m1_pair(u32 x, int p) {
  const u32 y = x << (4 * p);
  return (y & 0x80008000u) | ((y >> 3) & 0x0E000E00u);
}
#endif

// out[(p*2 + half)*4096 + code*256 + byte] = the f32 value of half `half` of pair p of the
// word holding `code` in every nibble, times the scale pair of `byte`: e2m1(code) *
// e4m3(byte) * 2^-FP4C_PAIR_SCALE_SHIFT exactly (the route's pairs times
// FP4C_ROUTE_UNSCALE).  Entries are NaN where e2m1_pair and e2m1_pairs disagree or where
// `code` alone at nibble pair_nibble(p, half) does not land in that half of pair p (zeros
// everywhere else).
FP4C_DEVICE void attn_dequant_table(float* out) {
  const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 4096u) return;
  const u32 code = i >> 8, byte = i & 255u;
  const u32 x = code * 0x11111111u;
  const u32 sf = pair_scale(byte * 0x0101u);
  u32 e[4];
  e2m1_pairs(x, e);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    if (e[p] != e2m1_pair(x, p)) e[p] = 0xFFFFFFFFu;  // the two forms must agree (NaN)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      u32 one[4];
      e2m1_pairs(code << (4 * pair_nibble(p, half)), one);
      const u32 keep = half ? 0xFFFF0000u : 0x0000FFFFu;
      bool ok = (one[p] & keep) == (e[p] & keep) && (one[p] & ~keep) == 0u;
#pragma unroll
      for (int o = 0; o < 4; ++o) ok = ok && (o == p || one[o] == 0u);
      if (!ok) e[p] |= half ? 0x7FFF0000u : 0x00007FFFu;  // NaN in that half
    }
    const u32 v = hmul2(e[p], sf);
    out[(p * 2 + 0) * 4096 + i] = f_mul(f16_bits_to_float(v & 0xFFFFu), FP4C_ROUTE_UNSCALE);
    out[(p * 2 + 1) * 4096 + i] = f_mul(f16_bits_to_float(v >> 16), FP4C_ROUTE_UNSCALE);
  }
}

// NAME: one kernel of 4096 threads' work (launch 16 x 256), out: 8 * 4096 floats
#define FP4C_ATTN_DEQUANT_TABLE_KERNEL(NAME) \
  extern "C" __global__ void NAME(float* out) { attn_dequant_table(out); }

#ifdef FP4C_INSTANTIATIONS
FP4C_INSTANTIATIONS
#endif
