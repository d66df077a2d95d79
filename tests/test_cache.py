"""PagedKVCache (CPU backend): store -> buffer bytes -> gather_dequant, spec section 4.

The expected page bytes are built here from ``fp4cache.quantize`` output with the test's
own layout code (``nvfp4_ref.build_page_side``: array transposes and the reshape/permute
form of the V swizzle), never with ``fp4cache.layout``.
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import nvfp4_ref as ref
import pytest
from nvfp4_ref import assert_same_values

import fp4cache
from fp4cache import PagedKVCache

F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = ("bfloat16", "float16", "float32")


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
        assert_same_values(k, wk)
        assert_same_values(v, wv)


def rand_kv(rng, n, H, D, dtype=BF16, scale=1.0):
    k = (rng.standard_normal((n, H, D)) * scale).astype(dtype)
    v = (rng.laplace(size=(n, H, D)) * scale).astype(dtype)
    return k, v


# (T, H, D); GEOMS are all swizzle-able, LINEAR_ONLY needs swizzle_v_scales=False
GEOMS = [(16, 2, 128), (4, 3, 64), (8, 1, 256), (12, 2, 64), (4, 1, 192)]
LINEAR_ONLY = [(6, 2, 48), (5, 3, 16), (1, 1, 32)]


def layout_cases():
    for layout, swz, rule in itertools.product(("HND", "NHD"), (True, False),
                                               ("static6", "4over6")):
        for T, H, D in GEOMS + (LINEAR_ONLY if not swz else []):
            yield pytest.param(layout, swz, rule, T, H, D,
                               id=f"{layout}-{'swz' if swz else 'lin'}-{rule}-T{T}H{H}D{D}")


@pytest.mark.parametrize("layout, swz, rule, T, H, D", list(layout_cases()))
def test_store_gather_round_trip_every_layout(layout, swz, rule, T, H, D):
    rng = np.random.default_rng(T * 1000 + H * 10 + D)
    kw = dict(num_blocks=5, block_size=T, num_heads=H, head_dim=D, layout=layout,
              scale_rule=rule, k_scale=0.5, v_scale=1.75, swizzle_v_scales=swz)
    cache, model = make_pair(kw)
    assert cache.buffer.shape == (5, 2, H * T * (D // 2 + D // 16))
    assert cache.buffer.dtype == np.uint8 and not cache.buffer.any()
    n = (5 * T) // 2 + 1  # partial pages
    slots = rng.choice(5 * T, size=n, replace=False)
    slots[::4] = -1  # padding tokens
    k, v = rand_kv(rng, n, H, D, scale=2.0)
    cache.store(slots, k, v)
    model.store(slots, k, v)
    check_against_model(cache, model)
    # a second store overwrites some rows and fills others
    slots2 = rng.choice(5 * T, size=T + 1, replace=False).astype(np.int32)
    k2, v2 = rand_kv(rng, T + 1, H, D, dtype=F32, scale=0.1)
    cache.store(slots2, k2, v2)
    model.store(slots2, k2, v2)
    check_against_model(cache, model, blocks=[3, 0, 3, 4, 1, 2, 2])
    assert cache.nonfinite_groups == (0, 0)
    cache.check()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_round_trip_equals_quantize_dequantize_per_token(layout):
    """Each stored token gathers back as dequantize(quantize(token)) of the functional API."""
    rng = np.random.default_rng(1)
    T, H, D = 8, 4, 128
    cache = PagedKVCache(6, T, H, D, layout=layout, scale_rule="4over6", k_scale=0.03,
                         v_scale=7.0, device="cpu")
    slots = np.array([47, 0, 9, 17, 30, 8, 1, 46, 23], np.int64)
    k, v = rand_kv(rng, len(slots), H, D, dtype=np.float16, scale=3.0)
    cache.store(slots, k, v)
    gk, gv = cache.gather_dequant(np.arange(6), dtype="float16")
    for i, slot in enumerate(slots):
        for x, g, sc in ((k, gk, 0.03), (v, gv, 7.0)):
            d, s = fp4cache.quantize(x[i], scale=sc, scale_rule="4over6")
            assert_same_values(g[slot], fp4cache.dequantize(d, s, scale=sc, dtype="float16"))
    # untouched rows decode to exact zeros
    written = np.zeros(6 * T, bool)
    written[slots] = True
    assert not gk[~written].astype(F32).any() and not gv[~written].astype(F32).any()


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_all_dtypes_in_and_out(in_dtype, out_dtype):
    rng = np.random.default_rng(2)
    kw = dict(num_blocks=3, block_size=4, num_heads=2, head_dim=64, scale_rule="4over6",
              k_scale=2.0**-4, v_scale=3.0)
    cache, model = make_pair(kw)
    k, v = rand_kv(rng, 10, 2, 64, dtype=ref.DTYPES[in_dtype], scale=4.0)
    slots = np.arange(10)[::-1].copy()
    cache.store(slots, k, v)
    model.store(slots, k, v)
    check_against_model(cache, model, blocks=[2, 1, 0], dtypes=(out_dtype,))
    # out= tuple, its dtype is used
    n = 3 * 4
    ok = np.full((n, 2, 64), 5, ref.DTYPES[out_dtype])
    ov = np.full((n, 2, 64), 5, ref.DTYPES[out_dtype])
    rk, rv = cache.gather_dequant(np.array([2, 1, 0], np.int32), out=(ok, ov))
    assert np.shares_memory(rk, ok) and np.shares_memory(rv, ov)
    wk, wv = model.gather([2, 1, 0], out_dtype)
    assert_same_values(ok, wk)
    assert_same_values(ov, wv)


def test_non_contiguous_k_v():
    rng = np.random.default_rng(3)
    T, H, D = 8, 3, 128
    kw = dict(num_blocks=4, block_size=T, num_heads=H, head_dim=D, layout="NHD")
    cache, model = make_pair(kw)
    n = 12
    big = rng.standard_normal((2 * n, H, 2 * D)).astype(BF16)
    k = big[::2, :, :D]  # token-strided slice of a bigger array
    hnd = rng.standard_normal((H, n, D)).astype(BF16)
    v = hnd.transpose(1, 0, 2)  # head-major memory, different strides than k
    assert not k.flags.c_contiguous and not v.flags.c_contiguous
    slots = rng.permutation(4 * T)[:n]
    cache.store(slots, k, v)
    model.store(slots, k, v)
    check_against_model(cache, model)
    # last-dim stride != 1 (every other element) and a negative token stride
    k3 = big[::-2, :, ::2][:n]
    v3 = big[1::2, :, D:][::-1]
    cache.store(slots, k3, v3)
    model.store(slots, k3, v3)
    check_against_model(cache, model)


def test_padding_slots_are_skipped_other_negatives_are_bad():
    """-1 (vLLM's padding id) is skipped and not counted; -100, -2**40, -7 are bad slots:
    IndexError when validating (nothing stored), counted when not."""
    rng = np.random.default_rng(4)
    kw = dict(num_blocks=2, block_size=4, num_heads=1, head_dim=64)
    cache, model = make_pair(kw)
    k, v = rand_kv(rng, 4, 1, 64)
    cache.store(np.array([-1, -1, -1, -1], np.int64), k, v)
    assert not cache.buffer.any() and cache.stats["bad_slots"] == 0
    for slots in ([-1, -1, -100, -(2**40)], [-1, 5, -7, 2]):
        with pytest.raises(IndexError, match=r"slot_mapping\[2\] = -\d+ is out of range"):
            cache.store(np.array(slots, np.int64), k, v)
        assert not cache.buffer.any()
    cache.store(np.array([-1, -1, -100, -(2**40)], np.int64), k, v, validate=False)
    assert not cache.buffer.any() and cache.stats["bad_slots"] == 2
    cache.store(np.array([-1, 5, -7, 2], np.int32), k, v, validate=False)
    model.store([-1, 5, -7, 2], k, v)
    check_against_model(cache, model)
    assert cache.stats["bad_slots"] == 3


def test_duplicate_slots_last_occurrence_wins():
    rng = np.random.default_rng(5)
    T, H, D = 4, 2, 64
    kw = dict(num_blocks=3, block_size=T, num_heads=H, head_dim=D, scale_rule="4over6")
    cache, model = make_pair(kw)
    slots = np.array([3, 7, 3, 3, 9, 7, -1, 3], np.int64)
    k, v = rand_kv(rng, len(slots), H, D, scale=5.0)
    cache.store(slots, k, v, unique_slots=False)
    model.store(slots, k, v)
    check_against_model(cache, model)
    gk, gv = cache.gather_dequant(np.arange(3), dtype="float32")
    for slot, last in ((3, 7), (7, 5), (9, 4)):
        d, s = fp4cache.quantize(k[last], scale_rule="4over6")
        assert_same_values(gk[slot], fp4cache.dequantize(d, s, dtype="float32"))
        d, s = fp4cache.quantize(v[last], scale_rule="4over6")
        assert_same_values(gv[slot], fp4cache.dequantize(d, s, dtype="float32"))


def test_gather_repeated_and_empty():
    rng = np.random.default_rng(6)
    kw = dict(num_blocks=3, block_size=4, num_heads=2, head_dim=128)
    cache, model = make_pair(kw)
    k, v = rand_kv(rng, 12, 2, 128)
    cache.store(np.arange(12), k, v)
    model.store(np.arange(12), k, v)
    check_against_model(cache, model, blocks=[1, 1, 1, 0, 2, 0])
    ek, ev = cache.gather_dequant(np.zeros(0, np.int64))
    assert ek.shape == (0, 2, 128) and ev.shape == (0, 2, 128) and ek.dtype == BF16
    before = cache.buffer.copy()
    cache.store(np.zeros(0, np.int64), np.zeros((0, 2, 128), BF16), np.zeros((0, 2, 128), BF16))
    np.testing.assert_array_equal(cache.buffer, before)


def test_slot_mapping_int32_int64_list_agree():
    rng = np.random.default_rng(7)
    k, v = rand_kv(rng, 6, 2, 64)
    bufs = []
    for slots in (np.array([0, 5, 9, 2, 11, 3], np.int32), np.array([0, 5, 9, 2, 11, 3]),
                  [0, 5, 9, 2, 11, 3]):
        c = PagedKVCache(3, 4, 2, 64, device="cpu")
        c.store(slots, k, v)
        bufs.append(c.buffer)
    np.testing.assert_array_equal(bufs[0], bufs[1])
    np.testing.assert_array_equal(bufs[0], bufs[2])
    strided = np.array([0, -5, 5, -5, 9, -5, 2, -5, 11, -5, 3, -5], np.int64)[::2]
    c = PagedKVCache(3, 4, 2, 64, device="cpu")
    c.store(strided, k, v)
    np.testing.assert_array_equal(c.buffer, bufs[0])
    blocks = np.array([2, 9, 0, 9, 1], np.int32)[::2]
    np.testing.assert_array_equal(
        c.gather_dequant(blocks)[0].view(np.uint16),
        c.gather_dequant(np.ascontiguousarray(blocks))[0].view(np.uint16))


def test_page_bytes_are_contiguous_k_then_v():
    """vLLM views the pool as (num_blocks, 2*H, T, D/2 + D/16): page b is one byte run."""
    rng = np.random.default_rng(8)
    T, H, D = 4, 2, 64
    cache = PagedKVCache(3, T, H, D, device="cpu")
    k, v = rand_kv(rng, 1, H, D)
    cache.store(np.array([T * 1 + 2]), k, v)
    assert cache.buffer.flags.c_contiguous
    pool = cache.buffer.reshape(3, 2 * H, T, D // 2 + D // 16)  # the vLLM view
    flat = cache.buffer.reshape(3, -1)
    assert np.shares_memory(pool, cache.buffer)
    assert not flat[0].any() and flat[1].any() and not flat[2].any()
    side = H * T * (D // 2 + D // 16)
    # K side of page 1 holds the K token's bytes
    d, s = fp4cache.quantize(k[0])
    page_k = flat[1, :side]
    hnd_data = page_k[: H * T * D // 2].reshape(H, T, D // 2)
    hnd_scales = page_k[H * T * D // 2:].reshape(H, T, D // 16)
    np.testing.assert_array_equal(hnd_data[:, 2], d)
    np.testing.assert_array_equal(hnd_scales[:, 2], s)


def test_properties_and_repr():
    c = PagedKVCache(7, 16, 8, 128, layout="NHD", scale_rule="4over6", k_scale=0.25,
                     v_scale=0.5, device="cpu")
    assert c.bytes_per_token == 2 * 8 * 72
    assert c.compression_ratio == pytest.approx(256 / 72)
    assert c.geometry == fp4cache.PageGeometry(8, 16, 128, "NHD", True)
    assert c.nonfinite_groups == (0, 0)
    assert c.buffer.shape == (7, 2, 8 * 16 * 72)
    r = repr(c)
    for frag in ("PagedKVCache", "num_blocks=7", "block_size=16", "num_heads=8",
                 "head_dim=128", "NHD", "4over6", "cpu"):
        assert frag in r
    c.check()
    d = PagedKVCache(1, 4, 1, 64, device="cpu")
    assert d.compression_ratio == pytest.approx(128 / 36)
    assert d.geometry.layout == "HND" and d.geometry.swizzle_v_scales


def test_nonfinite_values_count_and_decode_to_nan():
    T, H, D = 4, 2, 64
    cache = PagedKVCache(2, T, H, D, device="cpu")
    k = np.full((3, H, D), 6.0, F32)  # exactly representable: decodes to 6
    v = np.full((3, H, D), 6.0, F32)
    k[0, 1, 17] = np.nan  # group 1 of (token 0, head 1)
    k[2, 0, 63] = np.inf  # group 3 of (token 2, head 0)
    v[1, :, :] = -np.inf  # every group of token 1: H * D/16 groups
    cache.store(np.array([5, 0, 6]), k, v)
    assert cache.nonfinite_groups == (2, H * D // 16)
    gk, gv = cache.gather_dequant(np.array([0, 1]), dtype="float32")
    nan_k = np.isnan(gk)
    assert nan_k[5, 1, 16:32].all() and nan_k[6, 0, 48:64].all()
    assert nan_k.sum() == 32
    assert np.isnan(gv[0]).all() and np.isnan(gv).sum() == H * D
    np.testing.assert_array_equal(gk[0], 6.0)
    cache.check()  # non-finite values are not index errors
