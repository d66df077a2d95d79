"""LongLive blocked layout (spec sections 3 and 5): quantize_block and dequantize,
against the reference of ``nvfp4_ref`` (``longlive_quantize_block``,
``longlive_dequantize``).

Under the ``gpu`` marker the GPU equals the CPU bit for bit: the public functions (the
list API's hot path, arrays remembered by identity, which reads new contents and forgets
arrays that die; ``dequantize_pool`` as one launch with ids out of range, ``out=`` and
CUDA-graph replay; refusals before any GPU work is queued) and one layer down
(``TestCupyBackend``: the CuPy backend's quantize and pointer-table decode against the
NumPy backend's).
"""

from __future__ import annotations

import gc
import weakref

import ml_dtypes
import numpy as np
import nvfp4_ref as ref
import pytest
from helpers import capture_stream, make_values, poisoned_elements, same_bytes, same_values
from nvfp4_ref import (
    assert_same_values,
    longlive_dequantize,
    longlive_quantize_block,
    longlive_unblock,
)

import fp4cache
from fp4cache import _cpu as nb
from fp4cache import _hotpath, longlive
from fp4cache._plans import PlanCache
from fp4cache.layout import blocked_scale_offset, longlive_padded_rows

try:  # CuPy and its backend modules, for the GPU cases (which skip by their marker
    # where there is no GPU: collection needs no CuPy)
    import cupy as cp

    from fp4cache import _cuda as cb
except ImportError:
    cb = cp = None


F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = [(16, 8), (5, 3), (64, 4), (1, 1), (33, 4)]  # (Tb, H): R = 128, 15, 256, 1, 132


@pytest.mark.parametrize("D", [64, 128, 192, 256])
@pytest.mark.parametrize("rule", ["4over6", "static6"])
@pytest.mark.parametrize("Tb, H", SHAPES)
def test_quantize_block_matches_reference(D, rule, Tb, H):
    rng = np.random.default_rng(D + Tb * 7 + H)
    x = (rng.standard_normal((Tb, H, D)) * rng.uniform(0.01, 50)).astype(BF16)
    values, sf, amax = longlive.quantize_block(x, scale_rule=rule)
    rv, rsf, ramax = longlive_quantize_block(x, rule)
    Rp = -(-Tb * H // 128) * 128
    assert values.shape == (Rp, D // 2) and values.dtype == np.uint8
    assert sf.shape == (Rp * D // 16,) and sf.dtype == np.uint8
    assert amax.shape == (1,) and amax.dtype == np.float32
    assert amax[0] == np.abs(x.astype(F32)).max()
    np.testing.assert_array_equal(amax, ramax)
    np.testing.assert_array_equal(values, rv)
    np.testing.assert_array_equal(sf, rsf)
    assert not values[Tb * H:].any()
    if rule == "4over6":  # M = 256 keeps the 4-candidate (1.5x larger) below 448
        assert np.all(ref.e4m3_value(sf) <= 384)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dequantize_multiple_blocks_per_element_formula(D, dtype):
    rng = np.random.default_rng(D)
    Tb, H = 16, 3
    blocks = [longlive.quantize_block(
        (rng.standard_normal((Tb, H, D)) * m).astype(F32)) for m in (1.0, 1e-3, 300.0, 7.5)]
    vals, sfs, ams = (list(t) for t in zip(*blocks))
    got = longlive.dequantize(vals, sfs, ams, num_heads=H, block_token_size=Tb, dtype=dtype,
                              scale_rule="4over6")
    assert got.shape == (1, 4 * Tb, H, D)
    assert_same_values(got, longlive_dequantize(vals, sfs, ams, H, Tb, dtype))


@pytest.mark.parametrize("D", [64, 128, 256])
def test_static6_block_read_with_e4m3_max_448(D):
    rng = np.random.default_rng(D + 1)
    Tb, H = 8, 4
    x = rng.standard_normal((2, Tb, H, D)).astype(F32) * 20
    blocks = [longlive.quantize_block(x[i], scale_rule="static6") for i in range(2)]
    vals, sfs, ams = (list(t) for t in zip(*blocks))
    got = longlive.dequantize(vals, sfs, ams, H, Tb, dtype="float32", e4m3_max=448.0)
    assert_same_values(got, longlive_dequantize(vals, sfs, ams, H, Tb, "float32", e4m3_max=448.0))
    err = np.abs(got[0].reshape(2, Tb, H, D) - x)
    assert err.max() <= np.abs(x).max() / 4  # decodes the right thing, not just bytes
    assert_same_values(longlive.dequantize(vals, sfs, ams, H, Tb, dtype="float32",
                                           scale_rule="static6"), got)
    # reading a 448 block with 4over6's 256 is wrong by 448/256, exactly per element
    wrong = longlive.dequantize(vals, sfs, ams, H, Tb, dtype="float32", e4m3_max=256.0)
    assert_same_values(wrong, longlive_dequantize(vals, sfs, ams, H, Tb, "float32"))
    assert not np.array_equal(wrong, got)


def test_4over6_round_trip_accuracy_and_scale_equivalence():
    """Reader's fl(amax*fl(1/1536)) is the writer's s: decode == fl(fl(v*sf)*s)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 8, 128)).astype(F32)
    vals, sf, am = longlive.quantize_block(x)
    got = longlive.dequantize([vals], [sf], [am], 8, 16, dtype="float32",
                              scale_rule="4over6")[0]
    s = F32(am[0] * F32(F32(1) / F32(1536)))
    sfm = longlive_unblock(sf, 128, 8)
    want = ref.decode_values(vals, sfm, s).reshape(16, 8, 128)
    assert_same_values(got, want)
    rel = np.mean((got - x) ** 2) / np.mean(x**2)
    assert rel < 0.02


def test_scale_factor_inputs_any_shape_and_fp8_view():
    rng = np.random.default_rng(4)
    vals, sf, am = longlive.quantize_block(rng.standard_normal((16, 8, 64)).astype(F32))
    want = longlive.dequantize([vals], [sf], [am], 8, 16, e4m3_max=256)
    for sf2 in (sf.reshape(128, 4), sf.reshape(-1, 16), sf.view(ml_dtypes.float8_e4m3fn)):
        assert_same_values(longlive.dequantize([vals], [sf2], [am], 8, 16, e4m3_max=256),
                           want)


def test_zero_and_nonfinite_blocks():
    x = np.zeros((4, 2, 64), F32)
    vals, sf, am = longlive.quantize_block(x)
    assert am[0] == 0 and not vals.any() and not sf.any()
    y = np.ones((4, 2, 64), F32)
    y[3, 1, 5] = np.nan
    nv, nsf, nam = longlive.quantize_block(y)
    assert np.isnan(nam[0]) and not nv.any()
    rv, rsf, _ = longlive_quantize_block(y, "4over6")
    np.testing.assert_array_equal(nsf, rsf)
    g = np.full((4, 2, 64), 3.0, F32)
    gv, gsf, gam = longlive.quantize_block(g)
    out = longlive.dequantize([vals, nv, gv], [sf, nsf, gsf], [am, nam, gam], 2, 4,
                              dtype="float32", scale_rule="4over6")
    assert not out[0, :4].any()
    assert np.isnan(out[0, 4:8]).all()
    np.testing.assert_array_equal(out[0, 8:], 3.0)
    inf = np.zeros((4, 2, 64), ml_dtypes.bfloat16)
    inf[0, 0, 0] = np.inf
    assert np.isnan(longlive.quantize_block(inf)[2][0])


def test_dequantize_pool_matches_list_form():
    rng = np.random.default_rng(5)
    Tb, H, D = 8, 4, 128
    blocks = [longlive.quantize_block(rng.standard_normal((Tb, H, D)).astype(F32) * (i + 1))
              for i in range(5)]
    vals = np.stack([b[0] for b in blocks])
    sfs = np.stack([b[1] for b in blocks])
    ams = np.stack([b[2] for b in blocks])  # (N, 1)
    ids = np.array([4, 0, 0, 2], np.int32)
    got = longlive.dequantize_pool(vals, sfs, ams, ids, H, Tb, dtype="float16",
                                   scale_rule="4over6")
    want = longlive.dequantize([vals[i] for i in ids], [sfs[i] for i in ids],
                               [ams[i] for i in ids], H, Tb, dtype="float16",
                               scale_rule="4over6")
    assert_same_values(got, want)
    out = np.empty((1, 4 * Tb, H, D), F32)
    r = longlive.dequantize_pool(vals, sfs, ams.ravel(), ids, H, Tb, e4m3_max=256, out=out)
    assert np.shares_memory(r, out)
    assert_same_values(out, longlive_dequantize([vals[i] for i in ids], [sfs[i] for i in ids],
                                                [ams[i] for i in ids], H, Tb, "float32"))
    with pytest.raises(IndexError, match="block_ids"):
        longlive.dequantize_pool(vals, sfs, ams, np.array([5]), H, Tb, scale_rule="4over6")


def test_longlive_equals_paged_cache_values():
    """The same token stored in both layouts decodes identically when the scales agree."""
    rng = np.random.default_rng(6)
    Tb, H, D = 4, 2, 128
    x = rng.standard_normal((Tb, H, D)).astype(F32)
    vals, sf, am = longlive.quantize_block(x, scale_rule="static6")
    six_m = F32(6) * F32(448)
    s = F32(am[0] * F32(F32(1) / six_m))
    g = min(F32(six_m / am[0]), ref.FLT_MAX)
    assert g == ref.encode_multiplier(s)  # true for this seed's amax (not for every amax)
    d, sc = fp4cache.quantize(x, scale=float(s))
    np.testing.assert_array_equal(vals[:Tb * H], d.reshape(Tb * H, D // 2))


def test_quantize_block_non_contiguous_input():
    rng = np.random.default_rng(7)
    big = rng.standard_normal((4, 16, 256)).astype(BF16)  # [H, Tb, 2D]
    x = big.transpose(1, 0, 2)[:, :, ::2]  # [Tb, H, D=128], no unit stride anywhere
    got = longlive.quantize_block(x)
    want = longlive.quantize_block(np.ascontiguousarray(x))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(got, longlive_quantize_block(np.ascontiguousarray(x), "4over6")):
        np.testing.assert_array_equal(a, b)


# -- the rule travels with the block -------------------------------------------------------
def test_quantize_block_returns_a_block_that_knows_its_rule():
    import pickle

    x = np.random.default_rng(10).standard_normal((4, 2, 64)).astype(F32)
    for rule, m in (("4over6", 256.0), ("static6", 448.0)):
        block = longlive.quantize_block(x, rule)
        assert isinstance(block, longlive.LongLiveBlock) and isinstance(block, tuple)
        assert block.scale_rule == rule and block.e4m3_max == m
        values, sf, amax = block  # still unpacks like the three arrays
        assert values is block.values and sf is block.scale_factors and amax is block.amax
        assert f"scale_rule={rule!r}" in repr(block) and f"e4m3_max={m:g}" in repr(block)
        back = pickle.loads(pickle.dumps(block))
        assert back.scale_rule == rule
        for a, b in zip(back, block):
            np.testing.assert_array_equal(a, b)
    assert longlive.quantize_block(x).scale_rule == "4over6"  # LongLive's convention


def test_dequantize_takes_blocks_and_their_rule():
    rng = np.random.default_rng(11)
    Tb, H, D = 8, 4, 64
    xs = [rng.standard_normal((Tb, H, D)).astype(F32) * 9 for _ in range(3)]
    s6 = [longlive.quantize_block(x, "static6") for x in xs]
    s46 = [longlive.quantize_block(x, "4over6") for x in xs]
    got = longlive.dequantize(s6, num_heads=H, block_token_size=Tb, dtype="float32")
    want = longlive_dequantize(*zip(*s6), H, Tb, "float32", e4m3_max=448.0)
    assert_same_values(got, want)
    rel = np.sqrt(np.mean((got[0] - np.concatenate(xs)) ** 2) / np.mean(np.concatenate(xs) ** 2))
    assert rel < 0.12
    # the same call with the matching maximum spelled out is the same; a wrong one is loud
    assert_same_values(longlive.dequantize(s6, num_heads=H, block_token_size=Tb,
                                           dtype="float32", e4m3_max=448), want)
    with pytest.raises(ValueError, match=r"e4m3_max=256.*static6.*448"):
        longlive.dequantize(s6, num_heads=H, block_token_size=Tb, e4m3_max=256.0)
    got46 = longlive.dequantize(s46, None, None, H, Tb, "float32")
    assert_same_values(got46, longlive_dequantize(*zip(*s46), H, Tb, "float32"))
    with pytest.raises(ValueError, match="different scale rules"):
        longlive.dequantize([s6[0], s46[1]], num_heads=H, block_token_size=Tb)
    with pytest.raises(TypeError, match="LongLiveBlock"):
        longlive.dequantize([b.values for b in s6], num_heads=H, block_token_size=Tb)
    with pytest.raises(TypeError, match="both scale_factors and amax"):
        longlive.dequantize([b.values for b in s6], [b.scale_factors for b in s6],
                            num_heads=H, block_token_size=Tb)
    # the blocks know their shape: num_heads and block_token_size may be left out
    assert_same_values(longlive.dequantize(s6, dtype="float32"), want)
    # plain arrays do not know their rule: the caller must say it
    plain = longlive.dequantize(*zip(*s46), H, Tb, dtype="float32", scale_rule="4over6")
    assert_same_values(plain, got46)


@pytest.mark.parametrize("H, Tb, bad_H, bad_Tb", [
    (8, 32, 4, 32),    # 256 rows read as 128
    (8, 32, 8, 16),
    (8, 32, 8, 64),    # more rows than the arrays hold
    (3, 5, 3, 50),     # 15 -> 128 rows vs 150 -> 256
])
def test_dequantize_refuses_heads_tokens_that_do_not_match_the_rows(H, Tb, bad_H, bad_Tb):
    rng = np.random.default_rng(12)
    blocks = [longlive.quantize_block(rng.standard_normal((Tb, H, 128)).astype(F32))
              for _ in range(2)]
    vals, sfs, ams = (list(t) for t in zip(*blocks))
    pattern = rf"num_heads={bad_H} and block_token_size={bad_Tb} do not match.*Rp = "
    with pytest.raises(ValueError, match=pattern):
        longlive.dequantize(vals, sfs, ams, bad_H, bad_Tb, scale_rule="4over6")
    with pytest.raises(ValueError, match=r"(num_heads|block_token_size)=\d+ does not match "
                                         rf"the blocks: .*num_heads={H} and "
                                         rf"block_token_size={Tb}"):
        longlive.dequantize(blocks, num_heads=bad_H, block_token_size=bad_Tb)
    with pytest.raises(ValueError, match=pattern):
        longlive.dequantize_pool(np.stack(vals), np.stack(sfs), np.stack(ams), [0, 1],
                                 bad_H, bad_Tb, scale_rule="4over6")
    assert longlive.dequantize(vals, sfs, ams, H, Tb, scale_rule="4over6").shape == \
        (1, 2 * Tb, H, 128)


@pytest.mark.parametrize("bad, exc, match", [
    (lambda x: (x, "6over4"), ValueError, "scale_rule"),
    (lambda x: (x[..., :48], "4over6"), ValueError, "head_dim"),
    (lambda x: (x[:0], "4over6"), ValueError, "at least one token"),
    (lambda x: (x.astype(np.float64), "4over6"), TypeError, "x must have dtype"),
    (lambda x: (x[0], "4over6"), ValueError, "3-D"),
])
def test_quantize_block_checks_everything_before_any_work(bad, exc, match, monkeypatch):
    from fp4cache import _cpu

    def no_work(*a, **k):
        raise AssertionError("the backend was called before the arguments were checked")

    monkeypatch.setattr(_cpu, "longlive_quantize", no_work)
    monkeypatch.setattr(np, "ascontiguousarray", no_work)
    x = np.ones((4, 2, 64), F32)
    with pytest.raises(exc, match=match):
        longlive.quantize_block(*bad(x))


def test_list_fast_path_entries_die_with_their_arrays(monkeypatch):
    """The hot path's entries are keyed by array identity; an entry must disappear as
    soon as any of its arrays dies (before its id could be reused)."""
    import gc

    monkeypatch.setattr(_hotpath, "_current_device", lambda: 0)
    monkeypatch.setattr(_hotpath, "LONGLIVE_LISTS", PlanCache(32))
    vals = [np.zeros((128, 32), np.uint8) for _ in range(3)]
    sfs = [np.zeros(512, np.uint8) for _ in range(3)]
    ams = [np.ones(1, F32) for _ in range(3)]
    args = (2, 8, "bfloat16", 6.0, 256.0)
    launch = ("run", (1, 24, 2, 64), np.float32, np)
    _hotpath.longlive_list_remember(vals, sfs, ams, args, launch)
    assert _hotpath.longlive_list_hit(vals, sfs, ams, args) is launch
    assert _hotpath.longlive_list_hit(tuple(vals), sfs, ams, args) is launch  # same objects
    assert _hotpath.longlive_list_hit(vals[::-1], sfs, ams, args) is None     # another order
    assert _hotpath.longlive_list_hit(vals, sfs, ams, (2, 8, "float16", 6.0, 256.0)) is None
    assert _hotpath.longlive_list_hit(vals, sfs, ams, (2.0, 8, "bfloat16", 6.0, 256.0)) is None
    assert _hotpath.longlive_list_hit(vals, sfs, ams, (True, 8, "bfloat16", 6.0, 256.0)) is None
    monkeypatch.setattr(_hotpath, "_current_device", lambda: 1)
    assert _hotpath.longlive_list_hit(vals, sfs, ams, args) is None           # another GPU
    monkeypatch.setattr(_hotpath, "_current_device", lambda: 0)
    copy = [a.copy() for a in vals]
    assert _hotpath.longlive_list_hit(copy, sfs, ams, args) is None           # equal, not same
    del sfs[1]  # the list drops it, but the array lives on in nothing else: it dies
    gc.collect()
    assert len(_hotpath.LONGLIVE_LISTS) == 0


def test_raw_lists_need_their_rule_and_blocks_catch_swapped_counts():
    """Without these checks a static6 block given as raw arrays would decode with 4over6's
    256 silently (max error 3.37 instead of 0.45), and swapping num_heads and
    block_token_size (same product) would decode scrambled rows.  Raw arrays need the rule
    said; blocks know their (Tb, H) and refuse a swap."""
    rng = np.random.default_rng(13)
    Tb, H, D = 32, 8, 64
    x = rng.standard_normal((Tb, H, D)).astype(F32) * 3
    block = longlive.quantize_block(x, "static6")
    assert (block.block_token_size, block.num_heads) == (Tb, H)
    vals, sfs, ams = ([a] for a in block)
    for call in (lambda: longlive.dequantize(vals, sfs, ams, H, Tb, "float32"),
                 lambda: longlive.dequantize_pool(*(a[0][None] for a in (vals, sfs, ams)),
                                                  [0], H, Tb, "float32")):
        with pytest.raises(TypeError, match=r"scale_rule='4over6'.*scale_rule='static6'"):
            call()
    good = longlive.dequantize(vals, sfs, ams, H, Tb, "float32", scale_rule="static6")
    wrong = longlive.dequantize(vals, sfs, ams, H, Tb, "float32", scale_rule="4over6")
    err_good, err_wrong = (float(np.abs(y[0] - x).max()) for y in (good, wrong))
    assert err_good * 4 < err_wrong  # the rule matters: 448/256 on every value
    assert_same_values(longlive.dequantize([block], dtype="float32"), good)
    pool = longlive.dequantize_pool(*(a[0][None] for a in (vals, sfs, ams)), [0], H, Tb,
                                    "float32", scale_rule="static6")
    assert_same_values(pool, good)
    with pytest.raises(ValueError, match=r"num_heads=32 does not match the blocks"):
        longlive.dequantize([block], num_heads=Tb, block_token_size=H)
    with pytest.raises(ValueError, match=r"scale_rule='4over6' does not match the blocks"):
        longlive.dequantize([block], scale_rule="4over6")
    with pytest.raises(ValueError, match="different shapes"):
        longlive.dequantize([block, longlive.quantize_block(x.reshape(H, Tb, D), "static6")])
    import pickle

    back = pickle.loads(pickle.dumps(block))
    assert (back.block_token_size, back.num_heads, back.scale_rule) == (Tb, H, "static6")


# -- on the GPU, against the CPU -----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["static6", "4over6"])
def test_longlive_cuda_equals_cpu(rule):
    rng = np.random.default_rng(2)
    Tb, H, D = 30, 6, 128
    blocks = [(rng.standard_normal((Tb, H, D)) * s).astype(BF16) for s in (1, 100, 0.01)]
    out_c, out_g = [], []
    for x in blocks:
        out_c.append(longlive.quantize_block(x, rule))
        out_g.append(longlive.quantize_block(cp.asarray(x), rule))
        for a, b in zip(out_g[-1], out_c[-1]):
            assert_same_values(a, b)
    e4m3_max = 256.0 if rule == "4over6" else 448.0
    vals = [o[0] for o in out_c], [o[1] for o in out_c], [o[2] for o in out_c]
    gvals = [o[0] for o in out_g], [o[1] for o in out_g], [o[2] for o in out_g]
    ref = longlive.dequantize(*vals, num_heads=H, block_token_size=Tb, e4m3_max=e4m3_max)
    got = longlive.dequantize(*gvals, num_heads=H, block_token_size=Tb, e4m3_max=e4m3_max)
    assert_same_values(got, ref)
    pool_c = [np.stack(v) for v in vals]
    pool_g = [cp.stack(v) for v in gvals]
    ids = np.array([2, 0, 2, 1], np.int64)
    ref = longlive.dequantize_pool(*pool_c, ids, H, Tb, e4m3_max=e4m3_max)
    got = longlive.dequantize_pool(*pool_g, cp.asarray(ids), H, Tb, e4m3_max=e4m3_max)
    assert_same_values(got, ref)
    # an out-of-range id on the GPU: NaN rows for that block, the others as on the CPU
    bad_ids = cp.asarray(np.array([2, 3, 0, -1], np.int64))
    got = longlive.dequantize_pool(*pool_g, bad_ids, H, Tb, e4m3_max=e4m3_max)
    exp = ref.copy()
    exp[0, Tb:2 * Tb] = np.nan
    exp[0, 3 * Tb:] = np.nan
    exp[0, 2 * Tb:3 * Tb] = longlive.dequantize_pool(*pool_c, np.array([0]), H, Tb,
                                                     e4m3_max=e4m3_max)[0]
    assert_same_values(got, exp)


def _blocks(rng, n, Tb, H, D, rule="4over6"):
    xs = [(rng.standard_normal((Tb, H, D)) * (i + 1)).astype(np.float32) for i in range(n)]
    return [longlive.quantize_block(cp.asarray(x), rule) for x in xs]


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["4over6", "static6"])
def test_longlive_list_hot_path_matches_checked_call_and_reads_new_contents(rule):
    rng = np.random.default_rng(20)
    Tb, H, D = 32, 8, 128
    blocks = _blocks(rng, 5, Tb, H, D, rule)
    vals, sfs, ams = (list(g) for g in zip(*blocks))
    host = [[a.get() for a in g] for g in (vals, sfs, ams)]
    m = blocks[0].e4m3_max
    ref = longlive.dequantize(*host, H, Tb, e4m3_max=m)
    _hotpath.LONGLIVE_LISTS.clear()
    first = longlive.dequantize(vals, sfs, ams, H, Tb, e4m3_max=m)
    assert len(_hotpath.LONGLIVE_LISTS) == 1  # remembered after the checked call
    again = longlive.dequantize(vals, sfs, ams, H, Tb, e4m3_max=m)  # the hot path
    assert again.data.ptr != first.data.ptr  # a new output each call
    assert_same_values(first, ref)
    assert_same_values(again, ref)
    # the rule is known from the blocks
    assert_same_values(longlive.dequantize(blocks, num_heads=H, block_token_size=Tb), ref)
    # new contents behind the same arrays are decoded
    vals[2][...] = vals[0]
    sfs[2][...] = sfs[0]
    ams[2][...] = ams[0]
    exp = ref.copy()
    exp[0, 2 * Tb:3 * Tb] = ref[0, :Tb]
    assert_same_values(longlive.dequantize(vals, sfs, ams, H, Tb, e4m3_max=m), exp)
    # an entry goes with its arrays (checked before any exception's traceback, whose frames
    # may hold the arrays for as long as the exception lives)
    n = len(_hotpath.LONGLIVE_LISTS)
    gone = weakref.ref(vals[3])
    del blocks, vals[3], sfs[3], ams[3]
    gc.collect()
    assert gone() is None
    assert len(_hotpath.LONGLIVE_LISTS) < n
    # a mismatch is refused on the hot path too (the counts are part of the key)
    longlive.dequantize(vals, sfs, ams, H, Tb, e4m3_max=m)
    with pytest.raises(ValueError, match="do not match the blocks"):
        longlive.dequantize(vals, sfs, ams, 4, Tb, e4m3_max=m)


@pytest.mark.gpu
def test_longlive_hot_path_is_per_device_and_dtype():
    rng = np.random.default_rng(21)
    Tb, H, D = 16, 2, 64
    blocks = _blocks(rng, 3, Tb, H, D)
    vals, sfs, ams = (list(g) for g in zip(*blocks))
    ref = longlive.dequantize([a.get() for a in vals], [a.get() for a in sfs],
                              [a.get() for a in ams], H, Tb, dtype="float16", scale_rule="4over6")
    for _ in range(3):
        assert_same_values(longlive.dequantize(vals, sfs, ams, H, Tb, dtype="float16",
                                               scale_rule="4over6"), ref)
        assert longlive.dequantize(vals, sfs, ams, H, Tb, scale_rule="4over6").dtype == BF16


@pytest.mark.gpu
def test_longlive_mismatch_and_bad_blocks_refused_before_any_work(monkeypatch):
    rng = np.random.default_rng(22)
    Tb, H, D = 32, 8, 128
    blocks = _blocks(rng, 2, Tb, H, D)
    vals, sfs, ams = (list(g) for g in zip(*blocks))

    def no_work(*a, **k):
        raise AssertionError("GPU work was prepared before the arguments were checked")

    monkeypatch.setattr(cb, "longlive_list_launcher", no_work)
    monkeypatch.setattr(cb, "longlive_pool_launcher", no_work)
    with pytest.raises(ValueError, match=r"num_heads=4 and block_token_size=32 do not match"):
        longlive.dequantize(vals, sfs, ams, 4, Tb, scale_rule="4over6")
    # raw arrays must say their rule; blocks refuse swapped counts
    with pytest.raises(TypeError, match=r"scale_rule='4over6'.*scale_rule='static6'"):
        longlive.dequantize(vals, sfs, ams, H, Tb)
    with pytest.raises(TypeError, match=r"scale_rule='4over6'.*scale_rule='static6'"):
        longlive.dequantize_pool(cp.stack(vals), cp.stack(sfs), cp.stack(ams),
                                 np.array([0, 1]), H, Tb)
    with pytest.raises(ValueError, match=r"num_heads=32 does not match the blocks"):
        longlive.dequantize(blocks, num_heads=Tb, block_token_size=H)
    with pytest.raises(ValueError, match="do not match"):
        longlive.dequantize_pool(cp.stack(vals), cp.stack(sfs), cp.stack(ams),
                                 np.array([0, 1]), H, 16, scale_rule="4over6")
    strided = cp.zeros((vals[1].shape[0], 2 * vals[1].shape[1]), cp.uint8)[:, ::2]
    with pytest.raises(ValueError, match=r"values\[1\] must be C-contiguous"):
        longlive.dequantize([vals[0], strided], sfs, ams, H, Tb, scale_rule="4over6")
    with pytest.raises(ValueError, match=r"scale_factors\[1\] must hold"):
        longlive.dequantize(vals, [sfs[0], sfs[1][:-1]], ams, H, Tb, scale_rule="4over6")
    with pytest.raises(TypeError, match=r"amax\[0\]"):
        longlive.dequantize(vals, sfs, [ams[0].astype(cp.float16), ams[1]], H, Tb,
                            scale_rule="4over6")


@pytest.mark.gpu
@pytest.mark.parametrize("bad, exc, match", [
    (lambda x: (x, "6over4"), ValueError, "scale_rule"),
    (lambda x: (x[..., :48], "4over6"), ValueError, "head_dim"),
    (lambda x: (x[:0], "4over6"), ValueError, "at least one token"),
    (lambda x: (x.astype(cp.float64), "4over6"), TypeError, "x must have dtype"),
])
def test_quantize_block_on_gpu_checks_before_any_work(bad, exc, match, monkeypatch):
    x = cp.ones((4, 2, 64), cp.float32)
    args = bad(x)

    def no_work(*a, **k):
        raise AssertionError("GPU work was queued before the arguments were checked")

    monkeypatch.setattr(cb, "longlive_quantize", no_work)
    monkeypatch.setattr(cp, "ascontiguousarray", no_work)
    with pytest.raises(exc, match=match):
        longlive.quantize_block(*args)


def _pool(rng, n_pool, H, Tb, D):
    blocks = [longlive.quantize_block(rng.standard_normal((Tb, H, D)).astype(np.float32) * (i + 1),
                                      "4over6") for i in range(n_pool)]
    return [np.stack([b[j] for b in blocks]) for j in range(3)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D", [("bfloat16", 128), ("float16", 64), ("float32", 192)])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_dequantize_pool_one_launch_ids_out_and_graph(id_dtype, dtype, D):
    """16-bit outputs take the wide decode kernel, float32 outputs the other one."""
    rng = np.random.default_rng(5)
    H, Tb = 3, 40
    pool_c = _pool(rng, 5, H, Tb, D)
    pool_g = [cp.asarray(a) for a in pool_c]
    ids = np.array([4, 0, 4, 2, 1], id_dtype)
    ref = longlive.dequantize_pool(*pool_c, ids, H, Tb, dtype=dtype, scale_rule="4over6")
    ids_d = cp.asarray(ids)
    out = cp.full(ref.shape, np.nan, dtype=ref.dtype)
    got = longlive.dequantize_pool(*pool_g, ids_d, H, Tb, out=out, scale_rule="4over6")
    assert got is out
    assert_same_values(out, ref)
    # out of range on both sides: NaN rows for those blocks only
    bad = np.array([5, 1, -1, 2, 1 << 30], id_dtype)
    got = longlive.dequantize_pool(*pool_g, cp.asarray(bad), H, Tb, dtype=dtype,
                                   scale_rule="4over6")
    exp = longlive.dequantize_pool(*pool_c, np.where((bad < 0) | (bad >= 5), 0, bad), H, Tb,
                                   dtype=dtype, scale_rule="4over6")
    for j in (0, 2, 4):
        exp[0, j * Tb:(j + 1) * Tb] = np.nan
    assert_same_values(got, exp)
    # captured once, replayed with new ids in the same device array
    stream = capture_stream()
    with stream:
        out[...] = 0
        stream.begin_capture()
        longlive.dequantize_pool(*pool_g, ids_d, H, Tb, out=out, scale_rule="4over6")
        graph = stream.end_capture()
        new_ids = np.array([1, 1, 3, 0, 2], id_dtype)
        ids_d.set(new_ids, stream=stream)
        graph.launch(stream)
        stream.synchronize()
    assert_same_values(out, longlive.dequantize_pool(*pool_c, new_ids, H, Tb, dtype=dtype,
                                                     scale_rule="4over6"))


@pytest.mark.gpu
def test_wide_decode_many_blocks_and_a_misaligned_block():
    """Many small blocks (grid y), then one block at an odd address: the narrow kernel."""
    rng = np.random.default_rng(9)
    H, Tb, D = 2, 16, 64
    pool_c = _pool(rng, 70, H, Tb, D)
    ids = rng.integers(0, 70, 300)
    ref = longlive.dequantize_pool(*pool_c, ids, H, Tb, scale_rule="4over6")
    assert_same_values(
        longlive.dequantize_pool(*[cp.asarray(a) for a in pool_c], cp.asarray(ids), H, Tb,
                                 scale_rule="4over6"),
        ref)
    vals = [cp.asarray(pool_c[0][i]) for i in (3, 5)]
    raw = cp.zeros(vals[1].size + 1, cp.uint8)
    odd = raw[1:].reshape(vals[1].shape)
    odd[...] = vals[1]
    sfs = [cp.asarray(pool_c[1][i]) for i in (3, 5)]
    ams = [cp.asarray(pool_c[2][i]) for i in (3, 5)]
    exp = longlive.dequantize([pool_c[0][3], pool_c[0][5]], [pool_c[1][3], pool_c[1][5]],
                              [pool_c[2][3], pool_c[2][5]], H, Tb, scale_rule="4over6")
    assert_same_values(longlive.dequantize([vals[0], odd], sfs, ams, H, Tb,
                                           scale_rule="4over6"), exp)


@pytest.mark.gpu
def test_dequantize_list_reuses_pointer_tables_but_reads_new_contents():
    rng = np.random.default_rng(8)
    H, Tb, D = 2, 64, 64
    pool_c = _pool(rng, 3, H, Tb, D)
    vals = [cp.asarray(pool_c[0][i]) for i in range(3)]
    sfs = [cp.asarray(pool_c[1][i]) for i in range(3)]
    ams = [cp.asarray(pool_c[2][i]) for i in range(3)]
    ref = longlive.dequantize([a for a in pool_c[0]], [a for a in pool_c[1]],
                              [a for a in pool_c[2]], H, Tb, scale_rule="4over6")
    assert_same_values(longlive.dequantize(vals, sfs, ams, H, Tb, scale_rule="4over6"), ref)
    # same blocks (same pointers), new contents: the cached tables still point at them
    vals[1][...] = cp.asarray(pool_c[0][2])
    sfs[1][...] = cp.asarray(pool_c[1][2])
    ams[1][...] = cp.asarray(pool_c[2][2])
    exp = ref.copy()
    exp[0, Tb:2 * Tb] = ref[0, 2 * Tb:3 * Tb]
    assert_same_values(longlive.dequantize(vals, sfs, ams, H, Tb, scale_rule="4over6"), exp)
    # a different order is a different table
    assert_same_values(longlive.dequantize(vals[::-1], sfs[::-1], ams[::-1], H, Tb,
                                           scale_rule="4over6")[0, :Tb],
                       ref[0, 2 * Tb:])


VALUE_DTYPES = [BF16, np.dtype(np.float16), np.dtype(np.float32)]
RULES = ["static6", "4over6"]


@pytest.mark.gpu
class TestCupyBackend:
    """The CuPy backend against the NumPy backend on the same inputs, byte for
    byte (float outputs as unsigned-integer views, NaN positions compared apart:
    their payloads differ between CPU and GPU arithmetic)."""

    @pytest.mark.parametrize("dtype", VALUE_DTYPES, ids=str)
    @pytest.mark.parametrize("rule", RULES)
    @pytest.mark.parametrize("kind", ["normal", "zero", "nan", "inf"])
    @pytest.mark.parametrize("Tb,H,D", [(10, 3, 64), (64, 2, 128), (7, 5, 256)])
    def test_longlive_quantize(self, dtype, rule, kind, Tb, H, D):
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

    @pytest.mark.parametrize("dtype", VALUE_DTYPES, ids=str)
    @pytest.mark.parametrize("D", [64, 128, 192])
    def test_longlive_decode_pointer_tables(self, dtype, D):
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
        out = poisoned_elements(ref.shape, dtype)
        cb.longlive_dequantize(*tabs, out, num_heads=H, block_token_size=Tb, inv_denom=inv)
        same_values(out, ref, "longlive decode")
        # a null pointer (out-of-range pool id): that block's rows are NaN, the rest unchanged
        for which in range(3):
            ptrs = [tabs[0].copy(), tabs[1].copy(), tabs[2].copy()]
            ptrs[which][1] = 0
            out = poisoned_elements(ref.shape, dtype)
            cb.longlive_dequantize(*ptrs, out, num_heads=H, block_token_size=Tb, inv_denom=inv)
            exp = ref.copy()
            exp[0, Tb:2 * Tb] = np.nan
            same_values(out, exp, f"null pointer in table {which}")

    def test_longlive_round_trip_blocked_order(self):
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
