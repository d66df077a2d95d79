// fp4cache: paged attention over NVFP4 pages for sequences of many query rows (chunked
// prefill, the long sequences of a mixed batch) with Hopper's warpgroup MMA, sm_90a
// (wgmma.mma_async f16 -> f32, inline PTX, no CUDA headers).  The contract, the work items
// (find_work: a CTA per query tile, splits when every sequence fits one tile), bad ids,
// NaN groups, the counters and the split merge are varlen_attention.cu's, through the
// steps both kernels share (varlen_steps.cuh); the host takes this kernel in place of the
// 128-row mma.sync kernel (_r128) on an sm_90 device for bf16 / f16 q, the head dims of
// _abi.VARLEN_WG_HEAD_DIMS (64 / 128 / 256), without the window or the rotation.
//
// A CTA: four warpgroups, warp specialized (FlashAttention-3's structure).  Warpgroups 0
// and 1 (the row warps, 64 query rows each: warp k of the CTA rows 16 k .., as the _r128
// kernel's) run the MMAs and the softmax; warpgroups 2 and 3 (the decode warps) bring the
// NVFP4 page rows into registers and decode them once per CTA into the shared K / V
// stages.  setmaxnreg moves registers from the decode warps (64; 56 at head_dim 256) to
// the row warps (192; 200).
// Shared memory (the 128-byte swizzle of wgmma.cuh, one region per 64 columns): q [ROWS x
// D] f16, K stages and V stages [STEP keys x D] f16 (a ring each, with full / empty
// mbarriers), the decode warps' scale staging.  Steps of STEP keys (128; 32 at head_dim
// 256, where q and eight stages fill the SM); step i:
//   decode:  decode warp p decodes key block p (16 keys: vl_decode, lane (token t, side))
//            of step i into the rings' next K and V stages once the row warps released
//            them (head_dim 256: block p % 2, columns 64 (p / 2) ..); then it loads its
//            rows of step i + 1 (vl_load_page) and the block table entry of step i + 2
//            (vl_page), so that a step waits for one load only;
//   scores:  S = Q K^T, m64nSTEPk16 per warpgroup, both operands in shared memory;
//   softmax: online, per row (vl_weights_fma: vl_weights' contract, FlashAttention-3's
//            arithmetic); the K stage is released when S is in registers;
//   P.V:     O += P V, m64nDk16 (two m64n128k16 at head_dim 256), P from registers (S's
//            accumulators are the A fragments), V MN-major from shared memory; issued
//            with step i + 1's scores, the V stage released when both are done.
// The two row warpgroups take turns at the tensor cores (named barriers, FlashAttention-3's
// ping-pong): one issues its P.V and next scores while the other runs its softmax.
// q is converted to f16 per row with a power-of-two scale and K / V decode exactly to f16,
// as in the mma kernel: the products are the same, the f32 sums in another order.
#include "varlen_steps.cuh"
#include "wgmma.cuh"
#include "pipeline.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "varlen_wgmma.cu needs sm_90a (wgmma.mma_async)"
#endif

// The per-head-dim geometry (_abi.VARLEN_WG_GEOMETRY): keys per step, K and V stages
template <int D>
struct WgGeometry;
#define FP4C_WG_GEOMETRY_OF(d, step, k_stages, v_stages) \
  template <>                                             \
  struct WgGeometry<d> {                                  \
    static constexpr int STEP = step, KSTAGES = k_stages, VSTAGES = v_stages; \
  };
FP4C_VARLEN_WG_GEOMETRY(FP4C_WG_GEOMETRY_OF)
#undef FP4C_WG_GEOMETRY_OF

template <int D>
struct WgDims : HeadDims<D> {
  static_assert(D == 64 || D == 128 || D == 256, "the wgmma kernel: head_dim 64, 128 or 256");
  static constexpr int MW = FP4C_VARLEN_WG_ROW_WARPS;     // row warps (16 rows each)
  static constexpr int PW = FP4C_VARLEN_WG_DECODE_WARPS;  // decode warps
  static constexpr int W = MW + PW;
  static constexpr int THREADS = 32 * W;
  static constexpr int ROWS = FP4C_MMA_ROWS * MW;         // query rows of the CTA
  static constexpr int STEP = WgGeometry<D>::STEP;        // keys per step
  static constexpr int KTILES = STEP / 16;                // 16-key tiles of a step
  static constexpr int BLOCKS = STEP / FP4C_VARLEN_TILE_KEYS;  // key blocks of a step
  // a decode warp's unit: a key block's rows, or (fewer blocks than warps) a slice of
  // their columns; UNITS per decode warp and step, DC columns each
  static constexpr int PARTS = BLOCKS >= PW ? 1 : PW / BLOCKS;
  static constexpr int UNITS = BLOCKS * PARTS / PW;
  static constexpr int DC = D / PARTS;
  static constexpr int QT = ROWS * D * 2;                 // q, swizzled
  static constexpr int KT = STEP * D * 2;                 // K (or V) of one stage
  static constexpr int KSTAGES = WgGeometry<D>::KSTAGES;
  static constexpr int VSTAGES = WgGeometry<D>::VSTAGES;
  static constexpr int SC = PW * 2 * FP4C_VARLEN_TILE_KEYS * HeadDims<D>::G;  // scale staging
  static constexpr int KV = (KSTAGES + VSTAGES) * KT;
  // = _abi.varlen_wg_smem_bytes (1024: the swizzle atoms' alignment, found at run time)
  static constexpr int SMEM = 1024 + QT + KV + SC;
  // registers per thread after setmaxnreg (launched with 65536 / THREADS, rounded down to
  // a multiple of 8): the decode warps give, the row warps take.  Head_dim 256: O alone is
  // 128 registers of a row thread; at 56 / 200 ptxas spills 248 / 424 bytes (stores /
  // loads, ptxas 13.0), almost none in the decode loop; 48 / 208 ran 12 % slower
  static constexpr int START_REGS = (65536 / THREADS) & ~7;
  static constexpr int DECODE_REGS = D == 256 ? 56 : 64;
  static constexpr int ROW_REGS = D == 256 ? 200 : 192;
  static_assert(MW == 8 && PW == 8, "two row warpgroups, two decode warpgroups");
  static_assert(DECODE_REGS * 32 * PW + ROW_REGS * 32 * MW <= START_REGS * THREADS &&
                    DECODE_REGS <= START_REGS && ROW_REGS >= START_REGS,
                "setmaxnreg moves registers within the CTA's allocation");
  static_assert((STEP == 128 || STEP == 64 || STEP == 32) && ROWS == 128,
                "m64n128, m64n64 or m64n32 scores per warpgroup");
  static_assert(UNITS >= 1 && BLOCKS * PARTS == UNITS * PW && (PARTS == 1 || UNITS == 1) &&
                    DC % 64 == 0,
                "whole units per decode warp, slices of whole 64-column regions");
  static_assert(KSTAGES >= 2 && VSTAGES >= 2, "the decode of a step overlaps the MMAs of "
                "the one before");
  // the merged O reuses the stages and the scale staging after them (free: the decode
  // warps have reached the item's end barrier)
  static_assert(ROWS * (D + 1) * 4 <= KV + SC, "the merged O reuses the stages");
  static_assert(ROWS * FP4C_VARLEN_MAX_SPLITS * 4 <= QT, "split weights in q's place");
};

// Named barriers (0: the CTA's): the row warps' q and epilogue, the item's end (the decode
// warps arrive after their last bad key), the row warpgroups' turns at the tensor cores,
// the decode warps' item start
#define FP4C_WG_BAR_ROWS 1
#define FP4C_WG_BAR_END 2
#define FP4C_WG_BAR_TURN 3  // 3: warpgroup 0's turn, 4: warpgroup 1's
#define FP4C_WG_BAR_DECODE 5

// The rings' mbarriers (shared addresses): full (the decode warps' threads arrive) and
// empty (the row warps' threads arrive) per K and per V stage
template <int KS, int VS>
struct WgBars {
  u32 base;
  FP4C_DEVICE u32 full_k(u32 s) const { return base + 8u * s; }
  FP4C_DEVICE u32 full_v(u32 s) const { return base + 8u * (KS + s); }
  FP4C_DEVICE u32 empty_k(u32 s) const { return base + 8u * (KS + VS + s); }
  FP4C_DEVICE u32 empty_v(u32 s) const { return base + 8u * (2 * KS + VS + s); }
};

// The CTA's static shared memory
template <int D>
struct WgShared {
  static constexpr int ROWS = WgDims<D>::ROWS, NB = 2 * (WgDims<D>::KSTAGES + WgDims<D>::VSTAGES);
  u64 bars[NB];
  float m[1][ROWS], l[1][ROWS], M[ROWS], L[ROWS], rsc[ROWS];
  u32 lim[ROWS];
  u32 nan, flag, vnan[D / 16];
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
// scores: S = Q K^T for the warpgroup's 64 rows and the stage's STEP keys (committed, not
// waited); q_s / k_s: shared addresses of the warpgroup's q rows and of the stage's K
// ---------------------------------------------------------------------------------------
template <int D, int ROWS, int STEP>
FP4C_DEVICE void wg_scores(float (&s)[STEP / 16][2][4], u32 q_s, u32 k_s) {
  // q's descriptors made here at each call: hoisted out of the step loop they take 16
  // registers of the row warps (spilled)
  asm volatile("" : "+r"(q_s));
  const u64 qa = wg_desc(q_s, 16u, 1024u), kb = wg_desc(k_s, 16u, 1024u);
  wg_fence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const u32 off = (u32)(ks & 3) * 32u;  // k16 step inside the 128-byte row
    const u64 da = wg_desc_at(qa, (u32)(ks >> 2) * (ROWS * 128u) + off);
    const u64 db = wg_desc_at(kb, (u32)(ks >> 2) * (STEP * 128u) + off);
    if (ks == 0)
      wg_ss<STEP, true>(&s[0][0][0], da, db);
    else
      wg_ss<STEP, false>(&s[0][0][0], da, db);
  }
  wg_commit();
}

// ---------------------------------------------------------------------------------------
// P.V: O += P V for the warpgroup's rows (committed, not waited); pa[j]: the weights of
// keys 16 j .. 16 j + 15 (A fragments); v_s: shared address of the stage's V
// ---------------------------------------------------------------------------------------
template <int D, int STEP>
FP4C_DEVICE void wg_pv(VlRowState<D>& st, const u32 (&pa)[STEP / 16][4], u32 v_s) {
  // at most 128 columns per MMA (head_dim 256: two, the second from region 2): ptxas
  // checks every instruction against the launch's 128 registers, and an m64n256 wants 158
  constexpr int N = D < 128 ? D : 128;
  const u64 vb = wg_desc(v_s, STEP * 128u, 1024u);
  wg_fence();
#pragma unroll
  for (int j = 0; j < STEP / 16; ++j)
#pragma unroll
    for (int h = 0; h < D / N; ++h)
      wg_rs<N>(&st.o[h * (N / 8)][0], pa[j],
               wg_desc_at(vb, (u32)(h * (N / 64)) * (STEP * 128u) + (u32)j * 2048u));
  wg_commit();
}

// ---------------------------------------------------------------------------------------
// decode warps: every step's key blocks, through the rings (K stages rk, V stages rv);
// at the end the CTA's smallest bad key and the item's end barrier
// ---------------------------------------------------------------------------------------
template <int D>
FP4C_DEVICE void wg_decode_item(const VlWork& W, const VarlenParams& P, const VlSeq& S,
                                u8* s_kv, u8* s_sc, WgShared<D>& sh,
                                const WgBars<WgDims<D>::KSTAGES, WgDims<D>::VSTAGES>& B,
                                Ring<WgDims<D>::KSTAGES>& rk, Ring<WgDims<D>::VSTAGES>& rv,
                                u32 nsteps) {
  using A = WgDims<D>;
  constexpr int STEP = A::STEP;
  const u32 lane = threadIdx.x & 31u, p = (threadIdx.x >> 5) - (u32)A::MW;
  u8* my_stage = s_sc + p * (2 * 16 * A::G);
  u32 nan_key = FP4C_VL_NOKEY;
  VlRaw<D, A::DC> R[A::UNITS];
  i64 id[A::UNITS];  // the lane's pages of the next step (its rows are loaded a step ahead)
  // the lane's key of block p + PW u, step i, or (column slices) of block p % BLOCKS, its
  // slice's first column c0
  const u32 key_in = 16u * (A::PARTS == 1 ? p : p % (u32)A::BLOCKS) + (lane & 15u);
  const u32 c0 = A::PARTS == 1 ? 0u : p / (u32)A::BLOCKS * (u32)A::DC;
  if (nsteps > 0u) {
#pragma unroll
    for (int u = 0; u < A::UNITS; ++u) {
      const u32 key = W.s0 + key_in + 16u * A::PW * u;
      vl_load_page<D>(S, key, W.s1, vl_page(S, key, W.s1), R[u], c0);
      id[u] = nsteps > 1u ? vl_page(S, W.s0 + STEP + key_in + 16u * A::PW * u, W.s1) : -1;
    }
  }
  for (u32 i = 0; i < nsteps; ++i) {
    const u32 step = W.s0 + i * STEP;
    mbar_wait(B.empty_k(rk.stage), rk.phase ^ 1u);
    mbar_wait(B.empty_v(rv.stage), rv.phase ^ 1u);
    u16* k = (u16*)(s_kv + rk.stage * A::KT);
    u16* v = (u16*)(s_kv + (A::KSTAGES + rv.stage) * A::KT);
#pragma unroll
    for (int u = 0; u < A::UNITS; ++u) {
      const u32 off = key_in + 16u * A::PW * u;
      vl_decode<D>(R[u], step + off, P.swizzle, my_stage,
                   SwzTile<STEP>{k, v, off - (lane & 15u)}, nan_key, sh.vnan, c0 / 16u);
      if (i + 1u < nsteps) vl_load_page<D>(S, step + STEP + off, W.s1, id[u], R[u], c0);
      if (i + 2u < nsteps) id[u] = vl_page(S, step + 2u * STEP + off, W.s1);
    }
    fence_proxy_async();  // the stage's writes, for the wgmma reads (async proxy)
    mbar_arrive(B.full_k(rk.stage));
    mbar_arrive(B.full_v(rv.stage));
    rk.next();
    rv.next();
  }
#pragma unroll
  for (int o = 1; o <= 16; o <<= 1) nan_key = min(nan_key, __shfl_xor_sync(0xFFFFFFFFu, nan_key, o));
  if (lane == 0u && nan_key != FP4C_VL_NOKEY) atomicMin(&sh.nan, nan_key);
  NamedBar<FP4C_WG_BAR_END, A::THREADS>::arrive();
}

// ---------------------------------------------------------------------------------------
// row warps: the steps' MMAs and softmax, taking turns with the other warpgroup (wg); at
// the end the merge and write (vl_epilogue over the row warps)
// ---------------------------------------------------------------------------------------
FP4C_DEVICE void wg_turn_sync(u32 wg) {
  if (wg == 0u)
    NamedBar<FP4C_WG_BAR_TURN, 256>::sync();
  else
    NamedBar<FP4C_WG_BAR_TURN + 1, 256>::sync();
}
FP4C_DEVICE void wg_turn_pass(u32 wg) {  // the other warpgroup's turn
  if (wg == 0u)
    NamedBar<FP4C_WG_BAR_TURN + 1, 256>::arrive();
  else
    NamedBar<FP4C_WG_BAR_TURN, 256>::arrive();
}

// The row warps' state of an item's steps: scores / weights s, P fragments pa, O and the
// row statistics st, the lane's rows (lim, rs), the rings
template <int D>
struct WgRowSteps {
  using A = WgDims<D>;
  float s[A::KTILES][2][4];
  u32 pa[A::KTILES][4];
  VlRowState<D> st;
  u32 lim[2];
  float rs[2];
  u32 q_s, kv_s, wg, s0;
  WgBars<A::KSTAGES, A::VSTAGES> B;
  Ring<A::KSTAGES>& rk;
  Ring<A::VSTAGES>& rv;

  FP4C_DEVICE void first() {  // step 0's scores
    mbar_wait(B.full_k(rk.stage), rk.phase);
    wg_turn_sync(wg);
    wg_scores<D, A::ROWS, A::STEP>(s, q_s, kv_s + rk.stage * A::KT);
    wg_turn_pass(wg);
  }
  // step i: its softmax (MASK: with the rows' key limits), then its P.V and (MORE) step
  // i + 1's scores.  The last step is compiled apart: a wgmma under a condition makes
  // ptxas serialize them (C7515).
  template <bool MORE, bool MASK>
  FP4C_DEVICE void step(u32 i) {
    wg_wait<0>();  // step i's scores and step i - 1's P.V
    wg_fence_regs<8 * A::KTILES>(&s[0][0][0]);
    wg_fence_regs<D / 2>(&st.o[0][0]);
    mbar_arrive(B.empty_k(rk.stage));
    rk.next();
    if (i > 0u) {
      mbar_arrive(B.empty_v(rv.stage));
      rv.next();
    }
    {
      float alpha[2];
      const bool moved =
          vl_weights_fma<D, A::KTILES, MASK>(s, s0 + i * A::STEP, 16u, lim, rs, st, alpha);
      vl_pack<A::KTILES>(s, pa);
      vl_rescale<D>(st, alpha, moved);
    }
    if constexpr (MORE) mbar_wait(B.full_k(rk.stage), rk.phase);
    mbar_wait(B.full_v(rv.stage), rv.phase);
    wg_turn_sync(wg);
    wg_pv<D, A::STEP>(st, pa, kv_s + (A::KSTAGES + rv.stage) * A::KT);
    if constexpr (MORE) wg_scores<D, A::ROWS, A::STEP>(s, q_s, kv_s + rk.stage * A::KT);
    wg_turn_pass(wg);
  }
  FP4C_DEVICE void last() {  // the last P.V, its V stage released
    wg_wait<0>();
    wg_fence_regs<D / 2>(&st.o[0][0]);
    mbar_arrive(B.empty_v(rv.stage));
    rv.next();
  }
};

template <typename T, int D>
FP4C_DEVICE void wg_row_item(const VlWork& W, const VarlenParams& P, u8* s_q, u8* s_kv,
                             WgShared<D>& sh,
                             const WgBars<WgDims<D>::KSTAGES, WgDims<D>::VSTAGES>& B,
                             Ring<WgDims<D>::KSTAGES>& rk, Ring<WgDims<D>::VSTAGES>& rv,
                             u32 nsteps, void* __restrict__ out, float* __restrict__ lse) {
  using A = WgDims<D>;
  const u32 warp = threadIdx.x >> 5, wg = warp >> 2;
  WgRowSteps<D> R{{}, {}, {}, {}, {}, smem_u32(s_q) + wg * (64u * 128u),  // the warpgroup's rows
                  smem_u32(s_kv), wg, W.s0, B, rk, rv};
  vl_lane_rows(sh.lim, sh.rsc, warp, W.s1, R.lim, R.rs);
  R.st.reset();
  // O's zeros written before the first wgmma (moved into its pipeline stage, they make
  // ptxas serialize the wgmmas, C7515)
  wg_fence_regs<D / 2>(&R.st.o[0][0]);
  if (nsteps > 0u) {
    // the steps before `whole` reach no key limit of the warpgroup's rows (those of its
    // item: padding rows are never written): their softmax compares no key (a loop of
    // its own, since ptxas would turn a branch on it into predicated compares)
    u32 lo = W.s1;
    const u32 r0 = wg * 64u + (threadIdx.x & 31u);
#pragma unroll
    for (u32 h = 0; h < 2u; ++h)
      if (r0 + 32u * h < W.rows_here) lo = min(lo, sh.lim[r0 + 32u * h]);
    lo = redux_min(lo);
    const u32 whole = min(lo > W.s0 ? (lo - W.s0) / (u32)A::STEP : 0u, nsteps - 1u);
    R.first();
    u32 i = 0;
    for (; i < whole; ++i) R.template step<true, false>(i);
    for (; i + 1u < nsteps; ++i) R.template step<true, true>(i);
    R.template step<false, true>(nsteps - 1u);
    R.last();
  }
  // ---- merge (one warp per row block) and write -----------------------------------------
  vl_epilogue<T, D, A::MW, NamedBar<FP4C_WG_BAR_ROWS, 32 * A::MW>,
              NamedBar<FP4C_WG_BAR_END, A::THREADS>>(
      W, P, R.st, FP4C_VL_NOKEY, s_kv, s_q, sh.m, sh.l, sh.lim, sh.nan, sh.vnan, sh.M, sh.L,
      sh.flag, out, lse);
}

// ---------------------------------------------------------------------------------------
// The kernel: a CTA takes the work items blockIdx.x, + gridDim.x, ... (varlen_attention.cu);
// each role runs its own loop over them, with the CTA's barriers at the same places
// ---------------------------------------------------------------------------------------
template <typename T, int D>
FP4C_DEVICE void varlen_wg_impl(const void* __restrict__ q, const void* __restrict__ qsl,
                                const void* __restrict__ tables,
                                const void* __restrict__ seq_lens, void* __restrict__ out,
                                float* __restrict__ lse, const VarlenParams& P) {
  static_assert(T::kBytes == 2, "the wgmma kernel takes bf16 / f16 q");
  using A = WgDims<D>;
  constexpr int ROWS = A::ROWS, STEP = A::STEP;
  extern __shared__ __align__(16) u8 smem[];
  __shared__ __align__(8) WgShared<D> sh;
  u32 dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  // the host sized it by _abi.varlen_wg_smem_bytes: it must be this layout
  if (dyn < (u32)A::SMEM || P.smem != (u32)A::SMEM) __trap();
  u8* s_q = smem + ((1024u - (smem_u32(smem) & 1023u)) & 1023u);  // 1024-byte aligned
  u8* s_kv = s_q + A::QT;  // K stages, then V stages (KT bytes each)
  u8* s_sc = s_kv + A::KV;
  const WgBars<A::KSTAGES, A::VSTAGES> B{smem_u32(&sh.bars[0])};
  const u32 warp = threadIdx.x >> 5;
  if (threadIdx.x == 0u) {
#pragma unroll
    for (int s = 0; s < A::KSTAGES; ++s) {
      mbar_init(B.full_k(s), 32u * A::PW);
      mbar_init(B.empty_k(s), 32u * A::MW);
    }
#pragma unroll
    for (int s = 0; s < A::VSTAGES; ++s) {
      mbar_init(B.full_v(s), 32u * A::PW);
      mbar_init(B.empty_v(s), 32u * A::MW);
    }
  }
  __syncthreads();
  Ring<A::KSTAGES> rk;
  Ring<A::VSTAGES> rv;
  if (warp < (u32)A::MW) {  // the row warps
    regs_inc<A::ROW_REGS>();
    if (warp >= 4u) wg_turn_pass(1u);  // warpgroup 0 starts
    for (u32 item = blockIdx.x; item < P.items; item += gridDim.x) {
      VlWork W;
      if (!find_work<ROWS, STEP>(P, item, qsl, seq_lens, W)) continue;
      __syncthreads();  // the last item's shared memory is free
      if (((u64)q & 15u) == 0u)
        load_q16<T, D, ROWS, SwzRows<ROWS>, A::MW>(q, W, P, (u16*)s_q, sh.rsc, sh.lim);
      else
        load_q<T, D, ROWS, SwzRows<ROWS>, A::MW, false, false>(q, W, P, (u16*)s_q, nullptr,
                                                                sh.rsc, sh.lim);
      fence_proxy_async();  // q, for the wgmma reads
      NamedBar<FP4C_WG_BAR_ROWS, 32 * A::MW>::sync();
      wg_row_item<T, D>(W, P, s_q, s_kv, sh, B, rk, rv, (W.s1 - W.s0 + STEP - 1u) / STEP, out,
                        lse);
    }
    if (warp < 4u) wg_turn_sync(0u);  // warpgroup 1's last pass
  } else {  // the decode warps: the same items and CTA barriers
    regs_dec<A::DECODE_REGS>();
    // the item's decode starts while the row warps convert q: the stages and the NaN
    // reports (reset here) are free once the CTA barrier has seen the last item's end
    for (u32 item = blockIdx.x; item < P.items; item += gridDim.x) {
      VlWork W;
      if (!find_work<ROWS, STEP>(P, item, qsl, seq_lens, W)) continue;
      __syncthreads();
      if (threadIdx.x == 32u * A::MW) sh.nan = FP4C_VL_NOKEY;
      if (threadIdx.x - 32u * A::MW < (u32)A::G) sh.vnan[threadIdx.x - 32u * A::MW] = FP4C_VL_NOKEY;
      const VlSeq S{attn_seq(P, tables, W.b, W.h, W.h == 0u && W.last_tile),
                    ((P.side_bytes | P.data_bytes) & 15) == 0 ? 1u : 0u};
      NamedBar<FP4C_WG_BAR_DECODE, 32 * A::PW>::sync();
      wg_decode_item<D>(W, P, S, s_kv, s_sc, sh, B, rk, rv, (W.s1 - W.s0 + STEP - 1u) / STEP);
    }
  }
}

// NAME, q/out value type (bf16 / f16), head_dim (64 / 128 / 256)
#define FP4C_VARLEN_WG_KERNEL(NAME, T, D)                                                    \
  extern "C" __global__ void __launch_bounds__(                                              \
      32 * (FP4C_VARLEN_WG_ROW_WARPS + FP4C_VARLEN_WG_DECODE_WARPS), 1)                      \
      NAME(const void* __restrict__ q, const void* __restrict__ qsl,                         \
           const void* __restrict__ tables, const void* __restrict__ seq_lens,               \
           void* __restrict__ out, float* __restrict__ lse, const VarlenParams params) {     \
    varlen_wg_impl<T, D>(q, qsl, tables, seq_lens, out, lse, params);                        \
  }

#ifdef FP4C_INSTANTIATIONS
FP4C_INSTANTIATIONS
#endif
