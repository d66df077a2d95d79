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
// items blockIdx.x, + gridDim.x, ... (the grid is a few waves of resident CTAs).  On the
// device each CTA finds the work of its item:
//   - a sequence whose rows fit one CTA (decode, speculative tokens with their group's
//     heads) is one query tile whose keys are cut into up to
//     min(slots, max_splits) splits (no fewer than FP4C_VARLEN_MIN_SPLIT keys each),
//     merged by the last CTA to finish (an atomic ticket per (sequence, KV head), reset by
//     that CTA: CUDA-graph safe), as in decode_attention.cu;
//   - a longer sequence has one CTA per query tile of MMA_ROWS * MW rows (no split);
//   - items past a sequence's work are skipped at once, and so are sequences outside the
//     launch's
//     rows_lo < rows <= rows_hi (a mixed batch takes two launches: the 16-row kernel for
//     sequences of at most 16 rows, a larger one for the others).
// Kernels _r16, _r32, _r64, _r128 (MW = 1, 2, 4, 8 row warps; CTAs of max(4, MW) warps):
// warp w owns rows 16 (w / KW) .. + 15 and the tiles w % KW, w % KW + KW, ... of each step
// (KW = warps / MW; _r128: every tile of its 128-key step, in two calls of 4 tiles); the
// KW warps of a row block are merged in shared memory at the end.  Their _win variants (WIN) add the
// exact window and the q rotation (docs/window.md; the plain kernels have neither's code):
// the steps wholly before the window start run the plain loop, the later ones the window
// step below for their tiles at or past it.
//
// A step covers one tile of FP4C_VARLEN_TILE_KEYS keys per warp.  Steps:
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
//   scores:  S = Q K^T (A = q from registers or ldmatrix, B = K tile by ldmatrix).
//   softmax: online, per row, with the row's own key limit (causal and split end).
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
#include "fp4_common.cuh"
#include "paged_layout.cuh"
#include "attn_ptx.cuh"
#include "attn_dequant.cuh"
#include "attn_seq.cuh"
#include "attn_state.cuh"
#include "attn_epilogue.cuh"
#include "attn_window.cuh"
#include "hadamard.cuh"

// warps of a CTA: FP4C_VARLEN_WARPS, or MW when a CTA has more row warps (_r128)
#define FP4C_VL_WARPS(MW) ((MW) > FP4C_VARLEN_WARPS ? (MW) : FP4C_VARLEN_WARPS)
#define FP4C_VL_THREADS(MW) (32 * FP4C_VL_WARPS(MW))
#define FP4C_VL_NOKEY 0xFFFFFFFFu

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
  static constexpr int SMEM = KV + SC + QB * (SPLIT ? 2 : 1);  // = _abi.varlen_smem_bytes
  static constexpr bool QREG = MW > 1 && D * (SPLIT ? 2 : 1) <= 128;  // q fragments in registers
  static_assert(ROWS * (D + 1) * 4 <= KV, "the merged O reuses the K/V tiles");
  static_assert(TK == 16 && FP4C_MMA_ROWS == 16, "one m16n8k16 tile of keys and rows");
};

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

// Work item `item` (= (b * H + h) * slots + slot); false when it has none.
template <int ROWS, int STEP>
FP4C_DEVICE bool find_work(const VarlenParams& P, u32 item, const void* qsl,
                           const void* seq_lens, VlWork& W) {
  const u32 bh = item / P.slots, slot = item - bh * P.slots;
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

template <typename T, int D, int ROWS, int LD, int NW, bool SPLIT, bool WIN>
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
      sq[j * LD + col0 + 32u * k] = (u16)h2;
      if constexpr (SPLIT)
        sql[j * LD + col0 + 32u * k] = (u16)pack2(f16_t(), f_sub(v, lo_of(f16_t(), h2)), 0.0f);
    }
    if (lane == 0u) {
      s_rsc[j] = rs.score;
      s_lim[j] = live ? token_limit(W, tok, P.causal) : 0u;
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

template <int D>
struct VlRaw {
  u32 w[D / 8];   // the row's codes (0 unless state 1)
  u32 sc[D / 64];  // its scale row (D/16 bytes)
  u32 state;      // 0: zeros, 1: read, 2: bad page, 3: read for its scales only
};

template <int D>
FP4C_DEVICE void vl_load(const VlSeq& S, u32 key, u32 end, VlRaw<D>& R) {
  const u32 side = (threadIdx.x & 31u) >> 4;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) R.w[i] = 0u;
#pragma unroll
  for (int i = 0; i < D / 64; ++i) R.sc[i] = 0u;
  R.state = 0u;
  // swizzled V scales: the 4 rows of a 4-token block hold the scales of all 4 tokens (and
  // T % 4 == 0: the block lies in one page)
  const bool want = key < end || (S.swizzle && (key & ~3u) < end);
  if (!want) return;
  const u32 pe = fdiv(key, S.fT), t = key - pe * S.fT.d;
  const i64 id = load_id(S, pe);
  if (!page_ok(S, id)) {
    if (key < end) {
      R.state = 2u;
      if (t == 0u && side == 0u) count_bad_block(S);
    }
    return;
  }
  const u8* base = S.buffer + id * S.page_bytes + side * S.side_bytes;
  const u32 row = S.h * S.row_h + t * S.row_t;
  const u8* p = base + (u64)row * (D / 2);
  if (key >= end) {
    // read for its scales only (other lanes' swizzled V scales): codes stay 0
  } else if (S.vec16) {
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
      const U32x4 a = ldg16(p + 16 * i);
      R.w[4 * i] = a.x;
      R.w[4 * i + 1] = a.y;
      R.w[4 * i + 2] = a.z;
      R.w[4 * i + 3] = a.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) R.w[i] = ldg_u32(p + 4 * i);
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

// ---------------------------------------------------------------------------------------
// decode: the lane's row to f16 in the warp's tile (K rows 0..15, V rows 16..31); `stage`
// is the warp's [2][16][D/16] scale staging.  nan_key: smallest key of a bad page (its K
// and V decode to 0); s_vnan[grp]: smallest key whose V group grp is stored as NaN (it
// decodes to 0; the rows that see that key get NaN in the group's 16 columns at the end).
// ---------------------------------------------------------------------------------------
template <int D, int LD>
FP4C_DEVICE void vl_decode(const VlRaw<D>& R, u32 key, u32 swizzle, u8* stage, u16* tile,
                           u32& nan_key, u32* s_vnan) {
  constexpr int G = D / 16, SW = D / 64;
  const u32 lane = threadIdx.x & 31u, t = lane & 15u, side = lane >> 4;
  u32* mine = (u32*)(stage + (side * 16u + t) * G);
#pragma unroll
  for (int i = 0; i < SW; ++i) mine[i] = R.sc[i];
  __syncwarp();
  u32 sb[SW];  // this key's scale bytes, group order
  if (side == 1u && swizzle) {
#pragma unroll
    for (int i = 0; i < SW; ++i) sb[i] = 0u;
#pragma unroll
    for (int grp = 0; grp < G; ++grp) {
      u32 ts, gs;
      v_scale_swizzle(t, grp, grp / (G / 4), G / 4, ts, gs);
      sb[grp >> 2] |= (u32)stage[(16u + ts) * G + gs] << (8 * (grp & 3));
    }
  } else {
#pragma unroll
    for (int i = 0; i < SW; ++i) sb[i] = mine[i];
  }
  __syncwarp();  // the staging is read before the next step writes it
  const bool live = R.state == 1u;
  if (R.state == 2u) nan_key = min(nan_key, key);
  u16* dst = tile + (side * 16u + t) * LD;
#pragma unroll
  for (int grp = 0; grp < G; ++grp) {
    u32 sbyte = live ? (sb[grp >> 2] >> (8 * (grp & 3))) & 0xFFu : 0u;
    if (side == 1u && (sbyte & 0x7Fu) == 0x7Fu) {
      atomicMin(&s_vnan[grp], key);
      sbyte = 0u;
    }
    const u32 sf = pair_scale(sbyte * 0x0101u);
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
      *(U32x4*)(dst + 8 * w) = o;
    }
  }
}

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
// One warp, NTL decoded tiles of 16 keys (tile j: keys key0 + j * kstride .., at smem
// address tiles + j * tile_bytes, K rows then V rows): scores, softmax, P.V for the warp's
// 16 rows (lane rows g, g + 8).  lim: the rows' key limits (split end included); rs: score
// scales.
// ---------------------------------------------------------------------------------------
template <int D>
struct VlRowState {
  float m[2], l[2];
  float o[D / 8][4];
};

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
  float alpha[2];
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
        pa[j][2 * nt + r] = pack2(f16_t(), p0, p1);  // a0 / a1: keys 0..7, a2 / a3: 8..15
      }
    st.l[r] = f_fma(st.l[r], alpha[r], sum);
  }
  // rescale O only when a row maximum of the warp moved (else every alpha is 1)
  if (__any_sync(0xFFFFFFFFu, moved)) {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      st.o[i][0] = f_mul(st.o[i][0], alpha[0]);
      st.o[i][1] = f_mul(st.o[i][1], alpha[0]);
      st.o[i][2] = f_mul(st.o[i][2], alpha[1]);
      st.o[i][3] = f_mul(st.o[i][3], alpha[1]);
    }
  }
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
// merge: the KW warps of each row block into s_o (f32, natural d order, rows padded by one
// float) and the rows' (M, L) into s_M, s_L; a row that sees the CTA's nan_key gets L = NaN,
// one that sees s_vnan[grp] NaN in group grp's columns
// ---------------------------------------------------------------------------------------
template <int D, int MW>
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
  __syncthreads();
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
    __syncthreads();
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
  __syncthreads();
}


// ---------------------------------------------------------------------------------------
// finish: with splits, write the partial and let the last CTA of the (sequence, KV head)
// merge the partials (atomic ticket, reset by that CTA); then write out and lse
// ---------------------------------------------------------------------------------------
template <typename T, int D, int ROWS, int THREADS>
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
    if (!merge_splits<D, THREADS, FP4C_VARLEN_MAX_SPLITS>(S, s_o, s_M, s_L, s_w, s_flag))
      return;
  }
  const RowMap R = row_map(P, W.h, W.qs0, W.n);
  write_rows<T, D, THREADS>(R, W.r0, W.rows_here, s_o, s_M, s_L, P.out_scale, out, lse);
}

// ---------------------------------------------------------------------------------------
// One work item: a (sequence, KV head, query tile, split) unit
// ---------------------------------------------------------------------------------------
template <typename T, int D, int MW, bool WIN>
FP4C_DEVICE void varlen_item(u32 item, const void* __restrict__ q, const void* __restrict__ qsl,
                             const void* __restrict__ tables, const void* __restrict__ seq_lens,
                             void* __restrict__ out, float* __restrict__ lse,
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
  const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, g = lane >> 2;
  const u32 mw = warp / A::KW, kw = warp - mw * A::KW;
  u8* s_kv = smem;                        // W decoded tiles [K 16 x LD | V 16 x LD] f16
  u8* s_sc = smem + A::KV;                // W x [2][16][D/16] scale rows
  u16* sq = (u16*)(smem + A::KV + A::SC);  // q hi [ROWS][LD] (then lo)
  u16* sql = sq + ROWS * LD;
  if (threadIdx.x == 0) s_nan = FP4C_VL_NOKEY;
  if (threadIdx.x < (u32)A::G) s_vnan[threadIdx.x] = FP4C_VL_NOKEY;
  load_q<T, D, ROWS, LD, A::W, SPLIT, WIN>(q, W, P, sq, sql, s_rsc, s_lim);
  __syncthreads();

  // ---- this lane's rows: limits (split end included), score scales, q fragments ---------
  u32 lim[2];
  float rs[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const u32 row = 16u * mw + g + 8u * r;
    lim[r] = min(s_lim[row], W.s1);
    rs[r] = s_rsc[row];
  }
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
  st.m[0] = st.m[1] = FP4C_NEG_INF;
  st.l[0] = st.l[1] = 0.0f;
#pragma unroll
  for (int i = 0; i < A::NT; ++i) st.o[i][0] = st.o[i][1] = st.o[i][2] = st.o[i][3] = 0.0f;
  u32 nan_key = FP4C_VL_NOKEY;

  // ---- the steps: load (one step ahead), decode, scores / softmax / P.V -----------------
  const u32 my_key = 16u * warp + (lane & 15u);
  u8* my_stage = s_sc + warp * (2 * 16 * A::G);
  u16* my_tile = (u16*)(s_kv + warp * A::TILE);
  const u32 kv_s = smem_u32(s_kv);
  // the keys read from the pages: [s0, nv_end); the window's from nv_end on (a 16-key tile
  // is one or the other: ws is a multiple of the block size, itself of 16)
  const u32 nv_end = WIN ? min(W.s1, window_start(P, S, W.len)) : W.s1;
  VlRaw<D> R;
  if (W.s0 < W.s1) vl_load<D>(S, W.s0 + my_key, nv_end, R);
  // WIN: phase 0 takes the steps wholly before the window (the plain kernel's loop), phase
  // 1 the others, whose tiles at or past nv_end are window tiles
  u32 step = W.s0;
#pragma unroll
  for (int phase = 0; phase < (WIN ? 2 : 1); ++phase) {
    for (; WIN && phase == 0 ? step + A::STEP <= nv_end : step < W.s1; step += A::STEP) {
      const u32 tile0 = step + 16u * warp;
      if (WIN && phase == 1 && tile0 >= nv_end && tile0 < W.s1)  // warp-uniform
        vl_window<D, LD>(P, S, step + my_key, W.s1, my_tile, s_vnan);
      else
        vl_decode<D, LD>(R, step + my_key, P.swizzle, my_stage, my_tile, nan_key, s_vnan);
      if (step + A::STEP < W.s1) vl_load<D>(S, step + A::STEP + my_key, nv_end, R);
      // warp (mw, kw) computes tiles kw, kw + KW, ... of the step (MW = 1: its own tile),
      // NTL of them per vl_tiles call
      if constexpr (MW == 1) __syncwarp(); else __syncthreads();
#pragma unroll
      for (int hc = 0; hc < A::NCALL; ++hc) {
        const u32 t0 = kw + (u32)(hc * A::NTL * A::KW);  // the call's first tile
        if (step + 16u * t0 < wmax)
          vl_tiles<D, A::NTL, LD, SPLIT, A::QREG>(kv_s + t0 * A::TILE, A::KW * A::TILE,
                                                  step + 16u * t0, 16u * A::KW, wmax, qaddr,
                                                  qladdr, qf, qlf, lim, rs, st);
      }
      if constexpr (MW == 1) __syncwarp(); else __syncthreads();
    }
  }
#pragma unroll
  for (int o = 1; o <= 16; o <<= 1) nan_key = min(nan_key, __shfl_xor_sync(0xFFFFFFFFu, nan_key, o));
  if (lane == 0u && nan_key != FP4C_VL_NOKEY) atomicMin(&s_nan, nan_key);
  __syncthreads();

  float(*s_o)[D + 1] = reinterpret_cast<float(*)[D + 1]>(s_kv);
  vl_merge_warps<D, MW>(st, s_o, s_m, s_l, s_lim, s_nan, s_vnan, s_M, s_L);
  // the split weights take q's place (q is no longer read)
  static_assert(ROWS * FP4C_VARLEN_MAX_SPLITS * 4 <= A::QB, "split weights in q's place");
  float(*s_w)[FP4C_VARLEN_MAX_SPLITS] = reinterpret_cast<float(*)[FP4C_VARLEN_MAX_SPLITS]>(sq);
  vl_finish<T, D, ROWS, A::THREADS>(W, P, s_o, s_M, s_L, s_w, s_flag, out, lse);
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
                                  float* __restrict__ lse, const VarlenParams& P) {
  using A = VlDims<D, MW, T::kBytes == 4>;
  u32 dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  // the host sized it by _abi.varlen_smem_bytes: it must be this layout
  if (dyn < (u32)A::SMEM || P.smem != (u32)A::SMEM) __trap();
  for (u32 item = blockIdx.x; item < P.items; item += gridDim.x) {
    varlen_item<T, D, MW, WIN>(item, q, qsl, tables, seq_lens, out, lse, P);
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
           void* __restrict__ out, float* __restrict__ lse, const VarlenParams params) {     \
    varlen_attn_impl<T, D, MW, (WIN) != 0>(q, qsl, tables, seq_lens, out, lse, params);      \
  }

#ifdef FP4C_INSTANTIATIONS
FP4C_INSTANTIATIONS
#endif
