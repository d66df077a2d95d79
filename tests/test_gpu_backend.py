"""GPU backend == NumPy backend, byte for byte (pages, scales, decoded values).

Every test runs the CuPy kernels and the NumPy oracle on the same inputs (and the same
random initial page contents, so stray writes show up) and compares raw bytes; float
outputs are compared as unsigned-integer views, NaN positions compared separately
(NaN payloads differ between CPU and GPU arithmetic and carry no meaning).
"""

from __future__ import annotations

import random
import zlib

import ml_dtypes
import numpy as np
import pytest

from fp4cache import _numpy_backend as nb
from fp4cache._abi import STAT, STAT_NAMES
from fp4cache.formats import reciprocal_clamped
from fp4cache.layout import PageGeometry, blocked_scale_offset, longlive_padded_rows

NSTATS = len(STAT_NAMES)

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

from fp4cache import _cupy_backend as cb  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [BF16, np.dtype(np.float16), np.dtype(np.float32)]
RULES = ["static6", "4over6"]
_UINT = {2: np.uint16, 4: np.uint32}


# -- helpers ----------------------------------------------------------------------------
def same_values(gpu, ref, what=""):
    """Bit-identical float arrays, NaN anywhere the reference has NaN."""
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


def poisoned(shape, dtype):
    """Device array filled with a recognizable non-zero pattern (no float kernel)."""
    a = cp.empty(shape, dtype)
    a.view(_UINT[np.dtype(dtype).itemsize]).fill(0x7E7E)
    return a


def same_bytes(gpu, ref, what=""):
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


def slot_pattern(rng, kind, n, num_slots):
    if kind == "random":
        s = rng.choice(num_slots, size=n, replace=False) if n <= num_slots else \
            rng.integers(0, num_slots, n)
    elif kind == "contiguous":
        start = rng.integers(0, max(1, num_slots - n))
        s = (start + np.arange(n)) % num_slots
    elif kind == "negative":
        s = rng.choice(num_slots, size=n, replace=n > num_slots)
        s[rng.random(n) < 0.3] = -1
    elif kind == "partial":  # a few tokens in the middle of pages
        T = 16
        s = rng.integers(0, num_slots // T, n) * T + rng.integers(3, 9, n)
        s = np.unique(s)[:n]
        s = np.resize(s, n)
    elif kind == "duplicates":
        s = rng.integers(0, max(2, n // 3), n)
    elif kind == "oob":
        s = rng.integers(0, num_slots, n)
        bad = rng.random(n) < 0.2
        s[bad] = num_slots + rng.integers(0, 100, bad.sum())
        s[rng.random(n) < 0.1] = -5
    else:
        raise AssertionError(kind)
    return s


def _layout_case(rng, dtype, H, D, n, noncontig):
    """k on the host and the device, possibly non-contiguous / unaligned on the device."""
    k = make_values(rng, (n, H, D), dtype, nonfinite=0.002)
    if noncontig == "none":
        kd = cp.asarray(k)
    elif noncontig == "head_pad":  # head stride D + 16
        big = np.zeros((n, H, D + 16), dtype=dtype)
        big[:, :, :D] = k
        kd = cp.asarray(big)[:, :, :D]
    elif noncontig == "transposed":  # [H, N, D] storage
        kd = cp.asarray(np.ascontiguousarray(k.transpose(1, 0, 2))).transpose(1, 0, 2)
    elif noncontig == "token_step":  # every other token of a bigger array
        big = np.zeros((2 * n, H, D), dtype=dtype)
        big[::2] = k
        kd = cp.asarray(big)[::2]
    elif noncontig == "unaligned":  # data pointer off 16-byte alignment
        flat = np.zeros(n * H * D + 1, dtype=dtype)
        flat[1:] = k.reshape(-1)
        kd = cp.asarray(flat)[1:].reshape(n, H, D)
    else:
        raise AssertionError(noncontig)
    return k, kd


# -- store ------------------------------------------------------------------------------
def _store_cases(count=80, seed=1234):
    """A covering random subset of the full grid (each axis value cycles)."""
    axes = {
        "dtype": [0, 1, 2],
        "layout": ["HND", "NHD"],
        "swizzle": [True, False],
        "rule": RULES,
        "D": [64, 128, 256],
        "T": [16, 32, 64],
        "H": [1, 8, 32],
        "pattern": ["random", "contiguous", "negative", "partial", "duplicates", "oob"],
        "slot_dtype": [np.int32, np.int64],
        "noncontig": ["none", "none", "head_pad", "transposed", "token_step", "unaligned"],
        "scale": ["one", "calib", "calib", "tiny", "huge"],
        "ntok": ["small", "large"],
    }
    r = random.Random(seed)
    orders = {k: r.sample(v, len(v)) for k, v in axes.items()}
    cases = []
    for c in range(count):
        case = {k: orders[k][(c + r.randrange(len(v))) % len(v)] if c >= 24 else
                orders[k][c % len(v)] for k, v in axes.items()}
        cases.append(case)
    return cases


def _run_store(case, seed):
    rng = np.random.default_rng(seed)
    dtype = DTYPES[case["dtype"]]
    H, T, D = case["H"], case["T"], case["D"]
    geom = PageGeometry(H, T, D, case["layout"], case["swizzle"])
    budget = 300_000 // (H * D)
    n = int(rng.integers(1, min(100, budget) + 1)) if case["ntok"] == "small" else \
        int(rng.integers(129, max(130, min(700, budget)) + 1))
    num_blocks = max(2, (n // T) + int(rng.integers(1, 6)))
    num_slots = num_blocks * T
    slots = slot_pattern(rng, case["pattern"], n, num_slots).astype(case["slot_dtype"])
    k, kd = _layout_case(rng, dtype, H, D, n, case["noncontig"])
    v, vd = _layout_case(rng, dtype, H, D, n, "none" if case["noncontig"] == "unaligned"
                         else case["noncontig"])
    ks, kg = scales_for(rng, case["scale"])
    vs, vg = scales_for(rng, "calib")
    buf0 = rng.integers(0, 256, (num_blocks, 2, geom.side_bytes), dtype=np.uint8)
    buf_ref = buf0.copy()
    st_ref = np.zeros(NSTATS, np.uint64)
    nb.store(buf_ref, slots, k, v, geom=geom, rule=case["rule"], k_s=ks, k_g=kg, v_s=vs,
             v_g=vg, stats=st_ref)
    buf = cp.asarray(buf0)
    st = cp.zeros(NSTATS, cp.uint64)
    cb.store(buf, cp.asarray(slots), kd, vd, geom=geom, rule=case["rule"], k_s=ks, k_g=kg,
             v_s=vs, v_g=vg, stats=st)
    same_bytes(buf, buf_ref, f"pages {case}")
    assert np.array_equal(cp.asnumpy(st), st_ref), (cp.asnumpy(st), st_ref, case)
    return geom, buf, buf_ref, num_blocks


@pytest.mark.parametrize("case", _store_cases(), ids=lambda c: "-".join(
    str(c[k]) for k in ("dtype", "layout", "swizzle", "rule", "D", "T", "H", "pattern",
                        "noncontig", "scale", "ntok")))
def test_store_and_gather_match_numpy(case):
    geom, buf, buf_ref, num_blocks = _run_store(case, seed=zlib.crc32(str(case).encode()))
    # gather the pages back, including repeats and (for some cases) bad ids
    rng = np.random.default_rng(7)
    n = int(rng.integers(1, 2 * num_blocks + 1))
    blocks = rng.integers(0, num_blocks, n)
    if case["pattern"] == "oob":
        blocks[rng.random(n) < 0.3] = rng.choice([-1, num_blocks, num_blocks + 7])
    blocks = blocks.astype(case["slot_dtype"])
    out_dt = DTYPES[(case["dtype"] + 1) % 3]
    shape = (n * geom.block_size, geom.num_heads, geom.head_dim)
    rk, rv = np.empty(shape, out_dt), np.empty(shape, out_dt)
    st_ref = np.zeros(NSTATS, np.uint64)
    ks, vs = np.float32(0.75), np.float32(1.5)
    nb.gather_dequant(buf_ref, blocks, rk, rv, geom=geom, k_s=ks, v_s=vs, stats=st_ref)
    gk, gv = poisoned(shape, out_dt), poisoned(shape, out_dt)
    st = cp.zeros(NSTATS, cp.uint64)
    cb.gather_dequant(buf, cp.asarray(blocks), gk, gv, geom=geom, k_s=ks, v_s=vs, stats=st)
    same_values(gk, rk, "out_k")
    same_values(gv, rv, "out_v")
    assert np.array_equal(cp.asnumpy(st), st_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout,swizzle", [("HND", True), ("NHD", False), ("NHD", True)])
def test_gather_random_bytes_every_scale_byte(dtype, layout, swizzle):
    """Pages of random bytes: every E4M3 byte (NaN, negative, subnormal) decodes alike."""
    rng = np.random.default_rng(3)
    geom = PageGeometry(4, 16, 128, layout, swizzle)
    buf0 = rng.integers(0, 256, (9, 2, geom.side_bytes), dtype=np.uint8)
    blocks = np.array([3, 0, 8, 8, 1, -2, 9, 4], np.int64)
    shape = (len(blocks) * 16, 4, 128)
    rk, rv = np.empty(shape, dtype), np.empty(shape, dtype)
    st_ref = np.zeros(NSTATS, np.uint64)
    s = np.float32(0.37)
    nb.gather_dequant(buf0, blocks, rk, rv, geom=geom, k_s=s, v_s=np.float32(1.0),
                      stats=st_ref)
    gk, gv = poisoned(shape, dtype), poisoned(shape, dtype)
    st = cp.zeros(NSTATS, cp.uint64)
    cb.gather_dequant(cp.asarray(buf0), cp.asarray(blocks), gk, gv, geom=geom, k_s=s,
                      v_s=np.float32(1.0), stats=st)
    same_values(gk, rk, "k")
    same_values(gv, rv, "v")
    bad = STAT["bad_block_ids"]
    assert int(cp.asnumpy(st)[bad]) == 2 == int(st_ref[bad])


@pytest.mark.parametrize("n", [5, 128, 129, 1000])
def test_duplicate_slots_last_occurrence_wins(n):
    """Scan path (n <= 128) and claim path (n > 128) both keep the last occurrence."""
    rng = np.random.default_rng(n)
    geom = PageGeometry(2, 16, 64, "HND", True)
    num_blocks = 4
    slots = rng.integers(0, 20, n).astype(np.int64)  # many repeats
    slots[-1] = slots[0]
    k = make_values(rng, (n, 2, 64), BF16)
    v = make_values(rng, (n, 2, 64), BF16)
    buf_ref = np.zeros((num_blocks, 2, geom.side_bytes), np.uint8)
    st = np.zeros(NSTATS, np.uint64)
    nb.store(buf_ref, slots, k, v, geom=geom, rule="4over6", k_s=np.float32(1),
             k_g=np.float32(1), v_s=np.float32(1), v_g=np.float32(1), stats=st)
    for _ in range(3):  # deterministic across repeats
        buf = cp.zeros_like(cp.asarray(buf_ref))
        cb.store(buf, cp.asarray(slots), cp.asarray(k), cp.asarray(v), geom=geom,
                 rule="4over6", k_s=np.float32(1), k_g=np.float32(1), v_s=np.float32(1),
                 v_g=np.float32(1), stats=cp.zeros(NSTATS, cp.uint64))
        same_bytes(buf, buf_ref, "pages")


# -- flat codec -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("scale", ["one", "calib", "tiny", "huge"])
@pytest.mark.parametrize("D", [16, 48, 128])
def test_flat_quantize_dequantize(dtype, rule, scale, D):
    rng = np.random.default_rng(D + len(scale))
    n = 257
    x = make_values(rng, (n, D), dtype, nonfinite=0.003, tiny=True)
    s, g = scales_for(rng, scale)
    data_r = np.empty((n, D // 2), np.uint8)
    sc_r = np.empty((n, D // 16), np.uint8)
    nb.quantize(x, s, g, rule, data_r, sc_r)
    data = cp.empty((n, D // 2), cp.uint8)
    sc = cp.empty((n, D // 16), cp.uint8)
    cb.quantize(cp.asarray(x), s, g, rule, data, sc)
    same_bytes(data, data_r, "data")
    same_bytes(sc, sc_r, "scales")
    for out_dt in DTYPES:
        ref = np.empty((n, D), out_dt)
        nb.dequantize(data_r, sc_r, s, ref)
        out = poisoned((n, D), out_dt)
        cb.dequantize(data, sc, s, out)
        same_values(out, ref, f"dequantize {out_dt}")


def test_flat_unaligned_and_random_bytes():
    rng = np.random.default_rng(11)
    n, D = 100, 64
    x = make_values(rng, (n, D), np.float16)
    flat = cp.zeros(n * D + 1, cp.float16)
    xd = flat[1:].reshape(n, D)
    xd[...] = cp.asarray(x)
    data_r = np.empty((n, D // 2), np.uint8)
    sc_r = np.empty((n, D // 16), np.uint8)
    nb.quantize(x, np.float32(1), np.float32(1), "4over6", data_r, sc_r)
    dbuf = cp.zeros(n * D // 2 + 3, cp.uint8)
    data = dbuf[3:].reshape(n, D // 2)
    sc = cp.empty((n, D // 16), cp.uint8)
    cb.quantize(xd, np.float32(1), np.float32(1), "4over6", data, sc)
    same_bytes(data, data_r, "data")
    same_bytes(sc, sc_r, "scales")
    # random bytes decode, unaligned input and output
    raw = rng.integers(0, 256, (n, D // 2), dtype=np.uint8)
    rsc = rng.integers(0, 256, (n, D // 16), dtype=np.uint8)
    ref = np.empty((n, D), BF16)
    nb.dequantize(raw, rsc, np.float32(2.5), ref)
    obuf = cp.empty(n * D + 1, BF16)
    out = obuf[1:].reshape(n, D)
    dbuf[3:] = cp.asarray(raw.reshape(-1))
    cb.dequantize(data, cp.asarray(rsc), np.float32(2.5), out)
    same_values(out, ref, "dequantize")


# -- LongLive ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kind", ["normal", "zero", "nan", "inf"])
@pytest.mark.parametrize("Tb,H,D", [(10, 3, 64), (64, 2, 128), (7, 5, 256)])
def test_longlive_quantize(dtype, rule, kind, Tb, H, D):
    rng = np.random.default_rng(Tb * H + D)
    x = make_values(rng, (Tb, H, D), dtype)
    if kind == "zero":
        x = np.zeros_like(x)
        x[0, 0, :3] = -0.0
    elif kind == "nan":
        x[Tb // 2, H - 1, 5] = np.nan
    elif kind == "inf":
        x[0, 0, 0] = -np.inf
    Rp = longlive_padded_rows(Tb, H)
    vr = np.full((Rp, D // 2), 9, np.uint8)
    sr = np.full(Rp * D // 16, 9, np.uint8)
    ar = np.zeros(1, np.float32)
    nb.longlive_quantize(x, rule, vr, sr, ar)
    vg = cp.full((Rp, D // 2), 9, cp.uint8)
    sg = cp.full(Rp * D // 16, 9, cp.uint8)
    ag = cp.full(1, 5.0, cp.float32)
    cb.longlive_quantize(cp.asarray(x), rule, vg, sg, ag)
    same_values(ag, ar, "amax")
    same_bytes(vg, vr, "values")
    same_bytes(sg, sr, "scale factors")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 128, 192])
def test_longlive_decode_pointer_tables(dtype, D):
    rng = np.random.default_rng(D)
    H, Tb, nblk = 3, 50, 4
    Rp = longlive_padded_rows(Tb, H)
    S = D // 16
    vals = [rng.integers(0, 256, (Rp, D // 2), dtype=np.uint8) for _ in range(nblk)]
    sfs = [rng.integers(0, 256, Rp * S, dtype=np.uint8) for _ in range(nblk)]
    amax = [np.array([a], np.float32) for a in (3.5, 0.0, np.nan, 1e-3)]
    inv = np.float32(1) / np.float32(6 * 256)
    ref = np.empty((1, nblk * Tb, H, D), dtype)
    nb.longlive_dequantize(vals, sfs, amax, ref, num_heads=H, block_token_size=Tb,
                           inv_denom=inv)
    # one block's values at an odd address: the byte path
    dv = [cp.asarray(a) for a in vals]
    odd = cp.zeros(Rp * D // 2 + 1, cp.uint8)
    odd[1:] = dv[2].reshape(-1)
    ptr_v = [a.data.ptr for a in dv]
    ptr_v[2] = odd.data.ptr + 1
    ds = [cp.asarray(a) for a in sfs]
    da = [cp.asarray(a) for a in amax]
    tabs = [cp.asarray(np.array(p, np.uint64)) for p in
            (ptr_v, [a.data.ptr for a in ds], [a.data.ptr for a in da])]
    out = poisoned(ref.shape, dtype)
    cb.longlive_dequantize(*tabs, out, num_heads=H, block_token_size=Tb, inv_denom=inv)
    same_values(out, ref, "longlive decode")
    # a null pointer (out-of-range pool id): that block's rows are NaN, the rest unchanged
    for which in range(3):
        ptrs = [tabs[0].copy(), tabs[1].copy(), tabs[2].copy()]
        ptrs[which][1] = 0
        out = poisoned(ref.shape, dtype)
        cb.longlive_dequantize(*ptrs, out, num_heads=H, block_token_size=Tb, inv_denom=inv)
        exp = ref.copy()
        exp[0, Tb:2 * Tb] = np.nan
        same_values(out, exp, f"null pointer in table {which}")


def test_longlive_round_trip_blocked_order():
    """Quantize on the GPU, decode on the CPU: scale (r, s) sits at the blocked offset."""
    rng = np.random.default_rng(5)
    Tb, H, D = 40, 4, 128
    x = make_values(rng, (Tb, H, D), BF16)
    Rp = longlive_padded_rows(Tb, H)
    vg = cp.empty((Rp, D // 2), cp.uint8)
    sg = cp.empty(Rp * D // 16, cp.uint8)
    ag = cp.empty(1, cp.float32)
    cb.longlive_quantize(cp.asarray(x), "static6", vg, sg, ag)
    sf = cp.asnumpy(sg)
    offs = blocked_scale_offset(np.arange(Rp)[:, None], np.arange(D // 16)[None, :], D // 16)
    assert sorted(offs.reshape(-1).tolist()) == list(range(Rp * D // 16))
    assert not sf[offs[Tb * H:]].any()  # padding rows zero


# -- CUDA graph -------------------------------------------------------------------------
def test_gather_dequant_cuda_graph_capture_and_replay():
    rng = np.random.default_rng(21)
    geom = PageGeometry(8, 16, 128, "HND", True)
    num_blocks = 32
    buf = cp.asarray(rng.integers(0, 256, (num_blocks, 2, geom.side_bytes), dtype=np.uint8))
    blocks = cp.asarray(np.array([5, 1, 31, 1, 40, 0], np.int32))
    shape = (6 * 16, 8, 128)
    ok, ov = cp.empty(shape, BF16), cp.empty(shape, BF16)
    st = cp.zeros(NSTATS, cp.uint64)
    ks, vs = np.float32(0.5), np.float32(2.0)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cb.gather_dequant(buf, blocks, ok, ov, geom=geom, k_s=ks, v_s=vs, stats=st)  # warm
        stream.synchronize()
        stream.begin_capture()
        cb.gather_dequant(buf, blocks, ok, ov, geom=geom, k_s=ks, v_s=vs, stats=st)
        graph = stream.end_capture()
    for rep in range(3):
        # new page contents and new block ids between replays
        host = rng.integers(0, 256, (num_blocks, 2, geom.side_bytes), dtype=np.uint8)
        ids = rng.integers(-1, num_blocks + 1, 6).astype(np.int32)
        buf[...] = cp.asarray(host)
        blocks[...] = cp.asarray(ids)
        ok.view(cp.uint16).fill(0)
        ov.view(cp.uint16).fill(0)
        cp.cuda.get_current_stream().synchronize()
        graph.launch(stream)
        stream.synchronize()
        rk, rv = np.empty(shape, BF16), np.empty(shape, BF16)
        st_ref = np.zeros(NSTATS, np.uint64)
        nb.gather_dequant(host, ids.astype(np.int64), rk, rv, geom=geom, k_s=ks, v_s=vs,
                          stats=st_ref)
        same_values(ok, rk, f"replay {rep} k")
        same_values(ov, rv, f"replay {rep} v")
    # the warm-up call already saw block id 40
    assert int(cp.asnumpy(st)[STAT["bad_block_ids"]]) >= 1


# -- hypothesis -------------------------------------------------------------------------
hyp = pytest.importorskip("hypothesis")
st_ = hyp.strategies


@hyp.settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=list(hyp.HealthCheck))
@hyp.given(
    dt=st_.sampled_from([0, 1, 2]),
    rule=st_.sampled_from(RULES),
    layout=st_.sampled_from(["HND", "NHD"]),
    swizzle=st_.booleans(),
    H=st_.integers(1, 5),
    T=st_.sampled_from([4, 8, 16, 20]),
    G=st_.sampled_from([1, 3, 4, 5, 8, 12]),
    n=st_.integers(1, 300),
    seed=st_.integers(0, 2**31),
    i64=st_.booleans(),
)
def test_hypothesis_store_gather(dt, rule, layout, swizzle, H, T, G, n, seed, i64):
    rng = np.random.default_rng(seed)
    D = 16 * G
    dtype = DTYPES[dt]
    geom = PageGeometry(H, T, D, layout, swizzle and G % 4 == 0 and T % 4 == 0)
    num_blocks = int(rng.integers(1, 12))
    slots = rng.integers(-2, num_blocks * T + 2, n).astype(np.int64 if i64 else np.int32)
    k = make_values(rng, (n, H, D), dtype, nonfinite=0.01)
    v = make_values(rng, (n, H, D), dtype)
    s = np.float32(np.exp2(rng.uniform(-20, 20)))
    g = reciprocal_clamped(s)
    buf0 = rng.integers(0, 256, (num_blocks, 2, geom.side_bytes), dtype=np.uint8)
    ref = buf0.copy()
    st_ref = np.zeros(NSTATS, np.uint64)
    nb.store(ref, slots, k, v, geom=geom, rule=rule, k_s=s, k_g=g, v_s=s, v_g=g,
             stats=st_ref)
    buf = cp.asarray(buf0)
    st = cp.zeros(NSTATS, cp.uint64)
    cb.store(buf, cp.asarray(slots), cp.asarray(k), cp.asarray(v), geom=geom, rule=rule,
             k_s=s, k_g=g, v_s=s, v_g=g, stats=st)
    same_bytes(buf, ref, "pages")
    blocks = rng.integers(-1, num_blocks + 1, int(rng.integers(1, 6)))
    shape = (len(blocks) * T, H, D)
    rk, rv = np.empty(shape, dtype), np.empty(shape, dtype)
    nb.gather_dequant(ref, blocks, rk, rv, geom=geom, k_s=s, v_s=s, stats=st_ref)
    gk, gv = poisoned(shape, dtype), poisoned(shape, dtype)
    cb.gather_dequant(buf, cp.asarray(blocks), gk, gv, geom=geom, k_s=s, v_s=s, stats=st)
    same_values(gk, rk, "k")
    same_values(gv, rv, "v")
    assert np.array_equal(cp.asnumpy(st), st_ref)


def test_every_specialization_compiles_and_loads():
    from fp4cache import _kernels

    for spec in _kernels.all_specs():
        assert _kernels.get_kernel(spec) is not None



def test_claim_table_across_calls_graph_replays_and_freed_caches():
    """Large stores with repeated slots (claim, store, clear) through caches: stale claims
    of earlier calls never win a slot, in eager calls, graph replays and eager calls after
    replays; graphs captured from caches of different sizes on one stream replay
    correctly after the other caches are freed; the claim tables end all zero."""
    import gc

    from fp4cache import PagedKVCache

    rng = np.random.default_rng(99)
    H, D, T, n = 2, 64, 16, 300
    stream = cp.cuda.Stream(non_blocking=True)
    caches = []
    for nbk in (40, 64, 23):  # several caches, several sizes, one stream
        kw = dict(num_blocks=nbk, block_size=T, num_heads=H, head_dim=D, layout="NHD",
                  swizzle_v_scales=False)
        gpu, cpu = PagedKVCache(**kw, device="cuda"), PagedKVCache(**kw, device="cpu")
        dev = (cp.empty(n, cp.int64), cp.empty((n, H, D), BF16), cp.empty((n, H, D), BF16))
        with stream:
            dev[0].fill(-1)  # padding only: nothing stored before the checked calls
            gpu.store(*dev, unique_slots=False)  # the plan is made before capture
            gpu.store(*dev, unique_slots=False)
            stream.synchronize()
            stream.begin_capture()
            gpu.store(*dev, unique_slots=False)
            graph = stream.end_capture()
        caches.append((gpu, cpu, dev, graph, nbk))
    spare = PagedKVCache(8, T, H, D, device="cuda")  # freed before the replays
    del spare
    for call in range(12):
        i = call % len(caches)
        gpu, cpu, dev, graph, nbk = caches[i]
        slots = rng.permutation(nbk * T)[:n].astype(np.int64)
        slots[7::13] = slots[2]  # repeats: the last one wins
        k = make_values(rng, (n, H, D), BF16)
        v = make_values(rng, (n, H, D), BF16)
        cpu.store(slots, k, v, unique_slots=False)
        with stream:
            dev[0].set(slots, stream=stream)
            dev[1].set(k, stream=stream)
            dev[2].set(v, stream=stream)
            if call % 3 == 2:
                gpu.store(*dev, unique_slots=False)  # eager, between replays
            else:
                graph.launch(stream)
            stream.synchronize()
        same_bytes(gpu.buffer, cpu.buffer, f"call {call}")
        if call == 5:  # free the first cache (its graph goes too) and keep replaying
            caches[0] = None
            caches = [c for c in caches if c is not None]
            gc.collect()
    for gpu, *_ in caches:
        assert not gpu._state.claim.any()
