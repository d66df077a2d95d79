// fp4cache: fused paged attention for few query rows that reads the NVFP4 pages directly
// (vLLM layout, spec section 4), sm_80+ (mma.sync), no CUDA headers.  Decode:
//
//   out[b, h] = softmax(sm_scale * q[b, h] . K^T) . V   over the first seq_lens[b] tokens
//
// with K, V the values gather_dequant returns (E2M1 code * E4M3 scale * global scale).
// A CTA's rows are (query token, query head) pairs of one sequence and KV head (RowMap in
// attn_seq.cuh): decode has the group's query heads of one token; with query_start_loc
// (PagedKVCache.attention: speculative verification, the few-row sequences of a mixed
// batch) the n tokens x group heads of a sequence, n * group <= 8 (kernels without _wide),
// 16 (_wide) or 32 (_wide4: 16-bit q, D <= 128), each row with its bottom-right causal key
// limit.  Each page byte is read and decoded once per (sequence, KV head) whatever the
// number of rows.
//
// Steps (each a function below): load q (load_q, rotated by the Hadamard transform when
// the cache rotates K: hadamard_quarter_rows); per chunk of keys (walk_chunks: a cp.async ring;
// walk_tiles: registers) scores (trans_scores), online softmax (trans_softmax), P.V
// (trans_pv); the keys of the exact window (walk_exact: exact_scores, trans_softmax,
// exact_pv); merge the warps (merge_warps), write the split's partial and merge the
// splits (write_partial, merge_splits), write out (write_rows).
//
// Exact window (docs/window.md, block_size % 16 == 0): a sequence's keys [ws, len) are
// read from its window slots (bf16 K and V, window_seq finds ws: the longest run of its
// last win_pages pages that are mapped) instead of the NVFP4 pages, in the same pass: the
// NVFP4 walk of a split [s0, s1) stops at min(s1, ws), then its warps walk the exact
// 16-token tiles [max(s0, ws), s1) into the same online softmax (ws is a multiple of 16).
// Without a window (win_pages = 0) ws = len and nothing else runs.
//
// Work split (flash-decoding): one CTA of FP4C_ATTN_WARPS warps per (split, KV head,
// sequence).  A split is split_len consecutive tokens (a multiple of 16 * max(CH, 2) *
// warps); warp w of the CTA walks the chunks of CH 16-token tiles w, w + warps, ... of its
// split (CH by head_dim from fp4cache/_abi.py, see "Chunk ring" below; one tile per step
// for block sizes that are not a multiple of 16) with its own online softmax state (m, l,
// O).  The CTA merges its warps in shared memory; with one split that is the result,
// otherwise it writes a partial (m, l, O) to the workspace and the last CTA of the
// (sequence, KV head) to finish (an atomic ticket in `counters`, reset by that CTA so that
// CUDA-graph replays work) merges the partials of the splits that hold tokens.  No host
// synchronization, no allocation.
//
// Tensor cores: mma.sync.m16n8k16 with f16 inputs and f32 accumulation, transposed so that
// the rows are the MMAs' n side (nothing padded to 16): S^T = K Q^T (A = a 16-token K tile,
// m16 = tokens, decoded once; B = q, n8 = rows, loaded once; NC = 1, 2 or 4 n8 tiles) and
// O^T += V^T P^T (A = the V tile, m16 = 16 d values; B = P^T, taken from S^T's accumulator
// registers by movmatrix.trans).
// A dot product over d does not change when d is permuted in both q and K, the token
// order inside a tile is free as long as S, P and V agree, and the output's d order is
// undone when it is written.  So every lane reads CONTIGUOUS bytes of the page rows:
//   K: lane (g = lane/4, c = lane%4) holds K of the tile's tokens kt0 = 4(g/2) + g%2 and
//      kt0 + 2, bytes c*D/8 .. (c+1)*D/8 - 1 of each token's row (D/4 values, D/64 scale
//      groups).  Each 32-bit word of 8 codes makes two k-steps; q's fragment is permuted
//      the same way once.
//   V: lane (g, c) holds tokens 4c .. 4c+3 (logical tokens 2c, 2c+1, 2c+8, 2c+9 of the
//      P.V step, which is also where S's accumulator puts them) and bytes g*D/16 ..
//      (g+1)*D/16 - 1 of each (D/8 values).  With swizzled V scales the 4 scale bytes of
//      tokens 4c .. 4c+3 of one group are contiguous (one 32-bit load).
// Loads: with block_size % 16 == 0 every tile lies in one page and each warp streams its
// tiles (chunks) through a cp.async ring in shared memory (a stage is the tile's 16 rows
// of this head as in the page), then reads its lane's bytes from there; other block
// sizes (kernels without _paged16) look up each token's page and load into registers one tile
// ahead.  Layout (HND / NHD), V-scale swizzle and the index widths of block_tables and
// seq_lens are run-time parameters (row strides and flags in AttnParams).
// E2M1 -> f16 without tables, by bit moves (and on sm_89+ the E4M3 -> f16 conversion
// instruction): see attn_dequant.cuh.
//
// q is converted to f16 once per row with a power-of-two scale (max |q| lands in
// [2^14, 2^15)), exact for bf16 inputs whose components are within 2^29 of the row's
// largest; float32 q is split into f16 hi + lo parts (two MMAs), error ~2^-22.
//
// Bad block ids (outside [0, num_blocks)) among the pages a sequence uses: nothing is
// read from them, the CTA's partial gets l = NaN (so the outputs of that (sequence, KV
// head) are NaN) and the CTA of KV head 0 that holds the page's first token adds 1 to
// stats[3] (once per used block-table entry and call, as gather_dequant counts its pages).
#include "fp4_common.cuh"
#include "paged_layout.cuh"
#include "attn_ptx.cuh"
#include "attn_dequant.cuh"
#include "attn_seq.cuh"
#include "attn_state.cuh"
#include "attn_epilogue.cuh"
#include "hadamard.cuh"

#define FP4C_ATTN_THREADS (32 * FP4C_ATTN_WARPS)
// minimum resident CTAs per SM (register budget) by head_dim, loader, n8 tiles of rows and
// float32 q (one tile: D = 128 with 3 and 5 CTAs, D = 64 with 5, D = 256 with 3 measured
// and dropped; two: the accumulators double, D = 128 with 3 and 4 measured and dropped,
// D = 64 with 4 against 3 measured faster for 16-bit q (float32 q's second MMA spills
// there); four: q's fragments in shared memory, the O accumulators alone 128 registers at
// D = 128; see docs/kernels.md, "Alternatives measured and not taken")
#define FP4C_ATTN_MINB(D, PAGED16, TILES, SPLIT)                             \
  ((TILES) == 4   ? ((D) == 64 ? 2 : 1)                                      \
   : (TILES) == 2 ? ((D) == 64 ? ((SPLIT) ? 3 : 4) : (D) == 128 ? 2 : 1)     \
                  : (D) == 64 ? 4 : (D) == 128 ? ((PAGED16) ? 4 : 3) : 1)
// lazy softmax maximum: the slack in log2 units (weights up to 2^8, see trans_softmax)
#define FP4C_ATTN_SLACK 8.0f
// the running maximum of a column before its first key: finite, so that the weights of
// masked keys (-inf scores) and the rescale factor of the first key are 2^-inf = 0 with no
// guard, even for a column that sees no key in a chunk or at all (its l stays 0, and rows
// with l = 0 are written as 0 and lse = -inf); far below any score (|q.k| < 2^40 in f16).
#define FP4C_ATTN_M0 (-1e30f)

// Every non-pointer argument is one by-value struct, AttnParams, generated from
// fp4cache/_abi.py (with the host's layout checks).

// ---------------------------------------------------------------------------------------
// Geometry of one head_dim: HeadDims (attn_seq.cuh) and this kernel's lane layout
// ---------------------------------------------------------------------------------------
template <int D>
struct AttnDims : HeadDims<D> {
  static constexpr int KW = D / 32;   // words of K codes per lane and token
  static constexpr int KG = D / 64;   // K scale bytes per lane and token
  static constexpr int VW = D / 64;   // words of V codes per lane and token
  static constexpr int D16 = D / 16;  // m16 tiles of O^T = V^T P^T
  static constexpr int VG = D == 256 ? 2 : 1;  // V scale groups per lane
};

// Tile row of the first of lane g's two K tokens (the other is 2 rows further): rows g,
// g + 8 of S^T's accumulator, see "K:" in the header comment.
FP4C_DEVICE u32 k_token0(u32 g) { return 4u * (g >> 1) + (g & 1u); }

// Raw registers of one 16-token tile for one lane.
template <int D>
struct TileRaw {
  u32 k[2][AttnDims<D>::KW];  // K codes of tokens kt0, kt0 + 2
  u32 ks[2];                  // their K scale bytes (KG bytes each)
  u32 v[4][AttnDims<D>::VW];  // V codes of tokens 4c .. 4c + 3
  u32 vs[AttnDims<D>::VG];    // V scale bytes: byte e = token 4c + e (0 past the length)
  u32 bad;                    // a used page id was out of range
};

// The sequence's pages (attn_seq.cuh) and its length: the CTA of KV head 0 counts bad ids.
struct SeqCtx : AttnSeq {
  u32 len;  // keys of the sequence (seq_lens[b], clamped to the row's capacity)
};

// Page (K side) and row of token i < len (kernels without _paged16: each token's page
// looked up); ok = false for a bad id (then `page` is the pool's first page, never read).
FP4C_DEVICE const u8* token_page(const SeqCtx& S, u32 i, u32& t, bool& ok) {
  const u32 pe = fdiv(i, S.fT);
  t = i - pe * S.fT.d;
  const i64 id = load_id(S, pe);
  ok = page_ok(S, id);
  return S.buffer + (ok ? id : 0) * S.page_bytes;
}

template <int D>
FP4C_DEVICE void load_tile(const SeqCtx& S, u32 tile, TileRaw<D>& R) {
  using A = AttnDims<D>;
  const u32 lane = threadIdx.x & 31u, g = lane >> 2, c = lane & 3u;
  R.bad = 0u;
  // K: tokens kt0, kt0 + 2, bytes c*D/8 of the row
  const u32 kt0 = k_token0(g);
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const u32 i = tile + kt0 + 2u * q;
#pragma unroll
    for (int w = 0; w < A::KW; ++w) R.k[q][w] = 0u;
    R.ks[q] = 0u;
    if (i < S.len) {
      u32 t;
      bool ok;
      const u8* page = token_page(S, i, t, ok);
      if (ok) {
        const u32 row = S.h * S.row_h + t * S.row_t;
        const u8* p = page + (u64)row * (D / 2) + c * (D / 8);
        if constexpr (A::KW == 2) {
          const U32x2 a = ldg8(p);
          R.k[q][0] = a.x;
          R.k[q][1] = a.y;
        } else {
#pragma unroll
          for (int w4 = 0; w4 < A::KW / 4; ++w4) {
            const U32x4 a = ldg16(p + 16 * w4);
            R.k[q][4 * w4] = a.x;
            R.k[q][4 * w4 + 1] = a.y;
            R.k[q][4 * w4 + 2] = a.z;
            R.k[q][4 * w4 + 3] = a.w;
          }
        }
        const u8* sp = page + S.data_bytes + (u64)row * A::G + c * A::KG;
        R.ks[q] = A::KG == 1 ? ldg_u8(sp) : A::KG == 2 ? ldg_u16(sp) : ldg_u32(sp);
      } else {
        R.bad = 1u;
        if (t == 0u && c == 0u) count_bad_block(S);
      }
    }
  }
  // V: tokens 4c .. 4c+3, bytes g*D/16 of the row
  u32 t0 = 0u;
  const u8* vpage0 = S.buffer;
  bool ok0 = false;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const u32 i = tile + 4u * c + e;
#pragma unroll
    for (int w = 0; w < A::VW; ++w) R.v[e][w] = 0u;
    if (e == 0) {
#pragma unroll
      for (int j = 0; j < A::VG; ++j) R.vs[j] = 0u;
    }
    if (i < S.len) {
      u32 t;
      bool ok;
      const u8* vside = token_page(S, i, t, ok) + S.side_bytes;
      if (e == 0) {
        t0 = t;
        vpage0 = vside;
        ok0 = ok;
      }
      if (ok) {
        const u32 row = S.h * S.row_h + t * S.row_t;
        const u8* p = vside + (u64)row * (D / 2) + g * (D / 16);
        if constexpr (A::VW == 1) {
          R.v[e][0] = ldg_u32(p);
        } else if constexpr (A::VW == 2) {
          const U32x2 a = ldg8(p);
          R.v[e][0] = a.x;
          R.v[e][1] = a.y;
        } else {
          const U32x4 a = ldg16(p);
          R.v[e][0] = a.x;
          R.v[e][1] = a.y;
          R.v[e][2] = a.z;
          R.v[e][3] = a.w;
        }
        if (!S.swizzle) {
          const u8* sp = vside + S.data_bytes + (u64)row * A::G;
#pragma unroll
          for (int j = 0; j < A::VG; ++j) {
            const u32 grp = D == 64 ? g >> 1 : g * A::VG + j;
            R.vs[j] |= ldg_u8(sp + grp) << (8 * e);
          }
        }
      } else {
        R.bad = 1u;
      }
    }
  }
  if (S.swizzle && ok0) {
    // tokens 4c .. 4c+3 share a page (T % 4 == 0, tiles start at multiples of 16) and
    // t0 % 4 == 0: their 4 scale bytes of one group are contiguous
    const u32 nval = min(S.len - (tile + 4u * c), 4u);  // >= 1 since token 4c is used
    const u32 keep = nval >= 4u ? 0xFFFFFFFFu : (1u << (8u * nval)) - 1u;
#pragma unroll
    for (int j = 0; j < A::VG; ++j) {
      const u32 grp = D == 64 ? g >> 1 : g * A::VG + j;
      u32 ts, gs;
      v_scale_swizzle(t0, grp, grp / (A::G / 4), A::G / 4, ts, gs);
      const u8* sp = vpage0 + S.data_bytes + (u64)(S.h * S.row_h + ts * S.row_t) * A::G + gs;
      R.vs[j] = ldg_u32(sp) & keep;
    }
  }
}

// ---------------------------------------------------------------------------------------
// A stage of the shared-memory ring (block_size % 16 == 0) holds one tile: its 16 rows of
// this head as in the page, [K data 16 x D/2 | K scales 16 x S | V data | V scales] (the
// V-scale swizzle stays inside each 4-row block, so the 16 rows hold every scale of the
// tile's tokens).
// ---------------------------------------------------------------------------------------
template <int D>
struct Stage {
  static constexpr int KD = 0, KS = 8 * D, VD = 9 * D, VS = 17 * D, kBytes = 18 * D;
  static constexpr int kChunks = D / 64;  // 16-byte data chunks per lane and side
};

// This lane's page-relative source offsets for a tile starting at row 0 of its page:
// data chunks lane + 32 k of the 16 x D/2 block, and scale row lane % 16 (K for lanes
// 0..15, V for 16..31; side_bytes included).
template <int D>
struct CopyOffs {
  u32 d[Stage<D>::kChunks];
  u32 sc;
};

template <int D>
FP4C_DEVICE CopyOffs<D> copy_offsets(const SeqCtx& S) {
  const u32 lane = threadIdx.x & 31u;
  CopyOffs<D> C;
#pragma unroll
  for (int k = 0; k < Stage<D>::kChunks; ++k) {
    const u32 q = lane + 32u * k, row = q / (D / 32), col = q % (D / 32);
    C.d[k] = (S.h * S.row_h + row * S.row_t) * (D / 2) + col * 16u;
  }
  const u32 row = lane & 15u;
  C.sc = (lane >= 16u ? (u32)S.side_bytes : 0u) + (u32)S.data_bytes +
         (S.h * S.row_h + row * S.row_t) * (D / 16);
  return C;
}

// ---------------------------------------------------------------------------------------
// Chunk ring (block_size % 16 == 0): a warp
// takes CH consecutive tiles (a chunk) per step, so the online-softmax bookkeeping (row
// maxima, shuffles, rescale) is paid once per 16 * CH tokens, and every address it needs
// is a per-lane constant computed once plus the tile's page.
// ---------------------------------------------------------------------------------------
template <int D>
struct ChunkDims {
  static constexpr int CH = D == 64    ? FP4C_ATTN_CHUNK_TILES_D64   // tiles per chunk
                            : D == 128 ? FP4C_ATTN_CHUNK_TILES_D128  // (fp4cache/_abi.py)
                                       : FP4C_ATTN_CHUNK_TILES_D256;
  static_assert(CH >= 1 && CH <= 4, "tiles per chunk");
  static constexpr int kBytes = CH * Stage<D>::kBytes;  // one ring stage
};
// Two stages: one chunk in flight while one is computed (a third overflows the 48 KB of
// static shared memory at D = 128 and measured no faster at D = 64).
#define FP4C_ATTN_CHUNK_STAGES 2

// Per-lane constant offsets: page-relative sources of the lane's first data copy and of
// its scale copy (t0 = 0; data chunk k is 512 * row_t bytes further, the V side
// side_bytes), their stage-relative destinations, and the stage-relative offsets of what
// the lane reads.
template <int D>
struct ChunkLane {
  u32 src_k0, src_s;
  u32 dst_s;  // the K (lanes 0..15) or V (16..31) scale row of this lane
  u32 rk, rks, rv, rvs[AttnDims<D>::VG];
};

template <int D>
FP4C_DEVICE ChunkLane<D> chunk_lane(const SeqCtx& S) {
  using A = AttnDims<D>;
  const u32 lane = threadIdx.x & 31u, g = lane >> 2, c = lane & 3u;
  const CopyOffs<D> C = copy_offsets<D>(S);
  ChunkLane<D> L;
  L.src_k0 = C.d[0];
  L.src_s = C.sc;
  L.dst_s = (lane >= 16u ? Stage<D>::VS : Stage<D>::KS) + (lane & 15u) * (D / 16);
  const u32 kt0 = k_token0(g);
  L.rk = Stage<D>::KD + kt0 * (D / 2) + c * (D / 8);
  L.rks = Stage<D>::KS + kt0 * A::G + c * A::KG;
  L.rv = Stage<D>::VD + (4u * c) * (D / 2) + g * (D / 16);
#pragma unroll
  for (int j = 0; j < A::VG; ++j) {
    const u32 grp = D == 64 ? g >> 1 : g * A::VG + j;
    if (S.swizzle) {
      u32 ts, gs;
      v_scale_swizzle(4u * c, grp, grp / (A::G / 4), A::G / 4, ts, gs);
      L.rvs[j] = Stage<D>::VS + ts * A::G + gs;
    } else {
      L.rvs[j] = Stage<D>::VS + (4u * c) * A::G + grp;
    }
  }
  return L;
}

// Page and first row of a tile (T % 16 == 0): the page's index, FP4C_BAD_PAGE for a
// block id outside [0, num_blocks) (the host keeps num_blocks below it).
struct TileSrc {
  u32 page, t0;
};
#define FP4C_BAD_PAGE 0xFFFFFFFFu
FP4C_DEVICE u32 page_index(const SeqCtx& S, i64 id) {
  return page_ok(S, id) ? (u32)id : FP4C_BAD_PAGE;
}

// The block-table entries of the CH tiles of the chunk at key cs and each tile's first
// row; tiles at or past `end` read nothing (a multiple of 16 <= the row's capacity).  As
// block ids (RAW false: ptxas sign-extends each entry right after its load, so the warp
// waits for it there), or as loaded (RAW: the two- and four-tile forms, whose waits there
// 2 CTAs per SM do not hide; made ids where the chunk is issued, tile_src)
template <int CH, bool RAW>
struct ChunkIds {
  i64 id[CH];
  u32 t0[CH];
};
template <int CH>
struct ChunkIds<CH, true> {
  IdWords w[CH];
  u32 t0[CH];
};
template <int CH>
FP4C_DEVICE TileSrc tile_src(const SeqCtx& S, const ChunkIds<CH, false>& C, int j) {
  return TileSrc{page_index(S, C.id[j]), C.t0[j]};
}
template <int CH>
FP4C_DEVICE TileSrc tile_src(const SeqCtx& S, const ChunkIds<CH, true>& C, int j) {
  return TileSrc{page_index(S, id_of(S, C.w[j])), C.t0[j]};
}
template <int CH, bool RAW>
FP4C_DEVICE ChunkIds<CH, RAW> chunk_ids(const SeqCtx& S, u32 cs, u32 end) {
  ChunkIds<CH, RAW> C;
  u32 pe = fdiv(cs, S.fT), t0 = cs - pe * S.fT.d;  // one division, then row steps of 16
#pragma unroll
  for (int j = 0; j < CH; ++j) {
    if (j > 0) {
      t0 += 16u;
      if (t0 == S.fT.d) {
        t0 = 0u;
        ++pe;
      }
    }
    if constexpr (RAW) {
      C.w[j] = IdWords{0u, 0u};
      if (cs + 16u * j < end) C.w[j] = load_id_words(S, pe);
    } else {
      C.id[j] = cs + 16u * j < end ? load_id(S, pe) : 0;
    }
    C.t0[j] = t0;
  }
  return C;
}

// Copies of one tile into the stage at shared address `dst` (zeros and bad = 1 for an id
// outside the pool, counted once per block-table entry, by KV head 0).
template <int D>
FP4C_DEVICE void issue_tile_lane(const SeqCtx& S, const ChunkLane<D>& L, const TileSrc& ts,
                                 u32 dst, u32& bad) {
  const bool ok = ts.page != FP4C_BAD_PAGE;
  if (!ok) {
    bad = 1u;
    if (ts.t0 == 0u && (threadIdx.x & 31u) == 0u) count_bad_block(S);
  }
  const u32 n = ok ? 16u : 0u;
  // the tile's first data row: every copy is this address plus a per-lane constant
  const u32 toff = ts.t0 * S.row_t * (D / 2);  // and the scale rows: toff / 8
  const u64 page = (u64)S.buffer + (u64)(ok ? ts.page : 0u) * (u64)(u32)S.page_bytes;
  const u64 k0 = page + (L.src_k0 + toff);  // the lane's first K chunk
  const u64 v0 = k0 + (u64)S.side_bytes;
  const u32 lane = threadIdx.x & 31u, kstep = 512u * S.row_t;  // chunk k: 32 lanes later
#pragma unroll
  for (int k = 0; k < Stage<D>::kChunks; ++k) {
    const u32 q = lane + 32u * k;
    cp_async<16>(dst + Stage<D>::KD + q * 16u, (const void*)(k0 + k * kstep), n);
    cp_async<16>(dst + Stage<D>::VD + q * 16u, (const void*)(v0 + k * kstep), n);
  }
  constexpr int SB = D / 16;
  cp_async<SB>(dst + L.dst_s, (const void*)(page + (L.src_s + toff / 8u)), ok ? (u32)SB : 0u);
}

// The lane's K registers of the tile at `st` (what load_tile loads into registers).
template <int D>
FP4C_DEVICE void read_k(const ChunkLane<D>& L, const u8* st, u32 (&k)[2][AttnDims<D>::KW],
                        u32 (&ks)[2]) {
  using A = AttnDims<D>;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const u8* p = st + L.rk + q * D;  // token kt0 + 2q: two rows of D/2 bytes further
    if constexpr (A::KW == 2) {
      const U32x2 a = *(const U32x2*)p;
      k[q][0] = a.x;
      k[q][1] = a.y;
    } else {
#pragma unroll
      for (int w = 0; w < A::KW; w += 4) {
        const U32x4 a = *(const U32x4*)(p + 4 * w);
        k[q][w] = a.x;
        k[q][w + 1] = a.y;
        k[q][w + 2] = a.z;
        k[q][w + 3] = a.w;
      }
    }
    const u8* sp = st + L.rks + q * 2 * A::G;
    ks[q] = A::KG == 1 ? (u32)*sp : A::KG == 2 ? (u32)*(const u16*)sp : *(const u32*)sp;
  }
}

// The lane's V registers of the tile at `st`; scale bytes of tokens at or past `lim` are
// zeroed (their rows hold stale or unwritten bytes).
template <int D>
FP4C_DEVICE void read_v(const SeqCtx& S, const ChunkLane<D>& L, const u8* st, u32 tile, u32 lim,
                        bool full, u32 (&v)[4][AttnDims<D>::VW], u32 (&vs)[AttnDims<D>::VG]) {
  using A = AttnDims<D>;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const u8* p = st + L.rv + e * (D / 2);
    if constexpr (A::VW == 1) {
      v[e][0] = *(const u32*)p;
    } else if constexpr (A::VW == 2) {
      const U32x2 a = *(const U32x2*)p;
      v[e][0] = a.x;
      v[e][1] = a.y;
    } else {
      const U32x4 a = *(const U32x4*)p;
      v[e][0] = a.x;
      v[e][1] = a.y;
      v[e][2] = a.z;
      v[e][3] = a.w;
    }
  }
#pragma unroll
  for (int j = 0; j < A::VG; ++j) {
    const u8* sp = st + L.rvs[j];
    vs[j] = S.swizzle ? *(const u32*)sp
                      : (u32)sp[0] | ((u32)sp[A::G] << 8) | ((u32)sp[2 * A::G] << 16) |
                            ((u32)sp[3 * A::G] << 24);
  }
  if (!full) {
    const u32 first = tile + 4u * ((threadIdx.x & 31u) & 3u);
    const u32 nval = lim > first ? min(lim - first, 4u) : 0u;
    const u32 keep = nval >= 4u ? 0xFFFFFFFFu : (1u << (8u * nval)) - 1u;
#pragma unroll
    for (int j = 0; j < A::VG; ++j) vs[j] &= keep;
  }
}

// d index of the lo (half 0) or hi (half 1) value of K pair p of word w of chunk c
template <int D>
FP4C_DEVICE u32 k_pair_d(u32 c, int w, int p, int half) {
  return c * (D / 4) + 8 * w + pair_nibble(p, half);
}

// ---------------------------------------------------------------------------------------
// Steps on one tile or chunk, shared by the chunk ring and the register loop.  Lane
// (g, c) holds, in each n8 tile nc of the MMAs' n side, the rows 8 nc + 2 c + k (k = 0,
// 1): its 2 NC "columns" col = 2 nc + k.
// ---------------------------------------------------------------------------------------
// q as the B operand of S^T = K Q^T: per k-step j and n8 tile nc, the two registers of row
// g + 8 nc (the d permutation of K: k_pair_d); float32 q: the lo parts of a second MMA.
// Four n8 tiles (16-bit q only), and two at D = 256 with 16-bit q, keep them in shared
// memory, one copy per CTA (every warp has the same rows): pair (j, nc) of lane l at
// sh[(j NC + nc) 32 + l], read where used (in registers, 64 at D = 128 with four tiles and
// at D = 256 with two, they spill beside the O accumulators; two tiles at D <= 128 keep
// them in registers, as fast, docs/kernels.md).
template <int D, int NC, bool SPLIT>
struct QFrag {
  static constexpr bool kShared = !SPLIT && (NC == 4 || (NC == 2 && D == 256));
  static_assert(NC != 4 || !SPLIT, "four n8 tiles: 16-bit q only");
  u32 hi[kShared ? 1 : AttnDims<D>::KS][kShared ? 1 : NC][2];
  u32 lo[SPLIT ? AttnDims<D>::KS : 1][NC][2];
  const U32x2* sh;  // kShared: this lane's pair (0, 0)
  // the hi registers of k-step j, n8 tile nc
  FP4C_DEVICE U32x2 b(int j, int nc) const {
    if constexpr (kShared) return sh[(j * NC + nc) * 32];
    else return U32x2{hi[j][nc][0], hi[j][nc][1]};
  }
};
// Shared memory of QFrag::kShared, in 32-bit words (one word for the other forms)
template <int D, int NC, bool SPLIT>
FP4C_DEVICE constexpr int q_shared_words() {
  return QFrag<D, NC, SPLIT>::kShared ? AttnDims<D>::KS * NC * 64 : 1;
}

// The warp's online-softmax state of its columns.
template <int D, int NC>
struct RowState {
  float m[2 * NC], l[2 * NC];  // running maximum (log2, from FP4C_ATTN_M0), denominator
  float rsc[2 * NC];           // score scale of the column's row (log2 domain)
  u32 lim[2 * NC];             // the column's keys are below lim (split end, causal mask)
  u32 lim_all;                 // keys below it are seen by every row (no mask needed)
  float o[AttnDims<D>::D16][NC][4];  // O^T accumulators (d on the m16 side)
  u32 bad;                           // a used page id was out of range
};

// N consecutive q values at src as float32 (0 where !use): 16-byte loads when q is 16-byte
// aligned (vec), else one load per value; every load is issued before any is used.
template <typename T, int N>
FP4C_DEVICE void load_q_slice(const char* src, bool use, bool vec, float (&x)[N]) {
  constexpr int kWords = N * T::kBytes / 4;
  static_assert(kWords % 4 == 0, "whole 16-byte pieces");
  if (vec) {
    u32 w[kWords];
#pragma unroll
    for (int i = 0; i < kWords; i += 4) {
      U32x4 a{0u, 0u, 0u, 0u};
      if (use) a = ldg16(src + 4 * i);
      w[i] = a.x;
      w[i + 1] = a.y;
      w[i + 2] = a.z;
      w[i + 3] = a.w;
    }
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      if constexpr (T::kBytes == 4) {
        x[i] = __uint_as_float(w[i]);
      } else {
        x[2 * i] = lo_of(T(), w[i]);
        x[2 * i + 1] = hi_of(T(), w[i]);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = use ? load_one(T(), src + k * T::kBytes) : 0.0f;
  }
}

// load q: row g + 8 nc of the lane's n8 tiles (rotated when `rotate`: hadamard_quarter_rows,
// hadamard.cuh, without the normalization, which is in the host's qk_scale),
// scaled by a power of two per row (max |q| lands in [2^14, 2^15)) and rounded to f16
// (float32 q: hi + lo); the column's score scale (qk_scale with that power undone) goes to
// St.rsc.  Lane (g, c) needs exactly the D/4 values d = c D/4 .. (c+1) D/4 - 1 of its rows
// (k_pair_d), loaded once, all at once (one round trip: the loads of a short sequence's CTA
// are its latency, docs/kernels.md).
// QFrag::kShared: warp 0 writes the fragments to s_q (q_shared_words); the caller's
// barrier orders them before any warp's first read.
template <typename T, int D, int NC, bool SPLIT>
FP4C_DEVICE void load_q(const void* __restrict__ q, const RowMap& R, float qk_scale, u32 rotate,
                        u32* s_q, QFrag<D, NC, SPLIT>& Q, RowState<D, NC>& St) {
  using A = AttnDims<D>;
  using QF = QFrag<D, NC, SPLIT>;
  const u32 lane = threadIdx.x & 31u, g = lane >> 2, c = lane & 3u;
  Q.sh = reinterpret_cast<const U32x2*>(s_q) + lane;
  float x[NC][D / 4], rsc[NC];
  const bool vec = ((u64)q & 15u) == 0u;  // q's rows and slices are 16-byte multiples
#pragma unroll
  for (int nc = 0; nc < NC; ++nc) {
    const u32 row = g + 8u * nc;
    const char* src = (const char*)q + (row_of(R, row < R.rows ? row : 0u) * D + c * (D / 4)) *
                                           T::kBytes;
    load_q_slice<T, D / 4>(src, row < R.rows, vec, x[nc]);
  }
  if (rotate) {
#pragma unroll
    for (int nc = 0; nc < NC; ++nc) hadamard_quarter_rows<D>(x[nc]);
  }
#pragma unroll
  for (int nc = 0; nc < NC; ++nc) {
    float mx = 0.0f;
#pragma unroll
    for (int k = 0; k < D / 4; ++k) mx = f_max(mx, f_abs(x[nc][k]));
    mx = f_max(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
    mx = f_max(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
    const QRowScale rs = q_row_scale(mx, qk_scale);
    const float qscale = rs.q;
    rsc[nc] = rs.score;
#pragma unroll
    for (int j = 0; j < A::KS; ++j) {
      const int w = j >> 1, p0 = 2 * (j & 1);
#pragma unroll
      for (int pp = 0; pp < 2; ++pp) {
        // x[k] is d = c D/4 + k
        const float lo = f_mul(x[nc][k_pair_d<D>(0u, w, p0 + pp, 0)], qscale);
        const float hi = f_mul(x[nc][k_pair_d<D>(0u, w, p0 + pp, 1)], qscale);
        const u32 h2 = pack2(f16_t(), lo, hi);
        if constexpr (QF::kShared) {
          if (threadIdx.x < 32u) s_q[((j * NC + nc) * 32 + lane) * 2 + pp] = h2;
        } else {
          Q.hi[j][nc][pp] = h2;
        }
        if constexpr (SPLIT)
          Q.lo[j][nc][pp] = pack2(f16_t(), f_sub(lo, lo_of(f16_t(), h2)),
                                  f_sub(hi, hi_of(f16_t(), h2)));
      }
    }
  }
  // column 2 nc + k is row 8 nc + 2 c + k, whose scale lives in lanes g = 2 c + k
#pragma unroll
  for (int nc = 0; nc < NC; ++nc) {
    St.rsc[2 * nc] = __shfl_sync(0xFFFFFFFFu, rsc[nc], 8u * c);
    St.rsc[2 * nc + 1] = __shfl_sync(0xFFFFFFFFu, rsc[nc], 8u * c + 4u);
  }
}

// scores: S^T = K Q^T of one tile: A rows g, g+8 = the lane's tokens kt0, kt0 + 2 (codes
// kw, scale bytes ks), decoded once for the NC n8 tiles of q.
template <int D, int NC, bool SPLIT>
FP4C_DEVICE void trans_scores(const u32 (&kw)[2][AttnDims<D>::KW], const u32 (&ks)[2],
                              const QFrag<D, NC, SPLIT>& Q, float (&sT)[NC][4]) {
  using A = AttnDims<D>;
#pragma unroll
  for (int nc = 0; nc < NC; ++nc) sT[nc][0] = sT[nc][1] = sT[nc][2] = sT[nc][3] = 0.0f;
  u32 sfk[2][A::KG];
#pragma unroll
  for (int qq = 0; qq < 2; ++qq) {
#pragma unroll
    for (int k = 0; k < A::KG; k += 2) {
      const u32 two = A::KG == 1 ? (ks[qq] & 0xFFu) * 0x0101u : ks[qq] >> (8 * k);
      const u32 sf = pair_scale(two);
      if (A::KG == 1) {
        sfk[qq][0] = sf;
      } else {
        sfk[qq][k] = __byte_perm(sf, 0u, 0x1010u);
        sfk[qq][k + 1] = __byte_perm(sf, 0u, 0x3232u);
      }
    }
  }
#pragma unroll
  for (int w = 0; w < A::KW; ++w) {
    u32 e0[4], e1[4];
    e2m1_pairs(kw[0][w], e0);
    e2m1_pairs(kw[1][w], e1);
    const u32 sf0 = sfk[0][w >> 1], sf1 = sfk[1][w >> 1];
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int j = 2 * w + h2, p0 = 2 * h2;
      const u32 a0 = hmul2(e0[p0], sf0), a1 = hmul2(e1[p0], sf1);
      const u32 a2 = hmul2(e0[p0 + 1], sf0), a3 = hmul2(e1[p0 + 1], sf1);
#pragma unroll
      for (int nc = 0; nc < NC; ++nc) {
        const U32x2 b = Q.b(j, nc);
        mma_f16(sT[nc], a0, a1, a2, a3, b.x, b.y);
        if constexpr (SPLIT) mma_f16(sT[nc], a0, a1, a2, a3, Q.lo[j][nc][0], Q.lo[j][nc][1]);
      }
    }
  }
}

// Scores of column col of a chunk in the log2 domain; when !full, keys at or past `lim`
// masked to -inf.
template <int CH, int NC>
FP4C_DEVICE void chunk_scores(const float (&sT)[CH][NC][4], int col, float rsc, u32 first,
                              u32 lim, bool full, float (&x)[CH][2]) {
  const u32 g = (threadIdx.x & 31u) >> 2;
  const u32 kt0 = k_token0(g);
#pragma unroll
  for (int j = 0; j < CH; ++j) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      x[j][r] = f_mul(sT[j][col >> 1][2 * r + (col & 1)], rsc);
      if (!full && first + 16u * j + kt0 + 2u * r >= lim) x[j][r] = FP4C_NEG_INF;
    }
  }
}
// New running maximum m of a column from the chunk's scores x (max over the 8 lanes g);
// the factor 2^(old - new) for what was summed before; moved |= the maximum changed.
template <int CH>
FP4C_DEVICE float row_max_update(const float (&x)[CH][2], float& m, bool& moved) {
  float tmax = FP4C_NEG_INF;
#pragma unroll
  for (int j = 0; j < CH; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) tmax = f_max(tmax, x[j][r]);
  tmax = f_max(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, 4));
  tmax = f_max(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, 8));
  tmax = f_max(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, 16));
  const float mn = f_max(m, tmax);
  const float alpha = a_ex2(f_sub(m, mn));
  moved |= __float_as_uint(mn) != __float_as_uint(m);
  m = mn;
  return alpha;
}
// Weights p = 2^(x - m) of a column; l = l * alpha + their sum.
template <int CH>
FP4C_DEVICE void row_weights(const float (&x)[CH][2], float m, float alpha, float& l,
                             float (&p)[CH][2]) {
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < CH; ++j) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      p[j][r] = a_ex2(f_sub(x[j][r], m));
      sum = f_add(sum, p[j][r]);
    }
  }
  l = f_fma(l, alpha, sum);
}

// softmax: online softmax over CH consecutive tiles from key `first` (full: every key of
// the chunk is below every column's lim): (m, l) of the lane's columns across the 8 lanes
// g, O^T rescaled when a maximum moved, and P^T of each tile as the B operand (rows =
// keys g, g+8 x columns, transposed).  Lazy maximum (kLazy): while no score of the chunk
// exceeds the running maximum by more than FP4C_ATTN_SLACK (log2 domain), m stays and the
// chunk skips the max reduction (shuffles), the rescale and its ex2: the weights are then
// up to 2^SLACK = 256, exact in the math (softmax does not depend on the reference) and
// far inside f16 and f32 range.  m only ever grows, so no weight exceeds 2^SLACK.
template <int D, int CH, int NC>
FP4C_DEVICE void trans_softmax(const float (&sT)[CH][NC][4], u32 first, bool full,
                               RowState<D, NC>& St, u32 (&pb)[CH][NC][2]) {
  constexpr int NCOL = 2 * NC;
  constexpr bool kLazy = D >= 128;  // measured: 1-3 % faster at D 128 / 256, 1 % slower at 64
  float pp[NCOL][CH][2], alpha[NCOL];
  bool moved = false;
  if constexpr (!kLazy) {
    // columns one after the other (fewer live registers): maximum, weights, sum
#pragma unroll
    for (int k = 0; k < NCOL; ++k) {
      float x[CH][2];
      chunk_scores<CH, NC>(sT, k, St.rsc[k], first, St.lim[k], full, x);
      alpha[k] = row_max_update<CH>(x, St.m[k], moved);
      row_weights<CH>(x, St.m[k], alpha[k], St.l[k], pp[k]);
    }
  } else {
    float x[NCOL][CH][2];
    bool grow = false;
#pragma unroll
    for (int k = 0; k < NCOL; ++k) {
      alpha[k] = 1.0f;
      chunk_scores<CH, NC>(sT, k, St.rsc[k], first, St.lim[k], full, x[k]);
      const float cap = f_add(St.m[k], FP4C_ATTN_SLACK);  // M0 while nothing was seen
      // (never true since m starts at FP4C_ATTN_M0, but ptxas schedules the loop 3 %
      // faster with it: 109.2 against 112.2 us at B=8 x 32768 on the H200)
      grow |= is_neg_inf(St.m[k]);
#pragma unroll
      for (int j = 0; j < CH; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          grow |= f_gt(x[k][j][r], cap);  // false for NaN scores (they stay NaN weights)
    }
    if (__any_sync(0xFFFFFFFFu, grow)) {
#pragma unroll
      for (int k = 0; k < NCOL; ++k) alpha[k] = row_max_update<CH>(x[k], St.m[k], moved);
    }
#pragma unroll
    for (int k = 0; k < NCOL; ++k)
      row_weights<CH>(x[k], St.m[k], alpha[k], St.l[k], pp[k]);
  }
  if (__any_sync(0xFFFFFFFFu, moved)) {
#pragma unroll
    for (int i = 0; i < AttnDims<D>::D16; ++i)
#pragma unroll
      for (int nc = 0; nc < NC; ++nc)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          St.o[i][nc][e] = f_mul(St.o[i][nc][e], alpha[2 * nc + (e & 1)]);
  }
#pragma unroll
  for (int j = 0; j < CH; ++j)
#pragma unroll
    for (int nc = 0; nc < NC; ++nc)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        pb[j][nc][r] = movmatrix_trans(pack2(f16_t(), pp[2 * nc][j][r], pp[2 * nc + 1][j][r]));
}

// P.V: O^T += V^T P^T of one tile: A = the lane's V codes v (tokens 4c .. 4c+3) and scale
// bytes vs, decoded once for the NC n8 tiles; B = P^T (pb); m-tile i = 4w + 2hh + k, rows
// g / g+8 = pairs 2k / 2k+1.
template <int D, int NC>
FP4C_DEVICE void trans_pv(const u32 (&v)[4][AttnDims<D>::VW], const u32 (&vs)[AttnDims<D>::VG],
                          const u32 (&pb)[NC][2], float (&o)[AttnDims<D>::D16][NC][4]) {
#pragma unroll
  for (int w = 0; w < AttnDims<D>::VW; ++w) {
    const u32 sc = vs[D == 256 ? (w >> 1) : 0];
    const u32 sab = pair_scale(sc);
    const u32 scd = pair_scale(sc >> 16);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      u32 eab[4], ecd[4];
      e2m1_pairs(v_pair_word(v[0][w], v[1][w], hh), eab);
      e2m1_pairs(v_pair_word(v[2][w], v[3][w], hh), ecd);
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int i = 4 * w + 2 * hh + k;
        const u32 a0 = hmul2(eab[2 * k], sab), a1 = hmul2(eab[2 * k + 1], sab);
        const u32 a2 = hmul2(ecd[2 * k], scd), a3 = hmul2(ecd[2 * k + 1], scd);
#pragma unroll
        for (int nc = 0; nc < NC; ++nc) mma_f16(o[i][nc], a0, a1, a2, a3, pb[nc][0], pb[nc][1]);
      }
    }
  }
}

// One chunk (CH tiles from key cs, its bytes at `st`) of the chunk ring.
template <int D, int NC, bool SPLIT>
FP4C_DEVICE void attend_chunk(const SeqCtx& S, const ChunkLane<D>& L, const u8* st, u32 cs,
                              u32 s1, const QFrag<D, NC, SPLIT>& Q, RowState<D, NC>& St) {
  using A = AttnDims<D>;
  constexpr int CH = ChunkDims<D>::CH;
  const bool full = cs + 16u * CH <= St.lim_all;  // warp-uniform
  float sT[CH][NC][4];
#pragma unroll
  for (int j = 0; j < CH; ++j) {
    u32 kw[2][A::KW], ks[2];
    read_k<D>(L, st + j * Stage<D>::kBytes, kw, ks);
    trans_scores<D, NC, SPLIT>(kw, ks, Q, sT[j]);
  }
  u32 pb[CH][NC][2];
  trans_softmax<D, CH, NC>(sT, cs, full, St, pb);
#pragma unroll
  for (int j = 0; j < CH; ++j) {
    u32 vw[4][A::VW], vsc[A::VG];
    read_v<D>(S, L, st + j * Stage<D>::kBytes, cs + 16u * j, s1, cs + 16u * CH <= s1, vw, vsc);
    trans_pv<D, NC>(vw, vsc, pb[j], St.o);
  }
}

// One tile held in registers (the loop for block sizes that are not a multiple of 16).
template <int D, int NC, bool SPLIT>
FP4C_DEVICE void attend_tile(const TileRaw<D>& R, u32 tile, const QFrag<D, NC, SPLIT>& Q,
                             RowState<D, NC>& St) {
  float sT[1][NC][4];
  u32 pb[1][NC][2];
  trans_scores<D, NC, SPLIT>(R.k, R.ks, Q, sT[0]);
  trans_softmax<D, 1, NC>(sT, tile, tile + 16u <= St.lim_all, St, pb);
  trans_pv<D, NC>(R.v, R.vs, pb[0], St.o);
  St.bad |= R.bad;
}

// ---------------------------------------------------------------------------------------
// The exact window (docs/window.md; block_size % 16 == 0): keys [ws, len) of a sequence
// are read from its window slots (bf16 K and V rows, (S, 2, T, H, D) token-major) instead
// of the NVFP4 pages, in the lane layouts of the NVFP4 tiles (header comment): K of tokens
// kt0, kt0 + 2, d = c D/4 .. (c+1) D/4 - 1, V of tokens 4c .. 4c + 3, d = g D/8 .. (g+1)
// D/8 - 1.  Each value is multiplied into the units of the decoded NVFP4 values (kmul,
// vmul: the host's win_k_mul = 2^-PAIR_SCALE_SHIFT / k_scale, win_v_mul likewise, times
// the route's 1 / FP4C_ROUTE_UNSCALE), so that the score and output scales apply to both,
// and rounded to f16, saturated to +-65504 (f16x2_sat).  A NaN K value makes its key's
// scores NaN through the MMA (masked keys are -inf after it); V values of a group part
// holding a NaN are zeroed and the smallest such key of each group kept (vn): the columns
// whose rows see it get NaN in the group's 16 outputs after the walk (a masked row's
// weight 0 times NaN would be NaN in the shared P.V MMA).
// ---------------------------------------------------------------------------------------
struct WinSeq {
  const u16* win;  // the slots, at this KV head (+ h * D)
  const int* map;  // block id -> slot
  u32 slots;       // slots in the pool
  u32 ws;          // keys [ws, len) are exact (ws = len: none)
  u32 last;        // the sequence's last page
  u32 slot;        // lane j < 32: the slot of page last - j (where it is in the window)
  u32 hd;          // H * D: values per token row of a slot side
  float kmul, vmul;
};

// The window of the sequence, by every lane of the warp (one page per lane and a ballot):
// the longest run of its last pages, at most win_pages, whose ids are in range and mapped
// to a slot in [0, slots).  A split whose keys end before the last win_pages pages reads
// nothing (ws = len).
template <int D>
FP4C_DEVICE WinSeq window_seq(const AttnParams& P, const SeqCtx& S, u32 s1) {
  WinSeq W;
  W.ws = S.len;
  W.slot = 0u;
  if (P.win_pages == 0u || S.len == 0u) return W;  // (the plain path: nothing else)
  const u32 T = S.fT.d;
  const u32 n = fdiv(S.len - 1u, S.fT) + 1u;  // pages of the sequence
  const u32 np = min(P.win_pages, n);
  if (s1 <= (n - np) * T) return W;
  W.win = (const u16*)P.win + S.h * D;
  W.map = (const int*)P.win_map;
  W.slots = P.win_slots;
  W.last = n - 1u;
  W.hd = P.H * D;
  W.kmul = f_mul(P.win_k_mul, 1.0f / FP4C_ROUTE_UNSCALE);
  W.vmul = f_mul(P.win_v_mul, 1.0f / FP4C_ROUTE_UNSCALE);
  const u32 lane = threadIdx.x & 31u;
  u32 run = 0u;
  for (u32 j0 = 0u; j0 < np; j0 += 32u) {
    bool ok = false;
    if (j0 + lane < np) {
      const i64 id = load_id(S, W.last - j0 - lane);
      if (page_ok(S, id)) {
        const u32 sl = (u32)W.map[id];
        ok = sl < W.slots;
        if (j0 == 0u) W.slot = sl;
      }
    }
    const u32 m = __ballot_sync(0xFFFFFFFFu, ok);  // lanes from 0 up: the run
    const u32 k = m == 0xFFFFFFFFu ? 32u : (u32)(__ffs(~m) - 1);
    run += k;
    if (k < 32u) break;
  }
  if (run > 0u) W.ws = (n - run) * T;
  return W;
}

// The slot of window page pe (warp-uniform); ok = false only if the map changed under us
// (pages more than 32 from the end are looked up again).
FP4C_DEVICE u32 window_slot(const SeqCtx& S, const WinSeq& W, u32 pe, bool& ok) {
  const u32 j = W.last - pe;
  if (j < 32u) {
    ok = true;
    return __shfl_sync(0xFFFFFFFFu, W.slot, j);
  }
  const i64 id = load_id(S, pe);
  ok = page_ok(S, id);
  const u32 sl = ok ? (u32)W.map[id] : 0u;
  ok = ok && sl < W.slots;
  return sl;
}

// bf16 value i of a lane's row words (two per word, lo first), as float32 (exact)
template <int N>
FP4C_DEVICE float bf16_at(const u32 (&w)[N], int i) {
  return (i & 1) ? hi_of(bf16_t(), w[i >> 1]) : lo_of(bf16_t(), w[i >> 1]);
}

// N bf16 values (N / 2 words) of a slot row from p; zeros where !use
template <int N>
FP4C_DEVICE void load_win_row(const u16* p, bool use, u32 (&w)[N / 2]) {
#pragma unroll
  for (int i = 0; i < N / 2; i += 4) {
    U32x4 a{0u, 0u, 0u, 0u};
    if (use) a = ldg16(p + 2 * i);
    w[i] = a.x;
    w[i + 1] = a.y;
    w[i + 2] = a.z;
    w[i + 3] = a.w;
  }
}

// The lane's exact K (tokens kt0, kt0 + 2) and V (tokens 4c .. 4c + 3) of the tile at key
// `tile` (row t0 of its page, in slot `slot`); tokens at or past s1 read as 0.
template <int D>
FP4C_DEVICE void load_exact_k(const WinSeq& W, u32 T, u32 slot, u32 t0, u32 tile, u32 s1,
                              u32 (&k)[2][D / 8]) {
  const u32 lane = threadIdx.x & 31u, kt0 = k_token0(lane >> 2), c = lane & 3u;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const u32 t = kt0 + 2u * q;
    const u16* p = W.win + ((u64)slot * 2u * T + t0 + t) * W.hd + c * (D / 4);
    load_win_row<D / 4>(p, tile + t < s1, k[q]);
  }
}
template <int D>
FP4C_DEVICE void load_exact_v(const WinSeq& W, u32 T, u32 slot, u32 t0, u32 tile, u32 s1,
                              u32 (&v)[4][D / 16]) {
  const u32 lane = threadIdx.x & 31u, g = lane >> 2, c = lane & 3u;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const u32 t = 4u * c + e;
    const u16* p = W.win + ((u64)(slot * 2u + 1u) * T + t0 + t) * W.hd + g * (D / 8);
    load_win_row<D / 8>(p, tile + t < s1, v[e]);
  }
}

// Groups (parts of 16 values) of the lane's V words: one, two at D = 256
template <int D>
struct WinGroups {
  static constexpr int N = D == 256 ? 2 : 1;
  static constexpr int kWords = D / 16 / N;  // words of one group part
};

// V NaN: zero the NaN values of the lane's V words and keep the smallest key whose group
// part holds one (vn[j], group part j).
template <int D>
FP4C_DEVICE void exact_v_nan(u32 (&v)[4][D / 16], u32 tile, u32 (&vn)[WinGroups<D>::N]) {
  using WG = WinGroups<D>;
  const u32 c = threadIdx.x & 3u;
#pragma unroll
  for (int e = 0; e < 4; ++e)
#pragma unroll
    for (int j = 0; j < WG::N; ++j) {
      u32 any = 0u;
#pragma unroll
      for (int i = 0; i < WG::kWords; ++i) {
        u32& x = v[e][j * WG::kWords + i];
        // bit 15 / 31 set where |bf16| > inf's pattern 0x7F80: a NaN half
        const u32 nan = ((x & 0x7FFF7FFFu) + 0x007F007Fu) & 0x80008000u;
        any |= nan;
        x &= ~((nan >> 15) * 0xFFFFu);
      }
      if (any) vn[j] = min(vn[j], tile + 4u * c + e);
    }
}

// scores of an exact tile: trans_scores with the K pairs of k_pair_d taken from the bf16
// rows (times kmul) instead of decoded
template <int D, int NC, bool SPLIT>
FP4C_DEVICE void exact_scores(const u32 (&k)[2][D / 8], float kmul, const QFrag<D, NC, SPLIT>& Q,
                              float (&sT)[NC][4]) {
#pragma unroll
  for (int nc = 0; nc < NC; ++nc) sT[nc][0] = sT[nc][1] = sT[nc][2] = sT[nc][3] = 0.0f;
#pragma unroll
  for (int w = 0; w < AttnDims<D>::KW; ++w) {
    u32 a[2][4];  // token kt0 + 2q, pair p
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
      for (int p = 0; p < 4; ++p)
        a[q][p] = f16x2_sat(f_mul(bf16_at(k[q], 8 * w + pair_nibble(p, 0)), kmul),
                            f_mul(bf16_at(k[q], 8 * w + pair_nibble(p, 1)), kmul));
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int j = 2 * w + h2, p0 = 2 * h2;
#pragma unroll
      for (int nc = 0; nc < NC; ++nc) {
        const U32x2 b = Q.b(j, nc);
        mma_f16(sT[nc], a[0][p0], a[1][p0], a[0][p0 + 1], a[1][p0 + 1], b.x, b.y);
        if constexpr (SPLIT)
          mma_f16(sT[nc], a[0][p0], a[1][p0], a[0][p0 + 1], a[1][p0 + 1], Q.lo[j][nc][0],
                  Q.lo[j][nc][1]);
      }
    }
  }
}

// P.V of an exact tile: trans_pv with V^T's pairs (tokens 4c, 4c + 1 and 4c + 2, 4c + 3 of
// d and d - 1, d = 8w + 4hh + 3 - 2k) from the bf16 rows (times vmul)
template <int D, int NC>
FP4C_DEVICE void exact_pv(const u32 (&v)[4][D / 16], float vmul, const u32 (&pb)[NC][2],
                          float (&o)[AttnDims<D>::D16][NC][4]) {
  auto pair = [&](int a, int b, int d) {
    return f16x2_sat(f_mul(bf16_at(v[a], d), vmul), f_mul(bf16_at(v[b], d), vmul));
  };
#pragma unroll
  for (int w = 0; w < AttnDims<D>::VW; ++w)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int i = 4 * w + 2 * hh + k, d = 8 * w + 4 * hh + 3 - 2 * k;
        const u32 a0 = pair(0, 1, d), a1 = pair(0, 1, d - 1);
        const u32 a2 = pair(2, 3, d), a3 = pair(2, 3, d - 1);
#pragma unroll
        for (int nc = 0; nc < NC; ++nc) mma_f16(o[i][nc], a0, a1, a2, a3, pb[nc][0], pb[nc][1]);
      }
}

// After the warp's exact tiles: the smallest NaN key of each group over the lanes that
// hold its parts (c, and g ^ 1 at D = 64), then NaN in the group's outputs of the columns
// that see it (lane g holds the O^T of the d it read V for).
template <int D, int NC>
FP4C_DEVICE void window_nan_groups(u32 (&vn)[WinGroups<D>::N], RowState<D, NC>& St) {
#pragma unroll
  for (int j = 0; j < WinGroups<D>::N; ++j) {
    vn[j] = min(vn[j], __shfl_xor_sync(0xFFFFFFFFu, vn[j], 1));
    vn[j] = min(vn[j], __shfl_xor_sync(0xFFFFFFFFu, vn[j], 2));
    if (D == 64) vn[j] = min(vn[j], __shfl_xor_sync(0xFFFFFFFFu, vn[j], 4));
  }
#pragma unroll
  for (int i = 0; i < AttnDims<D>::D16; ++i)
#pragma unroll
    for (int nc = 0; nc < NC; ++nc)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (vn[D == 256 ? i >> 3 : 0] < St.lim[2 * nc + (e & 1)]) St.o[i][nc][e] = FP4C_NAN;
}

// ---------------------------------------------------------------------------------------
// Loads: the warp's keys of [s0, s1), warp w taking chunks (tiles) w, w + warps, ...
// ---------------------------------------------------------------------------------------
// block_size % 16 == 0: a cp.async ring of FP4C_ATTN_CHUNK_STAGES chunks per warp at
// `ring`; kCStages - 1 chunks in flight while one is computed, the page ids of the next
// chunk to issue read one chunk ahead (those of the warp's first chunk, `first`, before q:
// first_chunk).
template <int D>
FP4C_DEVICE u32 first_chunk_key(u32 s0) {
  return s0 + 16u * ChunkDims<D>::CH * (threadIdx.x >> 5);
}
template <int D, bool RAW>
FP4C_DEVICE ChunkIds<ChunkDims<D>::CH, RAW> first_chunk(const SeqCtx& S, u32 s0, u32 cap) {
  return chunk_ids<ChunkDims<D>::CH, RAW>(S, first_chunk_key<D>(s0), cap);
}
template <int D, int NC, bool SPLIT>
FP4C_DEVICE void walk_chunks(const SeqCtx& S, u8* ring, u32 s0, u32 s1,
                             const ChunkIds<ChunkDims<D>::CH, (NC > 1)>& first,
                             const QFrag<D, NC, SPLIT>& Q, RowState<D, NC>& St) {
  constexpr int CH = ChunkDims<D>::CH;
  constexpr int kCStages = FP4C_ATTN_CHUNK_STAGES;
  constexpr u32 kCT = 16u * CH, kCStep = kCT * FP4C_ATTN_WARPS;
  const u32 warp = threadIdx.x >> 5;
  const ChunkLane<D> L = chunk_lane<D>(S);
  const u32 ring_s = smem_u32(ring);
  u32 c_issue = first_chunk_key<D>(s0);
  // the next chunk's tiles: made at once (one n8 tile), or kept as loaded until the chunk
  // is issued (RAW)
  constexpr bool RAW = NC > 1;
  ChunkIds<CH, RAW> ids = first;
  TileSrc nxt[CH];
  auto take = [&](const ChunkIds<CH, RAW>& C) {
    if constexpr (RAW) {
      ids = C;
    } else {
#pragma unroll
      for (int j = 0; j < CH; ++j) nxt[j] = tile_src(S, C, j);
    }
  };
  take(first);
  auto issue = [&](int stg) {
    if (c_issue < s1) {
      TileSrc cur[CH];
#pragma unroll
      for (int j = 0; j < CH; ++j) cur[j] = RAW ? tile_src(S, ids, j) : nxt[j];
      if (c_issue + kCStep < s1) take(chunk_ids<CH, RAW>(S, c_issue + kCStep, s1));
#pragma unroll
      for (int j = 0; j < CH; ++j)
        if (c_issue + 16u * j < s1)
          issue_tile_lane<D>(S, L, cur[j],
                             ring_s + stg * ChunkDims<D>::kBytes + j * Stage<D>::kBytes, St.bad);
    }
    cp_async_commit();
    c_issue += kCStep;
  };
#pragma unroll
  for (int stg = 0; stg < kCStages - 1; ++stg) issue(stg);
  int stg = 0;
  for (u32 cs = s0 + kCT * warp; cs < s1; cs += kCStep) {
    issue(stg == 0 ? kCStages - 1 : stg - 1);
    cp_async_wait<kCStages - 1>();
    __syncwarp();  // every lane's copies of this stage have landed
    attend_chunk<D, NC, SPLIT>(S, L, ring + stg * ChunkDims<D>::kBytes, cs, s1, Q, St);
    __syncwarp();  // every lane has read the stage before it is refilled
    stg = stg == kCStages - 1 ? 0 : stg + 1;
  }
  cp_async_wait<0>();
}

// The exact keys [e0, s1) of the window (e0 = max(s0, ws), a multiple of 16): tile
// e0 + 16 w, + 16 warps, ... of warp w, loaded into registers (K and V together where they
// fit: D <= 128) and merged into the same online softmax.
template <int D, int NC, bool SPLIT>
FP4C_DEVICE void walk_exact(const SeqCtx& S, const WinSeq& W, u32 e0, u32 s1,
                            const QFrag<D, NC, SPLIT>& Q, RowState<D, NC>& St) {
  constexpr bool kBoth = D <= 128;
  const u32 T = S.fT.d;
  u32 vn[WinGroups<D>::N];
#pragma unroll
  for (int j = 0; j < WinGroups<D>::N; ++j) vn[j] = 0xFFFFFFFFu;
  for (u32 tile = e0 + 16u * (threadIdx.x >> 5); tile < s1; tile += 16u * FP4C_ATTN_WARPS) {
    const u32 pe = fdiv(tile, S.fT), t0 = tile - pe * T;
    bool ok;
    const u32 slot = window_slot(S, W, pe, ok);
    if (!ok) {
      St.bad = 1u;
      continue;
    }
    u32 k[2][D / 8], v[4][D / 16];
    load_exact_k<D>(W, T, slot, t0, tile, s1, k);
    if constexpr (kBoth) load_exact_v<D>(W, T, slot, t0, tile, s1, v);
    float sT[1][NC][4];
    u32 pb[1][NC][2];
    exact_scores<D, NC, SPLIT>(k, W.kmul, Q, sT[0]);
    trans_softmax<D, 1, NC>(sT, tile, tile + 16u <= St.lim_all, St, pb);
    if constexpr (!kBoth) load_exact_v<D>(W, T, slot, t0, tile, s1, v);
    exact_v_nan<D>(v, tile, vn);
    exact_pv<D, NC>(v, W.vmul, pb[0], St.o);
  }
  window_nan_groups<D, NC>(vn, St);
}

// Other block sizes: each token's page looked up, the next tile's loads in flight in
// registers while this one is computed (D = 256: one tile of registers, a second one
// would spill).
template <int D, int NC, bool SPLIT>
FP4C_DEVICE void walk_tiles(const SeqCtx& S, u32 s0, u32 s1, const QFrag<D, NC, SPLIT>& Q,
                            RowState<D, NC>& St) {
  constexpr u32 kStep = 16u * FP4C_ATTN_WARPS;
  u32 t0 = s0 + 16u * (threadIdx.x >> 5);
  if constexpr (D == 256 || NC > 1) {
    for (; t0 < s1; t0 += kStep) {
      TileRaw<D> ra;
      load_tile<D>(S, t0, ra);
      attend_tile<D, NC, SPLIT>(ra, t0, Q, St);
    }
  } else if (t0 < s1) {
    TileRaw<D> ra, rb;
    load_tile<D>(S, t0, ra);
    while (true) {
      const u32 t1 = t0 + kStep;
      if (t1 < s1) load_tile<D>(S, t1, rb);
      attend_tile<D, NC, SPLIT>(ra, t0, Q, St);
      if (t1 >= s1) break;
      const u32 t2 = t1 + kStep;
      if (t2 < s1) load_tile<D>(S, t2, ra);
      attend_tile<D, NC, SPLIT>(rb, t1, Q, St);
      if (t2 >= s1) break;
      t0 = t2;
    }
  }
}

// ---------------------------------------------------------------------------------------
// merge: the warps of the CTA in shared memory -> s_o (rows of natural d order), s_M, s_L
// (per row: the warps' largest m and the denominator; NaN when a page id was bad).  Each
// warp writes its O, scaled to the CTA's maximum, into a slab of its own (kSlabs of them:
// one per warp where they fit, MergeDims), then the slabs are summed in warp order into
// slab 0, which is s_o: two barriers after the key loop instead of one per warp.  The
// slabs overlay the chunk ring: their first write follows a barrier that every warp
// reaches after its key loop.
// ---------------------------------------------------------------------------------------
template <int D, int NC>
struct MergeDims {
  static constexpr int kSlab = 8 * NC * (D + 1) * 4;  // rows of the n8 tiles, padded by one
  static constexpr int kSlabs = FP4C_ATTN_WARPS * kSlab <= 40960 ? FP4C_ATTN_WARPS
                                : 2 * kSlab <= 40960              ? 2
                                                                   : 1;
  static_assert(FP4C_ATTN_WARPS % kSlabs == 0, "warps per slab");
  static constexpr int kBytes = kSlabs * kSlab;
};

template <int D, int NC>
FP4C_DEVICE void merge_warps(RowState<D, NC>& St, u32 rows, u8* s_raw,
                             float (*s_m)[8 * NC], float (*s_l)[8 * NC],
                             float* s_M, float* s_L, u32& s_flag) {
  using MD = MergeDims<D, NC>;
  const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3u;
  auto slab = [&](int k) { return reinterpret_cast<float(*)[D + 1]>(s_raw + k * MD::kSlab); };
#pragma unroll
  for (int k = 0; k < 2 * NC; ++k) {
    float l = St.l[k];
    l = f_add(l, __shfl_xor_sync(0xFFFFFFFFu, l, 4));
    l = f_add(l, __shfl_xor_sync(0xFFFFFFFFu, l, 8));
    l = f_add(l, __shfl_xor_sync(0xFFFFFFFFu, l, 16));
    if (g == 0u) {
      s_m[warp][8 * (k >> 1) + 2 * c + (k & 1)] = St.m[k];
      s_l[warp][8 * (k >> 1) + 2 * c + (k & 1)] = l;
    }
  }
  const bool bad = __any_sync(0xFFFFFFFFu, St.bad != 0u);
  if (threadIdx.x == 0) s_flag = 0u;
  __syncthreads();
  if (bad && lane == 0) atomicOr(&s_flag, 1u);
  float f[2 * NC];
#pragma unroll
  for (int k = 0; k < 2 * NC; ++k) {
    const u32 col = 8 * (k >> 1) + 2 * c + (k & 1);
    f[k] = warp_merge_weight<FP4C_ATTN_WARPS>(s_m, col, St.m[k]);  // (m >= M0: as grow)
  }
  float(*mine)[D + 1] = slab(warp % MD::kSlabs);
#pragma unroll
  for (int ph = 0; ph < FP4C_ATTN_WARPS / MD::kSlabs; ++ph) {
    if (warp / MD::kSlabs == (u32)ph) {
#pragma unroll
      for (int i = 0; i < AttnDims<D>::D16; ++i) {
        const int ww = i >> 2, hh = (i >> 1) & 1, k = i & 1;
        const u32 d = g * (D / 8) + 8 * ww + 4 * hh + 3 - 2 * k;  // row g; g+8: d - 1
#pragma unroll
        for (int nc = 0; nc < NC; ++nc)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float* dst = &mine[8 * nc + 2 * c + (e & 1)][d - (e >> 1)];
            const float v = f_mul(St.o[i][nc][e], f[2 * nc + (e & 1)]);
            *dst = ph == 0 ? v : f_add(*dst, v);
          }
      }
    }
    __syncthreads();
  }
  if constexpr (MD::kSlabs > 1) {
    float(*s_o)[D + 1] = slab(0);
    for (u32 k = threadIdx.x; k < rows * D; k += FP4C_ATTN_THREADS) {
      const u32 row = k / D, d = k % D;
      float v = s_o[row][d];
#pragma unroll
      for (int w = 1; w < MD::kSlabs; ++w) v = f_add(v, slab(w)[row][d]);
      s_o[row][d] = v;
    }
  }
  if (threadIdx.x < rows)
    merge_warp_row<FP4C_ATTN_WARPS>(s_m, s_l, threadIdx.x, s_flag != 0u, s_M, s_L);
  __syncthreads();
}

// ---------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------
// The CTA's sequence and rows (RowMap); false when this launch does not serve the
// sequence (no query token, or rows outside (rows_lo, rows_hi]: the other launch of a
// mixed batch).  Decode (qsl = nullptr): token b, one row per query head of the group.
FP4C_DEVICE bool seq_rows(const void* __restrict__ qsl, const AttnParams& P, u32 b, u32 h,
                          RowMap& R) {
  u32 tok0 = b, n = 1u;
  if (qsl != nullptr) {
    const QuerySpan Q = query_span(P, qsl, b);
    const i64 nq = Q.end > Q.tok0 ? Q.end - Q.tok0 : 0;
    if (!launch_rows(P, (u64)nq * P.group)) return false;  // (none when nq = 0)
    tok0 = (u32)Q.tok0;
    n = min((u32)nq, P.max_q);  // rows beyond max_query_len are not computed
  }
  R = row_map(P, h, tok0, n);
  return true;
}

// The columns' key limits for the keys below s1: St.lim (the column's row, causal) and
// St.lim_all (row 0 sees the fewest keys).
template <int D, int NC>
FP4C_DEVICE void key_limits(const RowMap& R, u32 s1, u32 len, RowState<D, NC>& St) {
  const u32 c = threadIdx.x & 3u;
  St.lim_all = min(s1, row_limit(R, 0u, len));
#pragma unroll
  for (int k = 0; k < 2 * NC; ++k)
    St.lim[k] = min(s1, row_limit(R, 8u * (k >> 1) + 2u * c + (k & 1), len));
}

// NC: n8 tiles of rows (1: up to 8 rows, 2: up to 16, 4: up to 32); PAGED16: block_size
// % 16 == 0.
// float32 q (SPLIT) runs a second MMA per k-step with q's lo parts.
template <typename T, int D, int NC, bool PAGED16>
FP4C_DEVICE void decode_attn_impl(const void* __restrict__ q, const void* __restrict__ qsl,
                                  const void* __restrict__ tables,
                                  const void* __restrict__ seq_lens, void* __restrict__ out,
                                  float* __restrict__ lse, const AttnParams& P) {
  constexpr bool SPLIT = T::kBytes == 4;
  constexpr int kRows = 8 * NC;  // the CTA's rows (padding past R.rows)
  constexpr int kRing = PAGED16 ? FP4C_ATTN_WARPS * FP4C_ATTN_CHUNK_STAGES * ChunkDims<D>::kBytes
                                : 0;
  constexpr int kEpi = kRows * (D + 1) * 4 + kRows * FP4C_ATTN_MAX_SPLITS * 4;
  constexpr int kMerge = MergeDims<D, NC>::kBytes;
  constexpr int kBuf = kRing > kEpi ? (kRing > kMerge ? kRing : kMerge)
                                    : (kEpi > kMerge ? kEpi : kMerge);
  // the chunk ring (during the key loop), then the merge slabs, then s_o (slab 0) and s_w
  // share one buffer
  __shared__ __align__(16) u8 s_raw[kBuf];
  static_assert(kRows <= FP4C_ATTN_THREADS, "a thread per row");
  float(*s_o)[D + 1] = reinterpret_cast<float(*)[D + 1]>(s_raw);  // rows padded by one
  float(*s_w)[FP4C_ATTN_MAX_SPLITS] =
      reinterpret_cast<float(*)[FP4C_ATTN_MAX_SPLITS]>(s_raw + kRows * (D + 1) * 4);
  __shared__ float s_m[FP4C_ATTN_WARPS][kRows], s_l[FP4C_ATTN_WARPS][kRows];
  __shared__ float s_M[kRows], s_L[kRows];
  __shared__ u32 s_flag;
  __shared__ __align__(16) u32 s_q[q_shared_words<D, NC, SPLIT>()];  // QFrag::kShared

  // one-dimensional grid of nsplit * H * B CTAs, split fastest
  const u32 H = P.H, nsplit = P.nsplit;
  const u32 bh = blockIdx.x / nsplit, split = blockIdx.x - bh * nsplit;
  const u32 b = bh / H, h = bh - b * H;
  RowMap R;
  if (!seq_rows(qsl, P, b, h, R)) return;
  // sequence length, clamped to the row's capacity
  const u32 len = seq_len(P, seq_lens, b);
  const i64 cap = seq_capacity(P);
  const u32 s0 = split * P.split_len;
  const u32 s1 = min(s0 + P.split_len, len);
  // the split partials of this (sequence, KV head), built where they are used (kept
  // across the key loop they cost registers: measured 1 % at B=8 x 32768)
  auto splits = [&]() {
    const u32 used = len == 0u ? 0u : (len + P.split_len - 1u) / P.split_len;
    return SplitSet{(float*)P.ws_o + (u64)bh * nsplit * P.rows_max * D,
                    (float*)P.ws_ml + (u64)bh * nsplit * P.rows_max * 2,
                    (u32*)P.counters + bh, nsplit, used, P.rows_max, R.rows};
  };

  // Latency (what a short sequence's CTA waits for): the sequence length, the block-table
  // entries of the warp's first chunk and q are loaded together, before any is used.
  const SeqCtx S{attn_seq(P, tables, b, h, h == 0u), len};
  ChunkIds<ChunkDims<D>::CH, (NC > 1)> first;
  if constexpr (PAGED16)
    first = first_chunk<D, (NC > 1)>(S, s0, cap < 0xFFFFFFFFll ? (u32)cap : ~0u);
  QFrag<D, NC, SPLIT> Q;
  RowState<D, NC> St;
  load_q<T, D, NC, SPLIT>(q, R, P.qk_scale, P.rotate, s_q, Q, St);
  if constexpr (QFrag<D, NC, SPLIT>::kShared) __syncthreads();  // s_q written
  // the window (exact keys [ws, len)); the NVFP4 keys of this split end at sw
  WinSeq W;
  u32 sw = s1;
  if constexpr (PAGED16) {
    W = window_seq<D>(P, S, s1);
    sw = min(s1, W.ws);
  }
  if (s0 < len) {
    // the columns' key limits, then the keys of this split
    key_limits<D, NC>(R, sw, len, St);
#pragma unroll
    for (int k = 0; k < 2 * NC; ++k) {
      St.m[k] = FP4C_ATTN_M0;
      St.l[k] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < AttnDims<D>::D16; ++i)
#pragma unroll
      for (int nc = 0; nc < NC; ++nc) St.o[i][nc][0] = St.o[i][nc][1] = St.o[i][nc][2] =
          St.o[i][nc][3] = 0.0f;
    St.bad = 0u;
    if constexpr (PAGED16) {
      walk_chunks<D, NC, SPLIT>(
          S, s_raw + (threadIdx.x >> 5) * (FP4C_ATTN_CHUNK_STAGES * ChunkDims<D>::kBytes), s0,
          sw, first, Q, St);
      if (sw < s1) {  // (the window's keys: the limits of the whole split)
        key_limits<D, NC>(R, s1, len, St);
        walk_exact<D, NC, SPLIT>(S, W, max(s0, W.ws), s1, Q, St);
      }
    } else {
      walk_tiles<D, NC, SPLIT>(S, s0, s1, Q, St);
    }
    merge_warps<D, NC>(St, R.rows, s_raw, s_m, s_l, s_M, s_L, s_flag);
    if (nsplit > 1u) write_partial<D, FP4C_ATTN_THREADS>(splits(), split, s_o, s_M, s_L);
  }
  if (nsplit > 1u) {
    if (!merge_splits<D, FP4C_ATTN_THREADS, FP4C_ATTN_MAX_SPLITS>(splits(), s_o, s_M, s_L, s_w,
                                                                  s_flag))
      return;
  } else if (s0 >= len) {
    // len == 0 with one split: nothing was computed
    if (threadIdx.x < kRows) {
      s_M[threadIdx.x] = FP4C_NEG_INF;
      s_L[threadIdx.x] = 0.0f;
    }
    __syncthreads();
  }
  write_rows<T, D, FP4C_ATTN_THREADS>(R, 0u, R.rows, s_o, s_M, s_L, P.out_scale, out, lse);
}

#define FP4C_ATTN_PARAMS                                                                  \
  const void *__restrict__ q, const void *__restrict__ qsl,                               \
      const void *__restrict__ tables, const void *__restrict__ seq_lens,                 \
      void *__restrict__ out, float *__restrict__ lse, const AttnParams params

// NAME, q/out value type, head_dim, TILES (n8 tiles of rows: 1, 2 or 4, up to 8, 16 or 32
// query rows), PAGED16 (block_size a multiple of 16: every tile lies in one page)
#define FP4C_ATTN_KERNEL(NAME, T, D, TILES, PAGED16)                                         \
  extern "C" __global__ void __launch_bounds__(FP4C_ATTN_THREADS,                           \
                                               FP4C_ATTN_MINB(D, PAGED16, TILES,            \
                                                              T::kBytes == 4))              \
      NAME(FP4C_ATTN_PARAMS) {                                                               \
    decode_attn_impl<T, D, TILES, PAGED16>(q, qsl, tables, seq_lens, out, lse, params);     \
  }

#ifdef FP4C_INSTANTIATIONS
FP4C_INSTANTIATIONS
#endif
