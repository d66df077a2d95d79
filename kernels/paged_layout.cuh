// fp4cache: offsets inside one page of the vLLM paged layout (spec section 4), for every
// kernel that reads or writes pages.  fp4cache/layout.py holds the same formulas for the
// host and the NumPy backend; the GPU tests compare the two byte for byte.
#pragma once
#include "fp4_common.cuh"

// Row index of (t, h) inside one side.
FP4C_DEVICE u32 row_index(u32 t, u32 h, u32 H, u32 T, u32 nhd) {
  return nhd ? t * H + h : h * T + t;
}

// Offset of scale (t, h, g) of a V side from the side's start (spec section 4): linear as
// K's, or swizzled per head for trtllm-gen, t' = (t//4)*4 + g//(G/4),
// g' = (g % (G/4))*4 + t%4, stored at the linear slot of (t', g').  G/4 divides as
// (g * swz_m) >> 20 with swz_m = ceil(2^20 / (G/4)) (exact for g < G, G/4 < 512).
// The one device implementation of the swizzle.
FP4C_DEVICE u64 v_scale_offset(u32 t, u32 h, u32 g, u32 H, u32 T, u32 G, u32 nhd, u32 swizzle,
                               u32 swz_m, i64 data_bytes) {
  if (!swizzle) return (u64)data_bytes + (u64)row_index(t, h, H, T, nhd) * G + g;
  const u32 gq = (g * swz_m) >> 20;
  const u32 ts = (t & ~3u) + gq;
  const u32 ss = (g - gq * (G >> 2)) * 4 + (t & 3u);
  return (u64)data_bytes + (u64)row_index(ts, h, H, T, nhd) * G + ss;
}

