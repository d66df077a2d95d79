// fp4cache: PTX wrappers of the attention kernels (decode_attention.cu, varlen_attention.cu):
// float helpers without .ftz (CuPy compiles with -ftz=true), L2-only and read-only loads,
// cp.async, mma.sync m16n8k16 f16 -> f32, movmatrix and ldmatrix, a warp's minimum (redux),
// the barriers the shared epilogue steps take (CtaBar, NamedBar).  sm_80+.
#pragma once
#include "fp4_common.cuh"

#define FP4C_NEG_INF __uint_as_float(0xFF800000u)

// x == -inf on the bit pattern (a float compare would be .ftz under CuPy's flags)
FP4C_DEVICE bool is_neg_inf(float x) { return __float_as_uint(x) == 0xFF800000u; }
// 2^x, approximate (2 ulp); ex2(-inf) = 0; results below 2^-126 flush to 0 (a softmax
// weight that small next to the row's maximum of 1 changes nothing)
FP4C_DEVICE float a_ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
FP4C_DEVICE float a_lg2(float x) {
  float r;
  asm("lg2.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
FP4C_DEVICE u32 hmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
FP4C_DEVICE u32 redux_min(u32 x) {  // the minimum over the warp's lanes (sm_80+)
  u32 r;
  asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(x));
  return r;
}
FP4C_DEVICE float ldcg_f32(const float* p) {  // L2 only: data other CTAs of this grid wrote
  float r;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
  return r;
}
// atomicAdd with acquire-release semantics at GPU scope (sm_70+)
FP4C_DEVICE u32 atom_add_acq_rel_gpu(u32* p, u32 v) {
  u32 r;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(r) : "l"(p), "r"(v) : "memory");
  return r;
}
FP4C_DEVICE U32x2 ldcg_u32x2(const float* p) {  // the same, 8 bytes (8-byte aligned)
  U32x2 r;
  asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
FP4C_DEVICE U32x4 ldcg_u32x4(const float* p) {  // the same, 16 bytes (16-byte aligned)
  U32x4 r;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
FP4C_DEVICE u32 ldg_u16(const u8* p) {
  unsigned short r;
  asm("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}
FP4C_DEVICE u32 ldg_u32(const u8* p) {
  u32 r;
  asm("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}

// The barrier of the threads that run a shared step (its `Bar` parameter): the whole CTA
// (__syncthreads), or named barrier ID of the N threads (multiple of 32) of a warp-
// specialized kernel's role; arrive: count this warp's threads without waiting (memory
// accesses before it are performed for the threads the barrier releases)
struct CtaBar {
  static FP4C_DEVICE void sync() { __syncthreads(); }
};
template <int ID, int N>
struct NamedBar {
  static_assert(ID > 0 && ID < 16 && N % 32 == 0, "named barriers 1..15 of N = 32 k threads");
  static FP4C_DEVICE void sync() { asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(N) : "memory"); }
  static FP4C_DEVICE void arrive() {
    asm volatile("bar.arrive %0, %1;" ::"n"(ID), "n"(N) : "memory");
  }
};

// cp.async (sm_80+): global -> shared without registers; src_size 0 fills zeros and
// reads nothing.
FP4C_DEVICE u32 smem_u32(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
template <int N>
FP4C_DEVICE void cp_async(u32 dst, const void* src, u32 src_size) {
  if constexpr (N == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(src_size) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(N),
                 "r"(src_size) : "memory");
  }
}
FP4C_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
FP4C_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// D = A * B + C, m16n8k16, f16 inputs, f32 accumulators
FP4C_DEVICE void mma_f16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// The same with only the first accumulator row (rows 8..15 of A are zero): the other two
// results are discarded.
FP4C_DEVICE void mma_f16_top(float* d, u32 a0, u32 a2, u32 b0, u32 b1) {
  float x, y;
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %10, %10};"
      : "+f"(d[0]), "+f"(d[1]), "=f"(x), "=f"(y)
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.0f));
}

// The f16 pair (lo = a, hi = b), round to nearest, saturated to +-65504 (an infinity or a
// value past the largest finite f16 gives it), NaN kept (min / max .NaN: sm_80+).
FP4C_DEVICE u32 f16x2_sat(float a, float b) {
  u32 r;
  asm("{ .reg .b32 t; cvt.rn.f16x2.f32 t, %1, %2; min.NaN.f16x2 t, t, %3; "
      "max.NaN.f16x2 %0, t, %4; }"
      : "=r"(r) : "f"(b), "f"(a), "r"(0x7BFF7BFFu), "r"(0xFBFFFBFFu));
  return r;
}

// Transpose of an 8x8 b16 matrix held one register per lane (lane/4 = row, pairs of columns)
FP4C_DEVICE u32 movmatrix_trans(u32 a) {
  u32 d;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}

// ldmatrix (sm_75+): four 8x8 b16 matrices from shared memory; lane l gives the row address
// of matrix l / 8, row l % 8 (16 bytes each); register k holds matrix k in the mma.sync
// fragment layout (lane / 4 = row, lane % 4 = column pair), or its transpose (.trans).
FP4C_DEVICE void ldmatrix_x4(u32 addr, u32 (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
FP4C_DEVICE void ldmatrix_x4_trans(u32 addr, u32 (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
