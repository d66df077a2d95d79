// fp4cache: PTX wrappers of Hopper's warpgroup MMA (wgmma.mma_async, sm_90a) for the
// wgmma attention kernel (varlen_wgmma.cu): shared-memory matrix descriptors in the
// 128-byte swizzle, the fence / commit / wait of a warpgroup's asynchronous MMAs, the
// generic-to-async proxy fence, and m64nNk16 f32 += f16 x f16 with both operands in shared
// memory (SS) or A from registers (RS).  Operand layouts as bench/wgmma_probe.py checks them
// on the GPU:
//   - a K-major operand (rows of 64 f16 = 128 bytes, row r's 16-byte chunk c at chunk
//     c ^ (r % 8)): 8-row groups 1024 bytes apart (SBO), the k16 steps +32 bytes inside the
//     128-byte row, a wider row continues in a separate region;
//   - an MN-major B operand (tnspB; rows along K, each 64 MN values in the same swizzle):
//     the 64-wide MN regions LBO bytes apart, 8-row groups SBO = 1024, k16 steps +2048;
//   - accumulators: warp w of the warpgroup rows 16 w + g, + 8 (lane = 4 g + c), columns
//     8 j + 2 c, + 1 in registers 4 j .. 4 j + 3 (the m16n8 accumulator layout per n8 tile).
#pragma once
#include "fp4_common.cuh"

// Descriptor of a shared-memory operand at shared address addr (its 8-row group starts
// on a 1024-byte boundary, plus the k offset), 128-byte swizzle
FP4C_DEVICE u64 wg_desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) |
         (1ull << 62);
}
// The descriptor of the operand `bytes` further than desc's (both inside shared memory:
// the start address field, bits 0..13, does not carry into the rest; a 32-bit add)
FP4C_DEVICE u64 wg_desc_at(u64 desc, u32 bytes) {
  return (desc & ~0xFFFFFFFFull) | (u64)((u32)desc + (bytes >> 4));
}
// Before a warpgroup's first wgmma after its registers (accumulators, A) were written
FP4C_DEVICE void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
FP4C_DEVICE void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most N of the warpgroup's committed groups are pending
template <int N>
FP4C_DEVICE void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// This thread's shared-memory writes (generic proxy) made visible to the async proxy
// (the wgmma operand reads) of the threads a barrier after it releases
FP4C_DEVICE void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// After a wait: the compiler's reads of the N accumulator registers at x stay after it
// (the asynchronous MMAs write them behind the compiler's back)
template <int N>
FP4C_DEVICE void wg_fence_regs(float* x) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(x[i])::"memory");
}

// The accumulator operands of an m64n128 (64 f32 registers per thread), an m64n64 (32) and
// an m64n32 (16) wgmma: the register list of the instruction (operands %0 ..) and the
// constraint list (K: "+f" to accumulate, "=f" to only write)
#define FP4C_WG_D64 \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
  "}"
#define FP4C_WG_D32 \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}"
#define FP4C_WG_D16 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FP4C_WG_ACC8(K, d, i) \
  K(d[i]), K(d[i + 1]), K(d[i + 2]), K(d[i + 3]), K(d[i + 4]), K(d[i + 5]), K(d[i + 6]), K(d[i + 7])
#define FP4C_WG_ACC16(K, d) FP4C_WG_ACC8(K, d, 0), FP4C_WG_ACC8(K, d, 8)
#define FP4C_WG_ACC32(K, d) FP4C_WG_ACC16(K, d), FP4C_WG_ACC8(K, d, 16), FP4C_WG_ACC8(K, d, 24)
#define FP4C_WG_ACC64(K, d) \
  FP4C_WG_ACC32(K, d), FP4C_WG_ACC8(K, d, 32), FP4C_WG_ACC8(K, d, 40), FP4C_WG_ACC8(K, d, 48), \
      FP4C_WG_ACC8(K, d, 56)

// One m64nNk16 f32 += f16 x f16 (an asm statement): SS with A (64 x 16) and B (N x 16)
// K-major in shared memory (descriptors da, db; AB: their operands), SCALE_D 0 for the
// first k16 step (d only written, K "=f") or 1 to accumulate ("+f"); RS with A from
// registers a[4] (per warp the m16n8k16 A fragment of its 16 rows) and B (16 x N) MN-major
// in shared memory (descriptor db, tnspB; AB: their operands).  REGS / ACC: N's
// accumulator list (FP4C_WG_D64 / FP4C_WG_ACC64 for N = 128); the operands after it are
// numbered from there (NVRTC takes no named asm operands)
#define FP4C_WG_SS(N, REGS, ACC, K, SCALE_D, AB)                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " #SCALE_D ", 0;\n"                  \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 " REGS ", " AB \
               ", p, 1, 1, 0, 0;\n}\n"                                                 \
               : ACC(K, d)                                                             \
               : "l"(da), "l"(db))
#define FP4C_WG_RS(N, REGS, ACC, AB)                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                              \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 " REGS ", " AB \
               ", p, 1, 1, 1;\n}\n"                                                    \
               : ACC("+f", d)                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))

// d (m64nN f32) = A B (INIT: the first k16 step) or += A B, A and B in shared memory
// (FP4C_WG_SS); N 32, 64 or 128
template <int N, bool INIT>
FP4C_DEVICE void wg_ss(float* d, u64 da, u64 db) {
  static_assert(N == 32 || N == 64 || N == 128, "m64n32, m64n64 or m64n128");
  if constexpr (N == 32 && INIT)
    FP4C_WG_SS(32, FP4C_WG_D16, FP4C_WG_ACC16, "=f", 0, "%16, %17");
  else if constexpr (N == 32)
    FP4C_WG_SS(32, FP4C_WG_D16, FP4C_WG_ACC16, "+f", 1, "%16, %17");
  else if constexpr (N == 128 && INIT)
    FP4C_WG_SS(128, FP4C_WG_D64, FP4C_WG_ACC64, "=f", 0, "%64, %65");
  else if constexpr (N == 128)
    FP4C_WG_SS(128, FP4C_WG_D64, FP4C_WG_ACC64, "+f", 1, "%64, %65");
  else if constexpr (INIT)
    FP4C_WG_SS(64, FP4C_WG_D32, FP4C_WG_ACC32, "=f", 0, "%32, %33");
  else
    FP4C_WG_SS(64, FP4C_WG_D32, FP4C_WG_ACC32, "+f", 1, "%32, %33");
}

// d (m64nN f32) += A B, A from registers (FP4C_WG_RS); N 64 or 128
template <int N>
FP4C_DEVICE void wg_rs(float* d, const u32 (&a)[4], u64 db) {
  static_assert(N == 64 || N == 128, "m64n64 or m64n128");
  if constexpr (N == 128)
    FP4C_WG_RS(128, FP4C_WG_D64, FP4C_WG_ACC64, "{%64, %65, %66, %67}, %68");
  else
    FP4C_WG_RS(64, FP4C_WG_D32, FP4C_WG_ACC32, "{%32, %33, %34, %35}, %36");
}
