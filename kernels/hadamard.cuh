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

// The stages are written once, here, for the three ways a vector sits in a warp: 16 values
// per thread over G lanes (store, gather: hadamard_rows), D/4 per lane over 4 lanes (the
// few-row kernel's q: decode_attention.cu) and d = lane + 32 k (the any-length kernel's q:
// hadamard_row).  Index bits held in a thread's registers are butterflied by
// hadamard_in_thread, bits held by the lane by hadamard_across_lanes; a caller runs them
// in the order of their strides (lowest first), then hadamard_normalize.

// The butterflies of strides 1 .. R/2 over a thread's R values x[0 .. R).
template <int R>
FP4C_DEVICE void hadamard_in_thread(float* x) {
#pragma unroll
  for (int s = 1; s < R; s <<= 1) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if ((i & s) == 0) {
        const float a = x[i], b = x[i + s];
        x[i] = f_add(a, b);
        x[i + s] = f_sub(a, b);
      }
    }
  }
}

// The butterflies between the thread with index idx (its lane's bits m = 1 .. G/2 as the
// vector's) and the lane idx ^ m, for each of its N values: the lower index keeps a + b, the
// higher a - b (a the lower's value).  Every lane of the warp must call it with the same G
// (the shuffles name all 32 lanes): lanes without an item pass any values.
template <int N>
FP4C_DEVICE void hadamard_across_lanes(float* x, u32 idx, u32 G) {
  for (u32 m = 1; m < G; m <<= 1) {  // G is uniform: every lane runs the same stages
    const bool hi = (idx & m) != 0u;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float p = __shfl_xor_sync(0xFFFFFFFFu, x[i], (int)m);
      x[i] = hi ? f_sub(p, x[i]) : f_add(x[i], p);
    }
  }
}

// Times the normalization (fl32(1/sqrt(D)): the host's rot_scale, or hadamard_norm<D>).
template <int N>
FP4C_DEVICE void hadamard_normalize(float* x, float scale) {
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = f_mul(x[i], scale);
}

// fl32(1/sqrt(D)) for the head sizes of the attention kernels (fp4cache.formats.hadamard's
// factor: 2^-3, 0x3DB504F3, 2^-4).
template <int D>
FP4C_DEVICE constexpr float hadamard_norm() {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
  return D == 64 ? 0.125f : D == 128 ? 0.08838834764831845f : 0.0625f;
}

// The transform of the NH heads a thread holds (x[q*16 .. q*16+15] for head q), group g
// of G (d = 16 g + i).
template <int NH>
FP4C_DEVICE void hadamard_rows(float (*x)[16], u32 g, u32 G, float scale) {
#pragma unroll
  for (int q = 0; q < NH; ++q) hadamard_in_thread<16>(x[q]);
  hadamard_across_lanes<NH * 16>(&x[0][0], g, G);
  hadamard_normalize<NH * 16>(&x[0][0], scale);
}

// The transform of a row of D values held x[k] = d lane + 32 k by the 32 lanes (strides
// 1 .. 16 across the lanes, then 32 .. D/2 in the registers, then the normalization; the
// whole warp calls it).
template <int D>
FP4C_DEVICE void hadamard_row(float (&x)[D / 32]) {
  hadamard_across_lanes<D / 32>(x, threadIdx.x & 31u, 32u);
  hadamard_in_thread<D / 32>(x);
  hadamard_normalize<D / 32>(x, hadamard_norm<D>());
}

// The transform without its normalization of rows held d = c D/4 + k in x[k] by the lanes
// c = lane % 4 (strides 1 .. D/8 in the registers, D/4 and D/2 across lanes c ^ 1, c ^ 2).
template <int D>
FP4C_DEVICE void hadamard_quarter_rows(float (&x)[D / 4]) {
  hadamard_in_thread<D / 4>(x);
  hadamard_across_lanes<D / 4>(x, threadIdx.x & 3u, 4u);
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
