// fp4cache: the steps the varlen attention kernels share (varlen_attention.cu: mma.sync,
// sm_80+; varlen_wgmma.cu: wgmma, sm_90a): the work item of a CTA (find_work), q to f16 in
// shared memory (load_q), one key row of the pages into registers (vl_load) and to f16 in
// shared memory (vl_decode), the online softmax of a row pair (vl_weights, vl_weights_fma,
// vl_rescale, vl_pack), the merge of the warps of a row block (vl_merge_warps), the split
// merge and write (vl_finish), both in the item's end (vl_epilogue).  The shared-memory
// layouts are the kernels': load_q and vl_decode write through a layout type
// (PaddedRows / PaddedTile here, the 128-byte swizzle of the wgmma kernel).  Work items,
// bad ids, NaN groups and the split plan: varlen_attention.cu's header.
#pragma once
#include "fp4_common.cuh"
#include "paged_layout.cuh"
#include "attn_ptx.cuh"
#include "attn_dequant.cuh"
#include "attn_seq.cuh"
#include "attn_state.cuh"
#include "attn_epilogue.cuh"
#include "hadamard.cuh"

// warps of a CTA: FP4C_VARLEN_WARPS, or MW when a CTA has more row warps (_r128)
#define FP4C_VL_WARPS(MW) ((MW) > FP4C_VARLEN_WARPS ? (MW) : FP4C_VARLEN_WARPS)
#define FP4C_VL_THREADS(MW) (32 * FP4C_VL_WARPS(MW))
#define FP4C_VL_NOKEY 0xFFFFFFFFu

// ---------------------------------------------------------------------------------------
// Work unit
// ---------------------------------------------------------------------------------------
// Sequence b and KV head h of the item; the sequence's query tokens [qs0, qs0 + n) (rows =
// n * group: the RowMap row_map(P, h, qs0, n) of attn_seq.cuh) and keys (len); the query
// tile's rows [r0, r0 + rows_here); the split's keys [s0, s1) of the tile's [0, kv_end).
struct VlWork {
  u32 b, h, qs0, n, len, rows, r0, rows_here, nsplit, split, split_len, s0, s1, kv_end;
  bool last_tile;
};

// Keys token i of the sequence sees: [0, limit), limit in [0, len].  causal_limit of
// attn_seq.cuh in 64-bit arithmetic: the same values, but with the 32-bit form ptxas
// allocates other registers here on sm_80 (24-byte spills in the d256_r32 kernels), and
// decode's row_limit needs the 32-bit form to keep its allocation.
FP4C_DEVICE u32 token_limit(const VlWork& W, u32 i, u32 causal) {
  if (!causal) return W.len;
  const i64 lim = (i64)W.len - (i64)W.n + (i64)i + 1;
  return lim <= 0 ? 0u : (u32)lim;
}

// The work of the CTA's k-th item, item = blockIdx.x + k * gridDim.x, taken from the last:
// (b * H + h) * slots + slot = P.items - 1 - item, so that a sequence's query tiles run
// longest first (causal: the last tile sees the most keys) and a batch's last sequences
// (vLLM's order: decodes, then the prefill chunks) get the first CTAs; false when it has
// none.
template <int ROWS, int STEP>
FP4C_DEVICE bool find_work(const VarlenParams& P, u32 item, const void* qsl,
                           const void* seq_lens, VlWork& W) {
  const u32 rev = P.items - 1u - item;
  const u32 bh = rev / P.slots, slot = rev - bh * P.slots;
  W.b = bh / P.H;
  W.h = bh - W.b * P.H;
  const QuerySpan Q = query_span(P, qsl, W.b);
  if (Q.end <= Q.tok0) return false;  // no query token
  W.qs0 = (u32)Q.tok0;
  W.n = (u32)(Q.end - Q.tok0);
  W.rows = W.n * P.group;
  if (!launch_rows(P, W.rows)) return false;  // another launch's
  W.len = seq_len(P, seq_lens, W.b);
  const u32 nqt = (W.rows + ROWS - 1) / ROWS;
  u32 qt;
  if (nqt == 1u) {
    const u32 want = max(1u, (W.len + FP4C_VARLEN_MIN_SPLIT - 1) / FP4C_VARLEN_MIN_SPLIT);
    W.nsplit = min(min(P.slots, P.max_splits), want);
    W.split = slot;
    qt = 0u;
    if (slot >= W.nsplit) return false;
  } else {
    W.nsplit = 1u;
    W.split = 0u;
    qt = slot;
    if (qt >= nqt) return false;
  }
  W.r0 = qt * ROWS;
  W.rows_here = min((u32)ROWS, W.rows - W.r0);
  W.last_tile = qt + 1u == nqt;
  W.kv_end = token_limit(W, (W.r0 + W.rows_here - 1u) / P.group, P.causal);
  const u32 per = (W.kv_end + W.nsplit - 1u) / W.nsplit;
  W.split_len = max((u32)STEP, (per + STEP - 1u) / STEP * STEP);
  const u64 s0 = (u64)W.split * W.split_len;
  W.s0 = s0 < W.kv_end ? (u32)s0 : W.kv_end;
  W.s1 = (u32)min((u64)W.kv_end, s0 + W.split_len);
  return true;
}

// ---------------------------------------------------------------------------------------
// q: rows of the tile to f16 in shared memory (decode column order), per-row score scale
// and key limit
// ---------------------------------------------------------------------------------------
// column of d-nibble n (0..7) inside its group of 8: 2p + half with pair_nibble(p, half) = n
FP4C_DEVICE u32 pair_column(u32 n) {
  u32 col = 0u;
#pragma unroll
  for (int p = 0; p < 4; ++p)
#pragma unroll
    for (int half = 0; half < 2; ++half)
      if ((u32)pair_nibble(p, half) == n) col = 2u * p + half;
  return col;
}

template <typename T, int D, int ROWS, class QL, int NW, bool SPLIT, bool WIN>
FP4C_DEVICE void load_q(const void* q, const VlWork& W, const VarlenParams& P, u16* sq,
                        u16* sql, float* s_rsc, u32* s_lim) {
  const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const u32 Hq = P.H * P.group;
  const u32 col0 = (lane & ~7u) + pair_column(lane & 7u);  // column of d = lane (+ 32k)
  for (u32 j = warp; j < (u32)ROWS; j += NW) {
    float x[D / 32];
    float mx = 0.0f;
    u32 tok = 0u;
    const bool live = j < W.rows_here;
    if (live) {
      const u32 jj = W.r0 + j;
      tok = jj / P.group;
      // row_of(row_map(P, h, qs0, n), jj), written out: through the RowMap ptxas allocates
      // up to 5 more registers in some of these kernels
      const u64 qrow = (u64)(W.qs0 + tok) * Hq + W.h * P.group + (jj - tok * P.group);
      const char* src = (const char*)q + qrow * D * T::kBytes;
#pragma unroll
      for (int k = 0; k < D / 32; ++k) {
        x[k] = load_one(T(), src + (lane + 32u * k) * T::kBytes);
        mx = f_max(mx, f_abs(x[k]));
      }
    } else {
#pragma unroll
      for (int k = 0; k < D / 32; ++k) x[k] = 0.0f;
    }
    if (WIN && P.rotate) {  // K is stored rotated (uniform: the cache's option)
      hadamard_row<D>(x);
      mx = 0.0f;
#pragma unroll
      for (int k = 0; k < D / 32; ++k) mx = f_max(mx, f_abs(x[k]));
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) mx = f_max(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
    const QRowScale rs = q_row_scale(mx, P.qk_scale);
    const float qscale = rs.q;
#pragma unroll
    for (int k = 0; k < D / 32; ++k) {
      const float v = f_mul(x[k], qscale);
      const u32 h2 = pack2(f16_t(), v, 0.0f);
      sq[QL::at(j, col0 + 32u * k)] = (u16)h2;
      if constexpr (SPLIT)
        sql[QL::at(j, col0 + 32u * k)] = (u16)pack2(f16_t(), f_sub(v, lo_of(f16_t(), h2)), 0.0f);
    }
    if (lane == 0u) {
      s_rsc[j] = rs.score;
      s_lim[j] = live ? token_limit(W, tok, P.causal) : 0u;
    }
  }
}

// load_q's values and shared-memory layout from 16-byte vectors (2-byte q whose rows start
// 16-byte aligned; neither the window nor the rotation): a lane loads 8 columns of a row,
// D / 8 lanes a row, all of the warp's rows in flight before the first is converted
template <typename T, int D, int ROWS, class QL, int NW>
FP4C_DEVICE void load_q16(const void* q, const VlWork& W, const VarlenParams& P, u16* sq,
                          float* s_rsc, u32* s_lim) {
  static_assert(T::kBytes == 2, "16-byte vectors of 8 bf16 / f16 values");
  constexpr int CH = D / 8;          // lanes per row
  constexpr int RPI = 32 / CH;       // rows per load
  constexpr int N = ROWS / NW / RPI;  // loads per lane
  static_assert(ROWS % (NW * RPI) == 0, "whole loads of rows per warp");
  const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, ch = lane % (u32)CH;
  const u32 Hq = P.H * P.group;
  U32x4 raw[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const u32 j = warp + (u32)NW * ((u32)(i * RPI) + lane / (u32)CH);
    raw[i] = U32x4{0u, 0u, 0u, 0u};
    if (j < W.rows_here) {
      const u32 jj = W.r0 + j, tok = jj / P.group;
      const u64 qrow = (u64)(W.qs0 + tok) * Hq + W.h * P.group + (jj - tok * P.group);
      raw[i] = ldg16((const char*)q + (qrow * D + 8u * ch) * 2u);
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const u32 j = warp + (u32)NW * ((u32)(i * RPI) + lane / (u32)CH);
    const u32 w[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
    float v[8];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      v[2 * e] = lo_of(T(), w[e]);
      v[2 * e + 1] = hi_of(T(), w[e]);
    }
    float mx = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) mx = f_max(mx, f_abs(v[e]));
#pragma unroll
    for (int o = CH / 2; o >= 1; o >>= 1) mx = f_max(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
    const QRowScale rs = q_row_scale(mx, P.qk_scale);
    u32 h[4];  // decode column order: word p holds d-nibbles pair_nibble(p, 0), (p, 1)
#pragma unroll
    for (int p = 0; p < 4; ++p)
      h[p] = pack2(f16_t(), f_mul(v[pair_nibble(p, 0)], rs.q), f_mul(v[pair_nibble(p, 1)], rs.q));
    *(U32x4*)&sq[QL::at(j, 8u * ch)] = U32x4{h[0], h[1], h[2], h[3]};
    if (ch == 0u) {
      s_rsc[j] = rs.score;
      s_lim[j] = j < W.rows_here ? token_limit(W, (W.r0 + j) / P.group, P.causal) : 0u;
    }
  }
}

// ---------------------------------------------------------------------------------------
// load: one key row (codes and scales) of K (lanes 0..15) or V (16..31) into registers
// ---------------------------------------------------------------------------------------
// The sequence's pages (attn_seq.cuh): the CTA of KV head 0 and the sequence's last query
// tile counts bad ids; vec16: 16-byte code loads (side and data bytes multiples of 16).
struct VlSeq : AttnSeq {
  u32 vec16;
};

// The lane's row: the codes of its DC columns (DC < D: a column slice, the wgmma kernel's
// head_dim 256) and the whole scale row
template <int D, int DC = D>
struct VlRaw {
  static_assert(DC % 64 == 0 && D % DC == 0, "whole 64-column slices of the row");
  u32 w[DC / 8];  // the slice's codes (0 unless state 1)
  u32 sc[D / 64];  // the row's scales (D/16 bytes)
  u32 state;      // 0: zeros, 1: read, 2: bad page, 3: read for its scales only
};

// Whether key's row is read: a key before end, or (swizzled V scales) in a 4-token block
// that holds one: the 4 rows of a block hold the scales of all 4 tokens (and T % 4 == 0:
// the block lies in one page)
FP4C_DEVICE bool vl_wanted(const VlSeq& S, u32 key, u32 end) {
  return key < end || (S.swizzle && (key & ~3u) < end);
}
// The block id of key's page (its block table entry; -1 when the row is not read)
FP4C_DEVICE i64 vl_page(const VlSeq& S, u32 key, u32 end) {
  return vl_wanted(S, key, end) ? load_id(S, fdiv(key, S.fT)) : (i64)-1;
}

// The row of key into R, its page's block id from page(pe) (pe: the page's index in the
// sequence): the block table entry (vl_load) or one read before (vl_load_page); c0: the
// first column of R's slice
struct VlTableId {
  const VlSeq& S;
  FP4C_DEVICE i64 operator()(u32 pe) const { return load_id(S, pe); }
};
struct VlGivenId {
  i64 id;
  FP4C_DEVICE i64 operator()(u32) const { return id; }
};
template <int D, int DC, class Page>
FP4C_DEVICE void vl_load_row(const VlSeq& S, u32 key, u32 end, const Page& page,
                             VlRaw<D, DC>& R, u32 c0 = 0u) {
  const u32 side = (threadIdx.x & 31u) >> 4;
  // zeros where the row is not read (only those paths write them: a read row's codes come
  // from its loads)
  auto no_codes = [&R]() {
#pragma unroll
    for (int i = 0; i < DC / 8; ++i) R.w[i] = 0u;
  };
  auto no_row = [&](u32 state) {
    no_codes();
#pragma unroll
    for (int i = 0; i < D / 64; ++i) R.sc[i] = 0u;
    R.state = state;
  };
  // swizzled V scales: the 4 rows of a 4-token block hold the scales of all 4 tokens (and
  // T % 4 == 0: the block lies in one page)
  const bool want = key < end || (S.swizzle && (key & ~3u) < end);
  if (!want) return no_row(0u);
  const u32 pe = fdiv(key, S.fT), t = key - pe * S.fT.d;
  const i64 id = page(pe);
  if (!page_ok(S, id)) {
    if (key < end && t == 0u && side == 0u && c0 == 0u) count_bad_block(S);  // once per page
    return no_row(key < end ? 2u : 0u);
  }
  const u8* base = S.buffer + id * S.page_bytes + side * S.side_bytes;
  const u32 row = S.h * S.row_h + t * S.row_t;
  const u8* p = base + (u64)row * (D / 2) + c0 / 2u;
  if (key >= end) {
    no_codes();  // read for its scales only (other lanes' swizzled V scales)
  } else if (S.vec16) {
#pragma unroll
    for (int i = 0; i < DC / 32; ++i) {
      const U32x4 a = ldg16(p + 16 * i);
      R.w[4 * i] = a.x;
      R.w[4 * i + 1] = a.y;
      R.w[4 * i + 2] = a.z;
      R.w[4 * i + 3] = a.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < DC / 8; ++i) R.w[i] = ldg_u32(p + 4 * i);
  }
  const u8* sp = base + S.data_bytes + (u64)row * (D / 16);  // D/16-byte aligned
  if constexpr (D == 64) {
    R.sc[0] = ldg_u32(sp);
  } else if constexpr (D == 128) {
    const U32x2 a = ldg8(sp);
    R.sc[0] = a.x;
    R.sc[1] = a.y;
  } else {
    const U32x4 a = ldg16(sp);
    R.sc[0] = a.x;
    R.sc[1] = a.y;
    R.sc[2] = a.z;
    R.sc[3] = a.w;
  }
  R.state = key < end ? 1u : 3u;
}

template <int D>
FP4C_DEVICE void vl_load(const VlSeq& S, u32 key, u32 end, VlRaw<D>& R) {
  vl_load_row<D>(S, key, end, VlTableId{S}, R);
}
// id: vl_page(S, key, end), read before
template <int D, int DC>
FP4C_DEVICE void vl_load_page(const VlSeq& S, u32 key, u32 end, i64 id, VlRaw<D, DC>& R,
                              u32 c0 = 0u) {
  vl_load_row<D>(S, key, end, VlGivenId{id}, R, c0);
}

// ---------------------------------------------------------------------------------------
// decode: the lane's row (its DC-column slice from group g0) to f16 in the warp's tile (K
// rows 0..15, V rows 16..31); `stage` is the warp's [2][16][D/16] scale staging (whole
// rows).  nan_key: smallest key of a bad page (its K and V decode to 0); s_vnan[grp]:
// smallest key whose V group grp is stored as NaN (it decodes to 0; the rows that see that
// key get NaN in the group's 16 columns at the end).
// ---------------------------------------------------------------------------------------
template <int D, int DC, class TR>
FP4C_DEVICE void vl_decode(const VlRaw<D, DC>& R, u32 key, u32 swizzle, u8* stage,
                           const TR& tile, u32& nan_key, u32* s_vnan, u32 g0 = 0u) {
  constexpr int G = D / 16, SW = D / 64, GC = DC / 16, SWC = DC / 64;
  const u32 lane = threadIdx.x & 31u, t = lane & 15u, side = lane >> 4;
  u32* mine = (u32*)(stage + (side * 16u + t) * G);
#pragma unroll
  for (int i = 0; i < SW; ++i) mine[i] = R.sc[i];
  __syncwarp();
  u32 sb[SWC];  // this key's scale bytes of the slice, group order
  if (side == 1u && swizzle) {
#pragma unroll
    for (int i = 0; i < SWC; ++i) sb[i] = 0u;
#pragma unroll
    for (int grp = 0; grp < GC; ++grp) {
      u32 ts, gs;
      v_scale_swizzle(t, g0 + grp, (g0 + grp) / (G / 4), G / 4, ts, gs);
      sb[grp >> 2] |= (u32)stage[(16u + ts) * G + gs] << (8 * (grp & 3));
    }
  } else {
#pragma unroll
    for (int i = 0; i < SWC; ++i) sb[i] = mine[g0 / 4u + i];
  }
  __syncwarp();  // the staging is read before the next step writes it
  const bool live = R.state == 1u;
  if (R.state == 2u) nan_key = min(nan_key, key);
#pragma unroll
  for (int i = 0; i < SWC; ++i) {  // four groups' scale bytes at a time
    u32 w = live ? sb[i] : 0u;
    // V groups stored as NaN (magnitude 0x7F): reported, decoded as 0
    const u32 nan = side == 1u ? ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u : 0u;
    if (nan != 0u) {
#pragma unroll
      for (int b = 0; b < 4; ++b)
        if (nan & (0x80u << (8 * b))) atomicMin(&s_vnan[g0 + 4 * i + b], key);
      w &= ~((nan >> 7) * 0xFFu);
    }
    sb[i] = w;
  }
#pragma unroll
  for (int grp = 0; grp < GC; ++grp) {
    // the group's scale byte in both bytes of the pair
    const u32 sf = pair_scale(__byte_perm(sb[grp >> 2], 0u, 0x11u * (u32)(grp & 3)));
#pragma unroll
    for (int hw = 0; hw < 2; ++hw) {
      const int w = 2 * grp + hw;
      u32 r[4];
      e2m1_pairs(R.w[w], r);  // 0 unless read (vl_load)
      U32x4 o;
      o.x = hmul2(r[0], sf);
      o.y = hmul2(r[1], sf);
      o.z = hmul2(r[2], sf);
      o.w = hmul2(r[3], sf);
      *(U32x4*)tile.chunk(side, t, 2u * g0 + w) = o;
    }
  }
}

// The mma.sync kernels' shared rows: LD f16 per row (D + pad: ldmatrix without bank
// conflicts), q row j at j * LD; a warp's decoded tile: K rows 0..15, then V rows 16..31
template <int LD>
struct PaddedRows {
  static FP4C_DEVICE u32 at(u32 j, u32 col) { return j * LD + col; }
};
template <int LD>
struct PaddedTile {
  u16* tile;
  FP4C_DEVICE u16* chunk(u32 side, u32 t, u32 w) const {
    return tile + (side * 16u + t) * LD + 8u * w;
  }
};

template <int D>
struct VlRowState {
  float m[2], l[2];
  float o[D / 8][4];
  FP4C_DEVICE void reset() {  // no key yet
    m[0] = m[1] = FP4C_NEG_INF;
    l[0] = l[1] = 0.0f;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  }
};

// The lane's rows 16 m + g and 16 m + g + 8 of the CTA (m: its warp's row block): their key
// limits (the split end s1 included) and score scales, from load_q's s_lim and s_rsc
FP4C_DEVICE void vl_lane_rows(const u32* s_lim, const float* s_rsc, u32 m, u32 s1,
                              u32 (&lim)[2], float (&rs)[2]) {
  const u32 g = (threadIdx.x & 31u) >> 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const u32 row = 16u * m + g + 8u * r;
    lim[r] = min(s_lim[row], s1);
    rs[r] = s_rsc[row];
  }
}

// ---------------------------------------------------------------------------------------
// softmax: NTL tiles of 16 keys (tile j: keys key0 + j * kstride ..) of the scores s (the
// m16n8 accumulator layout: s[j][nt] keys 8 nt + 2c, + 1 of rows g (0, 1) and g + 8 (2, 3)),
// in three parts that the wgmma kernel runs apart (its P.V of the previous step is in
// flight between them):
//   vl_weights: keys at or past the row's limit masked, the rows' maximum and sum moved,
//               s replaced by the weights P (f32), alpha the factor of the rows' old O;
//               true when a row maximum of the warp moved (else every alpha is 1);
//   vl_rescale: O times alpha when a maximum moved;
//   vl_pack:    P as f16 A fragments of the P.V MMA (pa[j]: a0 / a1 keys 0..7, a2 / a3
//               keys 8..15).
// ---------------------------------------------------------------------------------------
template <int D, int NTL>
FP4C_DEVICE bool vl_weights(float (&s)[NTL][2][4], u32 key0, u32 kstride, const u32 (&lim)[2],
                            const float (&rs)[2], VlRowState<D>& st, float (&alpha)[2]) {
  const u32 c = threadIdx.x & 3u;
  bool moved = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float x[NTL][2][2];
    float tmax = FP4C_NEG_INF;
#pragma unroll
    for (int j = 0; j < NTL; ++j)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const u32 key = key0 + kstride * j + 8u * nt + 2u * c + e;
          x[j][nt][e] = key < lim[r] ? f_mul(s[j][nt][2 * r + e], rs[r]) : FP4C_NEG_INF;
          tmax = f_max(tmax, x[j][nt][e]);  // max.f32 drops NaN
        }
    tmax = f_max(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, 1));
    tmax = f_max(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, 2));
    const float mn = f_max(st.m[r], tmax);
    const float ms = is_neg_inf(mn) ? 0.0f : mn;  // no key yet: weights 2^-inf = 0
    alpha[r] = a_ex2(f_sub(st.m[r], ms));
    moved |= __float_as_uint(mn) != __float_as_uint(st.m[r]);
    st.m[r] = mn;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < NTL; ++j)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float p0 = a_ex2(f_sub(x[j][nt][0], ms)), p1 = a_ex2(f_sub(x[j][nt][1], ms));
        sum = f_add(sum, f_add(p0, p1));
        s[j][nt][2 * r] = p0;
        s[j][nt][2 * r + 1] = p1;
      }
    st.l[r] = f_fma(st.l[r], alpha[r], sum);
  }
  return __any_sync(0xFFFFFFFFu, moved);
}

// ---------------------------------------------------------------------------------------
// softmax weights (vl_weights' contract) for score scales rs > 0, FlashAttention-3's way:
// the row maximum of the raw scores times rs (the same value: rounding is monotonic), the
// weights 2^(s rs - m) from one fma, and the key limits applied (MASK) only in the calls
// whose tiles (key0 + kstride j ..) reach one of the lane's rows' limits; other scales take
// vl_weights.  The wgmma kernel (MASK: the steps that may reach a limit) and the mma.sync
// kernels (vl_softmax) share it
// ---------------------------------------------------------------------------------------
template <int D, int NT, bool MASK>
FP4C_DEVICE bool vl_weights_fma(float (&s)[NT][2][4], u32 key0, u32 kstride,
                                const u32 (&lim)[2], const float (&rs)[2], VlRowState<D>& st,
                                float (&alpha)[2]) {
  if (!(f_gt(rs[0], 0.0f) && f_gt(rs[1], 0.0f)))
    return vl_weights<D, NT>(s, key0, kstride, lim, rs, st, alpha);
  const u32 c = threadIdx.x & 3u;
  bool moved = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (MASK && key0 + kstride * (u32)(NT - 1) + 16u > lim[r]) {
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (key0 + kstride * j + 8u * nt + 2u * c + e >= lim[r])
              s[j][nt][2 * r + e] = FP4C_NEG_INF;
    }
    // the row's maximum in four independent chains (the same value: max.f32 is exact and
    // drops NaN in any order)
    float tm[4] = {FP4C_NEG_INF, FP4C_NEG_INF, FP4C_NEG_INF, FP4C_NEG_INF};
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
        tm[(2 * j + nt) & 3] = f_max(tm[(2 * j + nt) & 3],
                                     f_max(s[j][nt][2 * r], s[j][nt][2 * r + 1]));
    float tmax = f_max(f_max(tm[0], tm[1]), f_max(tm[2], tm[3]));
    tmax = f_max(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, 1));
    tmax = f_max(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, 2));
    const float mn = f_max(st.m[r], f_mul(tmax, rs[r]));
    const float ms = is_neg_inf(mn) ? 0.0f : mn;  // no key yet: weights 2^-inf = 0
    alpha[r] = a_ex2(f_sub(st.m[r], ms));
    moved |= __float_as_uint(mn) != __float_as_uint(st.m[r]);
    st.m[r] = mn;
    const float nms = f_neg(ms);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float p0 = a_ex2(f_fma(s[j][nt][2 * r], rs[r], nms));
        const float p1 = a_ex2(f_fma(s[j][nt][2 * r + 1], rs[r], nms));
        sum = f_add(sum, f_add(p0, p1));
        s[j][nt][2 * r] = p0;
        s[j][nt][2 * r + 1] = p1;
      }
    st.l[r] = f_fma(st.l[r], alpha[r], sum);
  }
  return __any_sync(0xFFFFFFFFu, moved);
}

template <int D>
FP4C_DEVICE void vl_rescale(VlRowState<D>& st, const float (&alpha)[2], bool moved) {
  if (!moved) return;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    st.o[i][0] = f_mul(st.o[i][0], alpha[0]);
    st.o[i][1] = f_mul(st.o[i][1], alpha[0]);
    st.o[i][2] = f_mul(st.o[i][2], alpha[1]);
    st.o[i][3] = f_mul(st.o[i][3], alpha[1]);
  }
}

template <int NTL>
FP4C_DEVICE void vl_pack(const float (&s)[NTL][2][4], u32 (&pa)[NTL][4]) {
#pragma unroll
  for (int j = 0; j < NTL; ++j)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r)  // a0 / a1: keys 0..7, a2 / a3: 8..15
        pa[j][2 * nt + r] = pack2(f16_t(), s[j][nt][2 * r], s[j][nt][2 * r + 1]);
}

// The three in one (the mma.sync kernels: nothing in flight)
template <int D, int NTL>
FP4C_DEVICE void vl_softmax(float (&s)[NTL][2][4], u32 key0, u32 kstride, const u32 (&lim)[2],
                            const float (&rs)[2], VlRowState<D>& st, u32 (&pa)[NTL][4]) {
  float alpha[2];
  const bool moved = vl_weights_fma<D, NTL, true>(s, key0, kstride, lim, rs, st, alpha);
  vl_pack<NTL>(s, pa);
  vl_rescale<D>(st, alpha, moved);
}

// ---------------------------------------------------------------------------------------
// merge: the KW warps of each row block into s_o (f32, natural d order, rows padded by one
// float) and the rows' (M, L) into s_M, s_L; a row that sees the CTA's nan_key gets L = NaN,
// one that sees s_vnan[grp] NaN in group grp's columns
// ---------------------------------------------------------------------------------------
template <int D, int MW, class Bar = CtaBar>
FP4C_DEVICE void vl_merge_warps(VlRowState<D>& st, float (*s_o)[D + 1],
                                float (*s_m)[FP4C_MMA_ROWS * MW],
                                float (*s_l)[FP4C_MMA_ROWS * MW], const u32* s_lim,
                                u32 nan_key, const u32* s_vnan, float* s_M, float* s_L) {
  constexpr int KW = FP4C_VL_WARPS(MW) / MW, ROWS = FP4C_MMA_ROWS * MW;
  const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3u;
  const u32 mw = warp / KW, kw = warp - mw * KW;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.l[r] = f_add(st.l[r], __shfl_xor_sync(0xFFFFFFFFu, st.l[r], 1));
    st.l[r] = f_add(st.l[r], __shfl_xor_sync(0xFFFFFFFFu, st.l[r], 2));
    if (c == 0u) {
      s_m[kw][16u * mw + g + 8u * r] = st.m[r];
      s_l[kw][16u * mw + g + 8u * r] = st.l[r];
    }
  }
  Bar::sync();
  float f[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) f[r] = warp_merge_weight<KW>(s_m, 16u * mw + g + 8u * r, st.m[r]);
#pragma unroll
  for (int k = 0; k < KW; ++k) {
    if (kw == (u32)k) {
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const u32 d = 8u * i + (u32)pair_nibble(c, e & 1);
          float* dst = &s_o[16u * mw + g + 8u * (e >> 1)][d];
          const float v = f_mul(st.o[i][e], f[e >> 1]);
          *dst = k == 0 ? v : f_add(*dst, v);
        }
      }
    }
    Bar::sync();
  }
  if (threadIdx.x < (u32)ROWS)
    merge_warp_row<KW>(s_m, s_l, threadIdx.x, nan_key < s_lim[threadIdx.x], s_M, s_L);
  // V groups stored as NaN among the keys a row sees: NaN in the group's columns
  for (u32 k = threadIdx.x; k < (u32)(ROWS * (D / 16)); k += FP4C_VL_THREADS(MW)) {
    const u32 row = k / (D / 16), grp = k - row * (D / 16);
    if (s_vnan[grp] < s_lim[row]) {
#pragma unroll
      for (int e = 0; e < 16; ++e) s_o[row][16u * grp + e] = FP4C_NAN;
    }
  }
  Bar::sync();
}

// ---------------------------------------------------------------------------------------
// finish: with splits, write the partial and let the last CTA of the (sequence, KV head)
// merge the partials (atomic ticket, reset by that CTA); then write out and lse
// ---------------------------------------------------------------------------------------
template <typename T, int D, int ROWS, int THREADS, class Bar = CtaBar>
FP4C_DEVICE void vl_finish(const VlWork& W, const VarlenParams& P, float (*s_o)[D + 1],
                           float* s_M, float* s_L,
                           float (*s_w)[FP4C_VARLEN_MAX_SPLITS],  // split weights per row
                           u32& s_flag,
                           void* __restrict__ out, float* __restrict__ lse) {
  if (W.nsplit > 1u) {  // one query tile
    const u32 base = (W.b * P.H + W.h) * P.max_splits;
    const SplitSet S{(float*)P.ws_o + (u64)base * ROWS * D,
                     (float*)P.ws_ml + (u64)base * ROWS * 2,
                     (u32*)P.counters + (W.b * P.H + W.h), W.nsplit,
                     W.kv_end == 0u ? 0u : (W.kv_end + W.split_len - 1u) / W.split_len, ROWS,
                     W.rows_here};
    if (W.s0 < W.s1) write_partial<D, THREADS>(S, W.split, s_o, s_M, s_L);
    if (!merge_splits<D, THREADS, FP4C_VARLEN_MAX_SPLITS, Bar>(S, s_o, s_M, s_L, s_w, s_flag))
      return;
  }
  const RowMap R = row_map(P, W.h, W.qs0, W.n);
  write_rows<T, D, THREADS>(R, W.r0, W.rows_here, s_o, s_M, s_L, P.out_scale, out, lse);
}

// ---------------------------------------------------------------------------------------
// The end of a work item: the CTA's smallest bad key (the warps' nan_key), the warps'
// merge into s_o (over the decoded K/V at s_kv), then vl_finish with the split weights in
// q's place (s_q: q is no longer read).  Bar: the barrier of the threads that run it (the
// row warps); EndBar: the one after the smallest bad key, of every thread that decodes
// (a warp-specialized kernel's decode warps arrive at it)
// ---------------------------------------------------------------------------------------
template <typename T, int D, int MW, class Bar = CtaBar, class EndBar = Bar>
FP4C_DEVICE void vl_epilogue(const VlWork& W, const VarlenParams& P, VlRowState<D>& st,
                             u32 nan_key, u8* s_kv, void* s_q,
                             float (*s_m)[FP4C_MMA_ROWS * MW], float (*s_l)[FP4C_MMA_ROWS * MW],
                             const u32* s_lim, u32& s_nan, const u32* s_vnan, float* s_M,
                             float* s_L, u32& s_flag, void* __restrict__ out,
                             float* __restrict__ lse) {
#pragma unroll
  for (int o = 1; o <= 16; o <<= 1) nan_key = min(nan_key, __shfl_xor_sync(0xFFFFFFFFu, nan_key, o));
  if ((threadIdx.x & 31u) == 0u && nan_key != FP4C_VL_NOKEY) atomicMin(&s_nan, nan_key);
  EndBar::sync();
  float(*s_o)[D + 1] = reinterpret_cast<float(*)[D + 1]>(s_kv);
  vl_merge_warps<D, MW, Bar>(st, s_o, s_m, s_l, s_lim, s_nan, s_vnan, s_M, s_L);
  float(*s_w)[FP4C_VARLEN_MAX_SPLITS] = reinterpret_cast<float(*)[FP4C_VARLEN_MAX_SPLITS]>(s_q);
  vl_finish<T, D, FP4C_MMA_ROWS * MW, FP4C_VL_THREADS(MW), Bar>(W, P, s_o, s_M, s_L, s_w, s_flag,
                                                           out, lse);
}
