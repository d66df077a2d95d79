// fp4cache: fused paged decode attention that reads the NVFP4 pages directly
// (vLLM layout, spec section 4), sm_80+ (mma.sync), no CUDA headers.
//
//   out[b, h] = softmax(sm_scale * q[b, h] . K^T) . V   over the first seq_lens[b] tokens
//
// with K, V the values gather_dequant returns (E2M1 code * E4M3 scale * global scale).
//
// Work split (flash-decoding): one CTA of FP4C_ATTN_WARPS warps per (split, KV head,
// sequence).  A split is split_len consecutive tokens (a multiple of 16 * max(CH, 2) *
// warps); warp w of the CTA walks the 16-token tiles w, w + warps, ... of its split (groups
// of 1..8 with block_size % 16 == 0: the chunks of CH tiles w, w + warps, ..., CH by
// head_dim from fp4cache/_abi.py, see "Chunk ring" below) with its own online softmax state (m, l, O).  The CTA merges its warps in shared memory; with one split
// that is the result, otherwise it writes a partial (m, l, O) to the workspace and the
// last CTA of the (sequence, KV head) to finish (an atomic ticket in `counters`, reset
// by that CTA so that CUDA-graph replays work) merges the partials of the splits that
// hold tokens.  No host synchronization, no allocation.
//
// Tensor cores: mma.sync.m16n8k16 with f16 inputs and f32 accumulation.
//   Groups of 1..8 query heads per KV head (kernels without _wide; the trans_* steps),
//   transposed so that nothing is padded: S^T = K Q^T (A = a 16-token K tile, m16 = tokens; B = the group's q, n8 =
//   heads, loaded once) and O^T += V^T P^T (A = the V tile, m16 = 16 d values; B = P^T,
//   taken from S^T's accumulator registers by two movmatrix.trans).
//   Groups of 9..16 (_wide kernels): S = Q K^T (A = q, 16 rows), O += P V (A = P straight from S's
//   accumulator: the C layout of two n8 tiles is the A layout of one k16 step).
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
// instruction): see "NVFP4 -> f16 pairs" in attn_common.cuh.
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
#include "attn_common.cuh"

#define FP4C_ATTN_THREADS (32 * FP4C_ATTN_WARPS)
// minimum resident CTAs per SM (register budget) by head_dim (D = 128 with 3 and 5 CTAs,
// D = 64 with 5, D = 256 with 3 measured and dropped: KERNEL_NOTES, seventh and eighth
// sessions)
#define FP4C_ATTN_MINB(D, PAGED16) ((D) == 64 ? 4 : (D) == 128 ? ((PAGED16) ? 4 : 3) : 1)
// lazy softmax maximum: the slack in log2 units (weights up to 2^8, see trans_softmax)
#define FP4C_ATTN_SLACK 8.0f

// Every argument that stays the same from call to call, passed by value as one struct
// (host twin: fp4cache._cupy_attention.ATTN_PARAMS_DTYPE, same field order, align=True).
// AttnParams (every non-pointer argument) is generated from fp4cache/_abi.py.

// Host-checked table of the decode (tests/test_gpu_attention.py; a test-only kernel, built
// only by _kernels.attn_dequant_table_spec): out[(p*2 + half)*4096 + code*256 + byte] = the
// f32 value of half `half` of pair p of the word holding `code` in every nibble, times the
// scale pair of `byte`: e2m1(code) * e4m3(byte) * 2^-FP4C_PAIR_SCALE_SHIFT exactly.
// Entries are NaN where e2m1_pair and e2m1_pairs disagree or where `code` alone at nibble
// pair_nibble(p, half) does not land in that half of pair p (zeros everywhere else).
FP4C_DEVICE void attn_dequant_table(float* out) {
  const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 4096u) return;
  const u32 code = i >> 8, byte = i & 255u;
  const u32 x = code * 0x11111111u;
  const u32 sf = pair_scale(byte * 0x0101u);
  u32 e[4];
  e2m1_pairs(x, e);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    if (e[p] != e2m1_pair(x, p)) e[p] = 0xFFFFFFFFu;  // the two forms must agree (NaN)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      u32 one[4];
      e2m1_pairs(code << (4 * pair_nibble(p, half)), one);
      const u32 keep = half ? 0xFFFF0000u : 0x0000FFFFu;
      bool ok = (one[p] & keep) == (e[p] & keep) && (one[p] & ~keep) == 0u;
#pragma unroll
      for (int o = 0; o < 4; ++o) ok = ok && (o == p || one[o] == 0u);
      if (!ok) e[p] |= half ? 0x7FFF0000u : 0x00007FFFu;  // NaN in that half
    }
    const u32 v = hmul2(e[p], sf);
    out[(p * 2 + 0) * 4096 + i] = f16_bits_to_float(v & 0xFFFFu);
    out[(p * 2 + 1) * 4096 + i] = f16_bits_to_float(v >> 16);
  }
}

// ---------------------------------------------------------------------------------------
// Geometry of one head_dim
// ---------------------------------------------------------------------------------------
template <int D>
struct AttnDims {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
  static constexpr int G = D / 16;    // scales per row
  static constexpr int KS = D / 16;   // k-steps of Q.K
  static constexpr int KW = D / 32;   // words of K codes per lane and token
  static constexpr int KG = D / 64;   // K scale bytes per lane and token
  static constexpr int VW = D / 64;   // words of V codes per lane and token
  static constexpr int NT = D / 8;    // n8 tiles of P.V
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

struct SeqCtx {
  const u8* buffer;
  const void* table;  // this sequence's row of block_tables
  u64* stats;
  i64 num_blocks, page_bytes, side_bytes, data_bytes;
  FastDiv fT;
  u32 len, h, row_h, row_t, swizzle, paged16, bt64, count_bad;
};

FP4C_DEVICE i64 load_id(const SeqCtx& S, u32 e) {
  return S.bt64 ? ((const i64*)S.table)[e] : (i64)((const int*)S.table)[e];
}

// Where the tile's tokens live when a tile never crosses a page (T % 16 == 0): its page
// id and the row of its first token, read once per tile.
FP4C_DEVICE bool page_ok(const SeqCtx& S, i64 id) { return (u64)id < (u64)S.num_blocks; }
// count a bad block-table entry (the caller picks the one lane and tile that own it)
FP4C_DEVICE void count_bad_block(const SeqCtx& S) {
  if (S.count_bad) atomicAdd((unsigned long long*)S.stats + FP4C_STAT_BAD_BLOCK_IDS, 1ull);
}

struct TilePage {
  i64 id;
  u32 t0;
};

// Page (K side) and row of token i < len; ok = false for a bad id (then `page` is the
// pool's first page, never read).
FP4C_DEVICE const u8* token_page(const SeqCtx& S, u32 i, u32 tile, const TilePage& tp, u32& t,
                                 bool& ok) {
  i64 id;
  if (S.paged16) {
    t = tp.t0 + (i - tile);
    id = tp.id;
  } else {
    const u32 pe = fdiv(i, S.fT);
    t = i - pe * S.fT.d;
    id = load_id(S, pe);
  }
  ok = page_ok(S, id);
  return S.buffer + (ok ? id : 0) * S.page_bytes;
}

template <int D>
FP4C_DEVICE void load_tile(const SeqCtx& S, u32 tile, TileRaw<D>& R) {
  using A = AttnDims<D>;
  const u32 lane = threadIdx.x & 31u, g = lane >> 2, c = lane & 3u;
  R.bad = 0u;
  TilePage tp{0, 0u};
  if (S.paged16) {
    const u32 pe = fdiv(tile, S.fT);
    tp.id = load_id(S, pe);
    tp.t0 = tile - pe * S.fT.d;
  }
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
      const u8* page = token_page(S, i, tile, tp, t, ok);
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
      const u8* vside = token_page(S, i, tile, tp, t, ok) + S.side_bytes;
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
// Shared-memory tile ring (block_size % 16 == 0): each warp copies its next tiles with
// cp.async into FP4C_ATTN_STAGES(D) stages while it computes the current one, so that
// several tiles per warp are in flight without holding registers.  A stage is the tile's
// 16 rows of this head as in the page: [K data 16 x D/2 | K scales 16 x S | V data |
// V scales] (the V-scale swizzle stays inside each 4-row block, so the 16 rows hold
// every scale of the tile's tokens).
// ---------------------------------------------------------------------------------------
// (3 stages; 4 and 5 measured within 3 %: KERNEL_NOTES a3 to a5)
#define FP4C_ATTN_STAGES(D) ((D) == 256 ? 2 : 3)

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

// Issue the copies of the tile starting at `tile` (page id `id`) into stage `st`.
template <int D>
FP4C_DEVICE void issue_tile(const SeqCtx& S, const CopyOffs<D>& C, u32 tile, i64 id, u8* st,
                            u32& bad) {
  const u32 lane = threadIdx.x & 31u;
  const u32 t0 = tile - fdiv(tile, S.fT) * S.fT.d;  // row of the tile's first token
  const bool ok = page_ok(S, id);
  if (!ok) {
    bad = 1u;
    if (t0 == 0u && lane == 0u) count_bad_block(S);
  }
  const u32 n = ok ? 16u : 0u;
  const u8* page = S.buffer + (ok ? id : 0) * S.page_bytes;
  const u8* dsrc = page + (u64)(t0 * S.row_t) * (D / 2);
  const u32 sdst = smem_u32(st);
#pragma unroll
  for (int k = 0; k < Stage<D>::kChunks; ++k) {
    const u32 q = lane + 32u * k;
    cp_async<16>(sdst + Stage<D>::KD + q * 16u, dsrc + C.d[k], n);
    cp_async<16>(sdst + Stage<D>::VD + q * 16u, dsrc + S.side_bytes + C.d[k], n);
  }
  constexpr int SB = D / 16;  // scale bytes per row
  const u32 row = lane & 15u;
  cp_async<SB>(sdst + (lane >= 16u ? Stage<D>::VS : Stage<D>::KS) + row * SB,
               page + (u64)(t0 * S.row_t) * SB + C.sc, ok ? (u32)SB : 0u);
}

// The lane's registers of the tile in stage `st` (the same contents as load_tile).
template <int D>
FP4C_DEVICE void read_tile(const SeqCtx& S, const u8* st, u32 tile, TileRaw<D>& R) {
  using A = AttnDims<D>;
  const u32 lane = threadIdx.x & 31u, g = lane >> 2, c = lane & 3u;
  const u32 kt0 = k_token0(g);
  R.bad = 0u;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const u32 row = kt0 + 2u * q;
    const u8* p = st + Stage<D>::KD + row * (D / 2) + c * (D / 8);
#pragma unroll
    for (int w = 0; w < A::KW; w += 2) {
      const U32x2 a = *(const U32x2*)(p + 4 * w);
      R.k[q][w] = a.x;
      R.k[q][w + 1] = a.y;
    }
    const u8* sp = st + Stage<D>::KS + row * A::G + c * A::KG;
    R.ks[q] = A::KG == 1 ? (u32)*sp : A::KG == 2 ? (u32)*(const u16*)sp : *(const u32*)sp;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const u8* p = st + Stage<D>::VD + (4u * c + e) * (D / 2) + g * (D / 16);
    if constexpr (A::VW == 1) {
      R.v[e][0] = *(const u32*)p;
    } else {
#pragma unroll
      for (int w = 0; w < A::VW; w += 2) {
        const U32x2 a = *(const U32x2*)(p + 4 * w);
        R.v[e][w] = a.x;
        R.v[e][w + 1] = a.y;
      }
    }
  }
  const u32 nval = tile + 16u <= S.len ? 4u
                   : (S.len > tile + 4u * c ? min(S.len - (tile + 4u * c), 4u) : 0u);
  const u32 keep = nval >= 4u ? 0xFFFFFFFFu : (1u << (8u * nval)) - 1u;
#pragma unroll
  for (int j = 0; j < A::VG; ++j) {
    const u32 grp = D == 64 ? g >> 1 : g * A::VG + j;
    u32 x;
    if (S.swizzle) {
      u32 ts, gs;
      v_scale_swizzle(4u * c, grp, grp / (A::G / 4), A::G / 4, ts, gs);
      x = *(const u32*)(st + Stage<D>::VS + ts * A::G + gs);
    } else {
      const u8* sp = st + Stage<D>::VS + (4u * c) * A::G + grp;
      x = (u32)sp[0] | ((u32)sp[A::G] << 8) | ((u32)sp[2 * A::G] << 16) |
          ((u32)sp[3 * A::G] << 24);
    }
    R.vs[j] = x & keep;
  }
}

// ---------------------------------------------------------------------------------------
// Chunk ring of the transposed kernels (groups of 1..8, block_size % 16 == 0): a warp
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
FP4C_DEVICE u32 page_index(const SeqCtx& S, u32 e) {
  const i64 id = load_id(S, e);
  return page_ok(S, id) ? (u32)id : FP4C_BAD_PAGE;
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

// The lane's K registers of the tile at `st` (as read_tile).
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
// The transposed kernels' (groups of 1..8) steps on one tile, shared by the chunk ring
// and the loop of the kernels without _paged16.  Lane (g, c) tracks heads 2c and 2c+1.
// ---------------------------------------------------------------------------------------
// S^T = K Q^T of one tile: A rows g, g+8 = the lane's tokens kt0, kt0 + 2 (codes kw,
// scale bytes ks); B = q of head g (qa[.][0], [2]; float32 q: the lo parts in [1], [3]).
template <int D, bool SPLIT>
FP4C_DEVICE void trans_scores(const u32 (&kw)[2][AttnDims<D>::KW], const u32 (&ks)[2],
                              const u32 (&qa)[AttnDims<D>::KS][4], float (&sT)[4]) {
  using A = AttnDims<D>;
  sT[0] = sT[1] = sT[2] = sT[3] = 0.0f;
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
      mma_f16(sT, a0, a1, a2, a3, qa[j][0], qa[j][2]);
      if constexpr (SPLIT) mma_f16(sT, a0, a1, a2, a3, qa[j][1], qa[j][3]);
    }
  }
}

// Online softmax over CH consecutive tiles from token `first` (when !full, tokens at or
// past `lim` are masked): (mt, lt) of heads 2c, 2c+1 across the 8 lanes g, O^T rescaled
// when a row maximum moved, and P^T of each tile as the B operand (rows = tokens g, g+8 x
// heads 2c, 2c+1, transposed).  Lazy maximum (kLazy): while no score of the chunk exceeds
// the running maximum mt by more than FP4C_ATTN_SLACK (log2 domain), mt stays and the
// chunk skips the max reduction (shuffles), the rescale and its ex2: the weights are then
// up to 2^SLACK = 256, exact in the math (softmax does not depend on the reference) and
// far inside f16 and f32 range.  mt only ever grows, so no weight exceeds 2^SLACK.
// Scores of row k (head 2c + k) of a chunk in the log2 domain; tokens at or past `lim`
// masked to -inf when !full.
template <int CH>
FP4C_DEVICE void chunk_scores(const float (&sT)[CH][4], int k, float rsc, u32 first, u32 lim,
                              bool full, float (&x)[CH][2]) {
  const u32 g = (threadIdx.x & 31u) >> 2;
  const u32 kt0 = k_token0(g);
#pragma unroll
  for (int j = 0; j < CH; ++j) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      x[j][r] = f_mul(sT[j][2 * r + k], rsc);
      if (!full && first + 16u * j + kt0 + 2u * r >= lim) x[j][r] = FP4C_NEG_INF;
    }
  }
}
// New running maximum m of a row from the chunk's scores x (max over the 8 lanes g); the
// factor 2^(old - new) for what was summed before; moved |= the maximum changed.
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
// Weights p = 2^(x - m) of a row; l = l * alpha + their sum.
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

template <int D, int CH>
FP4C_DEVICE void trans_softmax(const float (&sT)[CH][4], u32 first, u32 lim, bool full,
                               const float (&rscT)[2], float (&mt)[2], float (&lt)[2],
                               float (&oT)[AttnDims<D>::D16][4], u32 (&pb)[CH][2]) {
  constexpr bool kLazy = D >= 128;  // measured: 1-3 % faster at D 128 / 256, 1 % slower at 64
  float pp[2][CH][2], alpha[2] = {1.0f, 1.0f};
  bool moved = false;
  if constexpr (!kLazy) {
    // rows one after the other (fewer live registers): maximum, weights, sum
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      float x[CH][2];
      chunk_scores<CH>(sT, k, rscT[k], first, lim, full, x);
      alpha[k] = row_max_update<CH>(x, mt[k], moved);
      row_weights<CH>(x, mt[k], alpha[k], lt[k], pp[k]);
    }
  } else {
    float x[2][CH][2];
    bool grow = false;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      chunk_scores<CH>(sT, k, rscT[k], first, lim, full, x[k]);
      const float cap = f_add(mt[k], FP4C_ATTN_SLACK);  // -inf while nothing was seen
      grow |= is_neg_inf(mt[k]);
#pragma unroll
      for (int j = 0; j < CH; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          grow |= f_gt(x[k][j][r], cap);  // false for NaN scores (they stay NaN weights)
    }
    if (__any_sync(0xFFFFFFFFu, grow)) {
#pragma unroll
      for (int k = 0; k < 2; ++k) alpha[k] = row_max_update<CH>(x[k], mt[k], moved);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) row_weights<CH>(x[k], mt[k], alpha[k], lt[k], pp[k]);
  }
  if (__any_sync(0xFFFFFFFFu, moved)) {
#pragma unroll
    for (int i = 0; i < AttnDims<D>::D16; ++i) {
      oT[i][0] = f_mul(oT[i][0], alpha[0]);
      oT[i][1] = f_mul(oT[i][1], alpha[1]);
      oT[i][2] = f_mul(oT[i][2], alpha[0]);
      oT[i][3] = f_mul(oT[i][3], alpha[1]);
    }
  }
#pragma unroll
  for (int j = 0; j < CH; ++j) {
    pb[j][0] = movmatrix_trans(pack2(f16_t(), pp[0][j][0], pp[1][j][0]));
    pb[j][1] = movmatrix_trans(pack2(f16_t(), pp[0][j][1], pp[1][j][1]));
  }
}

// O^T += V^T P^T of one tile: A = the lane's V codes v (tokens 4c .. 4c+3) and scale
// bytes vs; B = P^T (pb); m-tile i = 4w + 2hh + k, rows g / g+8 = pairs 2k / 2k+1.
template <int D>
FP4C_DEVICE void trans_pv(const u32 (&v)[4][AttnDims<D>::VW], const u32 (&vs)[AttnDims<D>::VG],
                          const u32 (&pb)[2], float (&oT)[AttnDims<D>::D16][4]) {
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
        mma_f16(oT[i], hmul2(eab[2 * k], sab), hmul2(eab[2 * k + 1], sab),
                hmul2(ecd[2 * k], scd), hmul2(ecd[2 * k + 1], scd), pb[0], pb[1]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------
// decode_attn_impl is about 600 lines, over the project's ~150 per step: its two compute
// paths (groups 1-8 transposed, 9-16 wide) and three loaders are still to be cut into the
// named steps (load, scores, softmax, P.V, merge, write) of kernels/varlen_attention.cu, with
// no loss of speed: the open part of the any-query-length issue.
// WIDE: groups of 9..16 query heads (accumulator rows g and g+8); else rows 0..7 only.
// SPLIT: float32 q as f16 hi + lo: group <= 8 puts the lo parts in rows 8..15 of A and
// adds the two accumulator rows; WIDE runs a second MMA with the lo parts.
template <typename T, int D, bool WIDE, bool PAGED16>
FP4C_DEVICE void decode_attn_impl(const void* __restrict__ q, const void* __restrict__ tables,
                                  const void* __restrict__ seq_lens, void* __restrict__ out,
                                  float* __restrict__ lse, const AttnParams& P) {
  using A = AttnDims<D>;
  constexpr bool SPLIT = T::kBytes == 4;
  constexpr int NR = WIDE ? 2 : 1;  // accumulator rows per lane
  const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3u;
  // one-dimensional grid of nsplit * H * B CTAs, split fastest
  const u32 H = P.H, group = P.group, nsplit = P.nsplit;
  const u32 bh = blockIdx.x / nsplit, split = blockIdx.x - bh * nsplit;
  const u32 b = bh / H, h = bh - b * H;

  // the tile ring (during the tile loop) and, after it, s_o and s_w share one buffer
  constexpr int kStages = FP4C_ATTN_STAGES(D);
  constexpr int kCStages = FP4C_ATTN_CHUNK_STAGES;
  constexpr int kRing = !PAGED16 ? 0
                        : !WIDE ? FP4C_ATTN_WARPS * kCStages * ChunkDims<D>::kBytes
                                : FP4C_ATTN_WARPS * kStages * Stage<D>::kBytes;
  constexpr int kEpi = 16 * (D + 1) * 4 + 16 * FP4C_ATTN_MAX_SPLITS * 4;
  __shared__ __align__(16) u8 s_raw[kRing > kEpi ? kRing : kEpi];
  // merged O (then the result); rows padded by one float against bank conflicts
  float(*s_o)[D + 1] = reinterpret_cast<float(*)[D + 1]>(s_raw);
  float(*s_w)[FP4C_ATTN_MAX_SPLITS] =
      reinterpret_cast<float(*)[FP4C_ATTN_MAX_SPLITS]>(s_raw + 16 * (D + 1) * 4);  // weights
  __shared__ float s_m[FP4C_ATTN_WARPS][16], s_l[FP4C_ATTN_WARPS][16];
  __shared__ float s_M[16], s_L[16];
  __shared__ u32 s_flag;

  // sequence length, clamped to the row's capacity
  i64 len64 = P.sl64 ? ((const i64*)seq_lens)[b] : (i64)((const int*)seq_lens)[b];
  const i64 cap = (i64)P.max_blocks * P.t.d;
  len64 = len64 < 0 ? 0 : (len64 > cap ? cap : len64);
  const u32 len = (u32)len64;
  const u32 s0 = split * P.split_len;
  const u32 s1 = min(s0 + P.split_len, len);
  const u32 qrow0 = (b * (H * group) + h * group);  // first query head of the group
  const u32 pidx = (b * H + h) * nsplit + split;

  if (s0 < len) {
    // ---- Q fragments: power-of-two scale per row, f16 (hi, lo) ---------------------
    float rsc[NR];  // score scale of each accumulator row (log2 domain)
    u32 qa[A::KS][4];
    u32 ql[WIDE && SPLIT ? A::KS : 1][4];  // WIDE float32 q: the lo parts (second MMA)
    {
      constexpr int rows = SPLIT && !WIDE ? 1 : NR;  // rows 8..15 hold lo parts if SPLIT
      float qscale[2] = {1.0f, 1.0f};
#pragma unroll
      for (int r = 0; r < rows; ++r) {
        const u32 row = g + 8u * r;
        float mx = 0.0f;
        if (row < group) {
          const char* src = (const char*)q + (u64)(qrow0 + row) * D * T::kBytes;
#pragma unroll 8
          for (int k = 0; k < D / 4; ++k)
            mx = f_max(mx, f_abs(load_one(T(), src + (c * (D / 4) + k) * T::kBytes)));
        }
        mx = f_max(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
        mx = f_max(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
        int e = 0;
        const u32 mb = __float_as_uint(mx);
        if (mb != 0u && mb < 0x7F800000u) {
          e = (int)(mb >> 23) - 127 - 14;  // mx * 2^-e in [2^14, 2^15) (normal mx)
          e = max(-100, min(100, e));
        }
        qscale[r] = __uint_as_float((u32)(127 - e) << 23);
        rsc[r] = f_mul(P.qk_scale, __uint_as_float((u32)(127 + e) << 23));
      }
#pragma unroll
      for (int j = 0; j < A::KS; ++j) {
        const int w = j >> 1, p0 = 2 * (j & 1);
#pragma unroll
        for (int f = 0; f < 4; ++f) {
          qa[j][f] = 0u;
          if constexpr (WIDE && SPLIT) ql[j][f] = 0u;
        }
#pragma unroll
        for (int r = 0; r < rows; ++r) {
          const u32 row = g + 8u * r;
          if (row >= group) continue;
          const char* src = (const char*)q + (u64)(qrow0 + row) * D * T::kBytes;
#pragma unroll
          for (int pp = 0; pp < 2; ++pp) {
            const float lo = f_mul(
                load_one(T(), src + k_pair_d<D>(c, w, p0 + pp, 0) * T::kBytes), qscale[r]);
            const float hi = f_mul(
                load_one(T(), src + k_pair_d<D>(c, w, p0 + pp, 1) * T::kBytes), qscale[r]);
            const u32 h2 = pack2(f16_t(), lo, hi);
            qa[j][2 * pp + r] = h2;  // a0a1 (pp 0, row g), a2a3 (row g+8), a4a5, a6a7
            if constexpr (SPLIT) {
              const u32 l2 = pack2(f16_t(), f_sub(lo, lo_of(f16_t(), h2)),
                                   f_sub(hi, hi_of(f16_t(), h2)));
              if constexpr (WIDE) {
                ql[j][2 * pp + r] = l2;
              } else {
                qa[j][2 * pp + 1] = l2;  // lo parts in rows 8..15
              }
            }
          }
        }
      }
    }

    SeqCtx S;
    S.buffer = (const u8*)P.buffer;
    S.table = P.bt64 ? (const void*)((const i64*)tables + (u64)b * P.max_blocks)
                     : (const void*)((const int*)tables + (u64)b * P.max_blocks);
    S.stats = (u64*)P.stats;
    S.num_blocks = P.num_blocks;
    S.page_bytes = 2 * P.side_bytes;
    S.side_bytes = P.side_bytes;
    S.data_bytes = P.data_bytes;
    S.fT = fastdiv_param(P.t);
    S.len = len;
    S.h = h;
    S.row_h = P.row_h;
    S.row_t = P.row_t;
    S.swizzle = P.swizzle;
    S.paged16 = P.paged16;
    S.bt64 = P.bt64;
    S.count_bad = h == 0u ? 1u : 0u;

    // ---- the tiles of this warp ------------------------------------------------------
    // !WIDE (groups of 1..8): S^T = K Q^T and O^T = V^T P^T, the tokens and head_dim on
    // the MMA's m16 side and the query heads on its n8 side (nothing padded); lane (g, c)
    // tracks heads 2c and 2c+1.  Else (9..16 heads) S = Q K^T, O = P V with two rows.
    float mt[2] = {FP4C_NEG_INF, FP4C_NEG_INF}, lt[2] = {0.0f, 0.0f};
    float oT[!WIDE ? A::D16 : 1][4];
#pragma unroll
    for (int i = 0; i < (!WIDE ? A::D16 : 1); ++i) oT[i][0] = oT[i][1] = oT[i][2] = oT[i][3] = 0.0f;
    float rscT[2] = {0.0f, 0.0f};
    if constexpr (!WIDE) {
      rscT[0] = __shfl_sync(0xFFFFFFFFu, rsc[0], 8u * c);       // head 2c lives in lanes g = 2c
      rscT[1] = __shfl_sync(0xFFFFFFFFu, rsc[0], 8u * c + 4u);  // head 2c + 1
    }
    float m[NR], l[NR];
    float o[!WIDE ? 1 : A::NT][4];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      m[r] = FP4C_NEG_INF;
      l[r] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < (!WIDE ? 1 : A::NT); ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    u32 bad = 0u;

    constexpr u32 kStep = 16u * FP4C_ATTN_WARPS;
    constexpr bool kPipe = D < 256;
    auto compute = [&](const TileRaw<D>& R, u32 tile) {
      if constexpr (WIDE) {
      // S = Q K^T: n8 tile q <-> K token kt0 + 2q of this lane's column g
      float s[2][4];
#pragma unroll
      for (int qq = 0; qq < 2; ++qq) {
        s[qq][0] = s[qq][1] = s[qq][2] = s[qq][3] = 0.0f;
        u32 sfk[A::KG];
        {
          const u32 ks = R.ks[qq];
#pragma unroll
          for (int k = 0; k < A::KG; k += 2) {
            const u32 two = A::KG == 1 ? (ks & 0xFFu) * 0x0101u : ks >> (8 * k);
            const u32 sf = pair_scale(two);
            if (A::KG == 1) {
              sfk[0] = sf;
            } else {
              sfk[k] = __byte_perm(sf, 0u, 0x1010u);
              sfk[k + 1] = __byte_perm(sf, 0u, 0x3232u);
            }
          }
        }
#pragma unroll
        for (int w = 0; w < A::KW; ++w) {
          const u32 x = R.k[qq][w];
          const u32 sf = sfk[w >> 1];
          u32 e[4];
          e2m1_pairs(x, e);
          const u32 b0 = hmul2(e[0], sf), b1 = hmul2(e[1], sf);
          const u32 b2 = hmul2(e[2], sf), b3 = hmul2(e[3], sf);
          const u32* a0 = qa[2 * w];
          const u32* a1 = qa[2 * w + 1];
          if (WIDE || SPLIT) {
            mma_f16(s[qq], a0[0], a0[1], a0[2], a0[3], b0, b1);
            mma_f16(s[qq], a1[0], a1[1], a1[2], a1[3], b2, b3);
          } else {
            mma_f16_top(s[qq], a0[0], a0[2], b0, b1);
            mma_f16_top(s[qq], a1[0], a1[2], b2, b3);
          }
          if constexpr (WIDE && SPLIT) {
            const u32* l0 = ql[2 * w];
            const u32* l1 = ql[2 * w + 1];
            mma_f16(s[qq], l0[0], l0[1], l0[2], l0[3], b0, b1);
            mma_f16(s[qq], l1[0], l1[1], l1[2], l1[3], b2, b3);
          }
        }
      }
      // online softmax per accumulator row; lane's tokens 4c + e, e = 0..3, are
      // s[0][0], s[0][1], s[1][0], s[1][1] (row g) and s[.][2], s[.][3] (row g+8)
      const u32 tok0 = tile + 4u * c;
      u32 pa[2][2];  // P as A fragments: [row][k half]
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        float x[4];
        if (SPLIT && !WIDE) {
          x[0] = f_add(s[0][0], s[0][2]);
          x[1] = f_add(s[0][1], s[0][3]);
          x[2] = f_add(s[1][0], s[1][2]);
          x[3] = f_add(s[1][1], s[1][3]);
        } else {
          x[0] = s[0][2 * r];
          x[1] = s[0][2 * r + 1];
          x[2] = s[1][2 * r];
          x[3] = s[1][2 * r + 1];
        }
        float tmax = FP4C_NEG_INF;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          x[e] = tok0 + e < len ? f_mul(x[e], rsc[r]) : FP4C_NEG_INF;
          tmax = f_max(tmax, x[e]);
        }
        tmax = f_max(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, 1));
        tmax = f_max(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, 2));
        const float mn = f_max(m[r], tmax);
        const float alpha = a_ex2(f_sub(m[r], mn));
        // no row of the warp has a new maximum: alpha = 1 everywhere, skip the rescale
        // (bit-pattern compare: NaN maxima never appear, f_max drops NaN)
        const bool same = __all_sync(0xFFFFFFFFu, __float_as_uint(mn) == __float_as_uint(m[r]));
        m[r] = mn;
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) p[e] = a_ex2(f_sub(x[e], mn));
        l[r] = f_fma(l[r], alpha, f_add(f_add(p[0], p[1]), f_add(p[2], p[3])));
        if (!same) {
#pragma unroll
          for (int i = 0; i < A::NT; ++i) {
            o[i][2 * r] = f_mul(o[i][2 * r], alpha);
            o[i][2 * r + 1] = f_mul(o[i][2 * r + 1], alpha);
          }
        }
        pa[r][0] = pack2(f16_t(), p[0], p[1]);
        pa[r][1] = pack2(f16_t(), p[2], p[3]);
      }
      // O += P V
#pragma unroll
      for (int w = 0; w < A::VW; ++w) {
        const u32 vs = R.vs[D == 256 ? (w >> 1) : 0];
        const u32 sab = pair_scale(vs);
        const u32 scd = pair_scale(vs >> 16);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const u32 xab = v_pair_word(R.v[0][w], R.v[1][w], hh);
          const u32 xcd = v_pair_word(R.v[2][w], R.v[3][w], hh);
          u32 eab[4], ecd[4];
          e2m1_pairs(xab, eab);
          e2m1_pairs(xcd, ecd);
#pragma unroll
          for (int pp = 0; pp < 4; ++pp) {
            const int i = 8 * w + 4 * hh + pp;
            const u32 b0 = hmul2(eab[pp], sab);
            const u32 b1 = hmul2(ecd[pp], scd);
            if (WIDE) {
              mma_f16(o[i], pa[0][0], pa[1][0], pa[0][1], pa[1][1], b0, b1);
            } else {
              mma_f16_top(o[i], pa[0][0], pa[0][1], b0, b1);
            }
          }
        }
      }
      bad |= R.bad;
      }
    };

    // One tile of the transposed kernels held in registers (kernels without _paged16).
    auto computeT = [&](const TileRaw<D>& R, u32 tile) {
      if constexpr (!WIDE) {
        float sT[1][4];
        u32 pb[1][2];
        trans_scores<D, SPLIT>(R.k, R.ks, qa, sT[0]);
        trans_softmax<D, 1>(sT, tile, s1, tile + 16u <= s1, rscT, mt, lt, oT, pb);
        trans_pv<D>(R.v, R.vs, pb[0], oT);
        bad |= R.bad;
      }
    };
    auto tile_step = [&](const TileRaw<D>& R, u32 tile) {
      if constexpr (!WIDE) {
        computeT(R, tile);
      } else {
        compute(R, tile);
      }
    };

    // One chunk (CH tiles from token cs, chunk bytes at `st`) of the transposed kernels.
    auto chunk_step = [&](const ChunkLane<D>& L, const u8* st, u32 cs) {
      if constexpr (PAGED16 && !WIDE) {
        constexpr int CH = ChunkDims<D>::CH;
        const bool full = cs + 16u * CH <= s1;  // warp-uniform
        float sT[CH][4];
#pragma unroll
        for (int j = 0; j < CH; ++j) {
          u32 kw[2][A::KW], ks[2];
          read_k<D>(L, st + j * Stage<D>::kBytes, kw, ks);
          trans_scores<D, SPLIT>(kw, ks, qa, sT[j]);
        }
        u32 pb[CH][2];
        trans_softmax<D, CH>(sT, cs, s1, full, rscT, mt, lt, oT, pb);
#pragma unroll
        for (int j = 0; j < CH; ++j) {
          u32 vw[4][A::VW], vsc[A::VG];
          read_v<D>(S, L, st + j * Stage<D>::kBytes, cs + 16u * j, s1, full, vw, vsc);
          trans_pv<D>(vw, vsc, pb[j], oT);
        }
      }
    };

    u32 t0 = s0 + 16u * warp;
    if constexpr (PAGED16 && !WIDE) {
      // chunk ring: kCStages - 1 chunks in flight while one is computed; the page ids of
      // the next chunk to issue are read one chunk ahead
      constexpr int CH = ChunkDims<D>::CH;
      constexpr u32 kCT = 16u * CH, kCStep = kCT * FP4C_ATTN_WARPS;
      const ChunkLane<D> L = chunk_lane<D>(S);
      u8* ring = s_raw + warp * (kCStages * ChunkDims<D>::kBytes);
      const u32 ring_s = smem_u32(ring);
      u32 c_issue = s0 + kCT * warp;
      TileSrc nxt[CH];
      auto fetch = [&](u32 cs) {  // the chunk's tiles: one division, then row steps of 16
        u32 pe = fdiv(cs, S.fT), t0 = cs - pe * S.fT.d;
#pragma unroll
        for (int j = 0; j < CH; ++j) {
          if (j > 0) {
            t0 += 16u;
            if (t0 == S.fT.d) {
              t0 = 0u;
              ++pe;
            }
          }
          if (cs + 16u * j < s1) nxt[j] = TileSrc{page_index(S, pe), t0};
        }
      };
      if (c_issue < s1) fetch(c_issue);
      auto issue = [&](int stg) {
        if (c_issue < s1) {
          TileSrc cur[CH];
#pragma unroll
          for (int j = 0; j < CH; ++j) cur[j] = nxt[j];
          if (c_issue + kCStep < s1) fetch(c_issue + kCStep);
#pragma unroll
          for (int j = 0; j < CH; ++j)
            if (c_issue + 16u * j < s1)
              issue_tile_lane<D>(S, L, cur[j],
                                 ring_s + stg * ChunkDims<D>::kBytes + j * Stage<D>::kBytes, bad);
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
        chunk_step(L, ring + stg * ChunkDims<D>::kBytes, cs);
        __syncwarp();  // every lane has read the stage before it is refilled
        stg = stg == kCStages - 1 ? 0 : stg + 1;
      }
      cp_async_wait<0>();
    } else if constexpr (PAGED16) {
      // cp.async ring: kStages - 1 tiles in flight while one is computed
      const CopyOffs<D> C = copy_offsets<D>(S);
      u8* ring = s_raw + warp * (kStages * Stage<D>::kBytes);
      u32 tile_issue = t0;
      i64 id_next = t0 < s1 ? load_id(S, fdiv(t0, S.fT)) : 0;
      auto issue = [&](int st) {
        if (tile_issue < s1) {
          const i64 id = id_next;
          const u32 tn = tile_issue + kStep;
          if (tn < s1) id_next = load_id(S, fdiv(tn, S.fT));  // one tile ahead
          issue_tile<D>(S, C, tile_issue, id, ring + st * Stage<D>::kBytes, bad);
        }
        cp_async_commit();
        tile_issue += kStep;
      };
#pragma unroll
      for (int st = 0; st < kStages - 1; ++st) issue(st);
      int st = 0;
      for (u32 tile = t0; tile < s1; tile += kStep) {
        issue(st == 0 ? kStages - 1 : st - 1);
        cp_async_wait<kStages - 1>();
        __syncwarp();  // every lane's copies of this stage have landed
        TileRaw<D> R;
        read_tile<D>(S, ring + st * Stage<D>::kBytes, tile, R);
        __syncwarp();  // every lane has read the stage before it is refilled
        tile_step(R, tile);
        st = st == kStages - 1 ? 0 : st + 1;
      }
      cp_async_wait<0>();
    } else if (!kPipe) {
      // D = 256: one tile of registers (a second one would spill)
      for (; t0 < s1; t0 += kStep) {
        TileRaw<D> ra;
        load_tile<D>(S, t0, ra);
        tile_step(ra, t0);
      }
    } else if (t0 < s1) {
      // the next tile's loads are in flight while this one is computed
      TileRaw<D> ra, rb;
      load_tile<D>(S, t0, ra);
      while (true) {
        const u32 t1 = t0 + kStep;
        if (t1 < s1) load_tile<D>(S, t1, rb);
        tile_step(ra, t0);
        if (t1 >= s1) break;
        const u32 t2 = t1 + kStep;
        if (t2 < s1) load_tile<D>(S, t2, ra);
        tile_step(rb, t1);
        if (t2 >= s1) break;
        t0 = t2;
      }
    }

    // ---- merge the warps of the CTA in shared memory ---------------------------------
    if constexpr (!WIDE) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        lt[k] = f_add(lt[k], __shfl_xor_sync(0xFFFFFFFFu, lt[k], 4));
        lt[k] = f_add(lt[k], __shfl_xor_sync(0xFFFFFFFFu, lt[k], 8));
        lt[k] = f_add(lt[k], __shfl_xor_sync(0xFFFFFFFFu, lt[k], 16));
        if (g == 0u) {
          s_m[warp][2 * c + k] = mt[k];
          s_l[warp][2 * c + k] = lt[k];
        }
      }
    } else {
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        l[r] = f_add(l[r], __shfl_xor_sync(0xFFFFFFFFu, l[r], 1));
        l[r] = f_add(l[r], __shfl_xor_sync(0xFFFFFFFFu, l[r], 2));
        if (c == 0u) {
          s_m[warp][g + 8 * r] = m[r];
          s_l[warp][g + 8 * r] = l[r];
        }
      }
    }
    bad = __any_sync(0xFFFFFFFFu, bad != 0u) ? 1u : 0u;
    if (threadIdx.x == 0) s_flag = 0u;
    __syncthreads();
    if (bad && lane == 0) atomicOr(&s_flag, 1u);
    if constexpr (!WIDE) {
      float f[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        float M = FP4C_NEG_INF;
#pragma unroll
        for (int w = 0; w < FP4C_ATTN_WARPS; ++w) M = f_max(M, s_m[w][2 * c + k]);
        f[k] = is_neg_inf(mt[k]) ? 0.0f : a_ex2(f_sub(mt[k], M));
      }
#pragma unroll
      for (int w = 0; w < FP4C_ATTN_WARPS; ++w) {
        if (warp == (u32)w) {
#pragma unroll
          for (int i = 0; i < A::D16; ++i) {
            const int ww = i >> 2, hh = (i >> 1) & 1, k = i & 1;
            const u32 d = g * (D / 8) + 8 * ww + 4 * hh + 3 - 2 * k;  // row g; g+8: d - 1
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float* dst = &s_o[2 * c + (e & 1)][d - (e >> 1)];
              const float v = f_mul(oT[i][e], f[e & 1]);
              *dst = w == 0 ? v : f_add(*dst, v);
            }
          }
        }
        __syncthreads();
      }
    } else {
      float f[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const u32 row = g + 8 * r;
        float M = FP4C_NEG_INF;
#pragma unroll
        for (int w = 0; w < FP4C_ATTN_WARPS; ++w) M = f_max(M, s_m[w][row]);
        f[r] = is_neg_inf(m[r]) ? 0.0f : a_ex2(f_sub(m[r], M));
      }
#pragma unroll
      for (int w = 0; w < FP4C_ATTN_WARPS; ++w) {
        if (warp == (u32)w) {
#pragma unroll
          for (int i = 0; i < (!WIDE ? 1 : A::NT); ++i) {
            const int ww = i >> 3, hh = (i >> 2) & 1, pp = i & 3;
            const u32 off = 8 * ww + 4 * hh + 3 - pp;
#pragma unroll
            for (int r = 0; r < NR; ++r) {
#pragma unroll
              for (int cc = 0; cc < 2; ++cc) {
                const u32 d = (2 * c + cc) * (D / 8) + off;
                float* dst = &s_o[g + 8 * r][d];
                const float v = f_mul(o[i][2 * r + cc], f[r]);
                *dst = w == 0 ? v : f_add(*dst, v);
              }
            }
          }
        }
        __syncthreads();
      }
    }
    if (threadIdx.x < group) {
      const u32 row = threadIdx.x;
      float M = FP4C_NEG_INF;
#pragma unroll
      for (int w = 0; w < FP4C_ATTN_WARPS; ++w) M = f_max(M, s_m[w][row]);
      float L = 0.0f;
#pragma unroll
      for (int w = 0; w < FP4C_ATTN_WARPS; ++w) {
        const float mw = s_m[w][row];
        const float fw = is_neg_inf(mw) ? 0.0f : a_ex2(f_sub(mw, M));
        L = f_fma(s_l[w][row], fw, L);
      }
      if (s_flag) L = FP4C_NAN;
      s_M[row] = M;
      s_L[row] = L;
    }
    __syncthreads();
    if (nsplit > 1u) {
      float* wo = (float*)P.ws_o + (u64)pidx * group * D;
      for (u32 k = threadIdx.x; k < group * D; k += FP4C_ATTN_THREADS) wo[k] = s_o[k / D][k % D];
      if (threadIdx.x < group) {
        float* wm = (float*)P.ws_ml + ((u64)pidx * 16 + threadIdx.x) * 2;
        wm[0] = s_M[threadIdx.x];
        wm[1] = s_L[threadIdx.x];
      }
    }
  }

  // ---- finish: one split writes the result; else the last CTA merges the partials -----
  if (nsplit > 1u) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      u32* cnt = (u32*)P.counters + (b * H + h);
      const u32 prev = atomicAdd(cnt, 1u);
      s_flag = prev == nsplit - 1u ? 1u : 0u;
      if (s_flag) *cnt = 0u;  // every CTA of this (b, h) has taken its ticket
    }
    __syncthreads();
    if (!s_flag) return;
    __threadfence();
    const u32 used = len == 0u ? 0u : (len + P.split_len - 1u) / P.split_len;
    const u32 base = (b * H + h) * nsplit;
    // per row: M = max of the splits' m, weights 2^(m_s - M), L = sum l_s * weight
    for (u32 row = warp; row < group; row += FP4C_ATTN_WARPS) {
      float M = FP4C_NEG_INF;
      for (u32 s = lane; s < used; s += 32u)
        M = f_max(M, ldcg_f32((const float*)P.ws_ml + ((u64)(base + s) * 16 + row) * 2));
#pragma unroll
      for (int k = 16; k >= 1; k >>= 1) M = f_max(M, __shfl_xor_sync(0xFFFFFFFFu, M, k));
      float L = 0.0f;
      for (u32 s = lane; s < used; s += 32u) {
        const float* wm = (const float*)P.ws_ml + ((u64)(base + s) * 16 + row) * 2;
        const float ms = ldcg_f32(wm);
        const float ws = is_neg_inf(ms) ? 0.0f : a_ex2(f_sub(ms, M));
        s_w[row][s] = ws;
        L = f_fma(ldcg_f32(wm + 1), ws, L);
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
    for (u32 k = 4u * threadIdx.x; k < group * D; k += 4u * FP4C_ATTN_THREADS) {
      const u32 row = k / D;
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const float* src = (const float*)P.ws_o + (u64)base * group * D + k;
#pragma unroll 16
      for (u32 s = 0; s < used; ++s) {
        const float w = s_w[row][s];
        const U32x4 v = ldcg_u32x4(src + (u64)s * group * D);
        acc[0] = f_fma(__uint_as_float(v.x), w, acc[0]);
        acc[1] = f_fma(__uint_as_float(v.y), w, acc[1]);
        acc[2] = f_fma(__uint_as_float(v.z), w, acc[2]);
        acc[3] = f_fma(__uint_as_float(v.w), w, acc[3]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) s_o[row][k % D + e] = acc[e];
    }
    __syncthreads();
  } else if (s0 >= len) {
    // len == 0 with one split: nothing was computed
    if (threadIdx.x < 16) {
      s_M[threadIdx.x] = FP4C_NEG_INF;
      s_L[threadIdx.x] = 0.0f;
    }
    __syncthreads();
  }
  // write out (and lse)
  for (u32 k = threadIdx.x; k < group * D; k += FP4C_ATTN_THREADS) {
    const u32 row = k / D, d = k % D;
    const float L = s_L[row];
    float v = 0.0f;
    if (len != 0u) v = f_mul(f_div(s_o[row][d], L), P.out_scale);
    store_one(T(), (char*)out + ((u64)(qrow0 + row) * D + d) * T::kBytes, v);
  }
  if (lse != nullptr && threadIdx.x < group) {
    const u32 row = threadIdx.x;
    const float L = s_L[row];
    // natural log of the denominator: (M + log2 L) * ln 2 (M is in the log2 domain)
    lse[qrow0 + row] = len == 0u ? FP4C_NEG_INF
                                 : f_mul(f_add(s_M[row], a_lg2(L)), 0.69314718055994531f);
  }
}

#define FP4C_ATTN_PARAMS                                                                  \
  const void *__restrict__ q, const void *__restrict__ tables,                           \
      const void *__restrict__ seq_lens, void *__restrict__ out, float *__restrict__ lse, \
      const AttnParams params

// NAME, q/out value type, head_dim, WIDE (groups of 9..16 query heads), PAGED16
// (block_size a multiple of 16: every tile lies in one page)
#define FP4C_ATTN_KERNEL(NAME, T, D, WIDE, PAGED16)                                     \
  extern "C" __global__ void __launch_bounds__(FP4C_ATTN_THREADS, FP4C_ATTN_MINB(D, PAGED16)) \
      NAME(FP4C_ATTN_PARAMS) {                                                              \
    decode_attn_impl<T, D, WIDE, PAGED16>(q, tables, seq_lens, out, lse, params);          \
  }

// NAME (the test-only table kernel above)
#define FP4C_ATTN_DEQUANT_TABLE_KERNEL(NAME) \
  extern "C" __global__ void NAME(float* out) { attn_dequant_table(out); }

#ifdef FP4C_INSTANTIATIONS
FP4C_INSTANTIATIONS
#endif
