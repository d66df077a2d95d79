// fp4cache: the exact window of the attention kernels (docs/window.md): where a sequence's
// window starts and the rows of a window slot as f16 in the decoded units (the q rotation
// is hadamard.cuh's).  A template parameter `Params` is AttnParams or VarlenParams
// (fp4cache/_abi.py: win, win_map, win_pages, win_slots, win_k_mul, win_v_mul have the
// same names in both).
#pragma once
#include "fp4_common.cuh"
#include "attn_ptx.cuh"
#include "attn_dequant.cuh"
#include "attn_seq.cuh"

// ---------------------------------------------------------------------------------------
// Window start: the first key read from the window slots
// ---------------------------------------------------------------------------------------
// The slot of a block id, or -1 when the id is outside the pool or not mapped to a slot in
// [0, win_slots)
template <class Params>
FP4C_DEVICE int window_slot(const Params& P, const AttnSeq& S, i64 id) {
  if (!page_ok(S, id)) return -1;
  const int slot = ((const int*)P.win_map)[id];
  return slot >= 0 && (u32)slot < P.win_slots ? slot : -1;
}

// ws of a sequence of len keys (n = ceil(len / T) pages): T * the first page of the longest
// run of its last pages, at most win_pages, that are mapped (window_slot >= 0); len when the
// last page is not mapped or the cache has no window.  The whole warp calls it (a ballot
// over 32 pages at a time); every lane gets the same value.
template <class Params>
FP4C_DEVICE u32 window_start(const Params& P, const AttnSeq& S, u32 len) {
  if (P.win_slots == 0u || len == 0u) return len;
  const u32 lane = threadIdx.x & 31u;
  const u32 n = fdiv(len - 1u, S.fT) + 1u;
  const u32 np = min(P.win_pages, n);
  u32 run = 0u;  // mapped pages at the end
  for (u32 i0 = 0u; i0 < np; i0 += 32u) {
    const u32 i = i0 + lane;  // page n - 1 - i
    const bool ok = i < np && window_slot(P, S, load_id(S, n - 1u - i)) >= 0;
    const u32 c = __clz(__brev(~__ballot_sync(0xFFFFFFFFu, ok)));  // leading mapped pages
    run += c;
    if (c < 32u) break;
  }
  return run == 0u ? len : (n - run) * S.fT.d;
}

// ---------------------------------------------------------------------------------------
// Window rows: bf16 bits -> f16 in the decoded NVFP4 units
// ---------------------------------------------------------------------------------------
// The decoded NVFP4 values of the attention kernels are x / k_scale * 2^-S_route (K) and
// x / v_scale * 2^-S_route (V): the host's win_k_mul / win_v_mul are 2^-S / k_scale and
// 2^-S / v_scale (S = FP4C_PAIR_SCALE_SHIFT), and the route's 2^(S - S_route) =
// 1 / FP4C_ROUTE_UNSCALE is applied here (exact), so qk_scale and out_scale apply to both.
template <class Params>
FP4C_DEVICE float window_mul(const Params& P, u32 side) {
  return f_mul(side ? P.win_v_mul : P.win_k_mul, 1.0f / FP4C_ROUTE_UNSCALE);
}

// Whether one of the 8 bf16 values of a holds a NaN (the store writes whole NaN groups)
FP4C_DEVICE bool bf16x8_nan(const U32x4& a) {
  const u32 w[4] = {a.x, a.y, a.z, a.w};
  bool nan = false;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    nan |= (w[i] & 0x7FFFu) > 0x7F80u || (w[i] & 0x7FFF0000u) > 0x7F800000u;
  return nan;
}

// The 8 bf16 values d = 8w .. 8w + 7 of a (element n: half n % 2 of word n / 2) times mul as
// 4 f16 pairs (saturated: f16x2_sat, attn_ptx.cuh) in the decode step's column order:
// pair p = (d 8w + pair_nibble(p, 0), 8w + pair_nibble(p, 1)), as e2m1_pairs writes a word
// of codes.
FP4C_DEVICE U32x4 window_word_f16(const U32x4& a, float mul) {
  const u32 w[4] = {a.x, a.y, a.z, a.w};
  float v[8];
#pragma unroll
  for (int n = 0; n < 8; ++n)
    v[n] = f_mul(n & 1 ? __uint_as_float(w[n >> 1] & 0xFFFF0000u)
                       : __uint_as_float(w[n >> 1] << 16), mul);
  u32 o[4];
#pragma unroll
  for (int p = 0; p < 4; ++p) o[p] = f16x2_sat(v[pair_nibble(p, 0)], v[pair_nibble(p, 1)]);
  return U32x4{o[0], o[1], o[2], o[3]};
}
