// fp4cache: LongLive blocked layout (spec section 5).
//
//   amax:      max |x| of one block into amax[0] (float32 bits, atomicMax; the
//              host zeroes it first).  Any NaN/Inf makes it NaN (0x7FC00000, which
//              is above every finite bit pattern and +inf).
//   quantize:  one thread per group of the Rp x D/16 padded grid; the block's
//              scalars come from amax on the device: g = min(fl(6M/amax), FLT_MAX),
//              s = fl(amax * fl(1/(6M))).  amax == 0 writes zeros; a non-finite
//              amax writes scale 0x7F and zero data for every real row.  Padding
//              rows (r >= Tb*H) are zero.  Scales go to the 128x4 blocked order.
//   decode:    blocks given by three device pointer tables (values, scales, amax);
//              out[(b*R + r), g*16 ...] = fl(fl(v*sf) * fl(amax * inv_denom)).  A null
//              entry in any table (an out-of-range pool id) gives NaN rows for that
//              block and no read.
#include "fp4_common.cuh"
#include "paged_layout.cuh"

template <typename T, bool VEC>
FP4C_DEVICE void amax_impl(const void* __restrict__ x, u32* __restrict__ amax, u64 n) {
  // Each thread covers 8 values (16 bytes for bf16/f16, 32 for f32) per step.
  u32 mb = 0u;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u64 nchunks = n / 8;
  for (u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x; c < nchunks; c += stride) {
    const char* p = (const char*)x + c * 8 * T::kBytes;
    if constexpr (VEC && T::kBytes == 2) {
      const U32x4 a = ldg16(p);
      const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        mb = max(mb, __float_as_uint(lo_of(T(), w[e])) & 0x7FFFFFFFu);
        mb = max(mb, __float_as_uint(hi_of(T(), w[e])) & 0x7FFFFFFFu);
      }
    } else if constexpr (VEC) {
      const U32x4 a = ldg16(p);
      const U32x4 b = ldg16(p + 16);
      const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) mb = max(mb, w[e] & 0x7FFFFFFFu);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        mb = max(mb, __float_as_uint(load_one(T(), p + e * T::kBytes)) & 0x7FFFFFFFu);
    }
  }
  // tail
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (tid < n - nchunks * 8) {
    const char* p = (const char*)x + (nchunks * 8 + tid) * T::kBytes;
    mb = max(mb, __float_as_uint(load_one(T(), p)) & 0x7FFFFFFFu);
  }
  if (mb >= 0x7F800000u) mb = 0x7FC00000u;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mb = max(mb, __shfl_xor_sync(0xFFFFFFFFu, mb, o));
  __shared__ u32 warp_max[32];
  const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  if (lane == 0) warp_max[warp] = mb;
  __syncthreads();
  if (warp == 0) {
    mb = lane < (blockDim.x >> 5) ? warp_max[lane] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mb = max(mb, __shfl_xor_sync(0xFFFFFFFFu, mb, o));
    if (lane == 0 && mb != 0u) atomicMax(amax, mb);
  }
}

#define FP4C_AMAX_KERNEL(NAME, T, VEC)                                                    \
  extern "C" __global__ void __launch_bounds__(256)                                       \
      NAME(const void* __restrict__ x, u32* __restrict__ amax, u64 n) {                   \
    amax_impl<T, VEC>(x, amax, n);                                                        \
  }

template <typename T, int RULE, bool VEC>
FP4C_DEVICE void ll_quantize_impl(const void* __restrict__ x, const float* __restrict__ amax,
                                  u8* __restrict__ values, u8* __restrict__ sf, u32 total,
                                  u32 rows, FastDiv fG) {
  const u32 gid = blockIdx.x * blockDim.x + threadIdx.x;
  if (gid >= total) return;
  const u32 r = fdiv(gid, fG);
  const u32 g = gid - r * fG.d;
  const u32 G = fG.d;
  const float am = amax[0];
  Encoded16 e;
  e.lo = e.hi = e.scale = 0u;
  if (r < rows) {
    if ((__float_as_uint(am) & 0x7FFFFFFFu) >= 0x7F800000u) {  // NaN or inf: the whole block decodes to NaN
      e.scale = 0x7Fu;
    } else if ((__float_as_uint(am) & 0x7FFFFFFFu) != 0u) {
      const float M6 = RULE == FP4C_RULE_4OVER6 ? 1536.0f : 2688.0f;        // fl(6*M)
      // fl(1/1536) and fl(1/2688)
      const float inv6M = __uint_as_float(RULE == FP4C_RULE_4OVER6 ? 0x3A2AAAABu : 0x39C30C31u);
      const float gm = f_min(f_div(M6, am), FP4C_FLT_MAX);
      const float s = f_mul(am, inv6M);
      Group16 xs;
      load_group<T, VEC>((const char*)x + (u64)gid * 16 * T::kBytes, xs);
      e = encode_group<RULE>(xs, s, gm);
    }
  }
  store_codes<VEC>(values + (u64)gid * 8, e);
  sf[blocked_scale_offset<i64>(r, g, G)] = (u8)e.scale;
}

#define FP4C_LL_QUANTIZE_KERNEL(NAME, T, RULE, VEC)                                            \
  extern "C" __global__ void __launch_bounds__(256)                                            \
      NAME(const void* __restrict__ x, const float* __restrict__ amax, u8* __restrict__ values, \
           u8* __restrict__ sf, u32 total, u32 rows, u32 gd, u32 g_m, u32 g_s) {                \
    ll_quantize_impl<T, RULE, VEC>(x, amax, values, sf, total, rows, FastDiv{gd, g_m, g_s});   \
  }

// Output chunks of 16 bytes (Chunk<T>::kValues values of row r of block b); a CTA
// covers FP4C_DECODE_CHUNKS * 256 consecutive chunks, thread tid every 256th one
// (coalesced stores, several loads in flight per thread).

// Where the blocks come from: either three device pointer tables (value_ptrs != 0),
// or a pool (base pointer + byte stride per array) and a block-id array; an id outside
// [0, n_pool) or a null table entry reads nothing and decodes to NaN.  The LLSource
// struct (device addresses as u64) is generated from fp4cache/_abi.py.

// Addresses of output block b's values, scale factors and amax: from the pointer
// tables, or from the pool and the block's id (null for an id outside the pool).
FP4C_DEVICE void block_addresses(const LLSource& src, u32 b, const u8*& vals, const u8*& sfs,
                                 u64& ap) {
  if (src.value_ptrs != 0u) {
    vals = (const u8*)((const u64*)src.value_ptrs)[b];
    sfs = (const u8*)((const u64*)src.sf_ptrs)[b];
    ap = ((const u64*)src.amax_ptrs)[b];
  } else {
    const i64 id = src.ids64 ? ((const i64*)src.ids)[b] : (i64)((const int*)src.ids)[b];
    const bool ok = id >= 0 && id < src.n_pool;
    const u64 u = ok ? (u64)id : 0u;
    vals = ok ? (const u8*)(src.vbase + u * src.vstride) : nullptr;
    sfs = ok ? (const u8*)(src.sbase + u * src.sstride) : nullptr;
    ap = ok ? src.abase + u * src.astride : 0u;
  }
}

template <typename T, bool VEC>
FP4C_DEVICE void ll_decode_impl(const LLSource& src, void* __restrict__ out, u32 total,
                                FastDiv fRC, FastDiv fC, float inv_denom) {
  constexpr int n = Chunk<T>::kValues;
  constexpr int per_group = Chunk<T>::kPerGroup;
  constexpr int M = FP4C_DECODE_CHUNKS;
  const u32 G = fC.d / per_group;
  const u32 base = blockIdx.x * (blockDim.x * M) + threadIdx.x;
  u32 codes[M], sfb[M];
  float gs[M];
  // The chunks of one thread nearly always lie in the same block: look its three
  // pointers (and amax) up once, again only when the block changes.
  u32 bprev = 0xFFFFFFFFu;
  const u8* vals = nullptr;
  const u8* sfs = nullptr;
  float scale = 0.0f;
  bool null_block = false, aligned = true;
#pragma unroll
  for (int j = 0; j < M; ++j) {
    const u32 gid = base + j * blockDim.x;
    codes[j] = 0u;
    sfb[j] = 0u;
    gs[j] = 0.0f;
    if (gid >= total) continue;
    const u32 b = fdiv(gid, fRC);
    const u32 rem = gid - b * fRC.d;  // r * C + c
    const u32 r = fdiv(rem, fC);
    const u32 c = rem - r * fC.d;
    if (b != bprev) {
      bprev = b;
      u64 ap;
      block_addresses(src, b, vals, sfs, ap);
      // A null pointer marks a block id outside the pool: NaN rows, nothing read.
      null_block = vals == nullptr || sfs == nullptr || ap == 0u;
      aligned = (((u64)vals) & (n / 2 - 1)) == 0u;  // chunk offsets are multiples of n/2
      if (!null_block) {
        float am;
        asm("ld.global.nc.f32 %0, [%1];" : "=f"(am) : "l"(ap));
        scale = f_mul(am, inv_denom);
      }
    }
    if (null_block) {  // codes 0 with scale 0x7F decode to NaN
      sfb[j] = 0x7Fu;
      gs[j] = 1.0f;
      continue;
    }
    const u8* p = vals + (u64)rem * (n / 2);
    codes[j] = aligned ? load_chunk_codes<T, true>(p) : load_chunk_codes<T, false>(p);
    sfb[j] = ldg_u8(sfs + blocked_scale_offset<u32>(r, c / per_group, G));
    gs[j] = scale;
  }
#pragma unroll
  for (int j = 0; j < M; ++j) {
    const u32 gid = base + j * blockDim.x;
    if (gid >= total) continue;
    decode_store_chunk<T, VEC>(codes[j], sfb[j], gs[j], (char*)out + (u64)gid * 16);
  }
}

#define FP4C_LL_DECODE_KERNEL(NAME, T, VEC)                                                   \
  extern "C" __global__ void __launch_bounds__(256)                                           \
      NAME(const LLSource src, void* __restrict__ out, u32 total, u32 rcd, u32 rc_m,          \
           u32 rc_s, u32 cd, u32 c_m, u32 c_s, float inv_denom) {                             \
    ll_decode_impl<T, VEC>(src, out, total, FastDiv{rcd, rc_m, rc_s}, FastDiv{cd, c_m, c_s}, \
                           inv_denom);                                                        \
  }

// Wide variant for 2-byte outputs (bf16/f16: 4 code bytes per 16-byte output chunk)
// when every block's values are 16-byte aligned.  Grid: x covers one block's R*C
// chunks, FP4C_LL_WIDE_TILES * 1024 per CTA (all tiles' loads issued first); y is the block (its three pointers are uniform over the CTA).
// Each lane loads the codes of 4 consecutive chunks with one 16-byte load, the warp
// transposes them through 512 bytes of shared memory, and lane l then decodes chunks
// l, l+32, l+64, l+96 of the warp's 128: every store instruction of the warp still
// writes 512 contiguous bytes, while each thread has 4x the bytes of codes in flight.
template <typename T>
FP4C_DEVICE void ll_decode_wide_impl(const LLSource& src, void* __restrict__ out, u32 rc,
                                     FastDiv fC, float inv_denom) {
  static_assert(T::kBytes == 2, "wide decode: 2-byte outputs only");
  constexpr int NT = FP4C_LL_WIDE_TILES;  // tiles of 1024 chunks per CTA, loads all first
  __shared__ U32x4 stage[NT][256];
  const u32 G = fC.d / 2;
  const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const u32 b = blockIdx.y;
  const u8 *vals, *sfs;
  u64 ap;
  block_addresses(src, b, vals, sfs, ap);
  const bool null_block = vals == nullptr || sfs == nullptr || ap == 0u;
  float scale = 1.0f;
  U32x4 raw[NT];
  u32 sfb[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    raw[t] = U32x4{0u, 0u, 0u, 0u};
#pragma unroll
    for (int k = 0; k < 4; ++k) sfb[t][k] = 0x7Fu;  // NaN rows for a block outside the pool
  }
  if (!null_block) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const u32 wbase = (blockIdx.x * NT + t) * 1024u + warp * 128u;  // warp's first chunk
      const u32 q = wbase + 4u * lane;  // rc is a multiple of 4, so q < rc covers q..q+3
      if (q < rc) raw[t] = ldg16(vals + (u64)q * 4u);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const u32 c = wbase + 32u * k + lane;
        if (c < rc) {
          const u32 r = fdiv(c, fC);
          sfb[t][k] = ldg_u8(sfs + blocked_scale_offset<u32>(r, (c - r * fC.d) >> 1, G));
        }
      }
    }
    float am;
    asm("ld.global.nc.f32 %0, [%1];" : "=f"(am) : "l"(ap));
    scale = f_mul(am, inv_denom);
  }
  char* o = (char*)out + ((u64)b * rc) * 16u;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    stage[t][threadIdx.x] = raw[t];
    __syncwarp();
    const u32* words = (const u32*)(&stage[t][warp * 32u]);
    const u32 wbase = (blockIdx.x * NT + t) * 1024u + warp * 128u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const u32 c = wbase + 32u * k + lane;
      if (c < rc) {
        decode_store_chunk<T, true>(words[32u * k + lane], sfb[t][k], scale, o + (u64)c * 16u);
      }
    }
  }
}

#define FP4C_LL_DECODE_WIDE_KERNEL(NAME, T)                                                   \
  extern "C" __global__ void __launch_bounds__(256)                                           \
      NAME(const LLSource src, void* __restrict__ out, u32 rc, u32 cd, u32 c_m, u32 c_s,       \
           float inv_denom) {                                                                 \
    ll_decode_wide_impl<T>(src, out, rc, FastDiv{cd, c_m, c_s}, inv_denom);                   \
  }

#ifdef FP4C_INSTANTIATIONS
FP4C_INSTANTIATIONS
#endif
