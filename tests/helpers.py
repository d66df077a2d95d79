"""Builders and checks shared by the test modules (a plain module, not a test module:
``from helpers import ...``).  The float64 references live in ``nvfp4_ref``; what is
here builds caches and inputs from seeds and compares results.

Nothing here imports CuPy at the top: the GPU helpers import it when they are called
(only GPU cases call them, and those skip by their marker where there is no GPU).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import nvfp4_ref as ref
from nvfp4_ref import paged_attention_f64

import fp4cache
from fp4cache import PagedKVCache
from fp4cache._arrays import array_module
from fp4cache.formats import reciprocal_clamped

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
_UINT = {2: np.uint16, 4: np.uint32}


# -- either backend ---------------------------------------------------------------------------
def xp_of(device):
    """The array module of a backend (``"cpu"``: NumPy, ``"cuda"``: CuPy)."""
    return array_module(device)


def host(a):
    """``a`` as a NumPy array (copied from the device for a CuPy array)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


# -- a CPU cache and its reference model (store / gather) ------------------------------------
def Model(*args, **kwargs):
    """The test's cache model, encoding with the library's functional quantize."""
    return ref.PagedModel(*args, quantize=fp4cache.quantize, **kwargs)


def make_pair(cache_kwargs, **model_kwargs):
    cache = PagedKVCache(**cache_kwargs, device="cpu")
    model = Model(**cache_kwargs)
    return cache, model


def check_against_model(cache, model, blocks=None, dtypes=("float32", "bfloat16")):
    np.testing.assert_array_equal(cache.buffer, model.buffer())
    if blocks is None:
        blocks = np.arange(model.nb)
    for dt in dtypes:
        k, v = cache.gather_dequant(np.asarray(blocks, np.int64), dtype=dt)
        wk, wv = model.gather(blocks, dt)
        ref.assert_same_values(k, wk)
        ref.assert_same_values(v, wv)


def rand_kv(rng, n, H, D, dtype=BF16, scale=1.0):
    k = (rng.standard_normal((n, H, D)) * scale).astype(dtype)
    v = (rng.laplace(size=(n, H, D)) * scale).astype(dtype)
    return k, v


# -- the CuPy backend against the NumPy backend, byte for byte -------------------------------
def same_values(gpu, ref, what=""):
    """Bit-identical float arrays, NaN anywhere the reference has NaN."""
    import cupy as cp

    g = cp.asnumpy(gpu) if not isinstance(gpu, np.ndarray) else gpu
    assert g.shape == ref.shape and g.dtype == ref.dtype, what
    gn = np.isnan(g.astype(np.float32))
    rn = np.isnan(ref.astype(np.float32))
    assert np.array_equal(gn, rn), f"{what}: NaN positions differ ({gn.sum()} vs {rn.sum()})"
    u = _UINT[ref.dtype.itemsize]
    gb = np.where(rn, 0, g.view(u))
    rb = np.where(rn, 0, ref.view(u))
    bad = np.flatnonzero(gb != rb)
    assert bad.size == 0, (f"{what}: {bad.size} values differ, first at {bad[:5]}: "
                           f"gpu {g.reshape(-1)[bad[:5]]} ref {ref.reshape(-1)[bad[:5]]}")


def poisoned_elements(shape, dtype):
    """Device array whose every element's integer view is 0x7E7E (no float kernel); the
    backend tests' pattern (``poisoned`` below fills every byte with 0x7E instead)."""
    import cupy as cp

    a = cp.empty(shape, dtype)
    a.view(_UINT[np.dtype(dtype).itemsize]).fill(0x7E7E)
    return a


def same_bytes(gpu, ref, what=""):
    import cupy as cp

    g = cp.asnumpy(gpu)
    bad = np.flatnonzero(g.reshape(-1) != ref.reshape(-1))
    assert bad.size == 0, f"{what}: {bad.size} bytes differ, first at {bad[:8]}"


def make_values(rng, shape, dtype, *, nonfinite=0.0, tiny=False):
    """Values with varied group magnitudes, exact ties, zeros and signed zeros."""
    x = rng.standard_normal(shape).astype(np.float32)
    # Per-row magnitudes over many binades.
    mag = np.exp2(rng.integers(-12, 12, size=shape[:-1] + (1,))).astype(np.float32)
    x = x * mag
    # Some groups on an exact grid (ties in E2M1 rounding), some zero, some -0.
    flat = x.reshape(-1, 16)
    n = flat.shape[0]
    pick = rng.random(n)
    grid = (rng.integers(-12, 13, size=(n, 16)) * 0.25).astype(np.float32)
    flat[pick < 0.15] = grid[pick < 0.15]
    flat[(pick >= 0.15) & (pick < 0.18)] = 0.0
    flat[(pick >= 0.18) & (pick < 0.20)] = -0.0
    if tiny:
        flat[(pick >= 0.2) & (pick < 0.3)] *= np.float32(1e-30)
    if nonfinite:
        m = rng.random(flat.shape) < nonfinite
        flat[m] = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), size=m.sum())
    return flat.reshape(shape).astype(dtype)


def scales_for(rng, kind):
    """(s, g) float32 pairs for the static scale path, including extreme ones."""
    if kind == "one":
        s = np.float32(1.0)
    elif kind == "calib":
        s = np.float32(rng.uniform(0.5, 8.0) / (6 * 448))
    elif kind == "tiny":
        s = np.float32(1e-38)
    else:  # huge
        s = np.float32(3e37)
    return s, reciprocal_clamped(s)


# -- attention on the CPU: caches, tables, queries, the reference, the bounds ----------------
#: unit roundoff of q's dtype, for the CPU attention tests' bound
UNIT_ROUNDOFF = {BF16: 2.0**-8, F16: 2.0**-11, F32: 2.0**-24}


def make_cache(num_blocks=24, block_size=16, num_heads=2, head_dim=64, *, fill=True, seed=0,
               **kw) -> PagedKVCache:
    """A CPU cache whose every slot holds random K/V (K with a few outlier channels)."""
    cache = PagedKVCache(num_blocks, block_size, num_heads, head_dim, device="cpu", **kw)
    if fill:
        rng = np.random.default_rng(seed)
        n = cache.num_slots
        k = rng.standard_normal((n, num_heads, head_dim), dtype=np.float32)
        k[:, :, :: max(1, head_dim // 4)] *= 8  # outlier channels
        v = rng.standard_normal((n, num_heads, head_dim), dtype=np.float32)
        cache.store(rng.permutation(n), k, v)
    return cache


def make_tables(cache, seq_lens, *, max_blocks=None, seed=1, pad=-1):
    """Random distinct pages for each sequence; unused entries are ``pad``."""
    rng = np.random.default_rng(seed)
    T = cache.block_size
    need = [-(-int(n) // T) for n in seq_lens]
    width = max(need + [1]) if max_blocks is None else max_blocks
    tables = np.full((len(seq_lens), width), pad, dtype=np.int32)
    for b, nb in enumerate(need):
        tables[b, :nb] = rng.choice(cache.num_blocks, size=nb, replace=nb > cache.num_blocks)
    return tables, np.asarray(seq_lens, dtype=np.int32)


def make_q(B, Hq, D, dtype=F32, seed=2):
    q = np.random.default_rng(seed).standard_normal((B, Hq, D), dtype=np.float32)
    return q.astype(dtype)


def starts_of(nq, itype=np.int32) -> np.ndarray:
    """``query_start_loc`` of per-sequence query counts."""
    return np.concatenate([[0], np.cumsum(nq, dtype=np.int64)]).astype(itype)


def attention_reference(cache, q, qsl, tables, lens, *, causal=True, sm_scale=None):
    """``nvfp4_ref.paged_attention_f64`` over the float32 K/V values ``gather_dequant``
    returns for every page of a CPU cache, ``sm_scale`` (default ``1/sqrt(head_dim)``)
    rounded to float32 as the cache uses it: float64 ``(out, lse)``; rows that see no key
    give zeros and lse -inf, a bad page in a row's keys NaN."""
    N, Hq, D = q.shape
    kd, vd = cache.gather_dequant(np.arange(cache.num_blocks), dtype="float32")
    scale = float(np.float32(1.0 / math.sqrt(D) if sm_scale is None else sm_scale))
    return paged_attention_f64(kd.astype(np.float64), vd.astype(np.float64), q,
                               np.asarray(qsl), np.asarray(tables), np.asarray(lens),
                               cache.block_size, scale, cache.num_blocks, causal)


def decode_reference(cache, q, block_tables, seq_lens, sm_scale=None):
    """``attention_reference`` of one query token per sequence (no mask)."""
    return attention_reference(cache, q, np.arange(q.shape[0] + 1), block_tables, seq_lens,
                               causal=False, sm_scale=sm_scale)


def assert_close(got, want, dtype):
    """The CPU attention tests' bound: element-wise, rows of (B, Hq)."""
    assert got.dtype == dtype
    got = got.astype(np.float64)
    row = np.abs(want).max(axis=-1, keepdims=True)
    tol = 2 * UNIT_ROUNDOFF[dtype] * np.abs(want) + 1e-9 * row
    if dtype == F16:
        tol = tol + 2.0**-24
    err = np.abs(got - want)
    assert np.all(err <= tol), (
        f"max error {err.max():.3g} at {np.unravel_index(np.argmax(err - tol), err.shape)}, "
        f"tolerance there {tol.flat[np.argmax(err - tol)]:.3g}"
    )


def assert_lse_close(got, want):
    assert got.dtype == np.float32
    fin = np.isfinite(want)
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(got[fin], want[fin], rtol=2.0**-23, atol=1e-9)


# -- attention on the GPU --------------------------------------------------------------------
DT = ref.DTYPES
#: the GPU attention tests' bound on a row's relative 2-norm error, by output dtype
TOL = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 3e-3}

# (H, T, D, layout, swizzle, rule, group, dtype): the GPU attention tests' shapes
ATTENTION_CASES = [
    (8, 16, 128, "HND", True, "static6", 4, "bfloat16"),
    (8, 16, 128, "NHD", True, "4over6", 4, "bfloat16"),
    (4, 16, 128, "HND", False, "static6", 8, "float16"),
    (2, 32, 64, "NHD", False, "4over6", 1, "float32"),
    (2, 16, 64, "HND", True, "static6", 16, "bfloat16"),
    (2, 16, 256, "HND", True, "4over6", 4, "bfloat16"),
    (2, 16, 256, "NHD", True, "static6", 16, "float32"),
    (2, 8, 256, "HND", False, "static6", 8, "float16"),
    (3, 4, 128, "HND", False, "4over6", 4, "bfloat16"),
    (2, 5, 128, "NHD", False, "static6", 3, "float32"),
    (2, 12, 128, "HND", True, "static6", 2, "float16"),
    (2, 32, 128, "HND", True, "4over6", 16, "float16"),
    (2, 16, 128, "NHD", True, "static6", 12, "bfloat16"),
    (1, 16, 64, "HND", True, "static6", 9, "float32"),
    (2, 16, 128, "HND", True, "static6", 8, "float32"),
    (2, 8, 64, "NHD", True, "4over6", 5, "float16"),
    (2, 16, 128, "HND", True, "static6", 1, "bfloat16"),
    # head_dim 64 with 4-tile chunks: bf16 / f16, both layouts, group 4 and 7
    (2, 16, 64, "NHD", True, "static6", 4, "bfloat16"),
    (3, 32, 64, "HND", False, "4over6", 7, "float16"),
]


def capture_stream():
    """A non-blocking CuPy stream for a test that captures or orders work itself, made
    once the current device is idle: such a stream does not wait for the default stream,
    so inputs built there (``cupy.zeros``, ``arange``, a store) must be finished first."""
    import cupy

    cupy.cuda.Device().synchronize()
    return cupy.cuda.Stream(non_blocking=True)


def kv_values(rng, n, H, D, *, nan_k=(), nan_v=()):
    """Realistic K/V: unit normal with a few outlier channels (x8) and RoPE-like
    structure ignored; optional NaN entries (token, head, d) that make groups NaN."""
    k = rng.standard_normal((n, H, D), dtype=np.float32)
    v = rng.standard_normal((n, H, D), dtype=np.float32)
    out_ch = rng.choice(D, size=max(1, D // 32), replace=False)
    k[:, :, out_ch] *= 8.0
    v[:, :, out_ch[:1]] *= 4.0
    for t, h, d in nan_k:
        k[t, h, d] = np.nan
    for t, h, d in nan_v:
        v[t, h, d] = np.nan
    return k, v


def make_gpu_cache(rng, *, H, T, D, layout="HND", swizzle=True, rule="static6", num_blocks,
                   nan_k=(), nan_v=(), decoded=True):
    """A GPU cache whose every slot (in order) holds ``kv_values``; with ``decoded``
    ``(cache, kd, vd)``, the float64 K/V of every slot as ``gather_dequant`` decodes them
    (the float64 reference's input), else the cache alone (the tests against the CPU
    backend, which decode nothing beforehand)."""
    import cupy as cp

    k_scale = 8.0 * 4.5 / (6 * 448)  # ~ amax / (6 * 448) of these values
    cache = fp4cache.PagedKVCache(num_blocks, T, H, D, layout=layout, scale_rule=rule,
                                  k_scale=k_scale, v_scale=4.5 / (6 * 448),
                                  swizzle_v_scales=swizzle, device="cuda")
    n = num_blocks * T
    k, v = kv_values(rng, n, H, D, nan_k=nan_k, nan_v=nan_v)
    cache.store(cp.arange(n, dtype=cp.int64), cp.asarray(k), cp.asarray(v))
    if not decoded:
        return cache
    kd, vd = cache.gather_dequant(cp.arange(num_blocks, dtype=cp.int32), dtype="float32")
    return cache, kd.get().astype(np.float64), vd.get().astype(np.float64)


def tables_for(rng, lens, T, num_blocks, max_blocks, itype=np.int32):
    """Block tables using distinct random pages, -1 past each sequence's pages."""
    tab = np.full((len(lens), max_blocks), -1, dtype=itype)
    perm = rng.permutation(num_blocks)
    pos = 0
    for b, L in enumerate(lens):
        need = min(max_blocks, -(-max(int(L), 0) // T))
        ids = perm[pos:pos + need] if pos + need <= num_blocks else rng.integers(
            0, num_blocks, need)
        pos += need
        tab[b, :need] = ids
    return tab


def rand_q(rng, N, Hq, D, dtname):
    q = rng.standard_normal((N, Hq, D), dtype=np.float32) * 1.5
    return q.astype(DT[dtname])


def decode_f64(kd, vd, q, tab, lens, T, sm_scale, num_blocks):
    """float64 attention over the decoded values; (out, lse); NaN rows for bad ids (one query
    token per sequence of ``nvfp4_ref.paged_attention_f64``)."""
    return paged_attention_f64(kd, vd, q, np.arange(q.shape[0] + 1), tab, lens, T, sm_scale,
                               num_blocks, False)


def poisoned(shape, dtype):
    """A device array whose every byte is 0x7E, so that an unwritten entry cannot pass."""
    import cupy as cp

    a = cp.empty(shape, dtype=dtype)
    a.view(cp.uint8).fill(0x7E)
    return a


def check(out, lse, ref_out, ref_lse, dtname, what="", maybe_nan=None, *,
          empty_rows_zero=False, lse_tol=1e-3):
    """The GPU attention bound against a reference: per row (token, query head) the
    relative 2-norm error over its finite entries <= ``TOL[dtname]``, NaN positions
    exact, lse within ``1e-3 * max(1, |lse|)`` with its NaN and -inf positions exact.
    ``maybe_nan`` (bool, ``out``'s shape): entries that may be NaN on the GPU although
    the reference computed them (then the row is compared on its other entries);
    ``empty_rows_zero``: a row that sees no key (lse -inf in the reference) must also be
    exactly zeros; ``lse_tol``: the lse bound's factor.  Returns the largest relative
    error."""
    import cupy as cp

    got = cp.asnumpy(out).astype(np.float64)
    ref_out = ref_out.astype(np.float64)
    gn, rn = np.isnan(got), np.isnan(ref_out)
    allowed = rn if maybe_nan is None else rn | (maybe_nan & gn)
    assert np.array_equal(gn, allowed), (
        f"{what}: NaN positions differ: gpu {gn.sum()} ref {rn.sum()}, first "
        f"{np.argwhere(gn != allowed)[:4].tolist()}")
    skip = gn | rn
    g = np.where(skip, 0.0, got)
    r = np.where(skip, 0.0, ref_out)
    num = np.sqrt(((g - r) ** 2).sum(-1))
    den = np.sqrt((r ** 2).sum(-1))
    rel = np.where(den > 0, num / np.maximum(den, 1e-300), num)
    worst = np.unravel_index(int(np.argmax(rel)), rel.shape)
    assert rel.max() <= TOL[dtname], f"{what}: row {worst} relative error {rel.max():.3g}"
    empty = np.isneginf(ref_lse)
    if empty_rows_zero:
        assert not got[empty].any(), f"{what}: a row that sees no key is not zeros"
    if lse is not None:
        gl = cp.asnumpy(lse).astype(np.float64)
        lnan = np.isnan(gl)
        want_nan = np.isnan(ref_lse)
        if maybe_nan is not None:
            want_nan = want_nan | (maybe_nan.any(-1) & lnan)
        assert np.array_equal(lnan, want_nan), f"{what}: lse NaN positions differ"
        assert np.array_equal(np.isneginf(gl), empty), f"{what}: lse -inf positions differ"
        fin = np.isfinite(ref_lse) & ~lnan
        err = np.abs(gl[fin] - ref_lse[fin])
        assert (err <= lse_tol * np.maximum(1.0, np.abs(ref_lse[fin]))).all(), \
            f"{what}: lse error {err.max():.3g}"
    return float(rel.max())


def check_rows(out, lse, ref_out, ref_lse, dtname, what="", maybe_nan=None, lse_tol=1e-3):
    """``check`` with ``empty_rows_zero``: the bound of the tests of the method against
    the CPU backend."""
    return check(out, lse, ref_out, ref_lse, dtname, what, maybe_nan, empty_rows_zero=True,
                 lse_tol=lse_tol)


def window_cpu_cache(rng, *, H, T, D, lens, P, rotation, layout="HND", swizzle=True,
                     extra_mapped=(), unmapped=(), nan_k=(), nan_v=(), spare=3):
    """A CPU cache (the oracle) whose sequences (one table row each) have their last ``P``
    pages mapped to window slots before every token is stored (so the slots hold the exact
    bf16 values); ``extra_mapped``: (sequence, page) also mapped (before the window: never
    read exactly), ``unmapped``: (sequence, page) unmapped after the stores (a shorter
    suffix or none); ``nan_k`` / ``nan_v``: (sequence, token, head, d) stored as NaN.
    Returns (cache, tab, lens)."""
    lens = np.asarray(lens, np.int32)
    npg = [-(-int(n) // T) for n in lens]
    num_blocks = sum(npg) + spare
    cpu = PagedKVCache(num_blocks, T, H, D, device="cpu", rotation=rotation, window_pages=P,
                       window_slots=P * len(lens) + len(extra_mapped), layout=layout,
                       swizzle_v_scales=swizzle, k_scale=8.0 * 4.5 / (6 * 448),
                       v_scale=4.5 / (6 * 448), scale_rule="4over6")
    width = max(npg) + 1
    tab = np.full((len(lens), width), -1, np.int32)
    perm = rng.permutation(num_blocks)
    pos = 0
    for b, n in enumerate(npg):
        tab[b, :n] = perm[pos:pos + n]
        pos += n
    if P:
        blocks = [int(tab[b, p]) for b, n in enumerate(npg) for p in range(max(0, n - P), n)]
        blocks += [int(tab[b, p]) for b, p in extra_mapped]
        cpu.map_window(blocks, list(range(len(blocks))))
    slots = np.concatenate([tab[b, np.arange(n) // T] * T + np.arange(n) % T
                            for b, n in enumerate(lens) if n])
    k, v = kv_values(rng, slots.size, H, D)
    k, v = k.astype(np.float32), v.astype(np.float32)
    start = np.concatenate([[0], np.cumsum(lens)])
    for (b, t, h, d), x in [(a, k) for a in nan_k] + [(a, v) for a in nan_v]:
        x[start[b] + t, h, d] = np.nan
    cpu.store(slots, k, v)
    for b, p in unmapped:
        cpu.map_window([int(tab[b, p])], [-1])
    return cpu, tab, lens


# -- the exact window, the rotation and the exact new tokens ----------------------------------
def sylvester(d: int) -> np.ndarray:
    """The normalized Hadamard matrix of order ``d`` in float64."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(d)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (uint16)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def window_reference(c: PagedKVCache, q, qsl, tab, lens, causal=True, new_kv=None):
    """float64 attention with the window split of ``docs/window.md`` written out on its
    own: per sequence the suffix of at most ``window_pages`` mapped pages read from the
    bf16 slots, the rest from the pages decoded in the stored basis; q rotated by the
    Hadamard matrix when the cache rotates.  ``new_kv``: the keys ``p >= L_b - n_b`` from
    those rows instead (K rotated with q).  Returns ``(out, lse)``."""
    T, H, D = c.block_size, c.num_heads, c.head_dim
    twin = PagedKVCache(c.num_blocks, T, H, D, device="cpu", k_scale=c.k_scale,
                        v_scale=c.v_scale, layout=c.layout, scale_rule=c.scale_rule)
    twin.buffer[:] = c.buffer
    kd, vd = (x.astype(np.float64) for x in
              twin.gather_dequant(np.arange(c.num_blocks), dtype="float32"))
    q = q.astype(np.float64)
    kn = None if new_kv is None else new_kv[0].astype(np.float64)
    vn = None if new_kv is None else new_kv[1].astype(np.float64)
    if c.rotation == "hadamard":
        q = q @ sylvester(D).T
        kn = None if kn is None else kn @ sylvester(D).T
    N, Hq, _ = q.shape
    g = Hq // H
    out = np.zeros((N, Hq, D))
    lse = np.full((N, Hq), -np.inf)
    scale = float(np.float32(1 / math.sqrt(D)))
    wmap = c.window_map
    for b in range(len(qsl) - 1):
        s0, s1 = int(qsl[b]), int(qsl[b + 1])
        n = s1 - s0
        L = int(min(lens[b], tab.shape[1] * T))
        if n == 0 or L == 0:
            continue
        K = kd[tab[b, np.arange(L) // T] * T + np.arange(L) % T].copy()
        V = vd[tab[b, np.arange(L) // T] * T + np.arange(L) % T].copy()
        npg = -(-L // T)
        p = npg - 1
        while (c.window_slots and p >= max(0, npg - c.window_pages)
               and 0 <= wmap[tab[b, p]] < c.window_slots):
            sl = wmap[tab[b, p]]
            toks = np.arange(p * T, min(L, (p + 1) * T))
            K[toks] = bf16_values(c.window[sl, 0, : len(toks)])
            V[toks] = bf16_values(c.window[sl, 1, : len(toks)])
            p -= 1
        if kn is not None:
            K[L - n:] = kn[s0:s1]
            V[L - n:] = vn[s0:s1]
        for t in range(n):
            lim = max(0, L - n + t + 1) if causal else L
            if lim == 0:
                continue
            for h in range(H):
                s = q[s0 + t, h * g:(h + 1) * g] @ K[:lim, h].T * scale
                m = s.max(axis=1, keepdims=True)
                w = np.exp(s - m)
                out[s0 + t, h * g:(h + 1) * g] = w @ V[:lim, h] / w.sum(axis=1, keepdims=True)
                lse[s0 + t, h * g:(h + 1) * g] = (m + np.log(w.sum(axis=1, keepdims=True)))[:, 0]
    return out, lse


# -- the front ends' calls into a backend ------------------------------------------------------
class RecordingRunner:
    """Stands in for a backend's ``attention_runner``: records what the front end hands to
    the backend, once per run of the returned launch (the runner's arguments with the
    arrays of the call); the launch is kept under the front end's key in the pool's plans,
    as the backends do."""

    def __init__(self):
        self.calls = []

    def __call__(self, pool, q, query_start_loc, block_tables, seq_lens, *, key=None, **kw):
        def run(q, query_start_loc, block_tables, seq_lens, out, lse):
            self.calls.append(dict(pool=pool, q=q, query_start_loc=query_start_loc,
                                   block_tables=block_tables, seq_lens=seq_lens, out=out,
                                   lse=lse, **kw))

        if key is not None:
            pool.plans.put(key, run)
        return run
