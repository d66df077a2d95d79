// fp4cache: the exact window's slots (docs/window.md), filled from and copied with pages.
//
//   fill:   map_window (mode 0: window_map[blocks[i]] = slots[i], and slot slots[i] >= 0
//           filled from page blocks[i]) and fill_window (mode 1: every mapped page's slot
//           refilled from the page), one launch.  A slot's value is the page's
//           dequantized float32 value in the stored basis (rotated K stays rotated)
//           rounded to bf16, NaN as 0x7FC0.
//   stage + write:  copy_window, after copy_blocks' page copy (page dst[i] already holds
//           page src[i]'s bytes): for a pair whose destination is mapped to slot d,
//           slot d <- slot map[src[i]] when the source is mapped too, else slot d is
//           filled from page dst[i].  Launch 1 (stage) copies every needed source slot
//           to staging row i (the cache's workspace), launch 2 (write) writes the
//           destination slots: every read of a slot precedes every write (chains, swaps
//           and cycles in one call).  A pair moves as copy_blocks' do: both ids in the
//           pool and src != dst.  Repeated destinations (only unvalidated ids) leave the
//           slot with one of the writers' values.
//
// Work items: one thread per group of 16 values of a slot, item gid = i * QG + q with
// QG = 2*T*H*G groups per slot and q = ((side*T + t)*H + h)*G + g: the window's own order
// (S, 2, T, H, D), so a warp writes contiguous bf16.
#include "fp4_common.cuh"
#include "hadamard.cuh"
#include "paged_layout.cuh"

template <typename IdT>
FP4C_DEVICE i64 load_window_id(const void* ids, u32 i) {
  return (i64)((const IdT*)ids)[i];
}

// Pair (or entry) i and group q of item gid.
FP4C_DEVICE void window_item(u32 gid, const WindowParams& P, u32& i, u32& q) {
  const FastDiv fQ = fastdiv_param(P.qg);
  i = fdiv(gid, fQ);
  q = gid - i * fQ.d;
}

FP4C_DEVICE u16* window_group(const WindowParams& P, u32 slot, u32 q) {
  return (u16*)P.win + ((u64)slot * P.qg.d + q) * 16u;
}

// Slot `slot`'s group q <- the same group of page b, dequantized, as bf16.
template <bool ALIGNED>
FP4C_DEVICE void fill_group(const WindowParams& P, i64 b, u32 slot, u32 q) {
  const FastDiv fG = fastdiv_param(P.g), fH = fastdiv_param(P.h), fT = fastdiv_param(P.t);
  const u32 G = fG.d, H = fH.d, Tn = fT.d;
  const u32 r = fdiv(q, fG), g = q - r * G;
  const u32 r2 = fdiv(r, fH), h = r - r2 * H;
  const u32 side = fdiv(r2, fT), t = r2 - side * Tn;
  const u8* p = (const u8*)P.buffer + (u64)b * (u64)(2 * P.side_bytes) +
                (u64)side * (u64)P.side_bytes;
  const u32 row = row_index(t, h, H, Tn, P.nhd);
  u32 lo, hi;
  if constexpr (ALIGNED) {
    const U32x2 c = ldg8(p + (u64)row * (G * 8) + g * 8);
    lo = c.x;
    hi = c.y;
  } else {
    const u8* c = p + (u64)row * (G * 8) + g * 8;
    lo = hi = 0u;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      lo |= ldg_u8(c + e) << (8 * e);
      hi |= ldg_u8(c + 4 + e) << (8 * e);
    }
  }
  const u64 soff = side == 0u ? (u64)P.data_bytes + (u64)row * G + g
                              : v_scale_offset(t, h, g, H, Tn, G, P.nhd, P.swizzle, P.swz_m,
                                               P.data_bytes);
  const u32 sf = ldg_u8(p + soff);
  float v[16];
  decode_group16(lo, hi, sf, side == 0u ? P.k_s : P.v_s, v);
  store_bf16x16(window_group(P, slot, q), bf16x16_of_nan(v));
}

// ---------------------------------------------------------------------------
// fill (map_window, fill_window)
// ---------------------------------------------------------------------------
template <typename IdT, bool ALIGNED>
FP4C_DEVICE void window_fill_impl(const void* __restrict__ blocks, const void* __restrict__ slots,
                                  const WindowParams& P) {
  const u32 gid = blockIdx.x * blockDim.x + threadIdx.x;
  if (gid >= P.total) return;
  u32 i, q;
  window_item(gid, P, i, q);
  const i64 b = load_window_id<IdT>(blocks, i);
  if ((u64)b >= (u64)P.num_blocks) return;  // validated by the front end: never
  int* map = (int*)P.win_map;
  i64 slot;
  if (P.mode == 0u) {
    slot = load_window_id<IdT>(slots, i);
    if (q == 0u) map[b] = (int)slot;  // nothing else of this launch reads the map
  } else {
    slot = map[b];
  }
  if ((u64)slot >= (u64)P.win_slots) return;  // -1: unmapped
  fill_group<ALIGNED>(P, b, (u32)slot, q);
}

// ---------------------------------------------------------------------------
// copy (copy_window)
// ---------------------------------------------------------------------------
// Pair i's ids and slots: whether it moves (copy_blocks' rule) and its destination is
// mapped; ss is its source's slot or -1.
template <typename IdT>
FP4C_DEVICE bool window_pair(const void* src, const void* dst, u32 i, const WindowParams& P,
                             i64& d, int& ds, int& ss) {
  const i64 s = load_window_id<IdT>(src, i);
  d = load_window_id<IdT>(dst, i);
  if ((u64)s >= (u64)P.num_blocks || (u64)d >= (u64)P.num_blocks || s == d) return false;
  const int* map = (const int*)P.win_map;
  ds = map[d];
  ss = map[s];
  if ((u32)ss >= P.win_slots) ss = -1;
  return (u32)ds < P.win_slots;
}

FP4C_DEVICE u16* staging_group(const WindowParams& P, u32 i, u32 q) {
  return (u16*)P.staging + ((u64)i * P.qg.d + q) * 16u;
}

FP4C_DEVICE void copy32(void* dst, const void* src) {
  const U32x4 a = ldg16(src);
  const U32x4 b = ldg16((const char*)src + 16);
  ((U32x4*)dst)[0] = a;
  ((U32x4*)dst)[1] = b;
}

// Launch 1: staging row i <- the source slot of every pair with both ends mapped.
template <typename IdT>
FP4C_DEVICE void window_stage_impl(const void* __restrict__ src, const void* __restrict__ dst,
                                   const WindowParams& P) {
  const u32 gid = blockIdx.x * blockDim.x + threadIdx.x;
  if (gid >= P.total) return;
  u32 i, q;
  window_item(gid, P, i, q);
  i64 d;
  int ds, ss;
  if (!window_pair<IdT>(src, dst, i, P, d, ds, ss) || ss < 0) return;
  copy32(staging_group(P, i, q), window_group(P, (u32)ss, q));
}

// Launch 2: the destination slots, from the staging rows or from the (copied) pages.
template <typename IdT, bool ALIGNED>
FP4C_DEVICE void window_write_impl(const void* __restrict__ src, const void* __restrict__ dst,
                                   const WindowParams& P) {
  const u32 gid = blockIdx.x * blockDim.x + threadIdx.x;
  if (gid >= P.total) return;
  u32 i, q;
  window_item(gid, P, i, q);
  i64 d;
  int ds, ss;
  if (!window_pair<IdT>(src, dst, i, P, d, ds, ss)) return;
  if (ss >= 0) {
    copy32(window_group(P, (u32)ds, q), staging_group(P, i, q));
  } else {
    fill_group<ALIGNED>(P, d, (u32)ds, q);
  }
}

#define FP4C_WINDOW_PARAMS \
  const void *__restrict__ a, const void *__restrict__ b, const WindowParams params

// NAME, id type, 8-byte aligned code loads
#define FP4C_WINDOW_FILL_KERNEL(NAME, IDT, ALIGNED)                                 \
  extern "C" __global__ void __launch_bounds__(256) NAME(FP4C_WINDOW_PARAMS) {      \
    window_fill_impl<IDT, ALIGNED>(a, b, params);                                   \
  }
#define FP4C_WINDOW_STAGE_KERNEL(NAME, IDT)                                         \
  extern "C" __global__ void __launch_bounds__(256) NAME(FP4C_WINDOW_PARAMS) {      \
    window_stage_impl<IDT>(a, b, params);                                           \
  }
#define FP4C_WINDOW_WRITE_KERNEL(NAME, IDT, ALIGNED)                                \
  extern "C" __global__ void __launch_bounds__(256) NAME(FP4C_WINDOW_PARAMS) {      \
    window_write_impl<IDT, ALIGNED>(a, b, params);                                  \
  }

#ifdef FP4C_INSTANTIATIONS
FP4C_INSTANTIATIONS
#endif
