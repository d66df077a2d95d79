"""LongLive blocked layout (spec sections 3 and 5): quantize_block and dequantize."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import nvfp4_ref as ref
import pytest
from nvfp4_ref import assert_same_values

import fp4cache
from fp4cache import longlive
from fp4cache._plans import PlanCache

F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)


def ref_quantize_block(x, rule):
    """Spec sections 3 + 5 from scratch: (values [Rp, D/2], sf [Rp*S], amax [1])."""
    x32 = np.asarray(x).astype(F32)
    Tb, H, D = x32.shape
    R, S = Tb * H, D // 16
    Rp = -(-R // 128) * 128
    values = np.zeros((Rp, D // 2), np.uint8)
    sfm = np.zeros((Rp, S), np.uint8)
    if not np.isfinite(x32).all():
        sfm[:R] = 0x7F
        return values, ref.to_blocked(sfm), np.array([np.nan], F32)
    amax = F32(np.abs(x32).max())
    if amax == 0:
        return values, ref.to_blocked(sfm), np.array([amax], F32)
    six_m = F32(6) * F32(256 if rule == "4over6" else 448)
    with np.errstate(over="ignore", divide="ignore"):
        g = min(F32(six_m / amax), ref.FLT_MAX)
    s = F32(amax * F32(F32(1) / six_m))
    codes, sf = ref.encode_groups(x32.reshape(-1, 16), s, g, rule)
    values[:R] = ref.pack(codes.reshape(R, D))
    sfm[:R] = sf.reshape(R, S)
    return values, ref.to_blocked(sfm), np.array([amax], F32)


def unblock(flat, Rp, S):
    """Inverse of to_blocked: flat E4M3 bytes -> [Rp, S] matrix."""
    perm = ref.to_blocked(np.arange(Rp * S).reshape(Rp, S))
    mat = np.empty(Rp * S, np.uint8)
    mat[perm] = np.asarray(flat).reshape(-1).view(np.uint8)
    return mat.reshape(Rp, S)


def ref_dequantize(values, sfs, amaxes, H, Tb, dtype, e2m1_max=6.0, e4m3_max=256.0):
    """Per-element decode fl(fl(v*sf) * fl(amax * fl(1/fl(e2m1_max*e4m3_max))))."""
    inv = F32(F32(1) / F32(F32(e2m1_max) * F32(e4m3_max)))
    D = 2 * values[0].shape[1]
    S, R = D // 16, Tb * H
    out = np.empty((1, len(values) * Tb, H, D), ref.DTYPES[dtype])
    for b, (val, sf, am) in enumerate(zip(values, sfs, amaxes)):
        gs = F32(F32(np.asarray(am).reshape(-1)[0]) * inv)
        sfm = unblock(sf, val.shape[0], S)[:R]
        v = ref.E2M1_TABLE[ref.unpack(val[:R])]  # [R, D]
        f = np.repeat(ref.e4m3_value(sfm), 16, axis=1)
        with np.errstate(invalid="ignore", over="ignore"):
            x = ((v * f) * gs).astype(ref.DTYPES[dtype])
        out[0, b * Tb:(b + 1) * Tb] = x.reshape(Tb, H, D)
    return out






SHAPES = [(16, 8), (5, 3), (64, 4), (1, 1), (33, 4)]  # (Tb, H): R = 128, 15, 256, 1, 132


@pytest.mark.parametrize("D", [64, 128, 192, 256])
@pytest.mark.parametrize("rule", ["4over6", "static6"])
@pytest.mark.parametrize("Tb, H", SHAPES)
def test_quantize_block_matches_reference(D, rule, Tb, H):
    rng = np.random.default_rng(D + Tb * 7 + H)
    x = (rng.standard_normal((Tb, H, D)) * rng.uniform(0.01, 50)).astype(BF16)
    values, sf, amax = longlive.quantize_block(x, scale_rule=rule)
    rv, rsf, ramax = ref_quantize_block(x, rule)
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
    assert_same_values(got, ref_dequantize(vals, sfs, ams, H, Tb, dtype))


@pytest.mark.parametrize("D", [64, 128, 256])
def test_static6_block_read_with_e4m3_max_448(D):
    rng = np.random.default_rng(D + 1)
    Tb, H = 8, 4
    x = rng.standard_normal((2, Tb, H, D)).astype(F32) * 20
    blocks = [longlive.quantize_block(x[i], scale_rule="static6") for i in range(2)]
    vals, sfs, ams = (list(t) for t in zip(*blocks))
    got = longlive.dequantize(vals, sfs, ams, H, Tb, dtype="float32", e4m3_max=448.0)
    assert_same_values(got, ref_dequantize(vals, sfs, ams, H, Tb, "float32", e4m3_max=448.0))
    err = np.abs(got[0].reshape(2, Tb, H, D) - x)
    assert err.max() <= np.abs(x).max() / 4  # decodes the right thing, not just bytes
    assert_same_values(longlive.dequantize(vals, sfs, ams, H, Tb, dtype="float32",
                                           scale_rule="static6"), got)
    # reading a 448 block with 4over6's 256 is wrong by 448/256, exactly per element
    wrong = longlive.dequantize(vals, sfs, ams, H, Tb, dtype="float32", e4m3_max=256.0)
    assert_same_values(wrong, ref_dequantize(vals, sfs, ams, H, Tb, "float32"))
    assert not np.array_equal(wrong, got)


def test_4over6_round_trip_accuracy_and_scale_equivalence():
    """Reader's fl(amax*fl(1/1536)) is the writer's s: decode == fl(fl(v*sf)*s)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 8, 128)).astype(F32)
    vals, sf, am = longlive.quantize_block(x)
    got = longlive.dequantize([vals], [sf], [am], 8, 16, dtype="float32",
                              scale_rule="4over6")[0]
    s = F32(am[0] * F32(F32(1) / F32(1536)))
    sfm = unblock(sf, 128, 8)
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
    rv, rsf, _ = ref_quantize_block(y, "4over6")
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
    assert_same_values(out, ref_dequantize([vals[i] for i in ids], [sfs[i] for i in ids],
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
    for a, b in zip(got, ref_quantize_block(np.ascontiguousarray(x), "4over6")):
        np.testing.assert_array_equal(a, b)


# -- the rule travels with the block ------------------------------------------------
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
    want = ref_dequantize(*zip(*s6), H, Tb, "float32", e4m3_max=448.0)
    assert_same_values(got, want)
    rel = np.sqrt(np.mean((got[0] - np.concatenate(xs)) ** 2) / np.mean(np.concatenate(xs) ** 2))
    assert rel < 0.12
    # the same call with the matching maximum spelled out is the same; a wrong one is loud
    assert_same_values(longlive.dequantize(s6, num_heads=H, block_token_size=Tb,
                                           dtype="float32", e4m3_max=448), want)
    with pytest.raises(ValueError, match=r"e4m3_max=256.*static6.*448"):
        longlive.dequantize(s6, num_heads=H, block_token_size=Tb, e4m3_max=256.0)
    got46 = longlive.dequantize(s46, None, None, H, Tb, "float32")
    assert_same_values(got46, ref_dequantize(*zip(*s46), H, Tb, "float32"))
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
    (8, 32, 4, 32),    # the case: 256 rows read as 128
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
    from fp4cache import _numpy_backend

    def no_work(*a, **k):
        raise AssertionError("the backend was called before the arguments were checked")

    monkeypatch.setattr(_numpy_backend, "longlive_quantize", no_work)
    monkeypatch.setattr(np, "ascontiguousarray", no_work)
    x = np.ones((4, 2, 64), F32)
    with pytest.raises(exc, match=match):
        longlive.quantize_block(*bad(x))


def test_list_fast_path_entries_die_with_their_arrays(monkeypatch):
    """The hot path's entries are keyed by array identity; an entry must disappear as
    soon as any of its arrays dies (before its id could be reused)."""
    import gc

    monkeypatch.setattr(longlive, "_current_device", lambda: 0)
    monkeypatch.setattr(longlive, "_LIST_FAST", PlanCache(32))
    vals = [np.zeros((128, 32), np.uint8) for _ in range(3)]
    sfs = [np.zeros(512, np.uint8) for _ in range(3)]
    ams = [np.ones(1, F32) for _ in range(3)]
    args = (2, 8, "bfloat16", 6.0, 256.0)
    launch = ("run", (1, 24, 2, 64), np.float32, np)
    longlive._list_remember(vals, sfs, ams, args, launch)
    assert longlive._list_hit(vals, sfs, ams, args) is launch
    assert longlive._list_hit(tuple(vals), sfs, ams, args) is launch  # same objects
    assert longlive._list_hit(vals[::-1], sfs, ams, args) is None     # another order
    assert longlive._list_hit(vals, sfs, ams, (2, 8, "float16", 6.0, 256.0)) is None
    assert longlive._list_hit(vals, sfs, ams, (2.0, 8, "bfloat16", 6.0, 256.0)) is None
    assert longlive._list_hit(vals, sfs, ams, (True, 8, "bfloat16", 6.0, 256.0)) is None
    monkeypatch.setattr(longlive, "_current_device", lambda: 1)
    assert longlive._list_hit(vals, sfs, ams, args) is None           # another GPU
    monkeypatch.setattr(longlive, "_current_device", lambda: 0)
    copy = [a.copy() for a in vals]
    assert longlive._list_hit(copy, sfs, ams, args) is None           # equal, not same
    del sfs[1]  # the list drops it, but the array lives on in nothing else: it dies
    gc.collect()
    assert len(longlive._LIST_FAST) == 0


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
