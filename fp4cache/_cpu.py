"""The NumPy backend: the bit-exact CPU implementation of the NVFP4 contract.

Every function here follows ``docs/format.md`` operation by operation in float32, so
that it is the oracle the CUDA kernels are compared against byte for byte.  The
functions take validated arguments from the front ends and write into preallocated
outputs: the protocol of :mod:`fp4cache._backend`, implemented on the GPU by
:mod:`fp4cache._cuda` with the same names and signatures.
"""

from __future__ import annotations

import functools
import sys
from typing import NamedTuple

import numpy as np

from . import _device
from ._abi import SCALE_SATURATES_ABOVE, STAT, STAT_NAMES
from ._pool import Pool
from .formats import (
    C4,
    C6,
    E2M1_VALUES,
    E4M3_NAN,
    FLT_MAX,
    RULE_E4M3_MAX,
    bf16_bits,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    float32_to,
    hadamard,
    pack_nibbles,
    reciprocal_clamped,
    unpack_nibbles,
)
from .layout import GROUP, PageGeometry, blocked_scale_offset

_F32 = np.float32
_ZERO = _F32(0.0)
_ONE = _F32(1.0)

_SATURATES_ABOVE = _F32(SCALE_SATURATES_ABOVE)  # 464: above it the clip to 448 matters
_E4M3_MIN_NORMAL_BYTE = 8  # 2^-6: bytes below are zero or subnormal


class EncodedGroups(NamedTuple):
    """What :func:`encode_groups` returns, one entry per group."""

    codes: np.ndarray      # uint8 (n, 16) E2M1 codes, not yet packed
    sf: np.ndarray         # uint8 (n,) E4M3 block-scale bytes
    nonfinite: np.ndarray  # bool (n,): held a NaN/Inf (scale 0x7F, codes 0)
    saturated: np.ndarray  # bool (n,): the chosen scale wanted more than 464 (clipped to 448)
    underflow: np.ndarray  # bool (n,): nonzero group, scale byte zero or subnormal


# -- one group scope ---------------------------------------------------------------------
def encode_groups(x: np.ndarray, s, g, rule: str) -> EncodedGroups:
    """Encode groups of 16 float32 values with decode multiplier ``s``, encode ``g``.

    Parameters
    ----------
    x : ndarray, float32, shape (n, 16)
    s, g : float32 scalars or float32 arrays broadcastable to (n,)
    rule : {"static6", "4over6"}

    Returns
    -------
    EncodedGroups
        Codes, scale bytes, and which groups were non-finite, had their scale saturated
        (``fl(g * fl(m * c)) > 464`` for the chosen candidate: it would round above 448,
        see ``_abi.SCALE_SATURATES_ABOVE``) or are nonzero with a zero or subnormal scale
        byte.
    """
    x = np.asarray(x, dtype=_F32)
    s = np.asarray(s, dtype=_F32)
    g = np.asarray(g, dtype=_F32)
    nonfinite = ~np.isfinite(x).all(axis=-1)
    if nonfinite.any():
        x = np.where(nonfinite[:, None], _ZERO, x)
    m = np.abs(x).max(axis=-1) if x.shape[0] else np.zeros(0, _F32)
    candidates = (C6,) if rule == "static6" else (C6, C4)
    best = None
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        for c in candidates:
            arg = g * (m * c)
            clipped = arg > _SATURATES_ABOVE
            sf = e4m3_encode(arg)
            f = e4m3_decode(sf)
            # os = 0 if f == 0 else min(fl(1/fl(f*s)), FLT_MAX); 1/0 -> inf -> FLT_MAX.
            os_ = np.where(f == _ZERO, _ZERO, reciprocal_clamped(f * s))
            codes = e2m1_encode(x * os_[:, None])
            if len(candidates) == 1:
                best = (codes, sf, None, clipped)
                break
            xh = (E2M1_VALUES[codes] * f[:, None]) * s[..., None]
            d = xh - x
            dd = d * d
            err = np.zeros(x.shape[0], _F32)
            for i in range(GROUP):  # sequential float32 sum, i = 0..15
                err = err + dd[:, i]
            if best is None:
                best = (codes, sf, err, clipped)
            else:
                use4 = err < best[2]
                best = (
                    np.where(use4[:, None], codes, best[0]),
                    np.where(use4, sf, best[1]),
                    None,
                    np.where(use4, clipped, best[3]),
                )
    codes, sf, _, saturated = best
    underflow = (m > 0) & (sf < _E4M3_MIN_NORMAL_BYTE)
    if nonfinite.any():
        codes = np.where(nonfinite[:, None], np.uint8(0), codes)
        sf = np.where(nonfinite, np.uint8(E4M3_NAN), sf)
        saturated = saturated & ~nonfinite
        underflow = underflow & ~nonfinite
    return EncodedGroups(codes.astype(np.uint8), sf.astype(np.uint8), nonfinite,
                         np.asarray(saturated, dtype=bool), np.asarray(underflow, dtype=bool))


def decode_groups(data: np.ndarray, sf: np.ndarray, s):
    """float32 values ``fl(fl(e2m1 * float(sf)) * s)`` of groups.

    ``data`` is ``[..., 8]`` packed bytes; ``sf`` is ``[...]`` E4M3 bytes; ``s``
    broadcasts against ``sf``.
    """
    codes = unpack_nibbles(data)
    f = e4m3_decode(sf)
    s = np.asarray(s, dtype=_F32)
    with np.errstate(over="ignore", invalid="ignore"):
        return (E2M1_VALUES[codes & 0xF] * f[..., None]) * s[..., None]


def _rows_to_groups(x: np.ndarray) -> np.ndarray:
    d = x.shape[-1]
    return np.ascontiguousarray(x, dtype=_F32).reshape(-1, d // GROUP, GROUP).reshape(-1, GROUP)


# -- protocol: flat codec ----------------------------------------------------------------
def quantize(x, s, g, rule, data_out, scales_out) -> None:
    """Quantize rows ``x [N, D]`` into ``data_out [N, D/2]`` and ``scales_out [N, D/16]``."""
    n, d = x.shape
    e = encode_groups(_rows_to_groups(x), s, g, rule)
    data_out[...] = pack_nibbles(e.codes.reshape(n, d))
    scales_out[...] = e.sf.reshape(n, d // GROUP)


def dequantize(data, scales, s, out) -> None:
    """Decode ``data [N, D/2]`` and ``scales [N, D/16]`` into ``out [N, D]``."""
    n, half = data.shape
    vals = decode_groups(data.reshape(n, -1, GROUP // 2), scales, s)
    out[...] = float32_to(vals.reshape(n, 2 * half), out.dtype)


# -- protocol: paged cache ----------------------------------------------------------------
def _last_occurrence(slots: np.ndarray) -> np.ndarray:
    """Indices of tokens whose slot is not repeated later in ``slots`` (last one wins)."""
    rev = slots[::-1]
    _, first_in_rev = np.unique(rev, return_index=True)
    return np.sort(len(slots) - 1 - first_in_rev)


def store(buffer, slot_mapping, k, v, *, geom: PageGeometry, rule, k_s, k_g, v_s, v_g,
          stats, unique_slots: bool = False, rotate: bool = False, window=None) -> None:
    """Quantize K/V ``[N, H, D]`` and scatter them into the page pool ``buffer``.

    ``unique_slots`` (a promise that lets the GPU skip its duplicate handling) changes
    nothing here: the last occurrence always wins, one of the outcomes it allows.
    ``rotate``: K is rotated (:func:`fp4cache.formats.hadamard`) before it is quantized.
    ``window``: ``(slots, map)`` of the exact window: a token of a mapped page is also
    written there as bf16 (``docs/window.md``)."""
    slots = np.asarray(slot_mapping).astype(np.int64)
    num_slots = buffer.shape[0] * geom.block_size
    # -1 is vLLM's padding id (skipped, not counted); any other negative slot is bad
    bad = (slots >= num_slots) | (slots < -1)
    if bad.any():
        stats[STAT["bad_slots"]] += np.uint64(bad.sum())
    idx = np.flatnonzero((slots >= 0) & ~bad)
    if idx.size == 0:
        return
    idx = idx[_last_occurrence(slots[idx])]
    slots = slots[idx]
    T, H, D = geom.block_size, geom.num_heads, geom.head_dim
    S = geom.scales_per_row
    blocks = (slots // T)[:, None, None]
    t = (slots % T)[:, None, None]
    h = np.arange(H)[None, :, None]
    j = np.arange(D // 2)[None, None, :]
    sc = np.arange(S)[None, None, :]
    if window is not None:
        win, win_map = window
        slot = win_map[blocks[:, 0, 0]]
        exact = np.flatnonzero((slot >= 0) & (slot < win.shape[0]))
    for side, x, s, g in ((0, k, k_s, k_g), (1, v, v_s, v_g)):
        rows = np.asarray(x)[idx]  # [n, H, D]
        if side == 0 and rotate:
            rows = hadamard(rows)
        e = encode_groups(_rows_to_groups(rows.reshape(-1, D)), s, g, rule)
        if window is not None and exact.size:
            win[slot[exact], side, t[exact, 0, 0]] = window_bits(rows[exact])
        kv = "kv"[side]
        for name, flags in (("nonfinite", e.nonfinite), ("saturated", e.saturated),
                            ("underflow", e.underflow)):
            stats[STAT[f"{kv}_{name}_groups"]] += np.uint64(flags.sum())
        data = pack_nibbles(e.codes.reshape(len(idx), H, D))
        buffer[blocks, side, geom.data_offset(t, h, j)] = data
        buffer[blocks, side, geom.scale_offset(t, h, sc, side=side)] = e.sf.reshape(
            len(idx), H, S)


def window_bits(rows: np.ndarray) -> np.ndarray:
    """bf16 bits of rows ``[..., D]`` as the store writes them to an exact window: round to
    nearest even, and a group of 16 values holding a NaN or an infinity all NaN."""
    x = np.asarray(rows, dtype=np.float32)
    bits = bf16_bits(x)
    g = x.reshape(x.shape[:-1] + (-1, GROUP))
    bad = ~np.isfinite(g).all(axis=-1, keepdims=True)
    bits = bits.reshape(g.shape)
    bits[np.broadcast_to(bad, g.shape)] = 0x7FC0
    return bits.reshape(x.shape)


def gather_dequant(buffer, blocks, out_k, out_v, *, geom: PageGeometry, k_s, v_s,
                   stats, rotate: bool = False) -> None:
    """Gather pages ``blocks`` and decode them into ``out_k``/``out_v`` ``[n*T, H, D]``
    (``rotate``: K turned back to the original basis, :func:`fp4cache.formats.hadamard`)."""
    blocks = np.asarray(blocks).astype(np.int64)
    n = blocks.size
    T, H, D = geom.block_size, geom.num_heads, geom.head_dim
    S = geom.scales_per_row
    bad = (blocks < 0) | (blocks >= buffer.shape[0])
    if bad.any():
        stats[STAT["bad_block_ids"]] += np.uint64(bad.sum())
    safe = np.where(bad, 0, blocks)[:, None, None, None]
    t = np.arange(T)[None, :, None, None]
    h = np.arange(H)[None, None, :, None]
    j = np.arange(D // 2)[None, None, None, :]
    sc = np.arange(S)[None, None, None, :]
    for side, s, out in ((0, k_s, out_k), (1, v_s, out_v)):
        data = buffer[safe, side, geom.data_offset(t, h, j)]  # [n, T, H, D/2]
        sf = buffer[safe, side, geom.scale_offset(t, h, sc, side=side)]  # [n, T, H, S]
        vals = decode_groups(data.reshape(n, T, H, S, GROUP // 2), sf, s)
        vals = vals.reshape(n, T, H, D)
        if bad.any():
            vals[bad] = np.nan
        if side == 0 and rotate:
            vals = hadamard(vals)
        out[...] = float32_to(vals.reshape(n * T, H, D), out.dtype)


# -- protocol: LongLive blocked layout ----------------------------------------------------
def longlive_scalars(amax, rule: str):
    """``(s, g)`` of a LongLive block from its float32 ``amax`` (spec section 3)."""
    M = _F32(RULE_E4M3_MAX[rule])
    six_m = _F32(6.0) * M
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        g = np.minimum(six_m / _F32(amax), FLT_MAX)
        s = _F32(amax) * (_ONE / six_m)
    return _F32(s), _F32(g)


def abs_max(x) -> np.float32:
    """``max |x|`` in float32 (NaN when ``x`` holds a NaN or an infinity; 0 if empty)."""
    x32 = np.asarray(x, dtype=_F32)
    if x32.size == 0:
        return _ZERO
    if not np.isfinite(x32).all():
        return _F32(np.nan)
    return _F32(np.abs(x32).max())


def longlive_quantize(x, rule, values_out, sf_out, amax_out) -> None:
    """Quantize one block ``x [Tb, H, D]`` into the blocked layout (spec section 5)."""
    Tb, H, D = x.shape
    S = D // GROUP
    R = Tb * H
    x32 = np.asarray(x, dtype=_F32)
    amax = abs_max(x32)
    finite = bool(np.isfinite(amax))
    amax_out[...] = amax
    values_out[...] = 0
    sf_out[...] = 0
    if amax == 0:
        return
    r = np.arange(R)[:, None]
    offs = blocked_scale_offset(r, np.arange(S)[None, :], S)
    if not finite:
        sf_out[offs] = E4M3_NAN
        return
    s, g = longlive_scalars(amax, rule)
    enc = encode_groups(_rows_to_groups(x32.reshape(R, D)), s, g, rule)
    codes, sf = enc.codes, enc.sf
    values_out[:R] = pack_nibbles(codes.reshape(R, D))
    sf_out[offs] = sf.reshape(R, S)


def longlive_dequantize(values, scale_factors, amax, out, *, num_heads, block_token_size,
                        inv_denom) -> None:
    """Decode LongLive blocks (lists of per-block arrays) into ``out [1, n*Tb, H, D]``."""
    H, Tb = num_heads, block_token_size
    R = Tb * H
    D = out.shape[-1]
    S = D // GROUP
    offs = blocked_scale_offset(np.arange(R)[:, None], np.arange(S)[None, :], S)
    for i, (vals, sfs, am) in enumerate(zip(values, scale_factors, amax)):
        gs = _F32(np.asarray(am, dtype=_F32).reshape(-1)[0]) * _F32(inv_denom)
        sf = np.asarray(sfs).reshape(-1).view(np.uint8)[offs]  # [R, S]
        data = np.asarray(vals)[:R].reshape(R, S, GROUP // 2)
        dec = decode_groups(data, sf, gs)
        out[0, i * Tb:(i + 1) * Tb] = float32_to(dec.reshape(Tb, H, D), out.dtype)


# -- protocol: decode attention over the paged cache ------------------------------------
#: Decoded K (or V) values per chunk of pages in :func:`attention`, and about the values
#: of the working memory of each of its calls of :func:`_attend` (bounds memory).
_ATTN_CHUNK_VALUES = 1 << 21


@functools.lru_cache(maxsize=64)
def _page_byte_order(geom: PageGeometry, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets, inside one page side, of the data ``[H, T, D/2]`` and the scales
    ``[H, T, D/16]`` of each (head, token) row: ``layout.PageGeometry``'s formulas
    evaluated once per geometry."""
    T, H = geom.block_size, geom.num_heads
    h = np.arange(H)[:, None, None]
    t = np.arange(T)[None, :, None]
    data = geom.data_offset(t, h, np.arange(geom.row_data_bytes)[None, None, :])
    scales = geom.scale_offset(t, h, np.arange(geom.scales_per_row)[None, None, :], side=side)
    return data.astype(np.intp), scales.astype(np.intp)


def decode_pages(pages: np.ndarray, geom: PageGeometry, side: int, s) -> np.ndarray:
    """float32 values ``[..., H, T, D]`` (head-major) of page sides ``pages [..., side_bytes]``.

    The same values as :func:`gather_dequant` (the same :func:`decode_groups`), read
    through one offset table per geometry instead of per-element index arrays.
    """
    data_idx, scale_idx = _page_byte_order(geom, side)
    T, H, D = geom.block_size, geom.num_heads, geom.head_dim
    lead = pages.shape[:-1]
    data = np.take(pages, data_idx, axis=-1)  # [..., H, T, D/2]
    sf = np.take(pages, scale_idx, axis=-1)  # [..., H, T, S]
    vals = decode_groups(data.reshape(lead + (H, T, D // GROUP, GROUP // 2)), sf, s)
    return vals.reshape(lead + (H, T, D))


#: Query rows (consecutive query tokens of one sequence) per work item of :func:`attention`:
#: a sequence with more is cut into items of this many rows (bounds memory, and lets an
#: item of early causal rows skip the pages that only later rows see).
_ATTN_ITEM_ROWS = 64


def attention(buffer, q, query_start_loc, block_tables, seq_lens, out, lse, *, geom: PageGeometry,
              k_s, v_s, sm_scale, stats, causal: bool = True, max_query_len=None,
              scratch=None, window=None, rotate: bool = False, new_kv=None) -> None:
    """``softmax(sm_scale * q K^T) V`` for the query tokens of each sequence (any number).

    Parameters
    ----------
    q : (N, Hq, D), the query tokens of all sequences concatenated; query head ``h`` reads
        KV head ``h // (Hq // H)``.
    query_start_loc : (B + 1,) int, non-decreasing from 0 to ``N`` (the front end checks):
        sequence ``b`` owns rows ``query_start_loc[b] : query_start_loc[b + 1]``
        (``n_b`` of them, possibly none).
    block_tables : (B, max_blocks) int; entries past ``ceil(seq_lens[b] / T)`` are not read.
    seq_lens : (B,) int, clamped to ``[0, max_blocks * T]``: the cached tokens of each
        sequence, this step's ``n_b`` included.
    out : (N, Hq, D), written in its dtype; lse : (N, Hq) float32 or None.
    causal : row ``i`` of sequence ``b`` sees keys ``0 .. seq_lens[b] - n_b + i``
        (bottom-right alignment); ``False``: every row sees all ``seq_lens[b]`` keys.
    max_query_len, scratch : unused (the GPU backend's launch bound and plans).
    new_kv : ``(k_new, v_new)``, each (N, H, D) float32 / float16 / bfloat16, or None: the
        exact new tokens.  With ``L_b = seq_lens[b]`` (after the clamp) the keys of
        sequence ``b`` at positions ``p`` in ``[L_b - n_b, L_b)`` are read from the rows
        ``query_start_loc[b] + p - (L_b - n_b)`` of ``k_new`` / ``v_new`` (their values
        in float64; ``rotate``: that ``k`` rotated too, as q is), never from the pages or
        the window; earlier positions as without it.  Masking is unchanged.

    K and V are the float32 values :func:`gather_dequant` returns; scores, softmax and
    the weighted sum are computed in float64 (online softmax over chunks of pages, all
    rows of many sequences at once), and rounded to ``out.dtype`` at the end.  A row
    that sees no key (a sequence of length 0, or ``n_b > seq_lens[b]``, which the front
    end refuses) gives zeros and ``lse = -inf``.  A block id outside the pool in the used
    part of a row of a sequence with queries is counted once in
    ``stats[STAT["bad_block_ids"]]`` and its page reads as NaN: the rows that see one of
    its tokens are NaN (not the tokens ``new_kv`` serves: their page is not read, though
    a bad id is still counted); nothing outside the pool is read.  A NaN group stored in
    a token reaches exactly the rows that see that token.
    """
    N = q.shape[0]
    T = geom.block_size
    starts = np.asarray(query_start_loc).astype(np.int64)
    nq = starts[1:] - starts[:-1]
    max_blocks = block_tables.shape[1]
    lens = np.clip(np.asarray(seq_lens).astype(np.int64), 0, max_blocks * T)
    ids = np.asarray(block_tables).astype(np.int64)
    num_blocks = buffer.shape[0]
    used = (np.arange(max_blocks)[None, :] < -(-lens // T)[:, None]) & (nq > 0)[:, None]
    bad = used & ((ids < 0) | (ids >= num_blocks))
    if bad.any():
        stats[STAT["bad_block_ids"]] += np.uint64(bad.sum())
    # The exact window: per sequence the first page read from the window slots and each
    # page's slot (docs/window.md).
    wsp = win = wslot = None
    if window is not None:
        win, win_map, wpages = window
        wsp, wslot = window_pages(ids, lens, T, win_map, win.shape[0], wpages)
    # The exact new tokens: per sequence the first position read from new_kv and the row
    # of new_kv holding position 0 (rows base + p for p >= first).
    fresh = None
    if new_kv is not None:
        k_new = np.asarray(new_kv[0]).astype(np.float64)
        first_new = lens - nq
        fresh = (_hadamard64(k_new) if rotate else k_new,
                 np.asarray(new_kv[1]).astype(np.float64), first_new, starts[:-1] - first_new)
    # The keys each query row sees: tokens [0, limit).
    seq = np.repeat(np.arange(nq.size), nq)
    limit = lens[seq]
    if causal:
        limit = np.maximum(limit - (starts[seq + 1] - 1 - np.arange(N)), 0)
    out[...] = 0
    if lse is not None:
        lse[...] = -np.inf
    # Work items: up to _ATTN_ITEM_ROWS consecutive rows of one sequence, grouped by their
    # row count rounded up to a power of two (padding wastes at most half of a group).
    first = [np.arange(starts[b], starts[b + 1], _ATTN_ITEM_ROWS) for b in np.flatnonzero(nq)]
    if not first:
        return
    item0 = np.concatenate(first)
    item1 = np.minimum(item0 + _ATTN_ITEM_ROWS, starts[seq[item0] + 1])
    width = 1 << np.ceil(np.log2(item1 - item0)).astype(np.int64)
    H, D = geom.num_heads, geom.head_dim
    for R in np.unique(width):
        # Items per call of _attend, whose working memory (accumulators, and decoded pages
        # and scores of at least one page per item) grows with its items: about
        # _ATTN_CHUNK_VALUES values per call, whatever the batch.
        M = int(R) * (q.shape[1] // H)
        per_call = max(1, _ATTN_CHUNK_VALUES // (H * (T * max(D, M) + M * D)))
        picked = np.flatnonzero(width == R)
        for c0 in range(0, picked.size, per_call):
            sel = picked[c0:c0 + per_call]
            rows = item0[sel][:, None] + np.arange(R)[None, :]  # [S, R]
            valid = rows < item1[sel][:, None]
            rows = np.where(valid, rows, item0[sel][:, None])
            lim = np.where(valid, limit[rows], 0)
            sq = seq[item0[sel]]
            exact = None if win is None else (win, wsp[sq], wslot[sq])
            new = None if fresh is None else (fresh[0], fresh[1], fresh[2][sq], fresh[3][sq])
            res, row_lse = _attend(buffer, q[rows], lim, ids[sq], bad[sq], geom=geom,
                                   k_s=k_s, v_s=v_s, sm_scale=sm_scale, exact=exact,
                                   rotate=rotate, new=new)
            keep = valid & (lim > 0)
            out[rows[keep]] = float32_to(res[keep].astype(np.float32), out.dtype)
            if lse is not None:
                lse[rows[keep]] = row_lse[keep].astype(np.float32)


def window_pages(ids, lens, T: int, win_map, slots: int, pages: int):
    """``(first, slot)`` of each sequence's exact window (``docs/window.md``): the first
    page read from the window (the page count when none is) and ``[B, max_blocks]`` the
    slot of each page (-1 outside the window)."""
    B, nb = ids.shape
    npg = -(-lens // T)
    first = npg.copy()
    slot = np.full((B, nb), -1, np.int64)
    num_blocks = win_map.shape[0]
    for b in range(B):
        for p in range(int(npg[b]) - 1, max(-1, int(npg[b]) - 1 - pages), -1):
            blk = int(ids[b, p])
            if not 0 <= blk < num_blocks or not 0 <= int(win_map[blk]) < slots:
                break
            slot[b, p] = int(win_map[blk])
            first[b] = p
    return first, slot


def _hadamard64(x: np.ndarray) -> np.ndarray:
    """The normalized Hadamard transform along the last axis in float64."""
    d = x.shape[-1]
    y = x.astype(np.float64, copy=True)
    h = 1
    while h < d:
        z = y.reshape(*y.shape[:-1], d // (2 * h), 2, h)
        y = np.stack([z[..., 0, :] + z[..., 1, :], z[..., 0, :] - z[..., 1, :]],
                     axis=-2).reshape(y.shape)
        h *= 2
    return y / np.sqrt(d)


def _window_rows(win, side: int, slots: np.ndarray) -> np.ndarray:
    """float32 ``[..., H, T, D]`` (head-major, as :func:`decode_pages`) of window slots."""
    x = win[slots, side].astype(np.uint32) << np.uint32(16)  # [..., T, H, D]
    return np.swapaxes(x.view(np.float32), -2, -3)


def _attend(buffer, q, limit, ids, bad, *, geom: PageGeometry, k_s, v_s, sm_scale,
            exact=None, rotate: bool = False, new=None):
    """Attention of work items of ``R`` query rows each: ``q [S, R, Hq, D]``, row ``r`` of
    item ``i`` seeing tokens ``[0, limit[i, r])`` of the pages ``ids[i]`` (``bad[i]``:
    entries outside the pool).  ``exact``: ``(window, first, slot)``, page ``j >=
    first[i]`` of item ``i`` read from window slot ``slot[i, j]``; ``rotate``: q rotated
    (K is stored rotated).  ``new``: ``(k, v, first, base)``, float64 rows ``(N, H, D)``
    (``k`` rotated with q), token ``p >= first[i]`` of item ``i`` read from row
    ``base[i] + p`` instead of its page.  Returns float64 ``out [S, R, Hq, D]`` and
    ``lse [S, R, Hq]`` (undefined where ``limit`` is 0)."""
    S, R, Hq, D = q.shape
    H, T = geom.num_heads, geom.block_size
    G = Hq // H
    M = R * G  # score rows per KV head: (query row, head of the group), row-major
    npages = -(-limit.max(axis=1) // T)
    # Items needing the most pages first: the items still active at page column j form a
    # prefix.
    order = np.argsort(-npages, kind="stable")
    npages, ids, bad = npages[order], ids[order], bad[order]
    if exact is not None:
        win, wfirst, wslot = exact[0], exact[1][order], exact[2][order]
    if new is not None:
        k_new, v_new, nfirst, nbase = new[0], new[1], new[2][order], new[3][order]
        nend = limit.max(axis=1)[order]  # no row sees a token past this (<= seq_lens)
    NB = int(npages[0])
    ids, bad = ids[:, :NB], bad[:, :NB]
    read = np.arange(NB)[None, :] < npages[:, None]
    page_bad = read & bad
    safe = np.where(read & ~bad, ids, 0)
    q64 = q.astype(np.float64)[order]
    if rotate:
        q64 = _hadamard64(q64)
    q64 = q64.reshape(S, R, H, G, D).transpose(0, 2, 1, 3, 4)
    q64 = q64.reshape(S, H, M, D)
    lim = np.repeat(limit[order], G, axis=1)[:, None, :, None]  # [S, 1, M, 1]
    m = np.full((S, H, M), -np.inf)
    den = np.zeros((S, H, M))
    acc = np.zeros((S, H, M, D))
    j0 = 0
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        while j0 < NB:
            na = int((npages > j0).sum())  # items with a page in column j0
            j1 = min(NB, j0 + max(1, _ATTN_CHUNK_VALUES // (na * T * H * max(D, M))))
            pages = buffer[safe[:na, j0:j1]]  # [na, c, 2, side_bytes]
            k = decode_pages(pages[:, :, 0], geom, 0, k_s)  # [na, c, H, T, D] float32
            v = decode_pages(pages[:, :, 1], geom, 1, v_s)
            if exact is not None:  # pages of the window: their bf16 values instead
                cols = np.arange(j0, j1)[None, :]
                hot = (cols >= wfirst[:na, None]) & (cols < npages[:na, None])
                if hot.any():
                    sl = wslot[:na, j0:j1][hot]
                    k[hot] = _window_rows(win, 0, sl)
                    v[hot] = _window_rows(win, 1, sl)
            chunk_bad = page_bad[:na, j0:j1]
            if chunk_bad.any():  # what the kernels do: such a page reads as NaN
                k[chunk_bad] = np.nan
                v[chunk_bad] = np.nan
            k = k.astype(np.float64)
            v = v.astype(np.float64)
            if new is not None:  # the exact new tokens: their rows, not their pages
                pos = np.arange(j0 * T, j1 * T).reshape(1, j1 - j0, T)
                hot = (pos >= nfirst[:na, None, None]) & (pos < nend[:na, None, None])
                if hot.any():
                    src = (nbase[:na, None, None] + pos)[hot]
                    k.transpose(0, 1, 3, 2, 4)[hot] = k_new[src]  # [na, c, T, H, D] views
                    v.transpose(0, 1, 3, 2, 4)[hot] = v_new[src]
            # The chunk's keys in order, [na, H, L = c*T, D]: one matmul per (item, head).
            k = k.transpose(0, 2, 1, 3, 4).reshape(na, H, -1, D)
            v = v.transpose(0, 2, 1, 3, 4).reshape(na, H, -1, D)
            seen = np.arange(j0 * T, j1 * T) < lim[:na]  # [na, 1, M, L]
            s = np.matmul(q64[:na], k.swapaxes(-1, -2))  # [na, H, M, L]
            s *= sm_scale
            np.copyto(s, -np.inf, where=~seen)
            m_new = np.maximum(m[:na], s.max(axis=-1))  # NaN propagates
            alpha = np.exp(m[:na] - m_new)  # exp(-inf) = 0 on a row's first chunk
            s -= m_new[..., None]
            p = np.exp(s, out=s)  # 0 for the tokens a row does not see
            v_nan = np.isnan(v)
            if v_nan.any():
                # 0 * NaN is NaN: a NaN value reaches only the rows that see its token.
                hit = np.matmul(seen.astype(np.float64), v_nan.astype(np.float64)) > 0
                pv = np.where(hit, np.nan, np.matmul(p, np.where(v_nan, 0.0, v)))
            else:
                pv = np.matmul(p, v)  # [na, H, M, D]
            den[:na] = den[:na] * alpha + p.sum(axis=-1)
            acc[:na] = acc[:na] * alpha[..., None] + pv
            m[:na] = m_new
            j0 = j1
        res = acc / den[..., None]
        row_lse = m + np.log(den)
    inv = np.empty_like(order)
    inv[order] = np.arange(S)
    res = res.reshape(S, H, R, G, D).transpose(0, 2, 1, 3, 4).reshape(S, R, Hq, D)[inv]
    row_lse = row_lse.reshape(S, H, R, G).transpose(0, 2, 1, 3).reshape(S, R, Hq)[inv]
    return res, row_lse


def decode_attention(buffer, q, block_tables, seq_lens, out, lse, *, geom: PageGeometry, k_s,
                     v_s, sm_scale, stats, scratch=None, window=None,
                     rotate: bool = False, new_kv=None) -> None:
    """``softmax(sm_scale * q K^T) V`` over the first ``seq_lens[b]`` tokens of each row:
    :func:`attention` with one query token per sequence (``q`` is ``(B, Hq, D)``; with
    ``new_kv``, rows ``(B, H, D)``, the token at ``seq_lens[b] - 1`` is row ``b``), whose
    notes apply (a sequence of length 0 gives zeros and ``lse = -inf``; a bad block id
    in the used part of a row makes that sequence's outputs NaN)."""
    B = q.shape[0]
    attention(buffer, q, np.arange(B + 1), block_tables, seq_lens, out, lse, geom=geom,
              k_s=k_s, v_s=v_s, sm_scale=sm_scale, stats=stats, causal=False, window=window,
              rotate=rotate, new_kv=new_kv)


# -- page moves ------------------------------------------------------------------------------
def _valid_ids(host: np.ndarray, num_blocks: int) -> np.ndarray:
    return (host >= 0) & (host < num_blocks)


def _count_bad(pool, n_bad: int) -> None:
    if n_bad:
        pool.stats[STAT["bad_block_ids"]] += np.uint64(n_bad)


def nan_page(geom: PageGeometry) -> np.ndarray:
    """The bytes of a page that decodes to NaN everywhere: data 0, scale bytes 0x7F."""
    side = np.zeros(geom.side_bytes, np.uint8)
    side[geom.data_bytes:] = 0x7F
    return np.concatenate([side, side])


def copy_pages(pool, src, dst, host_src, host_dst) -> None:
    """Copy pages ``src`` to ``dst`` (the host ids; every read before any write); a pair
    with an id outside the pool is skipped and each bad id counted."""
    n = pool.num_blocks
    vs, vd = _valid_ids(host_src, n), _valid_ids(host_dst, n)
    _count_bad(pool, int((~vs).sum() + (~vd).sum()))
    ok = vs & vd
    if ok.any():
        buf = pool.buffer
        buf[host_dst[ok]] = buf[host_src[ok]]  # the right side is a copy: reads first


def read_pages(pool, blocks, host_blocks, out) -> None:
    """Pages ``blocks`` into the rows of ``out``; a bad id reads a NaN page (counted)."""
    ok = _valid_ids(host_blocks, pool.num_blocks)
    rows = pool.buffer.reshape(pool.num_blocks, -1)
    out[ok] = rows[host_blocks[ok]]
    if not ok.all():
        out[~ok] = nan_page(pool.geometry)
        _count_bad(pool, int((~ok).sum()))


def write_pages(pool, blocks, host_blocks, data) -> None:
    """The rows of ``data`` into pages ``blocks``; a row with a bad id is skipped
    (counted)."""
    ok = _valid_ids(host_blocks, pool.num_blocks)
    _count_bad(pool, int((~ok).sum()))
    pool.buffer.reshape(pool.num_blocks, -1)[host_blocks[ok]] = data[ok]


# -- protocol: the exact window ---------------------------------------------------------------
def _fill_slots(pool, blocks: np.ndarray, slots: np.ndarray) -> None:
    """Window slots ``slots`` := the values of pages ``blocks`` (in the stored basis), bf16."""
    if blocks.size == 0:
        return
    geom = pool.geometry
    pages = pool.buffer[blocks]  # [n, 2, side_bytes]
    for side, s in ((0, pool.k_s), (1, pool.v_s)):
        vals = decode_pages(pages[:, side], geom, side, s)  # [n, H, T, D]
        pool.window[slots, side] = window_bits(np.swapaxes(vals, 1, 2))


def map_window(pool, blocks, slots) -> None:
    """``window_map[blocks] = slots`` (-1 unmaps) and each mapped slot filled from its page
    (ids checked by the front end)."""
    blocks = np.asarray(blocks).astype(np.int64)
    slots = np.asarray(slots).astype(np.int64)
    pool.window_map[blocks] = slots
    live = slots >= 0
    _fill_slots(pool, blocks[live], slots[live])


def fill_window(pool, blocks) -> None:
    """Refill the slots of the mapped pages among ``blocks`` from the pages."""
    blocks = np.asarray(blocks).astype(np.int64)
    blocks = blocks[(blocks >= 0) & (blocks < pool.num_blocks)]
    slots = pool.window_map[blocks].astype(np.int64)
    live = (slots >= 0) & (slots < pool.window_slots)
    _fill_slots(pool, blocks[live], slots[live])


def copy_window(pool, src, dst) -> None:
    """After ``copy_pages(src, dst)``: each mapped destination's slot gets the source's
    slot when the source is mapped, else the values of its (new) page; every read first."""
    src = np.asarray(src).astype(np.int64)
    dst = np.asarray(dst).astype(np.int64)
    n = pool.num_blocks
    ok = (src >= 0) & (src < n) & (dst >= 0) & (dst < n)
    src, dst = src[ok], dst[ok]
    S = pool.window_slots
    d = pool.window_map[dst].astype(np.int64)
    s = pool.window_map[src].astype(np.int64)
    live = (d >= 0) & (d < S)
    hot = live & (s >= 0) & (s < S)
    staged = pool.window[s[hot]].copy()  # every read before any write
    cold = live & ~hot
    _fill_slots(pool, dst[cold], d[cold])
    pool.window[d[hot]] = staged


# -- the pool and its prepared calls ---------------------------------------------------------
class HostPool(Pool):
    """The pool of a cache on the CPU: NumPy pages (its own, zeroed, or the caller's),
    counters and window.  Checking ids and lengths costs no synchronization here, so
    every call checks them (``validate`` is always True)."""

    checks_are_free = True
    __slots__ = ()


#: What :func:`allocation_bytes` counts per page besides the page.
PAGE_EXTRAS = ""


def allocation_bytes(geom: PageGeometry, num_blocks: int, own_pages: bool = True) -> int:
    """Bytes a CPU pool of ``num_blocks`` pages allocates at construction (its pages,
    unless given)."""
    return num_blocks * 2 * geom.side_bytes if own_pages else 0


def memory_available(device_id=None) -> tuple[int | None, str]:
    """``(bytes, where)``: the host's ``MemAvailable`` (None where unknown)."""
    have = _device.host_memory()
    return have, (f"{_device.format_bytes(have)} of host memory is available"
                  if have is not None else "")


def new_pool(geom: PageGeometry, *, device_id=None, num_blocks: int | None, pages, k_s, v_s,
             validate: bool, scale_rule: str, rotation: str, window_pages: int,
             window_slots: int) -> HostPool:
    """The pool of a new cache on the CPU."""
    if pages is None:
        try:
            pages = np.zeros((num_blocks, 2, geom.side_bytes), dtype=np.uint8)
        except (MemoryError, ValueError) as e:  # what the front end's check could not see
            raise ValueError(f"num_blocks = {num_blocks}: the page pool of "
                             f"{allocation_bytes(geom, num_blocks)} bytes cannot be "
                             f"allocated ({type(e).__name__}: {e})") from None
        owns = True
    else:
        owns = False
    n = pages.shape[0]
    window = window_map = None
    if window_slots:
        window = np.zeros((window_slots, 2, geom.block_size, geom.num_heads, geom.head_dim),
                          dtype=np.uint16)
        window_map = np.full(n, -1, dtype=np.int32)
    return HostPool(sys.modules[__name__], "cpu", None, geom, pages,
                    np.zeros(len(STAT_NAMES), dtype=np.uint64), k_s, v_s, owns_pages=owns,
                    validate=validate, scale_rule=scale_rule, rotation=rotation,
                    window_pages=window_pages, window=window, window_map=window_map)


def workspace_bound(geom: PageGeometry, max_batch_size: int, max_seq_len: int,
                    num_query_heads: int) -> tuple[int, int]:
    """The CPU needs no workspace: ``(0, 0)``."""
    return 0, 0


def store_runner(pool, slots, k, v, *, unique_slots: bool, key=None):
    """``run(slots, k, v)``: :func:`store` into ``pool`` for arrays like these (nothing to
    prepare on the CPU: ``key`` is not used)."""
    kw = {"geom": pool.geometry, "rule": pool.scale_rule, "k_s": pool.k_s, "k_g": pool.k_g,
          "v_s": pool.v_s, "v_g": pool.v_g, "stats": pool.stats, "unique_slots": unique_slots,
          "rotate": pool.rotated, "window": pool.store_window}

    def run(slots, k, v):
        store(pool.buffer, slots, k, v, **kw)

    return run


def gather_runner(pool, blocks, out_k, out_v, *, key=None):
    """``run(blocks, out_k, out_v)``: :func:`gather_dequant` of ``pool``'s pages."""
    kw = {"geom": pool.geometry, "k_s": pool.k_s, "v_s": pool.v_s, "stats": pool.stats,
          "rotate": pool.rotated}

    def run(blocks, out_k, out_v):
        gather_dequant(pool.buffer, blocks, out_k, out_v, **kw)

    return run


def attention_runner(pool, q, query_start_loc, block_tables, seq_lens, *,
                     max_query_len: int, causal: bool, sm_scale, exact_new: bool = False,
                     key=None):
    """``run(q, query_start_loc, block_tables, seq_lens, out, lse, new_kv=None)``:
    :func:`attention` over ``pool`` for arrays like these (``query_start_loc`` None: one
    query token per sequence, :func:`decode_attention`); ``new_kv``: the exact new
    tokens (``exact_new``: the caller will pass them, which the CPU always can)."""
    kw = {"geom": pool.geometry, "k_s": pool.k_s, "v_s": pool.v_s, "sm_scale": sm_scale,
          "stats": pool.stats, **pool.window_args}
    if query_start_loc is None:
        def run_decode(q, query_start_loc, block_tables, seq_lens, out, lse, new_kv=None):
            decode_attention(pool.buffer, q, block_tables, seq_lens, out, lse, new_kv=new_kv,
                             **kw)

        return run_decode

    def run(q, query_start_loc, block_tables, seq_lens, out, lse, new_kv=None):
        attention(pool.buffer, q, query_start_loc, block_tables, seq_lens, out, lse,
                  causal=causal, max_query_len=max_query_len, new_kv=new_kv, **kw)

    return run
