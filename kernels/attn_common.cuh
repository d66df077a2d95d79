// fp4cache: device helpers of the attention kernels (decode_attention.cu, varlen_attention.cu):
// PTX float/exp helpers without .ftz, cp.async, mma.sync m16n8k16 f16, movmatrix, and the
// NVFP4 -> f16 pair decode (E2M1 codes by bit moves or, on sm_89+, E4M3 conversions).
// Needs fp4_common.cuh before it.  FP4C_ATTN_BITMOVE (defined by the Spec of
// decode_attention_spec(..., decode_route="bitmove")) forces the bit route on any GPU.
#pragma once
#include "paged_layout.cuh"

#define FP4C_NEG_INF __uint_as_float(0xFF800000u)

// ---------------------------------------------------------------------------------------
// Small PTX helpers (no .ftz anywhere: CuPy compiles with -ftz=true)
// ---------------------------------------------------------------------------------------
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

// Transpose of an 8x8 b16 matrix held one register per lane (lane/4 = row, pairs of columns)
FP4C_DEVICE u32 movmatrix_trans(u32 a) {
  u32 d;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}

// ---------------------------------------------------------------------------------------
// NVFP4 -> f16 pairs
// ---------------------------------------------------------------------------------------
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
// The same value, one pair (the table kernel's cross-check)
FP4C_DEVICE u32 e2m1_pair(u32 x, int p) {
  const u32 y = x >> (4 * pair_nibble(p, 0));  // the pair's nibbles n, n + 2 at bits 0, 8
  const u32 b = ((y << 2) & 0x1C1Cu) | ((y << 4) & 0x8080u);
  u32 h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)b));
  return h;
}
#define FP4C_V_SEL_LO 0x5140u  // a.b0, b.b0, a.b1, b.b1
#define FP4C_ROUTE_UNSCALE 0.5f  // 2^(S_route - S): pairs are e2m1 * sf * 2^-6 (pair_scale)
#define FP4C_V_SEL_HI 0x7362u  // a.b2, b.b2, a.b3, b.b3
#else
FP4C_DEVICE u32 e2m1_pair(u32 x, int p) {
  const u32 y = x << (4 * p);
  return (y & 0x80008000u) | ((y >> 3) & 0x0E000E00u);
}
// All four pairs of x (the same values as e2m1_pair(x, p), p = 0..3), sharing the shifts:
// the masks are applied before the final shift.
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

// ---------------------------------------------------------------------------------------
// ldmatrix (sm_75+): four 8x8 b16 matrices from shared memory; lane l gives the row address
// of matrix l / 8, row l % 8 (16 bytes each); register k holds matrix k in the mma.sync
// fragment layout (lane / 4 = row, lane % 4 = column pair), or its transpose (.trans).
// ---------------------------------------------------------------------------------------
FP4C_DEVICE void ldmatrix_x4(u32 addr, u32 (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
FP4C_DEVICE void ldmatrix_x4_trans(u32 addr, u32 (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// ---------------------------------------------------------------------------------------
// q's per-row scale and the merge of partial softmax states (both attention kernels)
// ---------------------------------------------------------------------------------------
// q is rounded to f16 per row after a multiply by a power of two, `q`, that brings the row's
// largest |value| mx into [2^14, 2^15) (exact for bf16 components within 2^29 of it); the
// row's score scale, `score`, undoes it: the host's qk_scale times the decode route's
// FP4C_ROUTE_UNSCALE (both exact).
struct QRowScale {
  float q, score;
};
FP4C_DEVICE QRowScale q_row_scale(float mx, float qk_scale) {
  int e = 0;
  const u32 mb = __float_as_uint(mx);
  if (mb != 0u && mb < 0x7F800000u) {
    e = (int)(mb >> 23) - 127 - 14;  // mx * 2^-e in [2^14, 2^15) (normal mx)
    e = max(-100, min(100, e));
  }
  return QRowScale{__uint_as_float((u32)(127 - e) << 23),
                   f_mul(f_mul(qk_scale, FP4C_ROUTE_UNSCALE),
                         __uint_as_float((u32)(127 + e) << 23))};
}

// The factor of a partial state of running maximum m in a merge to the maximum M (0 for a
// state that saw no key, m = -inf)
FP4C_DEVICE float merge_weight(float m, float M) {
  return is_neg_inf(m) ? 0.0f : a_ex2(f_sub(m, M));
}
// (M, L) of row `row` from N partial states (s_m[k][row], s_l[k][row]): M = their largest m,
// L = sum l_k 2^(m_k - M)
template <int N, int S>
FP4C_DEVICE void merge_row(const float (*s_m)[S], const float (*s_l)[S], u32 row, float& M,
                           float& L) {
  M = FP4C_NEG_INF;
#pragma unroll
  for (int k = 0; k < N; ++k) M = f_max(M, s_m[k][row]);
  L = 0.0f;
#pragma unroll
  for (int k = 0; k < N; ++k) L = f_fma(s_l[k][row], merge_weight(s_m[k][row], M), L);
}

// ---------------------------------------------------------------------------------------
// Rows of a CTA: (query token, query head) pairs of one sequence and KV head
// ---------------------------------------------------------------------------------------
// Row r is query token t = r / group of the sequence (q / out row tok0 + t) and query head
// head0 + r % group.  Decode has one token per sequence; attention for several tokens packs
// n * group rows.  With `causal`, row r sees the keys below len - (n - 1 - t) (bottom-right
// alignment), else all len.
struct RowMap {
  u32 tok0;    // q / out row of the sequence's first query token
  u32 n;       // query tokens of the sequence (computed)
  u32 rows;    // n * group
  u32 group;   // query heads per KV head
  u32 Hq;      // query heads
  u32 head0;   // first query head of the KV head's group
  u32 causal;  // bottom-right causal mask
};
// q / out row (token * Hq + head) of row r
FP4C_DEVICE u64 row_of(const RowMap& R, u32 r) {
  const u32 t = r / R.group;
  return (u64)(R.tok0 + t) * R.Hq + R.head0 + (r - t * R.group);
}
// keys row r sees: [0, limit), limit in [0, len]; rows past R.rows see all (they are
// padding, their results are never written)
FP4C_DEVICE u32 row_limit(const RowMap& R, u32 r, u32 len) {
  if (!R.causal || r >= R.rows) return len;
  const u32 hide = R.n - 1u - r / R.group;  // the sequence's query tokens after row r's
  return len > hide ? len - hide : 0u;
}

// ---------------------------------------------------------------------------------------
// Split-KV partials and their merge (shared by the attention kernels)
// ---------------------------------------------------------------------------------------
// The partials of one (sequence, KV head) in the workspace: split s holds (m, l) of row r
// at ml[(s * stride + r) * 2] (m in the log2 domain) and its unnormalized O at
// o[(s * stride + r) * D + d]; one merge ticket (zero at rest).
struct SplitSet {
  float* o;
  float* ml;
  u32* ticket;
  u32 nsplit;  // CTAs that take a ticket
  u32 used;    // splits that hold keys (the first `used`)
  u32 stride;  // rows per split in the workspace
  u32 rows;    // rows to merge
};

// write: this CTA's split s (s_o, s_M, s_L of rows 0 .. W.rows - 1) into the workspace
template <int D, int THREADS>
FP4C_DEVICE void write_partial(const SplitSet& W, u32 s, const float (*s_o)[D + 1],
                               const float* s_M, const float* s_L) {
  float* wo = W.o + (u64)s * W.stride * D;
  for (u32 k = threadIdx.x; k < W.rows * D; k += THREADS) wo[k] = s_o[k / D][k % D];
  if (threadIdx.x < W.rows) {
    float* wm = W.ml + ((u64)s * W.stride + threadIdx.x) * 2;
    wm[0] = s_M[threadIdx.x];
    wm[1] = s_L[threadIdx.x];
  }
}

// merge: every CTA of the set takes a ticket; the last one (which resets the ticket, so
// that CUDA-graph replays work) combines the partials into s_M, s_L (per row: M = the
// splits' largest m, L = sum l_s 2^(m_s - M)) and s_o (sum O_s 2^(m_s - M)) and returns
// true; the others return false.  Call after write_partial, from every thread.
// Not inlined: kept out of the key loop's register allocation, the decode kernel's long rows
// run 1-2 % faster (B=8 x 32768: 102.8 against 105.2 us on the H200); the
// set is copied first so that its fields stay in registers (read through the reference,
// the loops reloaded them from the stack: 1 x 16384 tokens 21 against 15 us).
template <int D, int THREADS, int MAXS>
__device__ __noinline__ bool merge_splits(const SplitSet& set, float (*s_o)[D + 1],
                                          float* s_M, float* s_L, float (*s_w)[MAXS],
                                          u32& s_flag) {
  const SplitSet W = set;
  const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
  // the barrier orders the CTA's partial writes before thread 0's ticket, whose release
  // makes them visible to the last CTA and whose acquire (in the last CTA, with the next
  // barrier) makes every split's partials visible to all its threads (CUTLASS's semaphore
  // pattern: no fence by every thread)
  __syncthreads();
  if (tid == 0) {
    const u32 prev = atom_add_acq_rel_gpu(W.ticket, 1u);
    s_flag = prev == W.nsplit - 1u ? 1u : 0u;
    if (s_flag) *W.ticket = 0u;  // every CTA of this set has taken its ticket
  }
  __syncthreads();
  if (!s_flag) return false;
  // few splits (a short sequence's plan): every split's O of this thread's first four
  // outputs loaded before (m, l), so that the two round trips overlap (with many, the
  // loop below keeps 16 splits in flight; prefetching there measured slower)
  constexpr int kPre = 8;
  const u32 k0 = 4u * tid;
  const bool few = W.used <= (u32)kPre;
  U32x4 pre[kPre];
  if (few && k0 < W.rows * D) {
#pragma unroll
    for (int i = 0; i < kPre; ++i)
      if ((u32)i < W.used) pre[i] = ldcg_u32x4(W.o + k0 + (u64)i * W.stride * D);
  }
  // (m, l) of every split, loaded once (lane s % 32 holds split s): one round trip
  constexpr int kPer = (MAXS + 31) / 32;
  for (u32 row = warp; row < W.rows; row += THREADS / 32) {
    float ms[kPer], ls[kPer];
    float M = FP4C_NEG_INF;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const u32 s = lane + 32u * i;
      ms[i] = FP4C_NEG_INF;
      ls[i] = 0.0f;
      if (s < W.used) {
        const U32x2 ml = ldcg_u32x2(W.ml + ((u64)s * W.stride + row) * 2);
        ms[i] = __uint_as_float(ml.x);
        ls[i] = __uint_as_float(ml.y);
      }
      M = f_max(M, ms[i]);
    }
#pragma unroll
    for (int k = 16; k >= 1; k >>= 1) M = f_max(M, __shfl_xor_sync(0xFFFFFFFFu, M, k));
    float L = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const u32 s = lane + 32u * i;
      if (s < W.used) {
        const float ws = merge_weight(ms[i], M);
        s_w[row][s] = ws;
        L = f_fma(ls[i], ws, L);
      }
    }
#pragma unroll
    for (int k = 16; k >= 1; k >>= 1) L = f_add(L, __shfl_xor_sync(0xFFFFFFFFu, L, k));
    if (lane == 0) {
      s_M[row] = M;
      s_L[row] = L;
    }
  }
  __syncthreads();
  // O = sum_s w_s O_s, four consecutive outputs per thread and step (16-byte loads, 16
  // splits in flight: with many splits this loop is the kernel's tail)
  for (u32 k = k0; k < W.rows * D; k += 4u * THREADS) {
    const u32 row = k / D;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const float* src = W.o + k;
    if (few && k == k0) {  // the prefetched splits (the same order of sums)
#pragma unroll
      for (int i = 0; i < kPre; ++i) {
        if ((u32)i < W.used) {
          const float w = s_w[row][i];
          acc[0] = f_fma(__uint_as_float(pre[i].x), w, acc[0]);
          acc[1] = f_fma(__uint_as_float(pre[i].y), w, acc[1]);
          acc[2] = f_fma(__uint_as_float(pre[i].z), w, acc[2]);
          acc[3] = f_fma(__uint_as_float(pre[i].w), w, acc[3]);
        }
      }
    } else {
#pragma unroll 16
      for (u32 s = 0; s < W.used; ++s) {
        const float w = s_w[row][s];
        const U32x4 v = ldcg_u32x4(src + (u64)s * W.stride * D);
        acc[0] = f_fma(__uint_as_float(v.x), w, acc[0]);
        acc[1] = f_fma(__uint_as_float(v.y), w, acc[1]);
        acc[2] = f_fma(__uint_as_float(v.z), w, acc[2]);
        acc[3] = f_fma(__uint_as_float(v.w), w, acc[3]);
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) s_o[row][k % D + e] = acc[e];
  }
  __syncthreads();
  return true;
}

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
  // store where `out` is aligned to it (the row offsets are: D is a multiple of 64)
  const bool vec = ((u64)out & (4u * T::kBytes - 1u)) == 0u;
  const float scale = f_mul(out_scale, FP4C_ROUTE_UNSCALE);
  for (u32 k = 4u * threadIdx.x; k < rows * D; k += 4u * THREADS) {
    const u32 row = k / D, d = k - row * D;
    const float L = s_L[row];
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      v[e] = __float_as_uint(L) == 0u ? 0.0f : f_mul(f_div(s_o[row][d + e], L), scale);
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
