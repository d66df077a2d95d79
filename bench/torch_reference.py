"""The NVFP4 paged KV cache written in plain PyTorch: the baseline fp4cache is compared to.

This is what a user without fp4cache would write: quantize K/V with the NVFP4 rules of
the contract (``docs/format.md``, section 2) in float32 torch ops, and scatter the bytes
into vLLM's paged layout (section 4) with advanced indexing on views of the page pool;
gather pages back
and decode them.  It is written from the spec only (nothing here imports ``fp4cache``),
so that the agreement check in ``bench.py`` compares two independent implementations.

It runs on any torch device (CPU or CUDA), eager or under ``torch.compile``.

Differences from the contract, all deliberate and harmless for a timing baseline:

* the 4over6 squared error is ``(d*d).sum(-1)`` (torch's reduction order) instead of the
  spec's sequential float32 sum, so a near-tie between the 4- and 6-candidate can go the
  other way in rare groups;
* under ``torch.compile`` the compiler may contract multiplies and adds (FMA) and use its
  own division, so a few scale or data bytes may differ from the bit-exact contract;
* ``slot_mapping`` entries must all be valid (``0 <= slot < num_blocks*T``) and unique:
  padding tokens (slot < 0) must be filtered out by the caller, and duplicate slots are
  written in an unspecified order (torch's ``index_put_``);
* block ids of :func:`gather_dequant` must be valid (no NaN pages for bad ids).
"""

from __future__ import annotations

import struct

import torch

__all__ = ["encode_groups", "store", "store_flat", "gather_dequant", "pool_views",
           "scalars_from_scale", "constants"]

#: fl(1/6) in float32 (0x3E2AAAAB) and 1/4: the group-max multipliers of the candidates.
C6 = struct.unpack("<f", struct.pack("<I", 0x3E2AAAAB))[0]
C4 = 0.25
FLT_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
E4M3_MAX = 448.0
E4M3_NAN = 0x7F
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


_CONSTANTS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def constants(device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e2m1_values, nibble_shifts)`` on ``device``, made once per device.

    Building them in every call (``torch.tensor(list, device="cuda")``) would add a
    synchronous host-to-device copy to each call; call this once before
    ``torch.compile``-ing the functions below so the cache is filled.
    """
    key = str(torch.device(device))
    if key not in _CONSTANTS:
        _CONSTANTS[key] = (torch.tensor(_E2M1, dtype=torch.float32, device=device),
                           torch.tensor([0, 4], dtype=torch.uint8, device=device))
    return _CONSTANTS[key]


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32 (returned as a Python float)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def scalars_from_scale(scale: float) -> tuple[float, float]:
    """``(s, g)``: the decode multiplier and ``g = min(fl(1/s), FLT_MAX)`` (spec section 3).

    ``1/s`` in double rounded once to float32 is the correctly rounded float32 quotient
    (53 >= 2*24 + 2 bits), so this is exactly ``fl(1/s)``.  Call it outside compiled code.
    """
    s = _f32(float(scale))
    return s, _f32(min(1.0 / s, FLT_MAX))


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of float32 ``y``: nearest, ties to even, saturating, sign bit kept."""
    a = y.abs()
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
           + (a >= 3.5) + (a > 5.0))
    return mag | (torch.signbit(y).to(torch.uint8) << 3)


def encode_groups(x: torch.Tensor, s: float, g: float, rule: str):
    """Encode ``x [..., 16]`` (any float dtype) group by group.

    Returns
    -------
    codes : uint8 [..., 16]
        E2M1 codes (unpacked).
    sf : uint8 [...]
        E4M3 scale bytes (0x7F for a group holding a NaN or an infinity).
    """
    x = x.to(torch.float32)
    nonfinite = ~torch.isfinite(x).all(dim=-1)
    x = torch.where(nonfinite[..., None], torch.zeros_like(x), x)
    m = x.abs().amax(dim=-1)
    lut = constants(x.device)[0]
    best_codes = best_sf = best_err = None
    for c in ((C6,) if rule == "static6" else (C6, C4)):
        # sf = e4m3_satfinite(fl(g * fl(m * c))): clip to +-448, then round to nearest even.
        sf8 = ((m * c) * g).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        f = sf8.to(torch.float32)
        sf = sf8.view(torch.uint8)
        os_ = torch.where(f == 0, torch.zeros_like(f),
                          torch.reciprocal(f * s).clamp(max=FLT_MAX))
        codes = _e2m1_codes(x * os_[..., None])
        if rule == "static6":
            best_codes, best_sf = codes, sf
            break
        xh = (lut[codes.long()] * f[..., None]) * s
        d = xh - x
        err = (d * d).sum(dim=-1)
        if best_codes is None:
            best_codes, best_sf, best_err = codes, sf, err
        else:
            use4 = err < best_err  # a tie keeps the 6-candidate
            best_codes = torch.where(use4[..., None], codes, best_codes)
            best_sf = torch.where(use4, sf, best_sf)
    codes = torch.where(nonfinite[..., None], torch.zeros_like(best_codes), best_codes)
    sf_bytes = torch.where(nonfinite, torch.full_like(best_sf, E4M3_NAN), best_sf)
    return codes, sf_bytes


def pool_views(buffer: torch.Tensor, side: int, *, num_heads: int, block_size: int,
               head_dim: int, layout: str = "HND", swizzle: bool = True):
    """Views of one side of the page pool ``buffer [num_blocks, 2, side_bytes]`` (uint8).

    Returns
    -------
    data : uint8 view
        ``[nb, H, T, D/2]`` (HND) or ``[nb, T, H, D/2]`` (NHD).
    scales : uint8 view
        Linear: ``[nb, H, T, S]`` (HND) or ``[nb, T, H, S]`` (NHD).  Swizzled (V side
        with ``swizzle``): the stored ``(t', s')`` order, ``[nb, H, T/4, 4, S/4, 4]``
        (HND) or ``[nb, T/4, 4, H, S/4, 4]`` (NHD), whose axes are ``(t//4, s//(S/4),
        s%(S/4), t%4)`` of the logical scale ``(t, s)`` (spec section 4).
    """
    H, T, D = num_heads, block_size, head_dim
    S = D // 16
    nb = buffer.shape[0]
    db = H * T * D // 2
    data = buffer[:, side, :db]
    scales = buffer[:, side, db:]
    if layout == "HND":
        data = data.view(nb, H, T, D // 2)
        if side == 1 and swizzle:
            return data, scales.view(nb, H, T // 4, 4, S // 4, 4)
        return data, scales.view(nb, H, T, S)
    data = data.view(nb, T, H, D // 2)
    if side == 1 and swizzle:
        return data, scales.view(nb, T // 4, 4, H, S // 4, 4)
    return data, scales.view(nb, T, H, S)


def store(buffer: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          *, num_heads: int, block_size: int, head_dim: int, layout: str = "HND",
          swizzle: bool = True, rule: str = "static6", k_s: float = 1.0, k_g: float = 1.0,
          v_s: float = 1.0, v_g: float = 1.0) -> None:
    """Quantize ``k, v [N, H, D]`` and write them at ``slot_mapping`` into ``buffer``.

    ``buffer`` is the uint8 page pool ``[num_blocks, 2, H*T*(D/2 + D/16)]`` (K side,
    V side), as written by vLLM's ``reshape_and_cache_nvfp4``.  ``k_s, k_g`` (and
    ``v_s, v_g``) are the float32 decode/encode multipliers of
    :func:`scalars_from_scale` (vLLM's ``k_scale`` and its reciprocal).
    """
    H, T, D = num_heads, block_size, head_dim
    S = D // 16
    N = k.shape[0]
    slots = slot_mapping.long()
    blk = torch.div(slots, T, rounding_mode="floor")
    t = slots - blk * T
    for side, x, s, g in ((0, k, k_s, k_g), (1, v, v_s, v_g)):
        codes, sf = encode_groups(x.reshape(N, H, S, 16), s, g, rule)
        codes = codes.reshape(N, H, D)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # element 2i in the low nibble
        data, scales = pool_views(buffer, side, num_heads=H, block_size=T, head_dim=D,
                                  layout=layout, swizzle=swizzle)
        swz = side == 1 and swizzle
        if layout == "HND":
            data[blk, :, t, :] = packed
            if swz:
                scales[blk, :, t // 4, :, :, t % 4] = sf.reshape(N, H, 4, S // 4)
            else:
                scales[blk, :, t, :] = sf
        else:
            data[blk, t] = packed
            if swz:
                scales[blk, t // 4, :, :, :, t % 4] = sf.reshape(N, H, 4, S // 4).permute(
                    0, 2, 1, 3)
            else:
                scales[blk, t] = sf


def _side_offsets(t, h, e, side: int, *, num_heads: int, block_size: int, head_dim: int,
                  layout: str, swizzle: bool, scales: bool):
    """Byte offsets inside one page side of data byte ``e`` (or scale ``e``) of row (t, h).

    The formulas of spec section 4, on broadcasting integer tensors.
    """
    H, T, D = num_heads, block_size, head_dim
    S = D // 16
    if not scales:
        row = h * T + t if layout == "HND" else t * H + h
        return row * (D // 2) + e
    if side == 1 and swizzle:
        q = S // 4
        t, e = (t // 4) * 4 + e // q, (e % q) * 4 + t % 4
    row = h * T + t if layout == "HND" else t * H + h
    return H * T * (D // 2) + row * S + e


def store_flat(flat_buffer: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, *, num_heads: int, block_size: int, head_dim: int,
               layout: str = "HND", swizzle: bool = True, rule: str = "static6",
               k_s: float = 1.0, k_g: float = 1.0, v_s: float = 1.0, v_g: float = 1.0) -> None:
    """:func:`store` on the flat pool ``buffer.view(-1)`` with computed byte offsets.

    The form ``torch.compile`` turns into one in-place scatter kernel (the view form of
    :func:`store` makes the compiler copy whole regions of the pool on every call).
    In eager mode it materializes int64 offset tensors, so eager runs use :func:`store`.
    """
    H, T, D = num_heads, block_size, head_dim
    S = D // 16
    N = k.shape[0]
    side_bytes = H * T * (D // 2 + S)
    dev = flat_buffer.device
    slots = slot_mapping.long()
    blk = torch.div(slots, T, rounding_mode="floor")
    t = (slots - blk * T)[:, None, None]
    base = (blk * (2 * side_bytes))[:, None, None]
    h = torch.arange(H, device=dev)[None, :, None]
    j = torch.arange(D // 2, device=dev)[None, None, :]
    sc = torch.arange(S, device=dev)[None, None, :]
    geo = dict(num_heads=H, block_size=T, head_dim=D, layout=layout, swizzle=swizzle)
    for side, x, s, g in ((0, k, k_s, k_g), (1, v, v_s, v_g)):
        codes, sf = encode_groups(x.reshape(N, H, S, 16), s, g, rule)
        codes = codes.reshape(N, H, D)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        off = base + side * side_bytes
        data_idx = off + _side_offsets(t, h, j, side, scales=False, **geo)
        scale_idx = off + _side_offsets(t, h, sc, side, scales=True, **geo)
        flat_buffer.index_put_((data_idx.reshape(-1),), packed.reshape(-1))
        flat_buffer.index_put_((scale_idx.reshape(-1),), sf.reshape(-1))


def gather_dequant(buffer: torch.Tensor, blocks: torch.Tensor, out_k: torch.Tensor,
                   out_v: torch.Tensor, *, num_heads: int, block_size: int, head_dim: int,
                   layout: str = "HND", swizzle: bool = True, k_s: float = 1.0,
                   v_s: float = 1.0) -> None:
    """Decode pages ``blocks [n]`` into ``out_k``/``out_v`` ``[n*T, H, D]`` (any float dtype).

    Token ``i*T + t`` of the output is row ``t`` of page ``blocks[i]``; each value is
    ``fl(fl(e2m1 * float(sf)) * s)`` rounded to the output dtype (``k_s``/``v_s``: the
    float32 decode multipliers).
    """
    H, T, D = num_heads, block_size, head_dim
    S = D // 16
    n = blocks.shape[0]
    ids = blocks.long()
    lut, shifts = constants(buffer.device)
    for side, out, s in ((0, out_k, k_s), (1, out_v, v_s)):
        data, scales = pool_views(buffer, side, num_heads=H, block_size=T, head_dim=D,
                                  layout=layout, swizzle=swizzle)
        d = data[ids]
        sf = scales[ids]
        swz = side == 1 and swizzle
        if layout == "HND":
            d = d.permute(0, 2, 1, 3)  # [n, T, H, D/2]
            if swz:  # [n, H, T/4, s//q, s%q, t%4] -> [n, H, T, S]
                sf = sf.permute(0, 1, 2, 5, 3, 4).reshape(n, H, T, S)
            sf = sf.permute(0, 2, 1, 3)  # [n, T, H, S]
        elif swz:  # [n, T/4, s//q, H, s%q, t%4] -> [n, T, H, S]
            sf = sf.permute(0, 1, 5, 3, 2, 4).reshape(n, T, H, S)
        # element 2i is the low nibble of byte i, 2i+1 the high nibble
        codes = ((d[..., None] >> shifts) & 0xF).reshape(n, T, H, S, 16)
        f = sf.view(torch.float8_e4m3fn).to(torch.float32)
        vals = (lut[codes.long()] * f[..., None]) * s
        out.view(n, T, H, D).copy_(vals.reshape(n, T, H, D))
