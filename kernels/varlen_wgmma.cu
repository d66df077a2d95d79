// fp4cache: paged attention over NVFP4 pages for sequences of many query rows (chunked
// prefill, the long sequences of a mixed batch) with Hopper's warpgroup MMA, sm_90a
// (wgmma.mma_async f16 -> f32, inline PTX, no CUDA headers).  The contract, the work items
// (find_work: a CTA per query tile, splits when every sequence fits one tile), bad ids,
// NaN groups, the counters and the split merge are varlen_attention.cu's, through the
// steps both kernels share (varlen_steps.cuh); the host takes this kernel in place of the
// 128-row mma.sync kernel (_r128) on an sm_90 device for bf16 / f16 q, head_dim 64 / 128,
// without the window or the rotation.
//
// A CTA: two warpgroups (8 warps), 128 query rows (warpgroup w rows 64 w .. 64 w + 63; warp
// k of the CTA rows 16 k .., as the _r128 kernel's), steps of 128 keys.  Shared memory
// (the 128-byte swizzle of wgmma.cuh, one region per 64 columns): q [ROWS x D] f16, two K
// stages and three V stages [128 keys x D] f16, the warps' scale staging.  Step i (its K
// in K stage i % 2, its V in V stage i % 3):
//   scores:  S = Q K^T, m64n128k16 per warpgroup, both operands in shared memory (async;
//            behind step i - 1's P.V on the tensor cores);
//   decode:  while they run, lane (token t, side) of warp k decodes key 16 k + t of step
//            i + 1 from its registers into K stage (i + 1) % 2 and V stage (i + 1) % 3
//            (their last readers, step i - 1's scores and step i - 2's P.V, were waited
//            in step i - 1: vl_decode, every page byte once per CTA) and loads its key of
//            step i + 2 (vl_load);
//   softmax: after the one wait of the step (the scores and step i - 1's P.V), online, per
//            row, with the row's own key limit (vl_softmax, the mma kernel's);
//   P.V:     after a barrier (step i + 1 decoded), O += P V, m64nDk16, P from registers (S's
//            accumulators are the A fragments), V MN-major from shared memory (async).
// Measured and dropped (docs/kernels.md): FlashAttention-3's order (step i - 1's P.V issued
// after step i's scores, the softmax weights taken while it runs): ptxas needs its first
// step apart and spills more, 26 % slower here.
// q is converted to f16 per row with a power-of-two scale and K / V decode exactly to f16,
// as in the mma kernel: the products are the same, the f32 sums in another order.
#include "varlen_steps.cuh"
#include "wgmma.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "varlen_wgmma.cu needs sm_90a (wgmma.mma_async)"
#endif

template <int D>
struct WgDims : HeadDims<D> {
  static_assert(D == 64 || D == 128, "the wgmma kernel: head_dim 64 or 128");
  static constexpr int MW = FP4C_VARLEN_WG_ROW_WARPS;  // row warps (16 rows each)
  static constexpr int W = MW;                         // warps: two warpgroups
  static constexpr int THREADS = 32 * W;
  static constexpr int ROWS = FP4C_MMA_ROWS * MW;      // query rows of the CTA
  static constexpr int STEP = FP4C_VARLEN_WG_STEP;     // keys per step
  static constexpr int QT = ROWS * D * 2;              // q, swizzled
  static constexpr int KT = STEP * D * 2;              // K (or V) of one stage
  static constexpr int KSTAGES = FP4C_VARLEN_WG_K_STAGES;
  static constexpr int VSTAGES = FP4C_VARLEN_WG_V_STAGES;
  static constexpr int SC = W * 2 * FP4C_VARLEN_TILE_KEYS * HeadDims<D>::G;  // scale staging
  static constexpr int KV = (KSTAGES + VSTAGES) * KT;
  // = _abi.varlen_wg_smem_bytes (1024: the swizzle atoms' alignment, found at run time)
  static constexpr int SMEM = 1024 + QT + KV + SC;
  static_assert(STEP == 128 && ROWS == 128 && STEP == FP4C_VARLEN_TILE_KEYS * W,
                "m64n128 scores per warpgroup, 16 keys per warp and step");
  static_assert(KSTAGES == 2 && VSTAGES == 3, "step i + 1 is decoded while step i's scores "
                "and step i - 1's P.V read theirs");
  static_assert(ROWS * (D + 1) * 4 <= KV, "the merged O reuses the stages");
  static_assert(ROWS * FP4C_VARLEN_MAX_SPLITS * 4 <= QT, "split weights in q's place");
};

// The 128-byte swizzle of rows of D f16: column col of row j in region col / 64 (`rows`
// rows of 128 bytes), its 16-byte chunk (col % 64) / 8 at chunk ((col % 64) / 8) ^ (j % 8);
// indices in f16 units
template <int ROWS>
struct SwzRows {
  static FP4C_DEVICE u32 at(u32 j, u32 col) {
    return (col >> 6) * (ROWS * 64u) + j * 64u + ((((col >> 3) & 7u) ^ (j & 7u)) << 3) +
           (col & 7u);
  }
};
// A stage's decoded K (side 0) and V (side 1) rows, key0 + t the lane's key of the step:
// SwzRows' layout for column 8 w, as offsets of the stage's pointer
template <int STEP>
struct SwzTile {
  u16* k;
  u16* v;
  u32 key0;
  FP4C_DEVICE u16* chunk(u32 side, u32 t, u32 w) const {
    const u32 key = key0 + t;
    return (side ? v : k) + (w >> 3) * (STEP * 64u) + key * 64u + (((w & 7u) ^ (key & 7u)) << 3);
  }
};

// ---------------------------------------------------------------------------------------
// scores: S = Q K^T for the warpgroup's 64 rows and the stage's 128 keys (committed, not
// waited); q_s / k_s: shared addresses of the warpgroup's q rows and of the stage's K
// ---------------------------------------------------------------------------------------
template <int D, int ROWS, int STEP>
FP4C_DEVICE void wg_scores(float (&s)[8][2][4], u32 q_s, u32 k_s) {
  wg_fence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const u32 off = (u32)(ks & 3) * 32u;  // k16 step inside the 128-byte row
    const u64 da = wg_desc(q_s + (u32)(ks >> 2) * (ROWS * 128u) + off, 16u, 1024u);
    const u64 db = wg_desc(k_s + (u32)(ks >> 2) * (STEP * 128u) + off, 16u, 1024u);
    if (ks == 0)
      wg_ss_n128_init(&s[0][0][0], da, db);
    else
      wg_ss_n128(&s[0][0][0], da, db);
  }
  wg_commit();
}

// ---------------------------------------------------------------------------------------
// P.V: O += P V for the warpgroup's rows (committed, not waited); pa[j]: the weights of
// keys 16 j .. 16 j + 15 (A fragments); v_s: shared address of the stage's V
// ---------------------------------------------------------------------------------------
template <int D, int STEP>
FP4C_DEVICE void wg_pv(VlRowState<D>& st, const u32 (&pa)[8][4], u32 v_s) {
  wg_fence();
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const u64 db = wg_desc(v_s + (u32)j * 2048u, STEP * 128u, 1024u);
    if constexpr (D == 128)
      wg_rs_n128(&st.o[0][0], pa[j], db);
    else
      wg_rs_n64(&st.o[0][0], pa[j], db);
  }
  wg_commit();
}

// ---------------------------------------------------------------------------------------
// One work item: a (sequence, KV head, query tile, split) unit
// ---------------------------------------------------------------------------------------
template <typename T, int D>
FP4C_DEVICE void wg_item(u32 item, const void* __restrict__ q, const void* __restrict__ qsl,
                         const void* __restrict__ tables, const void* __restrict__ seq_lens,
                         void* __restrict__ out, float* __restrict__ lse, const VarlenParams& P) {
  using A = WgDims<D>;
  constexpr int ROWS = A::ROWS, STEP = A::STEP;
  extern __shared__ __align__(16) u8 smem[];
  __shared__ float s_m[1][ROWS], s_l[1][ROWS], s_M[ROWS], s_L[ROWS], s_rsc[ROWS];
  __shared__ u32 s_lim[ROWS];
  __shared__ u32 s_nan, s_flag, s_vnan[D / 16];
  VlWork W;
  if (!find_work<ROWS, STEP>(P, item, qsl, seq_lens, W)) return;
  const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  u8* s_q = smem + ((1024u - (smem_u32(smem) & 1023u)) & 1023u);  // 1024-byte aligned
  u8* s_kv = s_q + A::QT;  // K stages 0, 1, then V stages 0, 1, 2 (KT bytes each)
  u8* s_sc = s_kv + A::KV;
  if (threadIdx.x == 0) s_nan = FP4C_VL_NOKEY;
  if (threadIdx.x < (u32)A::G) s_vnan[threadIdx.x] = FP4C_VL_NOKEY;
  load_q<T, D, ROWS, SwzRows<ROWS>, A::W, false, false>(q, W, P, (u16*)s_q, nullptr, s_rsc,
                                                         s_lim);
  const VlSeq S{attn_seq(P, tables, W.b, W.h, W.h == 0u && W.last_tile),
                ((P.side_bytes | P.data_bytes) & 15) == 0 ? 1u : 0u};
  __syncthreads();

  // ---- this lane's rows: limits (split end included), score scales ----------------------
  u32 lim[2];
  float rs[2];
  vl_lane_rows(s_lim, s_rsc, warp, W.s1, lim, rs);
  VlRowState<D> st;
  st.reset();
  u32 nan_key = FP4C_VL_NOKEY;

  // ---- the first step's decode, the second's load; the steps -------------------------
  const u32 my_key = 16u * warp + (lane & 15u);
  u8* my_stage = s_sc + warp * (2 * 16 * A::G);
  const u32 q_s = smem_u32(s_q) + (warp >> 2) * (64u * 128u);  // the warpgroup's 64 rows
  const u32 kv_s = smem_u32(s_kv);
  const u32 nsteps = (W.s1 - W.s0 + STEP - 1u) / STEP;
  VlRaw<D> R;
  if (nsteps > 0u) {
    vl_load<D>(S, W.s0 + my_key, W.s1, R);
    vl_decode<D>(R, W.s0 + my_key, P.swizzle, my_stage,
                 SwzTile<STEP>{(u16*)s_kv, (u16*)(s_kv + 2 * A::KT), 16u * warp}, nan_key,
                 s_vnan);
    if (nsteps > 1u) vl_load<D>(S, W.s0 + STEP + my_key, W.s1, R);
  }
  fence_proxy_async();
  __syncthreads();
  // step i: K stage i % 2, V stage i % 3; the decode of step i + 1 writes K stage (i + 1) %
  // 2 (last read by step i - 1's scores) and V stage (i + 1) % 3 (step i - 2's P.V): both
  // waited by each warpgroup before step i - 1's P.V and the barrier there, so the decode
  // overlaps step i - 1's P.V and step i's scores (the one wait of a step retires both)
  u32 pa[8][4];
  u32 vcur = 0u;  // i % 3
  for (u32 i = 0; i < nsteps; ++i) {
    const u32 step = W.s0 + i * STEP, kcur = i & 1u, vnext = vcur == 2u ? 0u : vcur + 1u;
    float s[8][2][4];
    wg_scores<D, ROWS, STEP>(s, q_s, kv_s + kcur * A::KT);
    if (i + 1u < nsteps) {
      vl_decode<D>(R, step + STEP + my_key, P.swizzle, my_stage,
                   SwzTile<STEP>{(u16*)(s_kv + (kcur ^ 1u) * A::KT),
                                 (u16*)(s_kv + (2u + vnext) * A::KT), 16u * warp},
                   nan_key, s_vnan);
      if (i + 2u < nsteps) vl_load<D>(S, step + 2u * STEP + my_key, W.s1, R);
    }
    wg_wait<0>();  // the scores and step i - 1's P.V
    vl_softmax<D, 8>(s, step, 16u, lim, rs, st, pa);
    fence_proxy_async();
    __syncthreads();  // step i + 1 is decoded
    wg_pv<D, STEP>(st, pa, kv_s + (2u + vcur) * A::KT);
    vcur = vnext;
  }
  wg_wait<0>();
  // ---- merge (one warp per row block) and write -----------------------------------------
  vl_epilogue<T, D, A::MW>(W, P, st, nan_key, s_kv, s_q, s_m, s_l, s_lim, s_nan, s_vnan, s_M,
                           s_L, s_flag, out, lse);
}

// ---------------------------------------------------------------------------------------
// The kernel: a CTA takes the work items blockIdx.x, + gridDim.x, ... (varlen_attention.cu)
// ---------------------------------------------------------------------------------------
template <typename T, int D>
FP4C_DEVICE void varlen_wg_impl(const void* __restrict__ q, const void* __restrict__ qsl,
                                const void* __restrict__ tables,
                                const void* __restrict__ seq_lens, void* __restrict__ out,
                                float* __restrict__ lse, const VarlenParams& P) {
  static_assert(T::kBytes == 2, "the wgmma kernel takes bf16 / f16 q");
  using A = WgDims<D>;
  u32 dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  // the host sized it by _abi.varlen_wg_smem_bytes: it must be this layout
  if (dyn < (u32)A::SMEM || P.smem != (u32)A::SMEM) __trap();
  for (u32 item = blockIdx.x; item < P.items; item += gridDim.x) {
    wg_item<T, D>(item, q, qsl, tables, seq_lens, out, lse, P);
    __syncthreads();  // the next item reuses the shared memory
  }
}

// NAME, q/out value type (bf16 / f16), head_dim (64 / 128)
#define FP4C_VARLEN_WG_KERNEL(NAME, T, D)                                                    \
  extern "C" __global__ void __launch_bounds__(32 * FP4C_VARLEN_WG_ROW_WARPS, 1)            \
      NAME(const void* __restrict__ q, const void* __restrict__ qsl,                         \
           const void* __restrict__ tables, const void* __restrict__ seq_lens,               \
           void* __restrict__ out, float* __restrict__ lse, const VarlenParams params) {     \
    varlen_wg_impl<T, D>(q, qsl, tables, seq_lens, out, lse, params);                        \
  }

#ifdef FP4C_INSTANTIATIONS
FP4C_INSTANTIATIONS
#endif
