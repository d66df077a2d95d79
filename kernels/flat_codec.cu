// fp4cache: flat NVFP4 quantize / dequantize of a [N, D] matrix.
//
// Row-major in and out: data [N, D/2] (element 2i in the low nibble), scales
// [N, D/16] (one E4M3 byte per 16-value group).  One thread per group; gid runs
// over the N*D/16 groups in memory order, so group gid reads values
// [16*gid, 16*gid + 16), writes data bytes [8*gid, 8*gid + 8) and scale byte gid.
#include "fp4_common.cuh"

template <typename T, int RULE, bool VEC>
FP4C_DEVICE void quantize_impl(const void* __restrict__ x, u8* __restrict__ data,
                               u8* __restrict__ scales, u64* __restrict__ stats, u64 total,
                               float s, float g) {
  const u64 gid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (gid >= total) return;
  Group16 xs;
  load_group<T, VEC>((const char*)x + gid * 16 * T::kBytes, xs);
  const Encoded16 e = encode_group<RULE>(xs, s, g);
  if (e.nonfinite && stats != nullptr) atomicAdd(stats, 1ull);
  if (VEC) {
    U32x2 a;
    a.x = e.lo;
    a.y = e.hi;
    *(U32x2*)(data + gid * 8) = a;
  } else {
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      data[gid * 8 + b] = (u8)(e.lo >> (8 * b));
      data[gid * 8 + 4 + b] = (u8)(e.hi >> (8 * b));
    }
  }
  scales[gid] = (u8)e.scale;
}

#define FP4C_QUANTIZE_KERNEL(NAME, T, RULE, VEC)                                       \
  extern "C" __global__ void __launch_bounds__(256)                                    \
      NAME(const void* __restrict__ x, u8* __restrict__ data, u8* __restrict__ scales, \
           u64* __restrict__ stats, u64 total, float s, float g) {                     \
    quantize_impl<T, RULE, VEC>(x, data, scales, stats, total, s, g);                  \
  }

// One thread decodes CH consecutive groups (CH = 1 or 2); total counts threads.
template <typename T, bool VEC, int CH>
FP4C_DEVICE void dequantize_impl(const u8* __restrict__ data, const u8* __restrict__ scales,
                                 void* __restrict__ out, u64 total, float s) {
  const u64 gid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (gid >= total) return;
  u32 w[2 * CH];
  const u8* p = data + gid * (8 * CH);
  if constexpr (VEC && CH == 2) {
    const U32x4 a = ldg16(p);
    w[0] = a.x;
    w[1] = a.y;
    w[2 * CH - 2] = a.z;
    w[2 * CH - 1] = a.w;
  } else if constexpr (VEC) {
    const U32x2 a = ldg8(p);
    w[0] = a.x;
    w[1] = a.y;
  } else {
#pragma unroll
    for (int k = 0; k < 2 * CH; ++k) {
      w[k] = 0u;
#pragma unroll
      for (int e = 0; e < 4; ++e) w[k] |= (u32)p[4 * k + e] << (8 * e);
    }
  }
  u32 sfb[CH];
#pragma unroll
  for (int j = 0; j < CH; ++j) sfb[j] = scales[gid * CH + j];
#pragma unroll
  for (int j = 0; j < CH; ++j)
    decode_store_group<T, VEC>(w[2 * j], w[2 * j + 1], sfb[j], s,
                               (char*)out + (gid * CH + j) * 16 * T::kBytes);
}

#define FP4C_DEQUANTIZE_KERNEL(NAME, T, VEC, CH)                                              \
  extern "C" __global__ void __launch_bounds__(256)                                           \
      NAME(const u8* __restrict__ data, const u8* __restrict__ scales, void* __restrict__ out, \
           u64 total, float s) {                                                              \
    dequantize_impl<T, VEC, CH>(data, scales, out, total, s);                                 \
  }

#ifdef FP4C_INSTANTIATIONS
FP4C_INSTANTIATIONS
#endif
