// fp4cache: where the stored layouts put a value, for every kernel that reads or writes
// them: offsets inside one page of the vLLM paged layout (spec section 4) and LongLive's
// blocked scale order (section 5).  fp4cache/layout.py holds the same formulas for the host
// and the NumPy backend; the GPU tests compare the two byte for byte.
#pragma once
#include "fp4_common.cuh"

// V-scale swizzle of the vLLM paged layout (spec section 4, fp4cache.layout's
// swizzle_scale_index): the logical scale (t, g) of a head's [T, G] scale tile is stored
// at the linear position (ts, gs) = ((t & ~3) + g / Q, (g % Q) * 4 + t % 4), Q = G / 4.
// The caller passes gq = g / Q (a run-time divider or a compile-time constant).  The one
// device implementation: the store, the gather and the attention kernels use it.
FP4C_DEVICE void v_scale_swizzle(u32 t, u32 g, u32 gq, u32 Q, u32& ts, u32& gs) {
  ts = (t & ~3u) + gq;
  gs = (g - gq * Q) * 4 + (t & 3u);
}
// g / (G/4) as (g * swz_m) >> 20 with swz_m = ceil(2^20 / (G/4)) (exact for g < G, G/4 < 512)
FP4C_DEVICE u32 v_scale_group_quarter(u32 g, u32 swz_m) { return (g * swz_m) >> 20; }

// Row index of (t, h) inside one side.
FP4C_DEVICE u32 row_index(u32 t, u32 h, u32 H, u32 T, u32 nhd) {
  return nhd ? t * H + h : h * T + t;
}

// Offset of scale (t, h, g) of a V side from the side's start (spec section 4): linear as
// K's, or swizzled per head for trtllm-gen (v_scale_swizzle above), with g / (G/4) as
// (g * swz_m) >> 20, swz_m = ceil(2^20 / (G/4)).
FP4C_DEVICE u64 v_scale_offset(u32 t, u32 h, u32 g, u32 H, u32 T, u32 G, u32 nhd, u32 swizzle,
                               u32 swz_m, i64 data_bytes) {
  if (!swizzle) return (u64)data_bytes + (u64)row_index(t, h, H, T, nhd) * G + g;
  u32 ts, ss;
  v_scale_swizzle(t, g, v_scale_group_quarter(g, swz_m), G >> 2, ts, ss);
  return (u64)data_bytes + (u64)row_index(ts, h, H, T, nhd) * G + ss;
}

// Byte offset of scale (r, s) in cuBLAS' 128x4 blocked order (spec section 5, LongLive's
// scale tiles); I is i64, or u32 where the block's Rp*S scale bytes are known to fit in 32
// bits.
template <typename I>
FP4C_DEVICE I blocked_scale_offset(I r, u32 s, u32 scales_per_row) {
  const I tile = (r >> 7) * (I)(scales_per_row >> 2) + (s >> 2);
  return tile * 512 + (r & 31) * 16 + ((r & 127) >> 5) * 4 + (s & 3);
}
