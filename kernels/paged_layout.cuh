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
// K's, or swizzled per head for trtllm-gen (v_scale_swizzle in fp4_common.cuh, the one
// device implementation of the swizzle, which the decode attention uses too), with
// g / (G/4) as (g * swz_m) >> 20, swz_m = ceil(2^20 / (G/4)).
FP4C_DEVICE u64 v_scale_offset(u32 t, u32 h, u32 g, u32 H, u32 T, u32 G, u32 nhd, u32 swizzle,
                               u32 swz_m, i64 data_bytes) {
  if (!swizzle) return (u64)data_bytes + (u64)row_index(t, h, H, T, nhd) * G + g;
  u32 ts, ss;
  v_scale_swizzle(t, g, v_scale_group_quarter(g, swz_m), G >> 2, ts, ss);
  return (u64)data_bytes + (u64)row_index(ts, h, H, T, nhd) * G + ss;
}

