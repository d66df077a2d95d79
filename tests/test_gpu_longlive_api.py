"""GPU side of the LongLive front end, against the NumPy backend, bit for bit.

* the list API's hot path (arrays remembered by identity) returns what a checked call
  returns, reads new contents, and forgets arrays that die;
* ``LongLiveBlock`` input on the GPU picks the blocks' ``e4m3_max``;
* a ``num_heads``/``block_token_size`` that does not match the rows is refused on the
  hot path too, and before any work is queued;
* ``quantize_block`` checks its arguments before it queues any GPU work;
* ``calibrate_scale`` on CuPy input (one reduction, a host float).
"""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest
from nvfp4_ref import assert_same_values

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

import fp4cache  # noqa: E402
from fp4cache import _cupy_backend, longlive  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def _blocks(rng, n, Tb, H, D, rule="4over6"):
    xs = [(rng.standard_normal((Tb, H, D)) * (i + 1)).astype(np.float32) for i in range(n)]
    return [longlive.quantize_block(cp.asarray(x), rule) for x in xs]


@pytest.mark.parametrize("rule", ["4over6", "static6"])
def test_longlive_list_hot_path_matches_checked_call_and_reads_new_contents(rule):
    rng = np.random.default_rng(20)
    Tb, H, D = 32, 8, 128
    blocks = _blocks(rng, 5, Tb, H, D, rule)
    vals, sfs, ams = (list(g) for g in zip(*blocks))
    host = [[a.get() for a in g] for g in (vals, sfs, ams)]
    m = blocks[0].e4m3_max
    ref = longlive.dequantize(*host, H, Tb, e4m3_max=m)
    longlive._LIST_FAST.clear()
    first = longlive.dequantize(vals, sfs, ams, H, Tb, e4m3_max=m)
    assert len(longlive._LIST_FAST) == 1  # remembered after the checked call
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
    # a mismatch is refused on the hot path too (the counts are part of the key)
    with pytest.raises(ValueError, match="do not match the blocks"):
        longlive.dequantize(vals, sfs, ams, 4, Tb, e4m3_max=m)
    n = len(longlive._LIST_FAST)
    del blocks, vals[3]
    gc.collect()
    assert len(longlive._LIST_FAST) < n  # the entries that held the dead array are gone


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


def test_longlive_mismatch_and_bad_blocks_refused_before_any_work(monkeypatch):
    rng = np.random.default_rng(22)
    Tb, H, D = 32, 8, 128
    blocks = _blocks(rng, 2, Tb, H, D)
    vals, sfs, ams = (list(g) for g in zip(*blocks))

    def no_work(*a, **k):
        raise AssertionError("GPU work was prepared before the arguments were checked")

    monkeypatch.setattr(_cupy_backend, "longlive_list_launcher", no_work)
    monkeypatch.setattr(_cupy_backend, "longlive_pool_launcher", no_work)
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

    monkeypatch.setattr(_cupy_backend, "longlive_quantize", no_work)
    monkeypatch.setattr(cp, "ascontiguousarray", no_work)
    with pytest.raises(exc, match=match):
        longlive.quantize_block(*args)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
def test_calibrate_scale_on_gpu_equals_cpu(dtype):
    rng = np.random.default_rng(23)
    x = (rng.standard_normal((1000, 3, 128)) * 0.07).astype(dtype)
    xd = cp.asarray(x)
    for rule in ("static6", "4over6"):
        got = fp4cache.calibrate_scale(xd, rule)
        assert type(got) is float
        assert got == fp4cache.calibrate_scale(x, rule)
        assert fp4cache.calibrate_scale(xd[:, ::-1, 1::2], rule) == \
            fp4cache.calibrate_scale(x[:, ::-1, 1::2], rule)  # strided: copied, then reduced
    x[500, 1, 7] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        fp4cache.calibrate_scale(cp.asarray(x))
