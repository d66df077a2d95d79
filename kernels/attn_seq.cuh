// fp4cache: the sequence setup of the attention kernels (decode_attention.cu,
// varlen_attention.cu): a CTA's rows (RowMap), the keys each row sees (row_limit, the
// bottom-right causal mask) and q's per-row scale.
#pragma once
#include "fp4_common.cuh"
#include "attn_dequant.cuh"

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
