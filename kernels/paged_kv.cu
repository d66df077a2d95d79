// fp4cache: paged NVFP4 KV cache kernels (vLLM layout, spec section 4).
//
//   store:          K and V of N tokens -> their pages, one launch.  One thread
//                   encodes one 16-value group of K and the same group of V.
//   claim:          the duplicate-slot pre-pass used for large N (see below).
//   gather:         pages listed in a device block-id array -> bf16/f16/f32 rows,
//                   no host sync, no allocation (CUDA-graph capturable).
//
// Duplicate slots ("the last occurrence in slot_mapping wins", asked for per call; the
// default promises unique slots, dedup 0), chosen per call by the host (dedup field):
//   1 = scan:  token i is written only if no j > i has the same slot (used for
//              N <= FP4C_SCAN_MAX_TOKENS, e.g. decode steps): every CTA copies
//              slot_mapping into shared memory, thread t compares slot t with all
//              later ones, and the items read the verdict of their token;
//   2 = claim: a pre-pass does atomicMax(claim[slot], i + 1) for every valid token,
//              the store writes token i only if claim[slot] holds exactly i + 1, and a
//              clear pass sets claim[slot] = 0 again for every token.  The claim table
//              (u32, one entry per slot) belongs to the cache and is all zero between
//              calls, so there is no epoch to wrap: three launches, no host sync,
//              deterministic, and a captured CUDA graph replays correctly any number of
//              times.
#include "fp4_common.cuh"
#include "hadamard.cuh"
#include "paged_layout.cuh"

template <typename SlotT>
FP4C_DEVICE i64 load_slot(const void* p, i64 i) {
  return (i64)((const SlotT*)p)[i];
}

// slot -> (page, t).  Slots below 2^31 use the fast divider.
FP4C_DEVICE void split_slot(i64 slot, const FastDiv& fT, u64& page, u32& t) {
  if (slot < 0x7FFFFFFFll) {
    const u32 p = fdiv((u32)slot, fT);
    page = p;
    t = (u32)slot - p * fT.d;
  } else {
    page = (u64)slot / fT.d;
    t = (u32)((u64)slot - page * fT.d);
  }
}

// ---------------------------------------------------------------------------
// store
// ---------------------------------------------------------------------------
// Every non-pointer argument of the store travels by value in one StoreParams struct
// (generated from fp4cache/_abi.py): a decode step passes slots, k, v and the struct.

// NH = heads per thread: 1, or 2 when H is even.  With NH = 2 a thread encodes group g of
// heads h and h + H/2 of one token (K and V of each): the slot lookup, the duplicate
// check and the page address are shared, and the second head's pool offsets are the
// first's plus one constant (pair_rows rows), in both layouts and with the swizzle
// (it moves t only).  The host passes hg = (H/NH)*G.

// Token, (first) head and group of work item gid.
struct StoreItem {
  u32 i, h, g, rem;  // rem = h*G + g
};
FP4C_DEVICE StoreItem store_item(u32 gid, const StoreParams& P) {
  const FastDiv fHG = fastdiv_param(P.hg), fG = fastdiv_param(P.g);
  StoreItem it;
  it.i = fdiv(gid, fHG);
  it.rem = gid - it.i * fHG.d;
  it.h = fdiv(it.rem, fG);
  it.g = it.rem - it.h * fG.d;
  return it;
}

// Address of the item's K (or V) group in the input.
template <typename T>
FP4C_DEVICE const char* store_src(const void* x, const StoreItem& it, i64 tok_stride,
                                  i64 head_stride) {
  return (const char*)x + (it.i * tok_stride + it.h * head_stride + it.g * 16) * T::kBytes;
}

#if FP4C_SCAN_MAX_TOKENS > 256
#error "the duplicate scan takes one thread per token in a CTA of 256 threads"
#endif

// dedup 1: last[t] = 1 when no later token repeats token t's slot, for the n <=
// FP4C_SCAN_MAX_TOKENS tokens, computed by the whole CTA in shared memory: one global
// read per token, then independent shared-memory compares (no early exit, so they
// pipeline) instead of a chain of dependent global loads in every thread.  Every thread
// of the CTA must call it.
template <typename SlotT>
FP4C_DEVICE void scan_last_occurrences(const void* slots, u32 n, i64* s_slot, u8* last) {
  const u32 t = threadIdx.x;
  if (t < n) s_slot[t] = load_slot<SlotT>(slots, t);
  __syncthreads();
  if (t < n) {
    const i64 me = s_slot[t];
    bool later = false;
#pragma unroll 8
    for (u32 q = t + 1; q < n; ++q) later |= s_slot[q] == me;
    last[t] = later ? 0 : 1;
  }
  __syncthreads();
}

// Whether token it.i writes slot `slot` (a valid slot, no later duplicate), counting
// bad slots once per token: -1 is vLLM's padding id (skipped, not counted); any other
// negative slot, like one >= num_slots, is bad.  dedup: 1 = the scan's verdict (last),
// 2 = claim table (the claim pass left i + 1 of the last token with this slot).
FP4C_DEVICE bool store_slot_live(i64 slot, const StoreItem& it, const StoreParams& P,
                                 const u8* last) {
  if (slot == -1) return false;
  if ((u64)slot >= (u64)P.num_slots) {  // negative (as u64: huge) or past the pool
    if (it.rem == 0) atomicAdd((u64*)P.stats + FP4C_STAT_BAD_SLOTS, 1ull);
    return false;
  }
  if (P.dedup == 1) {
    return last[it.i] != 0;
  } else if (P.dedup == 2) {
    return ((const u32*)P.claim)[slot] == it.i + 1u;
  }
  return true;
}

// Where the item's groups go: the page's K side, the data offset and both scale offsets
// of head it.h (the other head of a pair adds pair_rows rows to each).
struct StoreDest {
  u8* kside;
  u64 doff, ksoff, vsoff;
  u64 page;  // the slot's page and token (the window's row)
  u32 t;
};
FP4C_DEVICE StoreDest store_dest(i64 slot, const StoreItem& it, const StoreParams& P) {
  const FastDiv fT = fastdiv_param(P.t);
  const u32 G = P.g.d, Tn = fT.d, g = it.g;
  u64 page;
  u32 t;
  split_slot(slot, fT, page, t);
  const u32 row = row_index(t, it.h, P.H, Tn, P.nhd);
  StoreDest d;
  d.kside = (u8*)P.buffer + page * (u64)(2 * P.side_bytes);
  d.doff = (u64)row * (G * 8) + g * 8;
  d.ksoff = (u64)P.data_bytes + (u64)row * G + g;
  d.vsoff = v_scale_offset(t, it.h, g, P.H, Tn, G, P.nhd, P.swizzle, P.swz_m, P.data_bytes);
  d.page = page;
  d.t = t;
  return d;
}

// max |x| of a raw group (x its float32 values) and whether it is non-finite.
template <typename T>
FP4C_DEVICE float raw_group_abs_max(const RawGroup<T>& r, const Group16& x, bool& nonfinite) {
  // 16-bit inputs: packed float maxima on sm_86+ (measured faster), an integer max of
  // bf16 below; float32 (and f16 below sm_86): the float max
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 860
  constexpr bool kPacked = T::kBytes == 2;
#else
  constexpr bool kPacked = false;
#endif
  if constexpr (kPacked) {
    return packed_group_abs_max<T>(r.w, nonfinite);
  } else if constexpr (T::kIsBf16) {
    return bf16_group_abs_max(r.w, nonfinite);
  } else {
    return group_abs_max(x, nonfinite);
  }
}

// Encode the NH K groups and NH V groups of one item.
template <typename T, int RULE, int NH>
FP4C_DEVICE void store_encode(const RawGroup<T>* rk, const RawGroup<T>* rv, const StoreParams& P,
                              const u32* pk, Encoded16* ek, Encoded16* ev) {
  const float* __restrict__ os_tab = (const float*)P.os_tab;
#pragma unroll
  for (int q = 0; q < NH; ++q) {
    Group16 xk, xv;
    unpack_raw(rk[q], xk);
    unpack_raw(rv[q], xv);
    bool nk, nv;
    const float mk = raw_group_abs_max<T>(rk[q], xk, nk);
    const float mv = raw_group_abs_max<T>(rv[q], xv, nv);
    ek[q] = encode_group_m<RULE, true>(xk, mk, nk, P.k_s, P.k_g, EncodeAux{os_tab, pk});
    ev[q] = encode_group_m<RULE, true>(xv, mv, nv, P.v_s, P.v_g, EncodeAux{os_tab + 128, pk});
  }
}

// max |x| of a group of floats as a tree (depth 4: the rotated K's values arrive at once).
FP4C_DEVICE float group_abs_max_tree(const Group16& g, bool& nonfinite) {
  u32 m[8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
    m[i] = max(__float_as_uint(g.x[i]) & 0x7FFFFFFFu, __float_as_uint(g.x[i + 8]) & 0x7FFFFFFFu);
#pragma unroll
  for (int w = 4; w >= 1; w >>= 1) {
#pragma unroll
    for (int i = 0; i < w; ++i) m[i] = max(m[i], m[i + w]);
  }
  nonfinite = m[0] >= 0x7F800000u;
  return __uint_as_float(m[0]);
}

// The same with K rotated (rotation="hadamard"): K's NH groups are the float32 values of
// the transform (their max and signs from the floats: the packed bf16 max does not apply).
template <typename T, int RULE, int NH>
FP4C_DEVICE void store_encode_rot(const float (*yk)[16], const RawGroup<T>* rv,
                                  const StoreParams& P, const u32* pk, Encoded16* ek,
                                  Encoded16* ev) {
  const float* __restrict__ os_tab = (const float*)P.os_tab;
#pragma unroll
  for (int q = 0; q < NH; ++q) {
    Group16 xk, xv;
#pragma unroll
    for (int e = 0; e < 16; ++e) xk.x[e] = yk[q][e];
    signs_from_floats(xk);
    unpack_raw(rv[q], xv);
    bool nk, nv;
    const float mk = group_abs_max_tree(xk, nk);
    const float mv = raw_group_abs_max<T>(rv[q], xv, nv);
    ek[q] = encode_group_m<RULE, true>(xk, mk, nk, P.k_s, P.k_g, EncodeAux{os_tab, pk});
    ev[q] = encode_group_m<RULE, true>(xv, mv, nv, P.v_s, P.v_g, EncodeAux{os_tab + 128, pk});
  }
}

// bf16 bits of a raw input group (bf16: the words themselves).
template <typename T>
FP4C_DEVICE Bf16x16 bf16x16_of_raw(const RawGroup<T>& r) {
  if constexpr (T::kIsBf16) {
    Bf16x16 b;
#pragma unroll
    for (int j = 0; j < 8; ++j) b.w[j] = r.w[j];
    return b;
  } else {
    Group16 x;
    unpack_raw(r, x);
    return bf16x16_of(x.x);
  }
}

// The window slot of a valid slot's page (-1: none, or no window): one int32 load, issued
// before the encode so that the arithmetic hides its latency (a volatile asm keeps it
// there: a plain load may be moved into the branch that uses it, after the encode).
FP4C_DEVICE int store_window_slot(i64 slot, const StoreParams& P) {
  if (P.win_slots == 0u || (u64)slot >= (u64)P.num_slots) return -1;
  u64 page;
  u32 t;
  split_slot(slot, fastdiv_param(P.t), page, t);
  int ws;
  asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(ws) : "l"((const int*)P.win_map + page));
  return ws;
}

// The exact window: when the item's page is mapped to a slot ws of [0, win_slots), its NH
// K and NH V groups as bf16 (16 x 0x7FC0 for a group the encoder found non-finite) into
// window[ws, side, t, h, 16g : 16g + 16], layout (S, 2, T, H, D).
template <int NH>
FP4C_DEVICE void store_window(int ws, const Bf16x16* wk, const Bf16x16* wv, const Encoded16* ek,
                              const Encoded16* ev, const StoreDest& d, const StoreItem& it,
                              const StoreParams& P) {
  if ((u32)ws >= P.win_slots) return;  // -1 (unmapped) as u32 is huge
  const u32 Tn = P.t.d, H = P.H, D = P.g.d * 16u;
  const u64 row = ((u64)(u32)ws * 2u * Tn + d.t) * H + it.h;
  u16* kw = (u16*)P.win + row * D + it.g * 16u;
  u16* vw = kw + (u64)Tn * H * D;
#pragma unroll
  for (int q = 0; q < NH; ++q) {
    const u64 o = (u64)q * (H / NH) * D;  // NH = 2: head h + H/2
    store_bf16x16(kw + o, ek[q].nonfinite ? bf16x16_nan() : wk[q]);
    store_bf16x16(vw + o, ev[q].nonfinite ? bf16x16_nan() : wv[q]);
  }
}

// Count the groups of the written items that have a property (non-finite, clipped or
// underflowed scale): one atomic per warp and counter, from the lanes that write.
FP4C_DEVICE void count_groups(u64* stats, int index, u32 n) {
  const u32 active = __activemask();
  const u32 any = __ballot_sync(active, n != 0u);
  if (any == 0u) return;
  const u32 total = __reduce_add_sync(active, n);
  if ((threadIdx.x & 31u) == (u32)(__ffs(active) - 1)) atomicAdd(stats + index, (u64)total);
}

// Write an item's encoded groups to its page and count its special groups.
template <bool VEC, int NH>
FP4C_DEVICE void store_write(const Encoded16* ek, const Encoded16* ev, const StoreDest& d,
                             const StoreParams& P) {
  const u32 G = P.g.d;
  u8* ks = d.kside;
  u8* vs = ks + P.side_bytes;
  u32 n[6] = {0u, 0u, 0u, 0u, 0u, 0u};  // k/v non-finite, k/v clipped, k/v underflow
#pragma unroll
  for (int q = 0; q < NH; ++q) {
    n[0] += ek[q].nonfinite ? 1u : 0u;
    n[1] += ev[q].nonfinite ? 1u : 0u;
    n[2] += ek[q].saturated ? 1u : 0u;
    n[3] += ev[q].saturated ? 1u : 0u;
    n[4] += ek[q].underflow ? 1u : 0u;
    n[5] += ev[q].underflow ? 1u : 0u;
    const u32 dr = q * P.pair_rows;  // pool rows from head h to this head
    const u64 o = d.doff + (u64)dr * (G * 8);
    store_codes<VEC>(ks + o, ek[q]);
    store_codes<VEC>(vs + o, ev[q]);
    ks[d.ksoff + (u64)dr * G] = (u8)ek[q].scale;
    vs[d.vsoff + (u64)dr * G] = (u8)ev[q].scale;
  }
  u64* stats = (u64*)P.stats;
  const u32 special = n[0] | n[1] | n[2] | n[3] | n[4] | n[5];
  if (__ballot_sync(__activemask(), special != 0u) == 0u) return;  // the common case
  count_groups(stats, FP4C_STAT_K_NONFINITE_GROUPS, n[0]);
  count_groups(stats, FP4C_STAT_V_NONFINITE_GROUPS, n[1]);
  count_groups(stats, FP4C_STAT_K_SATURATED_GROUPS, n[2]);
  count_groups(stats, FP4C_STAT_V_SATURATED_GROUPS, n[3]);
  count_groups(stats, FP4C_STAT_K_UNDERFLOW_GROUPS, n[4]);
  count_groups(stats, FP4C_STAT_V_UNDERFLOW_GROUPS, n[5]);
}

// One kernel thread per item: M = 1 (two items per thread were measured and dropped:
// docs/kernels.md).  The one-trip loops over M stay on purpose: NVVM compiles this
// shape better than the same steps written straight (that gave other PTX and, by `ptxas
// -v`, up to 16 more registers: 4over6 80 -> 96, i.e. 3 -> 2 CTAs per SM).  The loads of
// the item are issued first, then its groups encoded, and only then is it decided whether
// and where the item goes: the slot, duplicate and claim lookups overlap the loads and the
// arithmetic (a skipped or losing token's encoding is simply not written).
//
// ROT (rotation="hadamard"): K goes through the transform of hadamard.cuh right after the
// loads, in every lane of the warp (a lane past the grid's end or of a skipped token still
// takes part in the shuffles: nothing exits before it).  WIN (a cache with a window): a
// written item's groups also go to its page's window slot (store_window).
template <typename T, int RULE, typename SlotT, bool VEC, int NH, bool ROT, bool WIN>
FP4C_DEVICE void store_impl(const void* __restrict__ slots, const void* __restrict__ k,
                            const void* __restrict__ v, const StoreParams& P) {
  const u32 pk[8] = {P.pk[0], P.pk[1], P.pk[2], P.pk[3], P.pk[4], P.pk[5], P.pk[6], P.pk[7]};
  constexpr int M = 1;  // items per thread (see above)
  RawGroup<T> rk[M][NH], rv[M][NH];
  StoreItem it[M];
  i64 slot[M];
  bool inr[M];
  // small stores: the verdicts of the duplicate scan first (at the start, where few
  // registers are live; the kernel is latency-bound at these sizes anyway)
  __shared__ i64 s_slot[FP4C_SCAN_MAX_TOKENS];
  __shared__ u8 s_last[FP4C_SCAN_MAX_TOKENS];
  if (P.dedup == 1) scan_last_occurrences<SlotT>(slots, P.n_tokens, s_slot, s_last);  // uniform
  const u32 base = blockIdx.x * (blockDim.x * M) + threadIdx.x;
#pragma unroll
  for (int j = 0; j < M; ++j) {
    const u32 gid = base + j * blockDim.x;
    inr[j] = gid < P.total;
    if constexpr (ROT) {  // defined values for the lanes without an item
#pragma unroll
      for (int q = 0; q < NH; ++q) {
#pragma unroll
        for (int e = 0; e < 4 * T::kBytes; ++e) rk[j][q].w[e] = 0u;
      }
    }
    if (!inr[j]) continue;
    it[j] = store_item(gid, P);
    // K/V addresses depend on (i, h, g) only
    const char* kp = store_src<T>(k, it[j], P.k_tok_stride, P.k_head_stride);
    const char* vp = store_src<T>(v, it[j], P.v_tok_stride, P.v_head_stride);
#pragma unroll
    for (int q = 0; q < NH; ++q) {
      load_raw<T, VEC>(kp + q * P.k_pair_bytes, rk[j][q]);
      load_raw<T, VEC>(vp + q * P.v_pair_bytes, rv[j][q]);
    }
    slot[j] = load_slot<SlotT>(slots, it[j].i);
  }
  int wslot[M];  // WIN: the window slot of the item's page
  if constexpr (WIN) {
#pragma unroll
    for (int j = 0; j < M; ++j) wslot[j] = inr[j] ? store_window_slot(slot[j], P) : -1;
  }
  float yk[M][NH][16];  // ROT: K of the item, rotated
  if constexpr (ROT) {
#pragma unroll
    for (int j = 0; j < M; ++j) {
#pragma unroll
      for (int q = 0; q < NH; ++q) {
        Group16 x;
        unpack_raw(rk[j][q], x);
#pragma unroll
        for (int e = 0; e < 16; ++e) yk[j][q][e] = x.x[e];
      }
      // group g of the head is gid mod G (H*G and (H/2)*G are multiples of G = 2^k)
      const u32 gid = base + j * blockDim.x;
      hadamard_rows<NH>(yk[j], gid & (P.g.d - 1u), P.g.d, P.rot_scale);
    }
  }
  Bf16x16 wk[M][NH];  // WIN and ROT: the window's K, packed at once (8 words, not 16 floats)
  if constexpr (WIN && ROT) {
#pragma unroll
    for (int j = 0; j < M; ++j) {
#pragma unroll
      for (int q = 0; q < NH; ++q) wk[j][q] = bf16x16_of(yk[j][q]);
    }
  }
  Encoded16 ek[M][NH], ev[M][NH];
#pragma unroll
  for (int j = 0; j < M; ++j) {
    if (!inr[j]) continue;
    if constexpr (ROT) {
      store_encode_rot<T, RULE, NH>(yk[j], rv[j], P, pk, ek[j], ev[j]);
    } else {
      store_encode<T, RULE, NH>(rk[j], rv[j], P, pk, ek[j], ev[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < M; ++j) {
    if (!inr[j]) continue;
    if (!store_slot_live(slot[j], it[j], P, s_last)) continue;
    const StoreDest d = store_dest(slot[j], it[j], P);
    store_write<VEC, NH>(ek[j], ev[j], d, P);
    if constexpr (WIN) {
      if (wslot[j] >= 0) {
        // the input groups are read again (cache hits) rather than kept in registers
        // through the encode: an unmapped token costs one map load and no registers
        const char* kp = store_src<T>(k, it[j], P.k_tok_stride, P.k_head_stride);
        const char* vp = store_src<T>(v, it[j], P.v_tok_stride, P.v_head_stride);
        Bf16x16 bk[NH], bv[NH];
#pragma unroll
        for (int q = 0; q < NH; ++q) {
          RawGroup<T> r;
          if constexpr (ROT) {
            bk[q] = wk[j][q];
          } else {
            load_raw<T, VEC>(kp + q * P.k_pair_bytes, r);
            bk[q] = bf16x16_of_raw<T>(r);
          }
          load_raw<T, VEC>(vp + q * P.v_pair_bytes, r);
          bv[q] = bf16x16_of_raw<T>(r);
        }
        store_window<NH>(wslot[j], bk, bv, ek[j], ev[j], d, it[j], P);
      }
    }
  }
}

// Pointers that stay the same from call to call (pool, stats, claim table, os table)
// travel in the StoreParams struct: a decode step passes slots, k, v and one struct.
#define FP4C_STORE_PARAMS                                                                  \
  const void *__restrict__ slots, const void *__restrict__ k, const void *__restrict__ v,  \
      const StoreParams params

// NAME, value type, rule, slot type, vectorized loads/stores, heads per thread, K rotated,
// window writes
#define FP4C_STORE_KERNEL(NAME, T, RULE, SLOT, VEC, NH, ROT, WIN)                           \
  extern "C" __global__ void __launch_bounds__(256, 1)                                      \
      NAME(FP4C_STORE_PARAMS) {                                                             \
    store_impl<T, RULE, SLOT, VEC, NH, ROT, WIN>(slots, k, v, params);                      \
  }

// ---------------------------------------------------------------------------
// claim and clear (dedup mode 2)
// ---------------------------------------------------------------------------
template <typename SlotT>
FP4C_DEVICE void claim_impl(const void* __restrict__ slots, u32* __restrict__ claim,
                            u32 n_tokens, i64 num_slots) {
  const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n_tokens) return;
  const i64 slot = load_slot<SlotT>(slots, i);
  if (slot >= 0 && slot < num_slots) atomicMax(claim + slot, i + 1u);
}

// After the store: every entry the claim pass touched is zero again.
template <typename SlotT>
FP4C_DEVICE void clear_impl(const void* __restrict__ slots, u32* __restrict__ claim,
                            u32 n_tokens, i64 num_slots) {
  const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n_tokens) return;
  const i64 slot = load_slot<SlotT>(slots, i);
  if (slot >= 0 && slot < num_slots) claim[slot] = 0u;
}

#define FP4C_CLAIM_PARAMS \
  const void *__restrict__ slots, u32 *__restrict__ claim, u32 n_tokens, i64 num_slots

#define FP4C_CLAIM_KERNEL(NAME, SLOT)                                                 \
  extern "C" __global__ void __launch_bounds__(256) NAME(FP4C_CLAIM_PARAMS) {         \
    claim_impl<SLOT>(slots, claim, n_tokens, num_slots);                              \
  }

#define FP4C_CLEAR_KERNEL(NAME, SLOT)                                                 \
  extern "C" __global__ void __launch_bounds__(256) NAME(FP4C_CLAIM_PARAMS) {         \
    clear_impl<SLOT>(slots, claim, n_tokens, num_slots);                              \
  }

// ---------------------------------------------------------------------------
// gather + dequantize
// ---------------------------------------------------------------------------
// Output chunks: 16 bytes = Chunk<T>::kValues values of one (token, head) row.
// A CTA covers kGatherChunks * 256 consecutive chunks of the output, thread tid
// chunks base + j*256 + tid (j < kGatherChunks): every store instruction of a warp
// writes 512 contiguous bytes, and each thread has several independent loads in
// flight before its first decode.  Each chunk is decoded for K and for V:
// out[(i*T + t), h, e0 : e0 + kValues] from row (t, h) of page blocks[i].

template <typename T, typename BlockT, bool VEC>
FP4C_DEVICE void gather_impl(const void* __restrict__ blocks, void* __restrict__ out_k,
                             void* __restrict__ out_v, u32 total, const GatherParams& P) {
  const u8* __restrict__ buffer = (const u8*)P.buffer;
  const FastDiv fC = P.c, fH = P.h, fT = P.t;
  const u32 nhd = P.nhd;
  const i64 num_blocks = P.num_blocks, side_bytes = P.side_bytes, data_bytes = P.data_bytes;
  constexpr int n = Chunk<T>::kValues;
  constexpr int per_group = Chunk<T>::kPerGroup;
  constexpr int M = FP4C_DECODE_CHUNKS;
  const u32 G = fC.d / per_group, H = fH.d, Tn = fT.d;
  const u32 base = blockIdx.x * (blockDim.x * M) + threadIdx.x;
  u32 kc[M], vc[M], ksf[M], vsf[M];
  bool bad[M];
  u32 iprev = 0xFFFFFFFFu;  // page entry of the previous chunk: its id is reused
  i64 b = 0;
#pragma unroll
  for (int j = 0; j < M; ++j) {
    const u32 gid = base + j * blockDim.x;
    kc[j] = vc[j] = 0u;
    ksf[j] = vsf[j] = 0x7Fu;
    bad[j] = false;
    if (gid >= total) continue;
    const u32 orow = fdiv(gid, fC);  // (i*T + t)*H + h
    const u32 c = gid - orow * fC.d;
    const u32 it = fdiv(orow, fH);   // i*T + t
    const u32 h = orow - it * fH.d;
    const u32 i = fdiv(it, fT);
    const u32 t = it - i * fT.d;
    const u32 g = c / per_group;
    if (i != iprev) {
      iprev = i;
      b = (i64)((const BlockT*)blocks)[i];
    }
    if (b < 0 || b >= num_blocks) {  // NaN rows: codes 0 with scale 0x7F
      bad[j] = t == 0 && h == 0 && c == 0;
      continue;
    }
    const u8* kside = buffer + (u64)b * (u64)(2 * side_bytes);
    const u8* vside = kside + side_bytes;
    const u32 row = row_index(t, h, H, Tn, nhd);
    const u64 doff = (u64)row * (G * 8) + c * (n / 2);
    kc[j] = load_chunk_codes<T, VEC>(kside + doff);
    vc[j] = load_chunk_codes<T, VEC>(vside + doff);
    const u64 ksoff = (u64)data_bytes + (u64)row * G + g;
    const u64 vsoff = v_scale_offset(t, h, g, H, Tn, G, nhd, P.swizzle, P.swz_m, data_bytes);
    ksf[j] = ldg_u8(kside + ksoff);
    vsf[j] = ldg_u8(vside + vsoff);
  }
#pragma unroll
  for (int j = 0; j < M; ++j) {
    const u32 gid = base + j * blockDim.x;
    if (gid >= total) continue;
    if (bad[j]) atomicAdd((u64*)P.stats + FP4C_STAT_BAD_BLOCK_IDS, 1ull);
    decode_store_chunk<T, VEC>(kc[j], ksf[j], P.k_s, (char*)out_k + (u64)gid * 16);
    decode_store_chunk<T, VEC>(vc[j], vsf[j], P.v_s, (char*)out_v + (u64)gid * 16);
  }
}

// Block ids and outputs change from call to call; the pool, counters and every size travel
// in the GatherParams struct (generated from fp4cache/_abi.py).
#define FP4C_GATHER_PARAMS                                                              \
  const void *__restrict__ blocks, void *__restrict__ out_k, void *__restrict__ out_v,  \
      u32 total, const GatherParams params

// NAME, output value type, block-id type, vectorized
#define FP4C_GATHER_KERNEL(NAME, T, BLOCK, VEC)                                   \
  extern "C" __global__ void __launch_bounds__(256) NAME(FP4C_GATHER_PARAMS) {    \
    gather_impl<T, BLOCK, VEC>(blocks, out_k, out_v, total, params);              \
  }

// ---------------------------------------------------------------------------
// gather + dequantize, K rotated back (rotation="hadamard")
// ---------------------------------------------------------------------------
// One thread per (row, group g) item, g fastest: a head's G = D/16 groups are consecutive
// lanes of a warp (the transform's shuffles, hadamard.cuh).  The K group is decoded to
// float32, the head's D values go through the transform, then are rounded to T; V is
// decoded as by gather_impl.  Every lane takes part in the transform (a lane past the
// end computes on NaN codes and writes nothing).  P.c is G here.
template <typename T, bool VEC>
FP4C_DEVICE void store_group16(void* p, const float* v) {
  if constexpr (VEC && T::kBytes == 2) {
    U32x4 a, b;
    a.x = pack2(T(), v[0], v[1]);
    a.y = pack2(T(), v[2], v[3]);
    a.z = pack2(T(), v[4], v[5]);
    a.w = pack2(T(), v[6], v[7]);
    b.x = pack2(T(), v[8], v[9]);
    b.y = pack2(T(), v[10], v[11]);
    b.z = pack2(T(), v[12], v[13]);
    b.w = pack2(T(), v[14], v[15]);
    ((U32x4*)p)[0] = a;
    ((U32x4*)p)[1] = b;
  } else if constexpr (VEC) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      U32x4 a;
      a.x = __float_as_uint(v[4 * i]);
      a.y = __float_as_uint(v[4 * i + 1]);
      a.z = __float_as_uint(v[4 * i + 2]);
      a.w = __float_as_uint(v[4 * i + 3]);
      ((U32x4*)p)[i] = a;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) store_one(T(), (char*)p + i * T::kBytes, v[i]);
  }
}

// The 8 code bytes of a group (ALIGNED: 8-byte aligned, VEC's host condition).
template <bool ALIGNED>
FP4C_DEVICE void load_group_codes(const u8* p, u32& lo, u32& hi) {
  if constexpr (ALIGNED) {
    const U32x2 c = ldg8(p);
    lo = c.x;
    hi = c.y;
  } else {
    lo = hi = 0u;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      lo |= ldg_u8(p + e) << (8 * e);
      hi |= ldg_u8(p + 4 + e) << (8 * e);
    }
  }
}

template <typename T, typename BlockT, bool VEC>
FP4C_DEVICE void gather_rot_impl(const void* __restrict__ blocks, void* __restrict__ out_k,
                                 void* __restrict__ out_v, u32 total, const GatherParams& P) {
  const u8* __restrict__ buffer = (const u8*)P.buffer;
  const FastDiv fG = P.c, fH = P.h, fT = P.t;
  const u32 G = fG.d, H = fH.d, Tn = fT.d;
  const u32 gid = blockIdx.x * blockDim.x + threadIdx.x;
  const bool inr = gid < total;
  u32 klo = 0u, khi = 0u, vlo = 0u, vhi = 0u, ksf = 0x7Fu, vsf = 0x7Fu;
  bool bad = false;
  if (inr) {
    const u32 orow = fdiv(gid, fG);  // (i*T + t)*H + h
    const u32 g = gid - orow * G;
    const u32 it = fdiv(orow, fH);  // i*T + t
    const u32 h = orow - it * H;
    const u32 i = fdiv(it, fT);
    const u32 t = it - i * Tn;
    const i64 b = (i64)((const BlockT*)blocks)[i];
    if (b < 0 || b >= P.num_blocks) {  // NaN rows: codes 0 with scale 0x7F
      bad = t == 0 && h == 0 && g == 0;
    } else {
      const u8* kside = buffer + (u64)b * (u64)(2 * P.side_bytes);
      const u8* vside = kside + P.side_bytes;
      const u32 row = row_index(t, h, H, Tn, P.nhd);
      const u64 doff = (u64)row * (G * 8) + g * 8;
      load_group_codes<VEC>(kside + doff, klo, khi);
      load_group_codes<VEC>(vside + doff, vlo, vhi);
      ksf = ldg_u8(kside + (u64)P.data_bytes + (u64)row * G + g);
      vsf = ldg_u8(vside + v_scale_offset(t, h, g, H, Tn, G, P.nhd, P.swizzle, P.swz_m,
                                          P.data_bytes));
    }
  }
  float x[1][16];
  decode_group16(klo, khi, ksf, P.k_s, x[0]);
  hadamard_rows<1>(x, gid & (G - 1u), G, P.rot_scale);
  if (!inr) return;
  if (bad) atomicAdd((u64*)P.stats + FP4C_STAT_BAD_BLOCK_IDS, 1ull);
  store_group16<T, VEC>((char*)out_k + (u64)gid * 16 * T::kBytes, x[0]);
  float y[16];
  decode_group16(vlo, vhi, vsf, P.v_s, y);
  store_group16<T, VEC>((char*)out_v + (u64)gid * 16 * T::kBytes, y);
}

// NAME, output value type, block-id type, vectorized
#define FP4C_GATHER_ROT_KERNEL(NAME, T, BLOCK, VEC)                               \
  extern "C" __global__ void __launch_bounds__(256) NAME(FP4C_GATHER_PARAMS) {    \
    gather_rot_impl<T, BLOCK, VEC>(blocks, out_k, out_v, total, params);          \
  }

#ifdef FP4C_INSTANTIATIONS
FP4C_INSTANTIATIONS
#endif
