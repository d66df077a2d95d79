"""Independent reference of the NVFP4 contract (spec sections 1, 2, 4, 5) for the tests.

Written from the contract (``docs/format.md``) only: nothing here imports ``fp4cache``.
There are two group encoders, a scalar one (plain Python loops over NumPy float32 scalars, the spec
pseudo-code line by line) and a vectorized one (the same steps on ``[N, 16]`` arrays),
checked against each other in ``test_codec.py``.  Offsets are computed with direct
formulas and with NumPy reshape/transpose forms, never with ``fp4cache.layout``.  Last,
the float64 attention over decoded pages (``paged_attention_f64``) that every attention
test compares with, and the LongLive block encoder and decoder.
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = F32(struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0])
C6 = F32(struct.unpack("<f", struct.pack("<I", 0x3E2AAAAB))[0])  # fl(1/6)
C4 = F32(0.25)
E2M1_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"bfloat16": BF16, "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}


# -- element formats -------------------------------------------------------------------
def e2m1_encode_scalar(x) -> int:
    """E2M1 code of one float32: nearest magnitude, ties to the even code, saturate +-6."""
    x = F32(x)
    a = abs(float(x))
    sign = 8 if np.signbit(x) else 0
    if a >= 6.0:
        return sign | 7
    for code in range(7):
        lo, hi = E2M1_MAGS[code], E2M1_MAGS[code + 1]
        if a <= hi:
            twice = 2.0 * a  # exact in float64
            if twice < lo + hi:
                return sign | code
            if twice > lo + hi:
                return sign | (code + 1)
            return sign | (code if code % 2 == 0 else code + 1)
    raise AssertionError("unreachable")


def e2m1_value(code: int) -> float:
    v = E2M1_MAGS[code & 7]
    return -v if code & 8 else v


E2M1_TABLE = np.array([e2m1_value(c) for c in range(16)], dtype=F32)


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """Vectorized E2M1 codes via ``ml_dtypes.float4_e2m1fn`` (finite and +-inf inputs)."""
    x = np.asarray(x, dtype=F32)
    with np.errstate(invalid="ignore"):
        c = np.clip(x, F32(-6.0), F32(6.0)).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    return c & 0xF


def e4m3_encode(x) -> np.ndarray:
    """Saturating E4M3 byte(s): clip to +-448, then ml_dtypes' nearest-even cast."""
    x = np.asarray(x, dtype=F32)
    return np.clip(x, F32(-448), F32(448)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_value(b) -> np.ndarray:
    return np.asarray(b, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)


def _e4m3_positive_table() -> np.ndarray:
    """float64 values of E4M3 codes 0..126 computed from the bit fields (no ml_dtypes)."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


E4M3_POS = _e4m3_positive_table()


def e4m3_encode_bruteforce(x: np.ndarray) -> np.ndarray:
    """E4M3 bytes by nearest-value search over the 127 finite magnitudes, ties to even."""
    x = np.asarray(x, dtype=F32)
    a = np.minimum(np.abs(x).astype(np.float64), 448.0)
    hi = np.searchsorted(E4M3_POS, a, side="left")  # first value >= a
    hi = np.minimum(hi, 126)
    lo = np.maximum(hi - 1, 0)
    exact = E4M3_POS[hi] == a
    twice = 2 * a  # exact in float64; so is E4M3_POS[lo] + E4M3_POS[hi]
    mid = E4M3_POS[lo] + E4M3_POS[hi]
    code = np.where(twice < mid, lo, np.where(twice > mid, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(exact, hi, code)
    return (code | (np.signbit(x).astype(np.int64) << 7)).astype(np.uint8)


def pack(codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack(data: np.ndarray) -> np.ndarray:
    data = np.asarray(data, dtype=np.uint8)
    return np.stack([data & 0xF, data >> 4], axis=-1).reshape(data.shape[:-1]
                                                            + (2 * data.shape[-1],))


def encode_multiplier(scale) -> np.float32:
    """``g = min(fl(1/scale), FLT_MAX)``."""
    with np.errstate(divide="ignore", over="ignore"):
        return min(F32(1.0) / F32(scale), FLT_MAX)


# -- spec section 2: one group, scalar -------------------------------------------------
def _candidate_scalar(x, m, c, s, g):
    sf = int(e4m3_encode(F32(g * F32(m * c))))
    f = F32(e4m3_value(sf))
    if f == 0:
        os_ = F32(0.0)
    else:
        os_ = min(F32(F32(1.0) / F32(f * s)), FLT_MAX)
    codes = [e2m1_encode_scalar(F32(xi * os_)) for xi in x]
    err = F32(0.0)
    for xi, q in zip(x, codes):
        xh = F32(F32(F32(e2m1_value(q)) * f) * s)
        d = F32(xh - xi)
        err = F32(err + F32(d * d))
    return codes, sf, err


def encode_group_scalar(x, s, g, rule: str, *, return_errors: bool = False):
    """Spec section 2 for one group of 16 float32 values: ``(codes[16], scale_byte)``."""
    x = [F32(v) for v in np.asarray(x, dtype=F32).ravel()]
    assert len(x) == 16
    s, g = F32(s), F32(g)
    if not all(np.isfinite(v) for v in x):
        out = ([0] * 16, 0x7F)
        return (*out, None) if return_errors else out
    m = max(abs(v) for v in x)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        c6, sf6, e6 = _candidate_scalar(x, m, C6, s, g)
        if rule == "static6":
            res, errs = (c6, sf6), (e6,)
        elif rule == "4over6":
            c4, sf4, e4 = _candidate_scalar(x, m, C4, s, g)
            res, errs = ((c4, sf4) if e4 < e6 else (c6, sf6)), (e6, e4)
        else:
            raise ValueError(rule)
    return (*res, errs) if return_errors else res


# -- spec section 2: vectorized over groups --------------------------------------------
def _candidate_vec(x, m, c, s, g):
    sf = e4m3_encode(g * (m * c))
    f = e4m3_value(sf)
    os_ = np.where(f == 0, F32(0), np.minimum(F32(1.0) / np.where(f == 0, F32(1), f * s),
                                               FLT_MAX))
    codes = e2m1_encode(x * os_[:, None])
    xh = (E2M1_TABLE[codes] * f[:, None]) * s
    d = xh - x
    err = np.zeros(x.shape[0], dtype=F32)
    for i in range(16):
        err = err + d[:, i] * d[:, i]
    return codes, sf, err


def encode_groups(x: np.ndarray, s, g, rule: str):
    """Vectorized spec section 2: x float32 ``[N, 16]`` -> (codes ``[N, 16]``, scales ``[N]``)."""
    x = np.asarray(x, dtype=F32).reshape(-1, 16)
    s, g = F32(s), F32(g)
    finite = np.isfinite(x).all(axis=1)
    xs = np.where(finite[:, None], x, F32(0))
    m = np.abs(xs).max(axis=1) if len(xs) else np.zeros(0, F32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        codes, sf, e6 = _candidate_vec(xs, m, C6, s, g)
        if rule == "4over6":
            c4, sf4, e4 = _candidate_vec(xs, m, C4, s, g)
            pick4 = e4 < e6
            codes = np.where(pick4[:, None], c4, codes)
            sf = np.where(pick4, sf4, sf)
        elif rule != "static6":
            raise ValueError(rule)
    codes = np.where(finite[:, None], codes, 0).astype(np.uint8)
    sf = np.where(finite, sf, 0x7F).astype(np.uint8)
    return codes, sf


def quantize(x: np.ndarray, scale=1.0, rule: str = "static6"):
    """Reference of ``fp4cache.quantize``: x ``[..., D]`` -> (data ``[..., D/2]``, scales)."""
    x = np.asarray(x)
    D = x.shape[-1]
    s = F32(scale)
    codes, sf = encode_groups(x.astype(F32).reshape(-1, 16), s, encode_multiplier(s), rule)
    data = pack(codes.reshape(x.shape[:-1] + (D,)))
    return data, sf.reshape(x.shape[:-1] + (D // 16,))


def decode_values(data: np.ndarray, scales: np.ndarray, s) -> np.ndarray:
    """float32 values ``fl(fl(v * f) * s)`` of packed data ``[..., D/2]`` and scales."""
    codes = unpack(data)
    f = np.repeat(e4m3_value(scales), 16, axis=-1)
    with np.errstate(invalid="ignore", over="ignore"):
        return (E2M1_TABLE[codes] * f) * F32(s)


def dequantize(data, scales, scale=1.0, dtype="bfloat16") -> np.ndarray:
    with np.errstate(over="ignore"):
        return decode_values(data, scales, scale).astype(DTYPES[dtype])


# -- spec section 4: vLLM page offsets -------------------------------------------------
def row_index(layout: str, t, h, T: int, H: int):
    return h * T + t if layout == "HND" else t * H + h


def swizzle_tile(tile: np.ndarray) -> np.ndarray:
    """Stored order of one head's logical ``[T, S]`` V-scale tile (reshape/permute form)."""
    T, S = tile.shape
    return tile.reshape(T // 4, 4, 4, S // 4).transpose(0, 2, 3, 1).reshape(T, S)


def build_page_side(data: np.ndarray, scales: np.ndarray, layout: str, swizzle: bool):
    """Bytes of one side of one page from data ``[T, H, D/2]`` and scales ``[T, H, S]``.

    Uses array transposes (not per-element offsets): HND stores ``[H, T, ...]``,
    NHD stores ``[T, H, ...]``; a swizzled side permutes each head's ``[T, S]`` tile.
    """
    if layout == "HND":
        d = data.transpose(1, 0, 2)
        sc = scales.transpose(1, 0, 2)  # [H, T, S]
        if swizzle:
            sc = np.stack([swizzle_tile(sc[h]) for h in range(sc.shape[0])])
    else:
        d = data
        sc = scales  # [T, H, S]
        if swizzle:
            per_head = np.stack([swizzle_tile(sc[:, h]) for h in range(sc.shape[1])], axis=1)
            sc = per_head
    return np.concatenate([np.ascontiguousarray(d).ravel(), np.ascontiguousarray(sc).ravel()])


class PagedModel:
    """Logical contents of a paged cache (page, side, token, head) and its expected bytes.

    ``quantize(x, scale, rule) -> (data, scales)`` encodes tokens (this module's reference
    by default; the cache tests pass ``fp4cache.quantize``).  Duplicate slots: the last
    wins; slots outside ``[0, num_blocks*block_size)`` are skipped.
    """

    def __init__(self, num_blocks, block_size, num_heads, head_dim, *, layout="HND",
                 scale_rule="static6", k_scale=1.0, v_scale=1.0, swizzle_v_scales=True,
                 quantize=quantize):
        self.nb, self.T, self.H, self.D = num_blocks, block_size, num_heads, head_dim
        self.layout, self.rule, self.swizzle = layout, scale_rule, swizzle_v_scales
        self.scales = (k_scale, v_scale)
        self.quantize = quantize
        self.data = np.zeros((num_blocks, 2, block_size, num_heads, head_dim // 2), np.uint8)
        self.sf = np.zeros((num_blocks, 2, block_size, num_heads, head_dim // 16), np.uint8)

    def store(self, slots, k, v):
        slots = np.asarray(slots)
        for side, x in enumerate((k, v)):
            d, s = self.quantize(np.ascontiguousarray(x), self.scales[side], self.rule)
            for i, slot in enumerate(slots):  # in order: the last duplicate wins
                if 0 <= slot < self.nb * self.T:
                    self.data[slot // self.T, side, slot % self.T] = d[i]
                    self.sf[slot // self.T, side, slot % self.T] = s[i]

    def buffer(self):
        pages = []
        for b in range(self.nb):
            sides = [build_page_side(self.data[b, side], self.sf[b, side], self.layout,
                                     self.swizzle and side == 1) for side in (0, 1)]
            pages.append(np.stack(sides))
        return np.stack(pages)

    def gather(self, blocks, dtype):
        """Decoded pages ``blocks``; an id outside ``[0, num_blocks)`` gives NaN rows."""
        blocks = np.asarray(blocks, dtype=np.int64)
        bad = (blocks < 0) | (blocks >= self.nb)
        safe = np.where(bad, 0, blocks)
        out = []
        for side in (0, 1):
            d = self.data[safe, side].copy()
            s = self.sf[safe, side].copy()
            d[bad], s[bad] = 0, 0x7F
            out.append(dequantize(d.reshape(-1, self.H, self.D // 2),
                                  s.reshape(-1, self.H, self.D // 16), self.scales[side], dtype))
        return tuple(out)


# -- spec section 5: LongLive blocked scales -------------------------------------------
def to_blocked(scales: np.ndarray) -> np.ndarray:
    """fouroversix/cuBLAS ``to_blocked`` of a ``[R, S]`` scale matrix (reshape form)."""
    R, S = scales.shape
    nr, nc = -(-R // 128), -(-S // 4)
    padded = np.zeros((nr * 128, nc * 4), dtype=scales.dtype)
    padded[:R, :S] = scales
    blocks = padded.reshape(nr, 128, nc, 4).transpose(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(0, 2, 1, 3).reshape(-1, 32, 16).ravel()


# -- LongLive blocks: quantize_block and dequantize ------------------------------------
def longlive_quantize_block(x, rule):
    """Spec sections 3 + 5 from scratch: (values [Rp, D/2], sf [Rp*S], amax [1])."""
    x32 = np.asarray(x).astype(F32)
    Tb, H, D = x32.shape
    R, S = Tb * H, D // 16
    Rp = -(-R // 128) * 128
    values = np.zeros((Rp, D // 2), np.uint8)
    sfm = np.zeros((Rp, S), np.uint8)
    if not np.isfinite(x32).all():
        sfm[:R] = 0x7F
        return values, to_blocked(sfm), np.array([np.nan], F32)
    amax = F32(np.abs(x32).max())
    if amax == 0:
        return values, to_blocked(sfm), np.array([amax], F32)
    six_m = F32(6) * F32(256 if rule == "4over6" else 448)
    with np.errstate(over="ignore", divide="ignore"):
        g = min(F32(six_m / amax), FLT_MAX)
    s = F32(amax * F32(F32(1) / six_m))
    codes, sf = encode_groups(x32.reshape(-1, 16), s, g, rule)
    values[:R] = pack(codes.reshape(R, D))
    sfm[:R] = sf.reshape(R, S)
    return values, to_blocked(sfm), np.array([amax], F32)


def longlive_unblock(flat, Rp, S):
    """Inverse of to_blocked: flat E4M3 bytes -> [Rp, S] matrix."""
    perm = to_blocked(np.arange(Rp * S).reshape(Rp, S))
    mat = np.empty(Rp * S, np.uint8)
    mat[perm] = np.asarray(flat).reshape(-1).view(np.uint8)
    return mat.reshape(Rp, S)


def longlive_dequantize(values, sfs, amaxes, H, Tb, dtype, e2m1_max=6.0, e4m3_max=256.0):
    """Per-element decode fl(fl(v*sf) * fl(amax * fl(1/fl(e2m1_max*e4m3_max))))."""
    inv = F32(F32(1) / F32(F32(e2m1_max) * F32(e4m3_max)))
    D = 2 * values[0].shape[1]
    S, R = D // 16, Tb * H
    out = np.empty((1, len(values) * Tb, H, D), DTYPES[dtype])
    for b, (val, sf, am) in enumerate(zip(values, sfs, amaxes)):
        gs = F32(F32(np.asarray(am).reshape(-1)[0]) * inv)
        sfm = longlive_unblock(sf, val.shape[0], S)[:R]
        v = E2M1_TABLE[unpack(val[:R])]  # [R, D]
        f = np.repeat(e4m3_value(sfm), 16, axis=1)
        with np.errstate(invalid="ignore", over="ignore"):
            x = ((v * f) * gs).astype(DTYPES[dtype])
        out[0, b * Tb:(b + 1) * Tb] = x.reshape(Tb, H, D)
    return out


# -- comparison helpers ----------------------------------------------------------------
def bits(a) -> np.ndarray:
    """Raw bits of an array (uint of the same itemsize)."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same_values(got, want) -> None:
    """Bit-exact equality of arrays, NaN matching NaN (any payload); ``got`` may be a
    device array (copied to the host)."""
    if not isinstance(got, np.ndarray) and hasattr(got, "get"):
        got = got.get()
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    gn = np.isnan(got.astype(F32))
    np.testing.assert_array_equal(gn, np.isnan(want.astype(F32)))
    np.testing.assert_array_equal(bits(got)[~gn], bits(want)[~gn])


# -- attention over decoded pages ----------------------------------------------------
def paged_attention_f64(kd, vd, q, qsl, tab, lens, T, sm_scale, num_blocks, causal):
    """float64 attention of each query row over the keys it sees, the attention tests'
    one reference (CPU and GPU, decode and any query length): ``kd``, ``vd`` are the
    decoded K / V of every slot, ``(num_blocks * T, H, D)``;
    rows ``qsl[b] .. qsl[b+1]`` of ``q`` are sequence b's query tokens (bottom-right causal
    mask with ``causal``); ``(out (N, Hq, D), lse (N, Hq))``.  A sequence length is clamped
    to the table's capacity; a block id outside the pool makes its keys NaN (NaN rows), a
    NaN V value NaN columns; rows that see no key give zeros and lse -inf."""
    q = q.astype(np.float64)
    N, Hq, D = q.shape
    H = kd.shape[1]
    g = Hq // H
    out = np.zeros((N, Hq, D))
    lse = np.full((N, Hq), -np.inf)
    cap = tab.shape[1] * T
    for b in range(len(qsl) - 1):
        s0, s1 = int(qsl[b]), int(qsl[b + 1])
        n = s1 - s0
        if n <= 0:
            continue
        L = int(min(max(int(lens[b]), 0), cap))
        i = np.arange(L)
        ids = tab[b, i // T].astype(np.int64) if L else np.zeros(0, np.int64)
        bad = (ids < 0) | (ids >= num_blocks)
        rows = np.where(bad, 0, ids) * T + i % T
        K, V = kd[rows].copy(), vd[rows].copy()  # (L, H, D)
        K[bad] = np.nan  # a bad page's keys: NaN scores -> NaN rows
        for t in range(n):
            lim = max(0, L - n + t + 1) if causal else L
            if lim == 0:
                continue
            for h in range(H):
                qs = q[s0 + t, h * g:(h + 1) * g]  # (g, D)
                Vh = V[:lim, h].copy()
                nanv = np.isnan(Vh)
                with np.errstate(invalid="ignore", over="ignore"):
                    s = (qs @ K[:lim, h].T) * sm_scale  # (g, lim)
                    m = s.max(axis=1, keepdims=True)
                    p = np.exp(s - m)
                    den = p.sum(axis=1, keepdims=True)
                    o = (p @ np.where(nanv, 0.0, Vh)) / den
                o[:, nanv.any(axis=0)] = np.nan
                out[s0 + t, h * g:(h + 1) * g] = o
                lse[s0 + t, h * g:(h + 1) * g] = (m + np.log(den))[:, 0]
    return out, lse
