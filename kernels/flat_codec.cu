// fp4cache: flat NVFP4 quantize / dequantize of a [N, D] matrix.
//
// Row-major in and out: data [N, D/2] (element 2i in the low nibble), scales
// [N, D/16] (one E4M3 byte per 16-value group).  One thread per group; gid runs
// over the N*D/16 groups in memory order, so group gid reads values
// [16*gid, 16*gid + 16), writes data bytes [8*gid, 8*gid + 8) and scale byte gid.
#include "fp4_common.cuh"

template <typename T, int RULE, bool VEC>
FP4C_DEVICE void quantize_impl(const void* __restrict__ x, u8* __restrict__ data,
                               u8* __restrict__ scales, u64 total, float s, float g) {
  const u64 gid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (gid >= total) return;
  Group16 xs;
  load_group<T, VEC>((const char*)x + gid * 16 * T::kBytes, xs);
  const Encoded16 e = encode_group<RULE>(xs, s, g);
  store_codes<VEC>(data + gid * 8, e);
  scales[gid] = (u8)e.scale;
}

#define FP4C_QUANTIZE_KERNEL(NAME, T, RULE, VEC)                                       \
  extern "C" __global__ void __launch_bounds__(256)                                    \
      NAME(const void* __restrict__ x, u8* __restrict__ data, u8* __restrict__ scales, \
           u64 total, float s, float g) {                                              \
    quantize_impl<T, RULE, VEC>(x, data, scales, total, s, g);                         \
  }

// Output chunks of 16 bytes (Chunk<T>::kValues values); total counts chunks
// (N*D / kValues); a CTA covers FP4C_DECODE_CHUNKS * 256 consecutive chunks, thread
// tid every 256th one (coalesced stores, several loads in flight per thread).

template <typename T, bool VEC>
FP4C_DEVICE void dequantize_impl(const u8* __restrict__ data, const u8* __restrict__ scales,
                                 void* __restrict__ out, u64 total, float s) {
  constexpr int n = Chunk<T>::kValues;
  constexpr int M = FP4C_DECODE_CHUNKS;
  const u64 base = (u64)blockIdx.x * (blockDim.x * M) + threadIdx.x;
  u32 codes[M], sfb[M];
#pragma unroll
  for (int j = 0; j < M; ++j) {
    const u64 gid = base + (u64)j * blockDim.x;
    codes[j] = sfb[j] = 0u;
    if (gid >= total) continue;
    codes[j] = load_chunk_codes<T, VEC>(data + gid * (n / 2));
    sfb[j] = ldg_u8(scales + gid / Chunk<T>::kPerGroup);
  }
#pragma unroll
  for (int j = 0; j < M; ++j) {
    const u64 gid = base + (u64)j * blockDim.x;
    if (gid >= total) continue;
    decode_store_chunk<T, VEC>(codes[j], sfb[j], s, (char*)out + gid * n * T::kBytes);
  }
}

#define FP4C_DEQUANTIZE_KERNEL(NAME, T, VEC)                                                  \
  extern "C" __global__ void __launch_bounds__(256)                                           \
      NAME(const u8* __restrict__ data, const u8* __restrict__ scales, void* __restrict__ out, \
           u64 total, float s) {                                                              \
    dequantize_impl<T, VEC>(data, scales, out, total, s);                                     \
  }

#ifdef FP4C_INSTANTIATIONS
FP4C_INSTANTIATIONS
#endif
