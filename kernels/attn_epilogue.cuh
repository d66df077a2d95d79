// fp4cache: the output step of the attention kernels (decode_attention.cu,
// varlen_attention.cu): merged rows to out and lse.
#pragma once
#include "fp4_common.cuh"
#include "attn_ptx.cuh"
#include "attn_dequant.cuh"
#include "attn_seq.cuh"

// write out: out = O / L * out_scale (v_scale * 2^FP4C_PAIR_SCALE_SHIFT, from the host; times
// the decode route's FP4C_ROUTE_UNSCALE here, exact) and lse = (M +
// log2 L) ln 2 for rows r0 .. r0 + rows - 1 of the map (s_o, s_M, s_L rows 0 .. rows - 1);
// a row that saw no key (L = +0: bit compare, CuPy compiles with -ftz) gives 0 and -inf,
// a NaN L (a bad page) NaN.
template <typename T, int D, int THREADS>
FP4C_DEVICE void write_rows(const RowMap& R, u32 r0, u32 rows, const float (*s_o)[D + 1],
                            const float* s_M, const float* s_L, float out_scale,
                            void* __restrict__ out, float* __restrict__ lse) {
  // four consecutive values per thread and step: one 8-byte (16-bit types) or 16-byte
  // store where `out` is aligned to it (the row offsets are: D is a multiple of 64).  The
  // four are loaded at once and divided with no branch on L (a row without keys masked to
  // +0 after its division), two steps per iteration: independent chains, not one per thread
  const bool vec = ((u64)out & (4u * T::kBytes - 1u)) == 0u;
  const float scale = f_mul(out_scale, FP4C_ROUTE_UNSCALE);
#pragma unroll 2
  for (u32 k = 4u * threadIdx.x; k < rows * D; k += 4u * THREADS) {
    const u32 row = k / D, d = k - row * D;
    const float L = s_L[row];
    const u32 keep = __float_as_uint(L) == 0u ? 0u : 0xFFFFFFFFu;  // +0 where no key
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = s_o[row][d + e];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      v[e] = __uint_as_float(__float_as_uint(f_mul(f_div(v[e], L), scale)) & keep);
    char* dst = (char*)out + (row_of(R, r0 + row) * D + d) * T::kBytes;
    if (vec) {
      if constexpr (T::kBytes == 2) {
        U32x2 a;
        a.x = pack2(T(), v[0], v[1]);
        a.y = pack2(T(), v[2], v[3]);
        *(U32x2*)dst = a;
      } else {
        *(U32x4*)dst = U32x4{__float_as_uint(v[0]), __float_as_uint(v[1]),
                             __float_as_uint(v[2]), __float_as_uint(v[3])};
      }
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) store_one(T(), dst + e * T::kBytes, v[e]);
    }
  }
  if (lse != nullptr && threadIdx.x < rows) {
    const float L = s_L[threadIdx.x];
    lse[row_of(R, r0 + threadIdx.x)] =
        __float_as_uint(L) == 0u ? FP4C_NEG_INF
                                 : f_mul(f_add(s_M[threadIdx.x], a_lg2(L)), 0.69314718055994531f);
  }
}
