// fp4cache: partial softmax states of the attention kernels (decode_attention.cu,
// varlen_attention.cu) and their merges: the weight of a state in a merge, the merge of one
// row's states in shared memory (the warps of a CTA), and split-KV partials in the workspace
// with the merge by the last CTA of a (sequence, KV head).
#pragma once
#include "fp4_common.cuh"
#include "attn_ptx.cuh"

// The factor of a partial state of running maximum m in a merge to the maximum M (0 for a
// state that saw no key, m = -inf)
FP4C_DEVICE float merge_weight(float m, float M) {
  return is_neg_inf(m) ? 0.0f : a_ex2(f_sub(m, M));
}
// The largest running maximum of row `row` among N partial states (s_m[k][row])
template <int N, int S>
FP4C_DEVICE float states_max(const float (*s_m)[S], u32 row) {
  float M = FP4C_NEG_INF;
#pragma unroll
  for (int k = 0; k < N; ++k) M = f_max(M, s_m[k][row]);
  return M;
}
// (M, L) of row `row` from N partial states (s_m[k][row], s_l[k][row]): M = their largest m,
// L = sum l_k 2^(m_k - M)
template <int N, int S>
FP4C_DEVICE void merge_row(const float (*s_m)[S], const float (*s_l)[S], u32 row, float& M,
                           float& L) {
  M = states_max<N>(s_m, row);
  L = 0.0f;
#pragma unroll
  for (int k = 0; k < N; ++k) L = f_fma(s_l[k][row], merge_weight(s_m[k][row], M), L);
}

// ---------------------------------------------------------------------------------------
// The merge of a CTA's warps in shared memory: the N warps that hold the same rows have
// written their states of each row to s_m[k][row], s_l[k][row] (k: the warp's place among
// them); each scales its O by warp_merge_weight and adds it to the others', one thread per
// row writes the merged (M, L) (merge_warp_row).  How a warp's lanes hold its rows and O
// is the kernel's (decode: rows on the MMAs' n side; varlen: on the m side).
// ---------------------------------------------------------------------------------------
// The factor of a warp's own state of row `row` (running maximum m) in the merge
template <int N, int S>
FP4C_DEVICE float warp_merge_weight(const float (*s_m)[S], u32 row, float m) {
  return merge_weight(m, states_max<N>(s_m, row));
}
// The merged (M, L) of row `row` into s_M[row], s_L[row]; L = NaN where `nan` (the row saw
// a bad page)
template <int N, int S>
FP4C_DEVICE void merge_warp_row(const float (*s_m)[S], const float (*s_l)[S], u32 row, bool nan,
                                float* s_M, float* s_L) {
  float M, L;
  merge_row<N>(s_m, s_l, row, M, L);
  if (nan) L = FP4C_NAN;
  s_M[row] = M;
  s_L[row] = L;
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
// true; the others return false.  Call after write_partial, from every thread of `Bar`
// (CtaBar: the CTA).
// Not inlined: kept out of the key loop's register allocation, the decode kernel's long rows
// run 1-2 % faster (B=8 x 32768: 102.8 against 105.2 us on the H200); the
// set is copied first so that its fields stay in registers (read through the reference,
// the loops reloaded them from the stack: 1 x 16384 tokens 21 against 15 us).
template <int D, int THREADS, int MAXS, class Bar = CtaBar>
__device__ __noinline__ bool merge_splits(const SplitSet& set, float (*s_o)[D + 1],
                                          float* s_M, float* s_L, float (*s_w)[MAXS],
                                          u32& s_flag) {
  const SplitSet W = set;
  const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
  // the barrier orders the CTA's partial writes before thread 0's ticket, whose release
  // makes them visible to the last CTA and whose acquire (in the last CTA, with the next
  // barrier) makes every split's partials visible to all its threads (CUTLASS's semaphore
  // pattern: no fence by every thread)
  Bar::sync();
  if (tid == 0) {
    const u32 prev = atom_add_acq_rel_gpu(W.ticket, 1u);
    s_flag = prev == W.nsplit - 1u ? 1u : 0u;
    if (s_flag) *W.ticket = 0u;  // every CTA of this set has taken its ticket
  }
  Bar::sync();
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
  Bar::sync();
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
  Bar::sync();
  return true;
}
