// fp4cache: the sequence setup of the attention kernels (decode_attention.cu,
// varlen_attention.cu), one implementation for both: the geometry of a head_dim, the
// sequence's query tokens and key count (clamped to what the launch may touch) and whether
// this launch serves it, a CTA's rows (RowMap) and the keys each row sees (the bottom-right
// causal mask: causal_limit, row_limit), q's per-row scale, and the sequence's pages
// (AttnSeq: block-table lookups, bad ids and their count).  What differs stays in the
// kernels: decode serves one token (or the few rows of a short sequence) per CTA and keeps
// the length with the pages (SeqCtx); varlen cuts the rows of a longer sequence into query
// tiles and splits (VlWork) and adds the width of its row loads (VlSeq).  A template
// parameter `Params` is AttnParams or VarlenParams (fp4cache/_abi.py: the fields read here
// have the same names in both).
#pragma once
#include "fp4_common.cuh"
#include "attn_dequant.cuh"

// ---------------------------------------------------------------------------------------
// Geometry of one head_dim (each kernel's own tiling extends it: AttnDims, VlDims)
// ---------------------------------------------------------------------------------------
template <int D>
struct HeadDims {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
  static constexpr int G = D / 16;   // scales per row
  static constexpr int KS = D / 16;  // k-steps of Q.K
  static constexpr int NT = D / 8;   // n8 tiles of d (P.V)
};

// Entry i of an index array of 32-bit (is64 = 0) or 64-bit ints (query_start_loc,
// seq_lens, a row of block_tables)
FP4C_DEVICE i64 load_index(const void* p, u32 i, u32 is64) {
  return is64 ? ((const i64*)p)[i] : (i64)((const int*)p)[i];
}

// ---------------------------------------------------------------------------------------
// A sequence's query tokens and keys
// ---------------------------------------------------------------------------------------
// Query tokens [tok0, end) of sequence b: query_start_loc[b], [b + 1] clamped to q's
// num_tokens rows (an unvalidated bad entry never reads or writes outside q and out); none
// when end <= tok0.  Both in [0, num_tokens], 64-bit as the entries.
struct QuerySpan {
  i64 tok0, end;
};
template <class Params>
FP4C_DEVICE QuerySpan query_span(const Params& P, const void* qsl, u32 b) {
  i64 a = load_index(qsl, b, P.ql64), e = load_index(qsl, b + 1, P.ql64);
  a = a < 0 ? 0 : (a > (i64)P.num_tokens ? (i64)P.num_tokens : a);
  e = e > (i64)P.num_tokens ? (i64)P.num_tokens : e;
  return QuerySpan{a, e};
}
// Whether this launch serves a sequence of `rows` rows (n query tokens * group): rows in
// (rows_lo, rows_hi] (a mixed batch takes two launches, each for the sequences of its row
// range; a sequence without query tokens is served by none).
template <class Params, typename I>
FP4C_DEVICE bool launch_rows(const Params& P, I rows) {
  return rows > P.rows_lo && rows <= P.rows_hi;
}

// Keys a block-table row can hold: max_blocks * block_size
template <class Params>
FP4C_DEVICE i64 seq_capacity(const Params& P) {
  return (i64)P.max_blocks * P.t.d;
}
// seq_lens[b] clamped to [0, seq_capacity]
template <class Params>
FP4C_DEVICE u32 seq_len(const Params& P, const void* seq_lens, u32 b) {
  const i64 len = load_index(seq_lens, b, P.sl64);
  const i64 cap = seq_capacity(P);
  return (u32)(len < 0 ? 0 : (len > cap ? cap : len));
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
// The rows of n query tokens from tok0 for KV head h
template <class Params>
FP4C_DEVICE RowMap row_map(const Params& P, u32 h, u32 tok0, u32 n) {
  return RowMap{tok0, n, n * P.group, P.group, P.H * P.group, h * P.group, P.causal};
}
// q / out row (token * Hq + head) of row r
FP4C_DEVICE u64 row_of(const RowMap& R, u32 r) {
  const u32 t = r / R.group;
  return (u64)(R.tok0 + t) * R.Hq + R.head0 + (r - t * R.group);
}
// keys query token t (0 <= t < n) of a sequence of n query tokens and len keys sees under
// the bottom-right causal mask: [0, limit), limit = len - (n - 1 - t) in [0, len]
FP4C_DEVICE u32 causal_limit(u32 len, u32 n, u32 t) {
  const u32 hide = n - 1u - t;  // the sequence's query tokens after token t
  return len > hide ? len - hide : 0u;
}
// keys row r sees: [0, limit), limit in [0, len]; rows past R.rows see all (they are
// padding, their results are never written)
FP4C_DEVICE u32 row_limit(const RowMap& R, u32 r, u32 len) {
  if (!R.causal || r >= R.rows) return len;
  return causal_limit(len, R.n, r / R.group);
}

// ---------------------------------------------------------------------------------------
// q's per-row scale
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

// ---------------------------------------------------------------------------------------
// The pages of a sequence for one KV head
// ---------------------------------------------------------------------------------------
struct AttnSeq {
  const u8* buffer;
  const void* table;  // this sequence's row of block_tables
  u64* stats;
  i64 num_blocks, page_bytes, side_bytes, data_bytes;
  FastDiv fT;        // block_size
  u32 h;             // the KV head
  u32 row_h, row_t;  // a page row's head and token strides (HND / NHD)
  u32 swizzle, bt64;
  u32 count_bad;     // this CTA counts the bad block ids it meets
};
template <class Params>
FP4C_DEVICE AttnSeq attn_seq(const Params& P, const void* __restrict__ tables, u32 b, u32 h,
                             bool count_bad) {
  AttnSeq S;
  S.buffer = (const u8*)P.buffer;
  S.table = P.bt64 ? (const void*)((const i64*)tables + (u64)b * P.max_blocks)
                   : (const void*)((const int*)tables + (u64)b * P.max_blocks);
  S.stats = (u64*)P.stats;
  S.num_blocks = P.num_blocks;
  S.page_bytes = 2 * P.side_bytes;
  S.side_bytes = P.side_bytes;
  S.data_bytes = P.data_bytes;
  S.fT = fastdiv_param(P.t);
  S.h = h;
  S.row_h = P.row_h;
  S.row_t = P.row_t;
  S.swizzle = P.swizzle;
  S.bt64 = P.bt64;
  S.count_bad = count_bad ? 1u : 0u;
  return S;
}

// the block id of block-table entry e of the sequence
FP4C_DEVICE i64 load_id(const AttnSeq& S, u32 e) { return load_index(S.table, e, S.bt64); }
// the same entry as loaded (its two 32-bit words; hi repeats lo for int32 tables) and made
// a block id later (id_of), so that no instruction waits for the load before the id's use
struct IdWords {
  u32 lo, hi;
};
FP4C_DEVICE IdWords load_id_words(const AttnSeq& S, u32 e) {
  const u32* w = (const u32*)S.table + (e << S.bt64);
  return IdWords{w[0], w[S.bt64]};
}
FP4C_DEVICE i64 id_of(const AttnSeq& S, IdWords w) {
  return S.bt64 ? (i64)(((u64)w.hi << 32) | w.lo) : (i64)(int)w.lo;
}
// a block id inside the pool
FP4C_DEVICE bool page_ok(const AttnSeq& S, i64 id) { return (u64)id < (u64)S.num_blocks; }
// count a bad block-table entry in stats (the caller picks the one lane and tile that own
// it: once per used entry and call, as gather_dequant counts its pages)
FP4C_DEVICE void count_bad_block(const AttnSeq& S) {
  if (S.count_bad) atomicAdd((unsigned long long*)S.stats + FP4C_STAT_BAD_BLOCK_IDS, 1ull);
}
