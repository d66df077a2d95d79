// fp4cache: the normalized Hadamard transform of K (rotation="hadamard") and the bf16
// bits of the exact window (docs/window.md), for the kernels that store and read pages.
//
// A head's D values are held 16 per thread by the G = D/16 threads of consecutive lanes
// of one warp, aligned to G (group g of the head in lane g mod G): the butterfly stages
// of strides 1, 2, 4, 8 run inside the thread, those of strides 16 .. D/2 across lanes
// (__shfl_xor_sync with lane mask 1, 2, .., G/2: the lower lane of a pair keeps a + b,
// the higher a - b, a the lower lane's value), in that order, then every value is
// multiplied by fl32(1/sqrt(D)): fp4cache.formats.hadamard bit for bit (float32 .rn
// arithmetic without flush to zero).
#pragma once
#include "fp4_common.cuh"

// One butterfly stage of stride s < 16 inside the thread's 16 values.
template <int S>
FP4C_DEVICE void hadamard_stage_local(float* x) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if ((i & S) == 0) {
      const float a = x[i], b = x[i + S];
      x[i] = f_add(a, b);
      x[i + S] = f_sub(a, b);
    }
  }
}

// The transform of the NH heads a thread holds (x[q*16 .. q*16+15] for head q), group g
// of G.  Every lane of the warp must call it with the same G (the shuffles name all 32
// lanes): lanes without an item pass any values and ignore the result.
template <int NH>
FP4C_DEVICE void hadamard_rows(float (*x)[16], u32 g, u32 G, float scale) {
#pragma unroll
  for (int q = 0; q < NH; ++q) {
    hadamard_stage_local<1>(x[q]);
    hadamard_stage_local<2>(x[q]);
    hadamard_stage_local<4>(x[q]);
    hadamard_stage_local<8>(x[q]);
  }
  for (u32 m = 1; m < G; m <<= 1) {  // G is uniform: every lane runs the same stages
    const bool hi = (g & m) != 0u;
#pragma unroll
    for (int q = 0; q < NH; ++q) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float p = __shfl_xor_sync(0xFFFFFFFFu, x[q][i], (int)m);
        x[q][i] = hi ? f_sub(p, x[q][i]) : f_add(x[q][i], p);
      }
    }
  }
#pragma unroll
  for (int q = 0; q < NH; ++q) {
#pragma unroll
    for (int i = 0; i < 16; ++i) x[q][i] = f_mul(x[q][i], scale);
  }
}

// ---------------------------------------------------------------------------
// bf16 bits of the window
// ---------------------------------------------------------------------------
// 16 window values: 8 words of two bf16 each (element 2j in the low half of word j).
struct Bf16x16 {
  u32 w[8];
};

// Round to nearest even (cvt.rn.bf16x2.f32: fp4cache.formats.bf16_bits for every non-NaN
// float32, subnormals and overflow to infinity included).
FP4C_DEVICE Bf16x16 bf16x16_of(const float* x) {
  Bf16x16 r;
#pragma unroll
  for (int j = 0; j < 8; ++j) r.w[j] = pack2(bf16_t(), x[2 * j], x[2 * j + 1]);
  return r;
}

// The same with every NaN as 0x7FC0 (the window fill of dequantized values: a value is
// NaN exactly when its group's scale byte is 0x7F).
FP4C_DEVICE Bf16x16 bf16x16_of_nan(const float* x) {
  Bf16x16 r;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const bool na = (__float_as_uint(x[2 * j]) & 0x7FFFFFFFu) > 0x7F800000u;
    const bool nb = (__float_as_uint(x[2 * j + 1]) & 0x7FFFFFFFu) > 0x7F800000u;
    const u32 w = pack2(bf16_t(), x[2 * j], x[2 * j + 1]);
    r.w[j] = (na ? 0x7FC0u : (w & 0xFFFFu)) | (nb ? 0x7FC00000u : (w & 0xFFFF0000u));
  }
  return r;
}

// A group of 16 NaN (a group of the store holding a NaN or an infinity).
FP4C_DEVICE Bf16x16 bf16x16_nan() {
  Bf16x16 r;
#pragma unroll
  for (int j = 0; j < 8; ++j) r.w[j] = 0x7FC07FC0u;
  return r;
}

// 32 bytes at p (32-byte aligned: a group of a window row).
FP4C_DEVICE void store_bf16x16(void* p, const Bf16x16& v) {
  U32x4 a, b;
  a.x = v.w[0];
  a.y = v.w[1];
  a.z = v.w[2];
  a.w = v.w[3];
  b.x = v.w[4];
  b.y = v.w[5];
  b.z = v.w[6];
  b.w = v.w[7];
  ((U32x4*)p)[0] = a;
  ((U32x4*)p)[1] = b;
}

// Decode one stored group (8 code bytes lo, hi; scale byte sf; multiplier s) to float32:
// the contract's fl(fl(e2m1 * e4m3) * s), as decode_values.
FP4C_DEVICE void decode_group16(u32 lo, u32 hi, u32 sf, float s, float* v) {
  decode_values<8>(lo, sf, s, v);
  decode_values<8>(hi, sf, s, v + 8);
}
