// fp4cache: device code shared by every kernel.
//
// Self-contained on purpose: no CUDA headers, so that NVRTC from a pip-only
// install (cupy + nvidia-cuda-nvrtc) compiles it.  Every function here mirrors a
// formula of the numeric contract (docs/format.md):
//   - element formats: E2M1 (FP4) and E4M3 (FP8) in software, because sm_80 and
//     sm_90 have no FP4 conversion instruction;
//   - the group encoder (static6 / 4over6, spec section 2) with the sequential
//     float32 error sum, "tie keeps 6", non-finite groups -> scale 0x7F, data 0;
//   - bf16 / fp16 / fp32 loads (exact widening) and round-to-nearest-even stores.
// Arithmetic that decides a stored byte or a returned value goes through the
// f_mul / f_add / f_sub / f_div / f_fma wrappers below (PTX .rn instructions
// without .ftz, so subnormals survive CuPy's -ftz=true); f_fma only where the
// product is exact, so it rounds exactly like the separate add.  Float
// comparisons that could see subnormals compare bit patterns instead.  The
// module is also compiled with --fmad=false.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define FP4C_DEVICE __device__ __forceinline__

// Rule and layout values, counter indices, the sizes both sides use (FP4C_DECODE_CHUNKS, ...)
// and the structs kernels take by value: generated from fp4cache/_abi.py by the loader (no
// such file on disk), with layout static_asserts.
#include "fp4c_abi.cuh"

// ---------------------------------------------------------------------------
// float32 arithmetic with IEEE subnormals, whatever the compile flags say.
// CuPy appends -ftz=true to every NVRTC compile, which would make the CUDA
// intrinsics (__fmul_rn, fminf, fabsf, ...) flush subnormal inputs and results
// to zero; the contract keeps subnormals.  These wrappers emit the PTX
// instructions without .ftz, with round-to-nearest-even and no contraction.
// ---------------------------------------------------------------------------
FP4C_DEVICE float f_mul(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
FP4C_DEVICE float f_add(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
FP4C_DEVICE float f_sub(float a, float b) {
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// fma.rn without .ftz.  The encoders use it only where a*b is exact (then it rounds like
// the separate add); the attention's softmax and merges use it as a plain FMA.
FP4C_DEVICE float f_fma(float a, float b, float c) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}
FP4C_DEVICE float f_div(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
FP4C_DEVICE float f_min(float a, float b) {
  float r;
  asm("min.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
FP4C_DEVICE float f_max(float a, float b) {
  float r;
  asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// a > b (false if either is NaN), without the .ftz that CuPy's flags put on a C++ compare
FP4C_DEVICE bool f_gt(float a, float b) {
  unsigned r;
  asm("{ .reg .pred p; setp.gt.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(r) : "f"(a), "f"(b));
  return r != 0u;
}
FP4C_DEVICE float f_neg(float a) {
  float r;
  asm("neg.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
FP4C_DEVICE float f_abs(float a) {
  float r;
  asm("abs.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}

struct alignas(16) U32x4 { u32 x, y, z, w; };
struct alignas(8) U32x2 { u32 x, y; };

// ---------------------------------------------------------------------------
// Value types.  Each has a raw storage type and converters; T::kPerWord is the
// number of values in one 32-bit word (loads are done as 16-byte vectors).
// ---------------------------------------------------------------------------
struct bf16_t {
  typedef u16 raw;
  static constexpr int kBytes = 2;
  static constexpr bool kIsBf16 = true;
};
struct f16_t {
  typedef u16 raw;
  static constexpr int kBytes = 2;
  static constexpr bool kIsBf16 = false;
};
struct f32_t {
  typedef u32 raw;
  static constexpr int kBytes = 4;
  static constexpr bool kIsBf16 = false;
};

FP4C_DEVICE float f16_bits_to_float(u32 h) {
  float f;
  asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "r"(h));
  return f;
}

// Two float32 -> one 32-bit word holding two values (lo = a, hi = b), RNE.
FP4C_DEVICE u32 pack2(bf16_t, float a, float b) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  return r;
}
FP4C_DEVICE u32 pack2(f16_t, float a, float b) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  return r;
}

// Widen one 32-bit word of raw values to float32 (exact).
FP4C_DEVICE float lo_of(bf16_t, u32 w) { return __uint_as_float(w << 16); }
FP4C_DEVICE float hi_of(bf16_t, u32 w) { return __uint_as_float(w & 0xFFFF0000u); }
FP4C_DEVICE float lo_of(f16_t, u32 w) { return f16_bits_to_float(w & 0xFFFFu); }
FP4C_DEVICE float hi_of(f16_t, u32 w) { return f16_bits_to_float(w >> 16); }

// Load one raw element (scalar path, any alignment of the element type).
FP4C_DEVICE float load_one(bf16_t, const void* p) {
  return __uint_as_float(((u32)*(const u16*)p) << 16);
}
FP4C_DEVICE float load_one(f16_t, const void* p) { return f16_bits_to_float(*(const u16*)p); }
FP4C_DEVICE float load_one(f32_t, const void* p) { return *(const float*)p; }

FP4C_DEVICE void store_one(bf16_t, void* p, float v) { *(u16*)p = (u16)(pack2(bf16_t(), v, 0.0f)); }
FP4C_DEVICE void store_one(f16_t, void* p, float v) { *(u16*)p = (u16)(pack2(f16_t(), v, 0.0f)); }
FP4C_DEVICE void store_one(f32_t, void* p, float v) { *(float*)p = v; }

FP4C_DEVICE U32x4 ldg16(const void* p) {
  U32x4 r;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
FP4C_DEVICE U32x2 ldg8(const void* p) {
  U32x2 r;
  asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

// ---------------------------------------------------------------------------
// Group of 16 values: load as float32 plus raw bits for the max / finiteness.
// ---------------------------------------------------------------------------
struct Group16 {
  float x[16];
  u32 sgn[2];  // sign bits already at their nibble position: bit 4i+3 of sgn[i/8]
};

// Sign words of 8 values held as 16-bit halves in w[0..3] (element 2j low half of
// w[j]): gather the high bytes of the even elements and of the odd elements, then
// move each sign bit to bit 3 / bit 7 of its byte (one byte = two nibbles).
FP4C_DEVICE u32 signs_from_halves(u32 w0, u32 w1, u32 w2, u32 w3) {
  const u32 p = __byte_perm(w0, w1, 0x7351);  // [w0.b1, w1.b1, w0.b3, w1.b3]
  const u32 q = __byte_perm(w2, w3, 0x7351);
  const u32 even = __byte_perm(p, q, 0x5410);  // high bytes of elements 0,2,4,6
  const u32 odd = __byte_perm(p, q, 0x7632);   // high bytes of elements 1,3,5,7
  return ((even >> 4) & 0x08080808u) | (odd & 0x80808080u);
}

FP4C_DEVICE void signs_from_floats(Group16& g) {
  u32 s[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i) s[i >> 3] |= (__float_as_uint(g.x[i]) >> 31) << (4 * (i & 7) + 3);
  g.sgn[0] = s[0];
  g.sgn[1] = s[1];
}

// Vector load of 16 contiguous values (pointer 16-byte aligned); bf16 and f16 hold two
// values per 32-bit word (f32 has its own overload below).
template <typename T>
FP4C_DEVICE void load_group_vec(T, const void* p, Group16& g) {
  const U32x4 a = ldg16(p);
  const U32x4 b = ldg16((const char*)p + 16);
  const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    g.x[2 * i] = lo_of(T(), w[i]);
    g.x[2 * i + 1] = hi_of(T(), w[i]);
  }
  g.sgn[0] = signs_from_halves(w[0], w[1], w[2], w[3]);
  g.sgn[1] = signs_from_halves(w[4], w[5], w[6], w[7]);
}
FP4C_DEVICE void load_group_vec(f32_t, const void* p, Group16& g) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const U32x4 a = ldg16((const char*)p + 16 * i);
    g.x[4 * i] = __uint_as_float(a.x);
    g.x[4 * i + 1] = __uint_as_float(a.y);
    g.x[4 * i + 2] = __uint_as_float(a.z);
    g.x[4 * i + 3] = __uint_as_float(a.w);
  }
  signs_from_floats(g);
}
template <typename T>
FP4C_DEVICE void load_group_scalar(const void* p, Group16& g) {
#pragma unroll
  for (int i = 0; i < 16; ++i) g.x[i] = load_one(T(), (const char*)p + i * T::kBytes);
  signs_from_floats(g);
}
template <typename T, bool VEC>
FP4C_DEVICE void load_group(const void* p, Group16& g) {
  if (VEC) {
    load_group_vec(T(), p, g);
  } else {
    load_group_scalar<T>(p, g);
  }
}

// A group's raw bits, loaded but not yet widened (8 words for bf16/f16, 16 for
// f32): lets a thread issue the loads of several groups before computing any.
template <typename T>
struct RawGroup {
  u32 w[4 * T::kBytes];
};

template <typename T, bool VEC>
FP4C_DEVICE void load_raw(const void* p, RawGroup<T>& r) {
  if constexpr (VEC) {
#pragma unroll
    for (int i = 0; i < T::kBytes; ++i) {
      const U32x4 a = ldg16((const char*)p + 16 * i);
      r.w[4 * i] = a.x;
      r.w[4 * i + 1] = a.y;
      r.w[4 * i + 2] = a.z;
      r.w[4 * i + 3] = a.w;
    }
  } else if constexpr (T::kBytes == 2) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      r.w[i] = (u32)((const u16*)p)[2 * i] | ((u32)((const u16*)p)[2 * i + 1] << 16);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) r.w[i] = ((const u32*)p)[i];
  }
}

template <typename T>
FP4C_DEVICE void unpack_raw(const RawGroup<T>& r, Group16& g) {
  if constexpr (T::kBytes == 2) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      g.x[2 * i] = lo_of(T(), r.w[i]);
      g.x[2 * i + 1] = hi_of(T(), r.w[i]);
    }
    g.sgn[0] = signs_from_halves(r.w[0], r.w[1], r.w[2], r.w[3]);
    g.sgn[1] = signs_from_halves(r.w[4], r.w[5], r.w[6], r.w[7]);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) g.x[i] = __uint_as_float(r.w[i]);
    signs_from_floats(g);
  }
}

// ---------------------------------------------------------------------------
// Element formats
// ---------------------------------------------------------------------------
#define FP4C_FLT_MAX 3.40282346638528859812e+38f
#define FP4C_TWO_M126 1.17549435082228750797e-38f  // 2^-126 (0x00800000)
#define FP4C_TWO_P126 8.50705917302346158658e+37f  // 2^126
#define FP4C_TWO_P120 1.32922799578491587290e+36f  // 2^120
#define FP4C_TWO_P22 4194304.0f
#define FP4C_C6 0.16666667163372039795f  // fl(1/6) = 0x3E2AAAAB
#define FP4C_NAN __uint_as_float(0x7FC00000u)

// E4M3 (satfinite, RNE) byte of a float32 v >= 0 (+inf allowed, NaN never passed).
// Clipping to 448 first then rounding is what ml_dtypes' float8_e4m3fn gives
// for the clipped value; subnormals (multiples of 2^-9 below 2^-6) are kept.
// Software version (every architecture); e4m3_encode_nonneg below picks the
// conversion instruction where there is one (checked equal on every input by
// tests/test_gpu_decode_paths.py).
FP4C_DEVICE u32 e4m3_encode_nonneg_sw(float v) {
  v = f_min(v, 448.0f);
  const u32 u = __float_as_uint(v);
  if (__float_as_uint(v) < 0x3C800000u) {  // below 2^-6: subnormal E4M3, step 2^-9
    // 2^14 has an ulp of 2^-9, so the add rounds v to that grid (RNE); the
    // integer difference of the bit patterns is the code (0..8; 8 = 2^-6).
    return __float_as_uint(f_add(v, 16384.0f)) - 0x46800000u;
  }
  // Normal: keep 3 mantissa bits, RNE on the dropped 20 bits.
  const u32 r = u + 0x7FFFFu + ((u >> 20) & 1u);
  return (r >> 20) - (120u << 3);
}

// The same byte from sm_89's cvt.rn.satfinite.e4m3x2.f32 (RNE, out-of-range and +inf to
// 448, subnormals kept): one conversion instead of about ten integer operations.
FP4C_DEVICE u32 e4m3_encode_nonneg(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short h;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(0.0f), "f"(v));
  return h;  // the high byte holds the conversion of 0.0f: 0
#else
  return e4m3_encode_nonneg_sw(v);
#endif
}

// Float value of an E4M3 byte (0x7F / 0xFF are NaN).
FP4C_DEVICE float e4m3_decode(u32 b) {
  const u32 mag = b & 0x7Fu;
  if (mag == 0x7Fu) return FP4C_NAN;
  // E4M3 exponent field e maps on float32 exponent field e when scaled by
  // 2^-120, subnormals included; the multiply by 2^120 is exact.
  const float f = f_mul(__uint_as_float(mag << 20), FP4C_TWO_P120);
  return __uint_as_float(__float_as_uint(f) | ((b & 0x80u) << 24));
}

// Round a >= 0 (a < 8) to the E2M1 magnitude grid {0,.5,1,1.5,2,3,4,6}, RNE.
// The add of M*2^22 (M = 2^floor(log2 a), at least 1) leaves exactly one
// mantissa bit below the leading one (half-steps under 2), rounding to nearest
// even; the products M*2^22 are exact, so the two FMAs are two exact-product adds.
// Under 7 it never reaches 8, so no clamp is needed (the caller checks).
FP4C_DEVICE float e2m1_round_mag(float a) {
  const float M = f_max(__uint_as_float(__float_as_uint(a) & 0x7F800000u), 1.0f);
  const float q = f_fma(M, FP4C_TWO_P22, a);
  return f_fma(M, -FP4C_TWO_P22, q);  // the negated constant: no extra sign-flip op
}

// Code bits of a rounded magnitude r in {0,.5,...,6}: r * 2^-126 is exact and its
// float32 bit pattern is exactly code << 22 (E2M1's exponent field lands on
// float32's, 0.5 becoming the subnormal 2^-127).
FP4C_DEVICE u32 e2m1_mag_code(float r) {
  return __float_as_uint(f_mul(r, FP4C_TWO_M126)) >> 22;
}

// Signed E2M1 value of a code's low 4 bits.
FP4C_DEVICE float e2m1_value(u32 code) {
  const u32 bits = ((code & 7u) << 22) | ((code & 8u) << 28);
  return f_mul(__uint_as_float(bits), FP4C_TWO_P126);
}

// ---------------------------------------------------------------------------
// Group encoder (spec section 2).
// ---------------------------------------------------------------------------
struct Encoded16 {
  u32 lo, hi;   // 16 nibbles: element 2i low nibble of byte i
  u32 scale;    // E4M3 byte
  bool nonfinite;
  bool saturated;  // the chosen candidate's scale saturated: fl(g*fl(m*c)) > 464, i.e. it
                   // would round above 448 (FP4C_SCALE_SATURATES_ABOVE_BITS)
  bool underflow;  // nonzero group whose scale byte is zero or subnormal (< 2^-6)
};

// Write the 8 packed-code bytes of a group at dst (8-byte aligned when VEC).
template <bool VEC>
FP4C_DEVICE void store_codes(u8* dst, const Encoded16& e) {
  if (VEC) {
    U32x2 a;
    a.x = e.lo;
    a.y = e.hi;
    *(U32x2*)dst = a;
  } else {
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      dst[b] = (u8)(e.lo >> (8 * b));
      dst[4 + b] = (u8)(e.hi >> (8 * b));
    }
  }
}

FP4C_DEVICE float group_abs_max(const Group16& g, bool& nonfinite) {
  u32 mb = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) mb = max(mb, __float_as_uint(g.x[i]) & 0x7FFFFFFFu);
  nonfinite = mb >= 0x7F800000u;
  return __uint_as_float(mb);
}

// The same maximum from the raw 16-bit words of a bf16 group: two magnitudes per
// 32-bit word, compared as unsigned 16-bit pairs (one op for two values on sm_90).
FP4C_DEVICE u32 max_u16x2(u32 a, u32 b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  u32 r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  const u32 hi = max(a >> 16, b >> 16), lo = max(a & 0xFFFFu, b & 0xFFFFu);
  return (hi << 16) | lo;
#endif
}
// sm_86+: max(|a|, |b|) of 16-bit float pairs in one instruction (the sign of the result
// is junk, masked at the end); .NaN makes a NaN input give NaN.  Exact, no flushing.
FP4C_DEVICE u32 absmax2(bf16_t, u32 a, u32 b) {
  u32 r;
  asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
FP4C_DEVICE u32 absmax2(f16_t, u32 a, u32 b) {
  u32 r;
  asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// max |x| of a bf16 or f16 group from its 8 raw words (sm_86+):
// seven packed float maxima, then the larger of the two 16-bit magnitudes (non-negative
// 16-bit floats order like their bit patterns, infinities and NaNs above every finite).
template <typename T>
FP4C_DEVICE float packed_group_abs_max(const u32* w, bool& nonfinite) {
  u32 m = absmax2(T(), w[0], w[1]);
#pragma unroll
  for (int i = 2; i < 8; ++i) m = absmax2(T(), m, w[i]);
  const u32 lo = m & 0x7FFFu, hi = (m >> 16) & 0x7FFFu;
  const u32 mx = max(lo, hi);
  if constexpr (T::kIsBf16) {
    nonfinite = mx >= 0x7F80u;
    return __uint_as_float(mx << 16);
  } else {
    nonfinite = mx >= 0x7C00u;
    return f16_bits_to_float(mx);
  }
}

FP4C_DEVICE float bf16_group_abs_max(const u32* w, bool& nonfinite) {
  u32 m = w[0] & 0x7FFF7FFFu;
#pragma unroll
  for (int i = 1; i < 8; ++i) m = max_u16x2(m, w[i] & 0x7FFF7FFFu);
  const u32 mb = max(m << 16, m & 0xFFFF0000u);
  nonfinite = mb >= 0x7F800000u;
  return __uint_as_float(mb);
}

// Precomputed helpers a kernel may hand to the encoder (the store does):
//   os_tab: os = min(fl(1/fl(f*s)), FLT_MAX) (0 when f = 0) for each of the 128
//           non-negative E4M3 scale bytes, computed once per launch plan on the host
//           with the same IEEE float32 operations: a table read replaces a division;
//   pk:     the 8 multipliers that move a code (at bits 22..24) to its nibble
//           (2^10, 2^14, ..., 2^30 for mad.hi; 2^2, 2^6 for mad.lo).  Read from the
//           kernel's parameters, they stay integer multiply-adds (FMA pipe) instead of
//           becoming shifts (ALU pipe, the busiest one).
struct EncodeAux {
  const float* os_tab;
  const u32* pk;
};

// One candidate: scale byte and os for multiplier c.
template <bool AUX>
FP4C_DEVICE void candidate_scale(float m, float c, float s, float g, u32& sf, float& f, float& os,
                                 bool& clipped, const EncodeAux& aux) {
  const float a = f_mul(g, f_mul(m, c));
  // a > 464 (a >= 0, never NaN): at or below it the clip to 448 changes nothing
  clipped = __float_as_uint(a) > FP4C_SCALE_SATURATES_ABOVE_BITS;
  sf = e4m3_encode_nonneg(a);
  f = e4m3_decode(sf);
  if (AUX) {
    float o;
    asm("ld.global.nc.f32 %0, [%1];" : "=f"(o) : "l"(aux.os_tab + sf));
    os = o;
  } else if ((__float_as_uint(f) & 0x7FFFFFFFu) == 0u) {
    os = 0.0f;
  } else {
    os = f_min(f_div(1.0f, f_mul(f, s)), FP4C_FLT_MAX);
  }
}

// Rounded magnitudes r[i] = |e2m1(fl(x_i * os))| for the whole group.
template <bool CLAMP>
FP4C_DEVICE void round_group(const Group16& g, float os, float* r) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    float a = f_mul(f_abs(g.x[i]), os);
    if (CLAMP) a = f_min(a, 6.0f);
    r[i] = e2m1_round_mag(a);
  }
}

FP4C_DEVICE void round_group_any(const Group16& g, float m, float os, float* r) {
  // fl is monotone, so fl(m*os) bounds every fl(|x_i|*os).
  if (__float_as_uint(f_mul(m, os)) < 0x40E00000u) {  // < 7.0f (both >= 0)
    round_group<false>(g, os, r);
  } else {
    round_group<true>(g, os, r);
  }
}

// Sequential float32 sum of squared reconstruction errors.
FP4C_DEVICE float group_error(const Group16& g, const float* r, float f, float s) {
  float err = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float xh = f_mul(f_mul(r[i], f), s);
    const float d = f_sub(xh, f_abs(g.x[i]));
    err = f_add(err, f_mul(d, d));
  }
  return err;
}

// Magnitude codes of r[16] packed into two words (element 2i in the low nibble).
FP4C_DEVICE u32 mad_hi(u32 a, u32 b, u32 c) {
  u32 r;
  asm("mad.hi.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
FP4C_DEVICE u32 mad_lo(u32 a, u32 b, u32 c) {
  u32 r;
  asm("mad.lo.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
template <bool AUX>
FP4C_DEVICE void pack_mag_codes(const float* r, u32& lo, u32& hi, const EncodeAux& aux) {
  u32 w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    // code << 22 moved to bit 4*(i%8)
    const u32 c = __float_as_uint(f_mul(r[i], FP4C_TWO_M126));
    const int sh = 4 * (i & 7);
    if (AUX) {
      // shift and accumulate in one integer multiply-add; the shifted codes occupy
      // disjoint bits, so + is |
      w[i >> 3] = sh <= 22 ? mad_hi(c, aux.pk[sh / 4], w[i >> 3])
                           : mad_lo(c, aux.pk[sh / 4], w[i >> 3]);
    } else {
      w[i >> 3] |= sh <= 22 ? (c >> (22 - sh)) : (c << (sh - 22));
    }
  }
  lo = w[0];
  hi = w[1];
}

template <bool AUX>
FP4C_DEVICE void pack_codes(const Group16& g, const float* r, Encoded16& e, const EncodeAux& aux) {
  u32 lo, hi;
  pack_mag_codes<AUX>(r, lo, hi, aux);
  e.lo = lo | g.sgn[0];
  e.hi = hi | g.sgn[1];
}

template <int RULE, bool AUX = false>
FP4C_DEVICE Encoded16 encode_group_m(const Group16& g, float m, bool nonfinite, float s,
                                     float gm, const EncodeAux& aux = EncodeAux{nullptr, nullptr});

template <int RULE>
FP4C_DEVICE Encoded16 encode_group(const Group16& g, float s, float gm) {
  bool nonfinite;
  const float m = group_abs_max(g, nonfinite);
  return encode_group_m<RULE>(g, m, nonfinite, s, gm);
}

// The encoder given the group's max |x| (m) and whether the group is non-finite.  4over6
// packs each candidate's codes as soon as its error is known, so that only one
// candidate's 16 rounded values are live at a time (fewer registers, more warps).
template <int RULE, bool AUX>
FP4C_DEVICE Encoded16 encode_group_m(const Group16& g, float m, bool nonfinite, float s,
                                     float gm, const EncodeAux& aux) {
  Encoded16 e;
  e.nonfinite = nonfinite;
  e.saturated = false;
  e.underflow = false;
  if (nonfinite) {
    e.lo = 0u;
    e.hi = 0u;
    e.scale = 0x7Fu;
    return e;
  }
  u32 sf6;
  float f6, os6;
  bool clip6;
  candidate_scale<AUX>(m, FP4C_C6, s, gm, sf6, f6, os6, clip6, aux);
  float r6[16];
  round_group_any(g, m, os6, r6);
  const bool nonzero = __float_as_uint(m) != 0u;
  if (RULE == FP4C_RULE_4OVER6) {
    const float err6 = group_error(g, r6, f6, s);
    u32 lo6, hi6;
    pack_mag_codes<AUX>(r6, lo6, hi6, aux);
    u32 sf4;
    float f4, os4;
    bool clip4;
    candidate_scale<AUX>(m, 0.25f, s, gm, sf4, f4, os4, clip4, aux);
    float r4[16];
    round_group_any(g, m, os4, r4);
    const float err4 = group_error(g, r4, f4, s);
    u32 lo4, hi4;
    pack_mag_codes<AUX>(r4, lo4, hi4, aux);
    // err4 < err6 (a tie keeps 6); both are sums of squares (>= 0, never NaN), so
    // their bit patterns order like the values, subnormals included.
    const bool use4 = __float_as_uint(err4) < __float_as_uint(err6);
    e.scale = use4 ? sf4 : sf6;
    e.lo = (use4 ? lo4 : lo6) | g.sgn[0];
    e.hi = (use4 ? hi4 : hi6) | g.sgn[1];
    e.saturated = use4 ? clip4 : clip6;
  } else {
    e.scale = sf6;
    e.saturated = clip6;
    pack_codes<AUX>(g, r6, e, aux);
  }
  e.underflow = nonzero && e.scale < 8u;
  return e;
}

// Decode kernels give each thread one 16-byte piece of output, so that every store
// instruction of a warp writes 512 contiguous bytes (whole 32-byte sectors):
// kChunk<T> values (8 for bf16/f16, 4 for f32) = kChunk/2 bytes of packed codes.
template <typename T>
struct Chunk {
  static constexpr int kValues = 16 / T::kBytes;
  static constexpr int kPerGroup = 16 / kValues;  // threads per 16-value group
};

// Decode n = Chunk<T>::kValues codes (low nibbles first in `codes`) with scale
// byte sf and multiplier s; store them at p (16-byte aligned when VEC).
//
// Fast path (s < 2^116, the usual case), 2 multiplies and 1 PRMT per value:
//   * magnitude: the float whose bits are (4*v) << 16 is v * 2^-131 (a subnormal), and
//     4*v for the eight E2M1 magnitudes {0,.5,1,1.5,2,3,4,6} is {0,2,4,6,8,12,16,24}:
//     one byte, looked up for four codes at a time by a PRMT on a two-word table;
//   * sign: a second PRMT puts the value's byte at bits 16..23 and a byte holding only
//     its sign bit (0x80 or 0) at bits 24..31; bits 0..15 come from a sign-replicated
//     table byte (msb 0), i.e. zero;
//   * value: fl(x * fl(f*2^119)) = v*f*2^-12 exactly (v*f has at most 6 significant
//     bits and lies in [2^-10, 2688]), then fl(v*f*2^-12 * fl(s*2^12)) = fl(fl(v*f)*s),
//     the same real product rounded once: bit-identical to the contract's formula.
// Otherwise (s*2^12 not finite: huge or non-finite s) the plain formula is used.
#define FP4C_E2M1_X4_LO 0x06040200u  // 4*v for codes 0..3
#define FP4C_E2M1_X4_HI 0x18100C08u  // 4*v for codes 4..7
#define FP4C_TWO_P119 6.64613997892457936451e+35f
FP4C_DEVICE u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

template <int n>
FP4C_DEVICE void decode_values(u32 codes, u32 sf, float s, float* v) {
  const float f = e4m3_decode(sf);
  const float S = f_mul(s, 4096.0f);
  if (__float_as_uint(S) < 0x7F800000u) {  // positive and finite (s > 0 always)
    const float F = f_mul(f, FP4C_TWO_P119);
    const u32 mag = codes & 0x77777777u;
    const u32 lut_lo = FP4C_E2M1_X4_LO, lut_hi = FP4C_E2M1_X4_HI;
    const u32 b03 = prmt(lut_lo, lut_hi, mag);                      // codes 0..3 -> bytes
    const u32 b47 = n > 4 ? prmt(lut_lo, lut_hi, mag >> 16) : 0u;   // codes 4..7
    const u32 even = (codes << 4) & 0x80808080u;  // byte j: sign of code 2j at its msb
    const u32 odd = codes & 0x80808080u;          // byte j: sign of code 2j+1
#pragma unroll
    for (int i = 0; i < n; ++i) {
      // bytes 0,1 <- sign-replicated byte 0 of the table word (0); byte 2 <- table byte;
      // byte 3 <- sign byte (i >> 1) of the even/odd word
      const u32 sel = 0x88u | ((u32)(i & 3) << 8) | ((u32)(4 + (i >> 1)) << 12);
      const u32 bits = prmt(i < 4 ? b03 : b47, (i & 1) ? odd : even, sel);
      v[i] = f_mul(f_mul(__uint_as_float(bits), F), S);
    }
  } else {
#pragma unroll
    for (int i = 0; i < n; ++i) v[i] = f_mul(f_mul(e2m1_value(codes >> (4 * i)), f), s);
  }
}

template <typename T, bool VEC>
FP4C_DEVICE void decode_store_chunk(u32 codes, u32 sf, float s, void* p) {
  constexpr int n = Chunk<T>::kValues;
  float v[n];
  decode_values<n>(codes, sf, s, v);
  if constexpr (VEC && T::kBytes == 2) {
    U32x4 a;
    a.x = pack2(T(), v[0], v[1]);
    a.y = pack2(T(), v[2], v[3]);
    a.z = pack2(T(), v[4], v[5]);
    a.w = pack2(T(), v[6], v[7]);
    *(U32x4*)p = a;
  } else if constexpr (VEC) {
    U32x4 a;
    a.x = __float_as_uint(v[0]);
    a.y = __float_as_uint(v[1]);
    a.z = __float_as_uint(v[2]);
    a.w = __float_as_uint(v[3]);
    *(U32x4*)p = a;
  } else {
#pragma unroll
    for (int i = 0; i < n; ++i) store_one(T(), (char*)p + i * T::kBytes, v[i]);
  }
}

// Read-only global byte (the non-coherent path: the data is not written by the kernel).
FP4C_DEVICE u32 ldg_u8(const u8* p) {
  unsigned short r;
  asm("ld.global.nc.u8 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}

// Packed codes of one chunk: kValues/2 bytes at p (4 or 2 bytes), aligned or not.
template <typename T, bool ALIGNED>
FP4C_DEVICE u32 load_chunk_codes(const u8* p) {
  constexpr int nb = Chunk<T>::kValues / 2;
  if constexpr (ALIGNED && nb == 4) {
    u32 r;
    asm("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
  } else if constexpr (ALIGNED && nb == 2) {
    unsigned short r;
    asm("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
  } else {
    u32 r = 0u;
#pragma unroll
    for (int e = 0; e < nb; ++e) r |= (u32)p[e] << (8 * e);
    return r;
  }
}

// ---------------------------------------------------------------------------
// Integer helpers
// ---------------------------------------------------------------------------
// Unsigned division by a run-time constant d < 2^31 (Granlund-Montgomery):
// q = (umulhi(n, m) + n) >> s with s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1;
// struct FastDiv {u32 d, m, s;} is generated from fp4cache/_abi.py (a by-value field).
// A kernel takes its own copy of a parameter's FastDiv field by field: a struct copy of
// the param-space field makes other PTX (bench/ptx_diff.py).
FP4C_DEVICE FastDiv fastdiv_param(const FastDiv& f) { return FastDiv{f.d, f.m, f.s}; }
// The 33-bit sum goes through a funnel shift (s <= 31), so the quotient is a plain 32-bit
// value (a 64-bit shift made ptxas carry its high word into the callers' index math).
FP4C_DEVICE u32 fdiv(u32 n, const FastDiv& f) {
  const u32 lo = __umulhi(n, f.m) + n;
  return __funnelshift_r(lo, lo < n ? 1u : 0u, f.s);
}
