// fp4cache: paged attention over NVFP4 pages for any number of query tokens per sequence
// (speculative verification, chunked prefill, mixed batches; vLLM's flattened layout),
// sm_80+ (mma.sync m16n8k16 f16 -> f32, ldmatrix), no CUDA headers.
//
//   out[i, h] = softmax(sm_scale * q[i, h] . K^T) . V   over the keys row (i, h) sees:
//   sequence b owns query tokens query_start_loc[b] .. query_start_loc[b+1] - 1 (n_b of
//   them); causal: its token i (0 <= i < n_b) sees keys 0 .. seq_lens[b] - n_b + i
//   (bottom-right), else all seq_lens[b] keys; K, V the values gather_dequant returns.
//
// Rows are (query token, query head) pairs: row j of sequence b and KV head h is token
// j / group, query head h * group + j % group.  Work item (taken by one CTA of
// FP4C_VARLEN_WARPS warps) = (sequence, KV head, slot): B * H * slots of them, slots =
// query tiles x splits sized on the host from max_query_len only; a CTA loops over the
// items blockIdx.x, + gridDim.x, ... (the grid is a few waves of resident CTAs), numbered
// from the last (find_work: a sequence's longest query tiles and a batch's last sequences
// first).  On the device each CTA finds the work of its item:
//   - a sequence whose rows fit one CTA (decode, speculative tokens with their group's
//     heads) is one query tile whose keys are cut into up to
//     min(slots, max_splits) splits (no fewer than FP4C_VARLEN_MIN_SPLIT keys each),
//     merged by the last CTA to finish (an atomic ticket per (sequence, KV head), reset by
//     that CTA: CUDA-graph safe), as in decode_attention.cu;
//   - a longer sequence has one CTA per query tile of MMA_ROWS * MW rows (no split);
//   - items past a sequence's work are skipped at once, and so are sequences outside the
//     launch's rows_lo < rows <= rows_hi (a mixed batch's sequences of at most 16 rows are
//     the few-row kernel's launches, decode_attention.cu; this kernel takes the others).
// Kernels _r16, _r32, _r64, _r128 (MW = 1, 2, 4, 8 row warps; CTAs of max(4, MW) warps):
// warp w owns rows 16 (w / KW) .. + 15 and the tiles w % KW, w % KW + KW, ... of each step
// (KW = warps / MW; _r128: every tile of its 128-key step, in two calls of 4 tiles); the
// KW warps of a row block are merged in shared memory at the end.  Their _win variants
// (WIN) add the exact window, the q rotation and the exact new tokens (docs/window.md,
// docs/engines.md; the plain kernels have none of their code): the steps wholly before
// the window start and the first new key run the plain loop, the later ones the window
// and new steps below for their tiles at or past them.
//
// A step covers one tile of FP4C_VARLEN_TILE_KEYS keys per warp; the decoded tiles are one
// set (decode, barrier, compute, barrier) or, in _r128 with q's fragments in registers
// (VlDims::DBUF: head_dim 64 / 128 with 16-bit q, head_dim 64 with float32 q), two: step i + 1
// decoded into one while step i is computed from the other, one barrier per step, half the
// warps decoding first and half computing first.  Steps:
//   load:    lane (token t = lane % 16, side = lane / 16) reads its key's code row and scale
//            row into registers (the next step's loads are in flight while this step is
//            computed; a cp.async ring measured slower, docs/kernels.md); any block
//            size, either layout, V scales swizzled or not.
//   decode:  the lane's row to f16 in shared memory ([16][D + pad] per side and tile):
//            E2M1 pairs times the E4M3 scale pair (attn_dequant.cuh), so every page byte is
//            decoded once per CTA; the columns of a word come in the pair order of
//            e2m1_pairs (column 8w + 2p + half = d 8w + pair_nibble(p, half)), q is
//            stored in the same column order and the output's columns are mapped back.
//   window:  a tile at or past the sequence's window start ws (docs/window.md; ws = len
//            without a window) instead of load + decode: the lane's bf16 row of the
//            window slot (token t, side) to f16 times win_k_mul / win_v_mul (the decoded
//            units) in the decode step's column order (attn_window.cuh); tiles are 16
//            keys and ws a multiple of the block size (itself of 16 with a window), so a
//            tile is all-NVFP4 or all-window.
//   new:     with the exact new tokens (new_k / new_v, the _win variants), the keys of a
//            tile at or past the sequence's first new key (len - n, anywhere in a page)
//            are the caller's rows in the same units (K rotated as q is), written over
//            the decoded or window rows; the pages are not read for them.
//   scores:  S = Q K^T (A = q from registers or ldmatrix, B = K tile by ldmatrix).
//   softmax: online, per row, with the row's own key limit (causal and split end) applied
//            only in the tiles that reach it; FlashAttention-3's arithmetic (vl_weights_fma,
//            the wgmma kernel's).
//   P.V:     O += P V (A = P from S's accumulators, B = V tile by ldmatrix.trans).
//   merge:   warps of the same rows in shared memory; splits through the workspace.
//   write:   out / lse, zeros and -inf for a row that sees no key.
//
// q is converted to f16 per row with a power-of-two scale (max |q| lands in [2^14, 2^15),
// exact for bf16 / f16); float32 q is split into f16 hi + lo parts (two MMAs).  With
// `rotate` (K stored rotated) the q row goes through the normalized Hadamard transform in
// float32 first (hadamard_row, hadamard.cuh).
//
// Bad block ids (outside [0, num_blocks)): nothing is read from a bad page, its K and V
// decode to 0 and the smallest such key of the CTA is kept; a row that sees that key gets
// l = NaN (NaN output and lse), as decode_attention.cu.  K groups stored as NaN make the
// scores of the rows that see them NaN (window K NaN groups alike: they stay NaN in f16).
// V groups stored as NaN (in the pages or the window slots) decode to 0 and the
// smallest such key per group is kept; a row that sees it gets NaN in the group's 16
// output columns (what the float math gives when only the keys a row sees take part: a
// masked weight of 0 times a NaN would be NaN in the shared P.V MMA).  The CTA of
// KV head 0 and the sequence's last query tile that reads a bad page's first token adds 1
// to stats[3] (once per block-table entry that a query row uses, and call).
#include "varlen_steps.cuh"
#include "attn_window.cuh"

// Geometry of one head_dim: HeadDims (attn_seq.cuh) and this kernel's tiling
template <int D, int MW, bool SPLIT>
struct VlDims : HeadDims<D> {
  static constexpr int W = FP4C_VL_WARPS(MW);       // warps of the CTA
  static_assert(W % MW == 0, "row warps divide the warps");
  static constexpr int THREADS = 32 * W;
  static constexpr int KW = W / MW;                  // warps sharing one row block
  static constexpr int ROWS = FP4C_MMA_ROWS * MW;    // query rows of the CTA
  static constexpr int TK = FP4C_VARLEN_TILE_KEYS;   // keys per warp tile
  static constexpr int STEP = TK * W;                // keys per CTA step
  static constexpr int NTL = MW < 4 ? MW : 4;        // tiles of one vl_tiles call (registers)
  static constexpr int NCALL = MW / NTL;             // vl_tiles calls per step (MW tiles)
  static constexpr int LD = D + FP4C_VARLEN_SMEM_PAD;  // f16 per shared row
  static constexpr int TILE = 2 * TK * LD * 2;       // bytes of one decoded K + V tile
  static constexpr int KV = W * TILE;
  static constexpr int SC = W * 2 * TK * HeadDims<D>::G;  // scale-row staging
  static constexpr int QB = ROWS * LD * 2;           // q hi (and as much again for lo)
  static constexpr bool QREG = MW > 1 && D * (SPLIT ? 2 : 1) <= 128;  // q fragments in registers
  // _r128 with q in registers: two sets of decoded tiles, the second in q's place (free
  // once the fragments are read), step i + 1 decoded into one while step i is computed
  static constexpr bool DBUF = MW == 8 && QREG;
  static constexpr int KVSET = KV + SC;  // the second set's offset (after the staging)
  static constexpr int SMEM =
      DBUF ? 2 * KV + SC : KV + SC + QB * (SPLIT ? 2 : 1);  // = _abi.varlen_smem_bytes
  static_assert(!DBUF || QB * (SPLIT ? 2 : 1) <= KV, "q in the second set's place");
  static_assert(ROWS * (D + 1) * 4 <= KV, "the merged O reuses the K/V tiles");
  static_assert(TK == 16 && FP4C_MMA_ROWS == 16, "one m16n8k16 tile of keys and rows");
};

// ---------------------------------------------------------------------------------------
// window: the lane's row of a window tile (its 16 keys at or past ws: all in mapped pages)
// to f16 in the warp's tile, in the decode step's units and column order (attn_window.cuh);
// read and written in place of vl_load + vl_decode.  Keys at or past `end` are zeros; a V
// group holding a NaN is written as zeros and its key kept in s_vnan as a decoded one; a K
// NaN stays NaN (the scores of the rows that see the key).
// ---------------------------------------------------------------------------------------
template <int D, int LD>
FP4C_DEVICE void vl_window(const VarlenParams& P, const VlSeq& S, u32 key, u32 end, u16* tile,
                           u32* s_vnan) {
  const u32 lane = threadIdx.x & 31u, t = lane & 15u, side = lane >> 4;
  u16* dst = tile + (side * 16u + t) * LD;
  const u8* src = nullptr;
  if (key < end) {
    const u32 pe = fdiv(key, S.fT), tt = key - pe * S.fT.d;
    const u32 slot = (u32)window_slot(P, S, load_id(S, pe));  // >= 0 for a key past ws
    const u64 row = ((u64)(2u * slot + side) * S.fT.d + tt) * P.H + S.h;
    src = (const u8*)P.win + row * (D * 2);
  }
  const float mul = window_mul(P, side);
#pragma unroll 2
  for (int grp = 0; grp < D / 16; ++grp) {
    U32x4 a[2] = {U32x4{0u, 0u, 0u, 0u}, U32x4{0u, 0u, 0u, 0u}};
    if (src != nullptr) {
      a[0] = ldg16(src + 32 * grp);
      a[1] = ldg16(src + 32 * grp + 16);
    }
    if (side == 1u && (bf16x8_nan(a[0]) || bf16x8_nan(a[1]))) {
      atomicMin(&s_vnan[grp], key);
      a[0] = a[1] = U32x4{0u, 0u, 0u, 0u};
    }
#pragma unroll
    for (int hw = 0; hw < 2; ++hw)
      *(U32x4*)(dst + 8 * (2 * grp + hw)) = window_word_f16(a[hw], mul);
  }
}
// ---------------------------------------------------------------------------------------
// new: the exact new tokens (VarlenParams.new_kind != 0; docs/engines.md).  The keys of
// the warp's tile at or past the sequence's first new key `first` (len - n) are written
// over what the decode or window step left: a key before s1 from the caller's row
// qs0 + key - first of new_k (rotated with P.rotate, as q is) or new_v, times
// win_k_mul / win_v_mul (the decoded units, as the window's rows), a key at or past s1 as
// zeros.  G = D / 16 consecutive lanes hold a row, 16 values each (lane g: d = 16 g ..),
// 32 / G rows a pass, K rows (0..15) then V rows, so a pass is one side.  A V group holding
// a NaN is written as zeros and its key kept in s_vnan, a K NaN stays NaN, as the window's;
// a bad page whose first key is new is counted (vl_load counts the pages it reads).
// ---------------------------------------------------------------------------------------
// the 16 values of a new row's group at p (16-byte aligned; kind: FP4C_NEW_*)
FP4C_DEVICE void new_group(u32 kind, const u8* p, float (&x)[16]) {
  if (kind == FP4C_NEW_F32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const U32x4 a = ldg16(p + 16 * i);
      x[4 * i] = __uint_as_float(a.x);
      x[4 * i + 1] = __uint_as_float(a.y);
      x[4 * i + 2] = __uint_as_float(a.z);
      x[4 * i + 3] = __uint_as_float(a.w);
    }
    return;
  }
  const U32x4 a = ldg16(p), b = ldg16(p + 16);
  const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[2 * i] = kind == FP4C_NEW_BF16 ? lo_of(bf16_t(), w[i]) : lo_of(f16_t(), w[i]);
    x[2 * i + 1] = kind == FP4C_NEW_BF16 ? hi_of(bf16_t(), w[i]) : hi_of(f16_t(), w[i]);
  }
}

template <int D, int LD>
FP4C_DEVICE void vl_new_rows(const VarlenParams& P, const VlWork& W, const VlSeq& S, u32 first,
                             u32 key0, const void* new_k, const void* new_v, u16* tile,
                             u32* s_vnan) {
  constexpr int G = D / 16, RPP = 32 / G;  // lanes per row, rows per pass
  const u32 lane = threadIdx.x & 31u, g = lane % G, rr = lane / G;
  const u32 ebytes = P.new_kind == FP4C_NEW_F32 ? 4u : 2u;
#pragma unroll 2
  for (u32 r0 = 0; r0 < 32u; r0 += RPP) {
    const u32 side = r0 >> 4, t = (r0 & 15u) + rr, key = key0 + t;  // side: warp-uniform
    const bool mine = key >= first, live = mine && key < W.s1;
    float x[16];
    if (live) {
      const u64 row = (u64)(W.qs0 + key - first) * (side ? P.new_v_ld : P.new_k_ld) +
                      (u64)S.h * D + 16u * g;
      new_group(P.new_kind, (const u8*)(side ? new_v : new_k) + row * ebytes, x);
      const u32 pe = fdiv(key, S.fT);
      if (side == 0u && g == 0u && key == pe * S.fT.d && !page_ok(S, load_id(S, pe)))
        count_bad_block(S);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = 0.0f;
    }
    if (side == 0u && P.rotate) hadamard_rows<1>((float(*)[16])x, g, G, hadamard_norm<D>());
    const float mul = window_mul(P, side);
    bool nan = false;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      x[i] = f_mul(x[i], mul);
      nan |= (__float_as_uint(x[i]) & 0x7FFFFFFFu) > 0x7F800000u;  // (no .ftz compare)
    }
    if (side == 1u && nan) {  // (only a live row holds a NaN)
      atomicMin(&s_vnan[g], key);
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = 0.0f;
    }
    if (mine) {
      u16* dst = tile + (side * 16u + t) * LD + 16u * g;
#pragma unroll
      for (int hw = 0; hw < 2; ++hw) {
        u32 o[4];
#pragma unroll
        for (int p = 0; p < 4; ++p)
          o[p] = f16x2_sat(x[8 * hw + pair_nibble(p, 0)], x[8 * hw + pair_nibble(p, 1)]);
        *(U32x4*)(dst + 8 * hw) = U32x4{o[0], o[1], o[2], o[3]};
      }
    }
  }
}
// ---------------------------------------------------------------------------------------
// One warp, NTL decoded tiles of 16 keys (tile j: keys key0 + j * kstride .., at smem
// address tiles + j * tile_bytes, K rows then V rows): scores, softmax, P.V for the warp's
// 16 rows (lane rows g, g + 8).  lim: the rows' key limits (split end included); rs: score
// scales.
// ---------------------------------------------------------------------------------------
template <int D, int NTL, int LD, bool SPLIT, bool QREG>
FP4C_DEVICE void vl_tiles(u32 tiles, u32 tile_bytes, u32 key0, u32 kstride, u32 wmax, u32 qaddr,
                          u32 qladdr, const u32 (&qf)[QREG ? D / 16 : 1][4],
                          const u32 (&qlf)[QREG && SPLIT ? D / 16 : 1][4],
                          const u32 (&lim)[2], const float (&rs)[2],
                          VlRowState<D>& st) {
  constexpr int KS = D / 16, NT = D / 8;
  const u32 lane = threadIdx.x & 31u, c = lane & 3u, mi = lane >> 3, r8 = lane & 7u;
  // ---- scores: S = Q K^T ----------------------------------------------------------------
  float s[NTL][2][4];
#pragma unroll
  for (int j = 0; j < NTL; ++j)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) s[j][nt][0] = s[j][nt][1] = s[j][nt][2] = s[j][nt][3] = 0.0f;
  const u32 koff = ((((mi >> 1) * 8u + r8) * LD) + (mi & 1u) * 8u) * 2u;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    u32 a[4], al[4];
    if constexpr (QREG) {
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        a[f] = qf[ks][f];
        if constexpr (SPLIT) al[f] = qlf[ks][f];
      }
    } else {
      ldmatrix_x4(qaddr + ks * 32u, a);
      if constexpr (SPLIT) ldmatrix_x4(qladdr + ks * 32u, al);
    }
#pragma unroll
    for (int j = 0; j < NTL; ++j) {
      if (key0 + kstride * j >= wmax) continue;  // warp-uniform: no row sees this tile
      u32 b[4];
      ldmatrix_x4(tiles + j * tile_bytes + koff + ks * 32u, b);
      mma_f16(s[j][0], a[0], a[1], a[2], a[3], b[0], b[1]);
      mma_f16(s[j][1], a[0], a[1], a[2], a[3], b[2], b[3]);
      if constexpr (SPLIT) {
        mma_f16(s[j][0], al[0], al[1], al[2], al[3], b[0], b[1]);
        mma_f16(s[j][1], al[0], al[1], al[2], al[3], b[2], b[3]);
      }
    }
  }
  // ---- softmax: per row, keys at or past the row's limit masked -------------------------
  u32 pa[NTL][4];
  vl_softmax<D, NTL>(s, key0, kstride, lim, rs, st, pa);
  // ---- P.V: O += P V ----------------------------------------------------------------------
  const u32 voff = ((((mi & 1u) * 8u + r8) * LD) + (mi >> 1) * 8u) * 2u;
#pragma unroll
  for (int j = 0; j < NTL; ++j) {
    if (key0 + kstride * j >= wmax) continue;
    const u32 vt = tiles + j * tile_bytes + 16u * LD * 2u + voff;
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      u32 b[4];
      ldmatrix_x4_trans(vt + np * 32u, b);
      mma_f16(st.o[2 * np], pa[j][0], pa[j][1], pa[j][2], pa[j][3], b[0], b[1]);
      mma_f16(st.o[2 * np + 1], pa[j][0], pa[j][1], pa[j][2], pa[j][3], b[2], b[3]);
    }
  }
}

// ---------------------------------------------------------------------------------------
// One work item: a (sequence, KV head, query tile, split) unit
// ---------------------------------------------------------------------------------------
template <typename T, int D, int MW, bool WIN>
FP4C_DEVICE void varlen_item(u32 item, const void* __restrict__ q, const void* __restrict__ qsl,
                             const void* __restrict__ tables, const void* __restrict__ seq_lens,
                             void* __restrict__ out, float* __restrict__ lse,
                             const void* __restrict__ new_k, const void* __restrict__ new_v,
                             const VarlenParams& P) {
  constexpr bool SPLIT = T::kBytes == 4;
  using A = VlDims<D, MW, SPLIT>;
  constexpr int ROWS = A::ROWS, LD = A::LD;
  extern __shared__ __align__(16) u8 smem[];
  __shared__ float s_m[A::KW][ROWS], s_l[A::KW][ROWS], s_M[ROWS], s_L[ROWS], s_rsc[ROWS];
  __shared__ u32 s_lim[ROWS];
  __shared__ u32 s_nan, s_flag, s_vnan[D / 16];
  VlWork W;
  if (!find_work<ROWS, A::STEP>(P, item, qsl, seq_lens, W)) return;
  const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const u32 mw = warp / A::KW, kw = warp - mw * A::KW;
  u8* s_kv = smem;                        // W decoded tiles [K 16 x LD | V 16 x LD] f16
  u8* s_sc = smem + A::KV;                // W x [2][16][D/16] scale rows
  u16* sq = (u16*)(smem + A::KV + A::SC);  // q hi [ROWS][LD] (then lo)
  u16* sql = sq + ROWS * LD;
  if (threadIdx.x == 0) s_nan = FP4C_VL_NOKEY;
  if (threadIdx.x < (u32)A::G) s_vnan[threadIdx.x] = FP4C_VL_NOKEY;
  load_q<T, D, ROWS, PaddedRows<LD>, A::W, SPLIT, WIN>(q, W, P, sq, sql, s_rsc, s_lim);
  __syncthreads();

  // ---- this lane's rows: limits (split end included), score scales, q fragments ---------
  u32 lim[2];
  float rs[2];
  vl_lane_rows(s_lim, s_rsc, mw, W.s1, lim, rs);
  u32 wmax = max(lim[0], lim[1]);
#pragma unroll
  for (int o = 4; o <= 16; o <<= 1) wmax = max(wmax, __shfl_xor_sync(0xFFFFFFFFu, wmax, o));
  const u32 mi = lane >> 3;
  const u32 qoff = (((16u * mw + (mi & 1u) * 8u + (lane & 7u)) * LD) + (mi >> 1) * 8u) * 2u;
  const u32 qaddr = smem_u32(sq) + qoff, qladdr = smem_u32(sql) + qoff;
  u32 qf[A::QREG ? A::KS : 1][4], qlf[A::QREG && SPLIT ? A::KS : 1][4];
  if constexpr (A::QREG) {
#pragma unroll
    for (int ks = 0; ks < A::KS; ++ks) {
      ldmatrix_x4(qaddr + ks * 32u, qf[ks]);
      if constexpr (SPLIT) ldmatrix_x4(qladdr + ks * 32u, qlf[ks]);
    }
  }

  const VlSeq S{attn_seq(P, tables, W.b, W.h, W.h == 0u && W.last_tile),
                ((P.side_bytes | P.data_bytes) & 15) == 0 ? 1u : 0u};

  VlRowState<D> st;
  st.reset();
  u32 nan_key = FP4C_VL_NOKEY;

  // ---- the steps: load (one step ahead), decode, scores / softmax / P.V -----------------
  const u32 my_key = 16u * warp + (lane & 15u);
  u8* my_stage = s_sc + warp * (2 * 16 * A::G);
  u16* my_tile = (u16*)(s_kv + warp * A::TILE);  // (the single set's)
  const u32 kv_s = smem_u32(s_kv);
  // the keys read from the pages: [s0, nv_end); the window's from nv_end on (a 16-key tile
  // is one or the other: ws is a multiple of the block size, itself of 16); the new
  // tokens' from `first` on (new: written over a tile that reaches them)
  const bool fresh = WIN && P.new_kind != 0u;
  const u32 first = fresh ? W.len - W.n : W.len;  // (n <= len: the host checks)
  const u32 nv_end = WIN ? min(min(W.s1, first), window_start(P, S, W.len)) : W.s1;
  // the tile of keys [k0, k0 + 16): decoded (or the window's) below `first`, then the new
  // rows over it (warp-uniform)
  auto fill_tile = [&](u32 k0, u16* tile, const VlRaw<D>& R) {
    if (fresh && k0 >= first) {
      vl_new_rows<D, LD>(P, W, S, first, k0, new_k, new_v, tile, s_vnan);
      return;
    }
    if (WIN && k0 >= nv_end && k0 < W.s1)
      vl_window<D, LD>(P, S, k0 + (lane & 15u), min(W.s1, first), tile, s_vnan);
    else
      vl_decode<D>(R, k0 + (lane & 15u), P.swizzle, my_stage, PaddedTile<LD>{tile}, nan_key,
                   s_vnan);
    if (fresh && k0 + 16u > first) {
      __syncwarp();  // the decoded rows are written before the new rows replace some
      vl_new_rows<D, LD>(P, W, S, first, k0, new_k, new_v, tile, s_vnan);
    }
  };
  if constexpr (A::DBUF) {
    // two sets: step i + 1 decoded into one while step i is computed from the other (free:
    // the barrier ending step i - 1 follows its last read), one barrier per step; warps
    // 0-3 decode first and warps 4-7 compute first, so that each SM sub-partition holds a
    // warp of each (the decode's loads and conversions beside the other's MMAs)
    VlRaw<D> R;
    auto decode_into = [&](u32 k0, u32 set) {  // step k0's tile of this warp
      fill_tile(k0 + 16u * warp, (u16*)(s_kv + set * A::KVSET + warp * A::TILE), R);
      if (k0 + A::STEP < W.s1) vl_load<D>(S, k0 + A::STEP + my_key, nv_end, R);
    };
    if (W.s0 < W.s1) {
      vl_load<D>(S, W.s0 + my_key, nv_end, R);
      decode_into(W.s0, 0u);
    }
    __syncthreads();  // the first set, and q's fragments read (q's place is the second)
    const u32 order = warp < (u32)(A::W / 2) ? 0u : 1u;
    u32 set = 0u;
    for (u32 step = W.s0; step < W.s1; step += A::STEP, set ^= 1u) {
#pragma unroll 1
      for (u32 ph = 0; ph < 2u; ++ph) {
        if (ph == order) {
          if (step + A::STEP < W.s1) decode_into(step + A::STEP, set ^ 1u);
        } else {
#pragma unroll
          for (int hc = 0; hc < A::NCALL; ++hc) {
            const u32 t0 = kw + (u32)(hc * A::NTL * A::KW);
            if (step + 16u * t0 < wmax)
              vl_tiles<D, A::NTL, LD, SPLIT, A::QREG>(
                  kv_s + set * A::KVSET + t0 * A::TILE, A::KW * A::TILE, step + 16u * t0,
                  16u * A::KW, wmax, qaddr, qladdr, qf, qlf, lim, rs, st);
          }
        }
      }
      __syncthreads();
    }
  } else {
    VlRaw<D> R;
    if (W.s0 < W.s1) vl_load<D>(S, W.s0 + my_key, nv_end, R);
    // WIN: phase 0 takes the steps wholly before the window (the plain kernel's loop), phase
    // 1 the others, whose tiles at or past nv_end are window tiles
    u32 step = W.s0;
#pragma unroll
    for (int phase = 0; phase < (WIN ? 2 : 1); ++phase) {
      for (; WIN && phase == 0 ? step + A::STEP <= nv_end : step < W.s1; step += A::STEP) {
        if (WIN && phase == 1)
          fill_tile(step + 16u * warp, my_tile, R);
        else
          vl_decode<D>(R, step + my_key, P.swizzle, my_stage, PaddedTile<LD>{my_tile},
                       nan_key, s_vnan);
        if (step + A::STEP < W.s1) vl_load<D>(S, step + A::STEP + my_key, nv_end, R);
        // warp (mw, kw) computes tiles kw, kw + KW, ... of the step (MW = 1: its own tile),
        // NTL of them per vl_tiles call
        if constexpr (MW == 1) __syncwarp(); else __syncthreads();
#pragma unroll
        for (int hc = 0; hc < A::NCALL; ++hc) {
          const u32 t0 = kw + (u32)(hc * A::NTL * A::KW);  // the call's first tile
          if (step + 16u * t0 < wmax)
            vl_tiles<D, A::NTL, LD, SPLIT, A::QREG>(kv_s + t0 * A::TILE, A::KW * A::TILE,
                                                    step + 16u * t0, 16u * A::KW, wmax,
                                                    qaddr, qladdr, qf, qlf, lim, rs, st);
        }
        if constexpr (MW == 1) __syncwarp(); else __syncthreads();
      }
    }
  }
  static_assert(ROWS * FP4C_VARLEN_MAX_SPLITS * 4 <= A::QB, "split weights in q's place");
  vl_epilogue<T, D, MW>(W, P, st, nan_key, s_kv, sq, s_m, s_l, s_lim, s_nan, s_vnan, s_M, s_L,
                        s_flag, out, lse);
}

// minimum resident CTAs per SM (register budget): 16-row kernels keep q in shared memory
// to reach 3 (D = 128) / 4 (D = 64) CTAs per SM, enough loads in flight for long contexts
// (_r128: 8 warps, one CTA)
#define FP4C_VL_MINB(D, MW) \
  ((MW) > 4 ? 1 : (D) == 64 ? ((MW) == 1 ? 4 : 3) : (D) == 128 ? ((MW) == 1 ? 3 : 2) : 1)
// ---------------------------------------------------------------------------------------
// The kernel: a CTA takes the work items blockIdx.x, + gridDim.x, ... (the grid is capped
// at a few waves of resident CTAs, so the items a mixed batch's launch leaves empty cost a
// loop turn, not a CTA launch)
// ---------------------------------------------------------------------------------------
template <typename T, int D, int MW, bool WIN>
FP4C_DEVICE void varlen_attn_impl(const void* __restrict__ q, const void* __restrict__ qsl,
                                  const void* __restrict__ tables,
                                  const void* __restrict__ seq_lens, void* __restrict__ out,
                                  float* __restrict__ lse, const void* __restrict__ new_k,
                                  const void* __restrict__ new_v, const VarlenParams& P) {
  using A = VlDims<D, MW, T::kBytes == 4>;
  u32 dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  // the host sized it by _abi.varlen_smem_bytes: it must be this layout
  if (dyn < (u32)A::SMEM || P.smem != (u32)A::SMEM) __trap();
  for (u32 item = blockIdx.x; item < P.items; item += gridDim.x) {
    varlen_item<T, D, MW, WIN>(item, q, qsl, tables, seq_lens, out, lse, new_k, new_v, P);
    __syncthreads();  // the next item reuses the shared memory
  }
}

// NAME, q/out value type, head_dim, row warps (1, 2, 4, 8: 16 .. 128 rows per CTA), WIN (1:
// the exact window and the q rotation compiled in, runtime-selected by the params; 0: the
// plain cache's kernel, without their code)
#define FP4C_VARLEN_KERNEL(NAME, T, D, MW, WIN)                                              \
  extern "C" __global__ void __launch_bounds__(FP4C_VL_THREADS(MW), FP4C_VL_MINB(D, MW))     \
      NAME(const void* __restrict__ q, const void* __restrict__ qsl,                         \
           const void* __restrict__ tables, const void* __restrict__ seq_lens,               \
           void* __restrict__ out, float* __restrict__ lse, const void* __restrict__ new_k,  \
           const void* __restrict__ new_v, const VarlenParams params) {                      \
    varlen_attn_impl<T, D, MW, (WIN) != 0>(q, qsl, tables, seq_lens, out, lse, new_k, new_v, \
                                           params);                                          \
  }

#ifdef FP4C_INSTANTIATIONS
FP4C_INSTANTIATIONS
#endif
