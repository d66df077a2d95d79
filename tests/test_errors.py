"""Bad input, faults and non-finite values: exceptions name the parameter, and a refused
call never changes the cache buffer.

The same table runs on ``device="cuda"`` when a GPU is present (caches built with
``validate=True`` there, so that out-of-range ids are refused eagerly as on the CPU).

Over 600 lines because it is one table of refusals per public entry point (store, gather,
attention, LongLive, pages, the constructor), each checked with the buffer unchanged;
splitting it by entry point would repeat the fixtures.

"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import nvfp4_ref as ref
import pytest
from conftest import DEVICES, gpu_available
from helpers import host, xp_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp4cache
from fp4cache import PagedKVCache, longlive
from fp4cache.layout import PageGeometry

F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)
NB, T, H, D = 4, 8, 2, 64


@dataclass
class Ctx:
    cache: Any
    xp: Any
    k: Any
    v: Any
    slots: Any

    def arr(self, a, dtype=None):
        return self.xp.asarray(np.asarray(a, dtype=dtype))

    def kv(self, shape, dtype=BF16):
        return self.arr(np.ones(shape, F32).astype(dtype))


def make_ctx(device, **kw) -> Ctx:
    kw = dict(dict(layout="HND", scale_rule="4over6", k_scale=0.5, v_scale=2.0), **kw)
    if device == "cuda":
        kw["validate"] = True
    cache = PagedKVCache(NB, T, H, D, device=device, **kw)
    xp = xp_of(device)
    rng = np.random.default_rng(0)
    n = 5
    k = xp.asarray(rng.standard_normal((n, H, D)).astype(BF16))
    v = xp.asarray(rng.standard_normal((n, H, D)).astype(BF16))
    slots = xp.asarray(np.array([3, 9, 17, 30, 31], np.int64))
    cache.store(slots, k, v)  # non-zero pages, so that "unchanged" means something
    return Ctx(cache, xp, k, v, slots)


# (id, call, exception, message fragment)
STORE_CASES = [
    ("k-int32", lambda c: c.cache.store(c.slots, c.kv((5, H, D), np.int32), c.v),
     TypeError, "k"),
    ("k-float64", lambda c: c.cache.store(c.slots, c.kv((5, H, D), np.float64),
                                          c.kv((5, H, D), np.float64)), TypeError, "k"),
    ("v-bool", lambda c: c.cache.store(c.slots, c.k, c.kv((5, H, D), np.bool_)),
     TypeError, "v"),
    ("v-uint8", lambda c: c.cache.store(c.slots, c.k, c.kv((5, H, D), np.uint8)),
     TypeError, "v"),
    ("k-v-dtype-mismatch", lambda c: c.cache.store(c.slots, c.k, c.kv((5, H, D), F32)),
     TypeError, "dtype"),
    ("slots-float", lambda c: c.cache.store(c.arr([0, 1, 2, 3, 4], F32), c.k, c.v),
     TypeError, "slot_mapping"),
    ("slots-uint32", lambda c: c.cache.store(c.arr([0, 1, 2, 3, 4], np.uint32), c.k, c.v),
     TypeError, "slot_mapping"),
    ("slots-int16", lambda c: c.cache.store(c.arr([0, 1, 2, 3, 4], np.int16), c.k, c.v),
     TypeError, "slot_mapping"),
    ("slots-2d", lambda c: c.cache.store(c.arr([[0, 1, 2, 3, 4]], np.int64), c.k, c.v),
     ValueError, "slot_mapping"),
    ("slots-short", lambda c: c.cache.store(c.arr([0, 1, 2, 3], np.int64), c.k, c.v),
     ValueError, "slot_mapping"),
    ("slots-long", lambda c: c.cache.store(c.arr([0, 1, 2, 3, 4, 5], np.int64), c.k, c.v),
     ValueError, "slot_mapping"),
    ("k-rank2", lambda c: c.cache.store(c.slots, c.kv((5, H * D)), c.v), ValueError, "k"),
    ("k-rank4", lambda c: c.cache.store(c.slots, c.kv((5, H, D, 1)), c.v), ValueError, "k"),
    ("v-rank2", lambda c: c.cache.store(c.slots, c.k, c.kv((5, H * D))), ValueError, "v"),
    ("k-heads", lambda c: c.cache.store(c.slots, c.kv((5, H + 1, D)), c.kv((5, H + 1, D))),
     ValueError, "k"),
    ("v-heads", lambda c: c.cache.store(c.slots, c.k, c.kv((5, H - 1, D))), ValueError, "v"),
    ("k-head-dim", lambda c: c.cache.store(c.slots, c.kv((5, H, 128)), c.kv((5, H, 128))),
     ValueError, "k"),
    ("k-head-dim-not-16", lambda c: c.cache.store(c.slots, c.kv((5, H, 40)), c.kv((5, H, 40))),
     ValueError, "k"),
    ("k-v-tokens-mismatch", lambda c: c.cache.store(c.slots, c.k, c.kv((4, H, D))),
     ValueError, "shape"),
    ("slot-out-of-range", lambda c: c.cache.store(c.arr([0, 1, NB * T, 3, 4], np.int64),
                                                  c.k, c.v), IndexError, "slot_mapping"),
    ("slot-far-out-of-range", lambda c: c.cache.store(c.arr([0, 1, 2, 3, 2**40], np.int64),
                                                      c.k, c.v), IndexError, "slot_mapping"),
    ("slot-out-of-range-int32", lambda c: c.cache.store(
        c.arr([-1, 2**31 - 1, 2, 3, 4], np.int32), c.k, c.v), IndexError, "slot_mapping"),
    ("slot-out-of-range-nonfinite", lambda c: c.cache.store(
        c.arr([0, 1, 2, 3, NB * T + 5], np.int64), c.arr(np.full((5, H, D), np.nan, BF16)), c.v),
     IndexError, "slot_mapping"),
]


GATHER_CASES = [
    ("blocks-float", lambda c: c.cache.gather_dequant(c.arr([0, 1], F32)),
     TypeError, "blocks"),
    ("blocks-uint64", lambda c: c.cache.gather_dequant(c.arr([0, 1], np.uint64)),
     TypeError, "blocks"),
    ("blocks-2d", lambda c: c.cache.gather_dequant(c.arr([[0, 1]], np.int64)),
     ValueError, "blocks"),
    ("block-too-big", lambda c: c.cache.gather_dequant(c.arr([0, NB], np.int64)),
     IndexError, "blocks"),
    ("block-negative", lambda c: c.cache.gather_dequant(c.arr([0, -1], np.int32)),
     IndexError, "blocks"),
    ("dtype-int8", lambda c: c.cache.gather_dequant(c.arr([0], np.int64), dtype="int8"),
     TypeError, "dtype"),
    ("dtype-float64", lambda c: c.cache.gather_dequant(c.arr([0], np.int64), dtype=np.float64),
     TypeError, "dtype"),
    ("out-not-tuple", lambda c: c.cache.gather_dequant(c.arr([0], np.int64),
                                                       out=c.kv((T, H, D))), TypeError, "out"),
    ("out-one-array", lambda c: c.cache.gather_dequant(c.arr([0], np.int64),
                                                       out=(c.kv((T, H, D)),)), TypeError, "out"),
    ("out-shape", lambda c: c.cache.gather_dequant(
        c.arr([0, 1], np.int64), out=(c.kv((T, H, D)), c.kv((T, H, D)))), ValueError, "out"),
    ("out-v-shape", lambda c: c.cache.gather_dequant(
        c.arr([0], np.int64), out=(c.kv((T, H, D)), c.kv((T, H + 1, D)))), ValueError, "out"),
    ("out-dtype-float64", lambda c: c.cache.gather_dequant(
        c.arr([0], np.int64), out=(c.kv((T, H, D), np.float64), c.kv((T, H, D), np.float64))),
     TypeError, "out"),
    ("out-dtype-mismatch", lambda c: c.cache.gather_dequant(
        c.arr([0], np.int64), out=(c.kv((T, H, D)), c.kv((T, H, D), F32))), TypeError, "out"),
    ("out-vs-dtype", lambda c: c.cache.gather_dequant(
        c.arr([0], np.int64), dtype="float16", out=(c.kv((T, H, D)), c.kv((T, H, D)))),
     TypeError, "dtype"),
    ("out-non-contiguous", lambda c: c.cache.gather_dequant(
        c.arr([0], np.int64), out=(c.kv((T, H, 2 * D))[..., ::2], c.kv((T, H, D)))),
     ValueError, "out"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("call, exc, fragment",
                         [pytest.param(*case[1:], id=case[0]) for case in
                          STORE_CASES + GATHER_CASES])
def test_bad_input_refused_buffer_unchanged(device, call, exc, fragment):
    c = make_ctx(device)
    before = host(c.cache.buffer).copy()
    stats = c.cache.nonfinite_groups
    with pytest.raises(exc, match=re.escape(fragment)):
        call(c)
    np.testing.assert_array_equal(host(c.cache.buffer), before)
    assert c.cache.nonfinite_groups == stats
    c.cache.check()  # an eagerly refused call leaves no fault behind


@pytest.mark.parametrize("device", DEVICES)
def test_out_arrays_untouched_when_refused(device):
    c = make_ctx(device)
    ok = c.kv((2 * T, H, D))
    ov = c.kv((2 * T, H, D))
    with pytest.raises(IndexError, match="blocks"):
        c.cache.gather_dequant(c.arr([1, NB + 3], np.int64), out=(ok, ov))
    assert np.all(host(ok).astype(F32) == 1) and np.all(host(ov).astype(F32) == 1)


@pytest.mark.gpu
def test_cross_backend_arrays():
    """K/V/out are never moved between host and device (TypeError); index arrays are."""
    import cupy

    c = make_ctx("cuda")
    before = host(c.cache.buffer).copy()
    kh, vh = host(c.k), host(c.v)
    with pytest.raises(TypeError, match="k"):
        c.cache.store(c.slots, kh, c.v)
    with pytest.raises(TypeError, match="v"):
        c.cache.store(c.slots, c.k, vh)
    with pytest.raises(TypeError, match="out"):
        c.cache.gather_dequant(c.arr([0], np.int64), out=(np.empty((T, H, D), BF16),
                                                          np.empty((T, H, D), BF16)))
    np.testing.assert_array_equal(host(c.cache.buffer), before)
    c.cache.store(host(c.slots), c.k, c.v)  # host index arrays are converted
    c.cache.store([3, 9, 17, 30, 31], c.k, c.v)
    k1, _ = c.cache.gather_dequant([0, 1])
    k2, _ = c.cache.gather_dequant(np.array([0, 1]))
    assert isinstance(k1, cupy.ndarray)
    np.testing.assert_array_equal(host(k1).view(np.uint16), host(k2).view(np.uint16))
    cpu = PagedKVCache(NB, T, H, D, device="cpu")
    with pytest.raises(TypeError, match="k"):
        cpu.store(np.arange(5), c.k, vh)


@pytest.mark.skipif(gpu_available(), reason="checks the no-GPU error")
def test_cuda_device_without_gpu_is_a_clear_runtime_error():
    with pytest.raises(RuntimeError, match="cuda"):
        PagedKVCache(NB, T, H, D, device="cuda")
    assert PagedKVCache(NB, T, H, D).device == "cpu"


# -- construction --------------------------------------------------------------------------
CTOR_CASES = [
    ("head-dim-40", dict(head_dim=40, swizzle_v_scales=False), ValueError, "head_dim"),
    ("head-dim-48-swizzle", dict(head_dim=48), ValueError, "head_dim"),
    ("head-dim-0", dict(head_dim=0), ValueError, "head_dim"),
    ("block-size-6-swizzle", dict(block_size=6), ValueError, "block_size"),
    ("block-size-0", dict(block_size=0), ValueError, "block_size"),
    ("num-heads-0", dict(num_heads=0), ValueError, "num_heads"),
    ("num-heads-float", dict(num_heads=2.0), ValueError, "num_heads"),
    ("num-blocks-0", dict(num_blocks=0), ValueError, "num_blocks"),
    ("num-blocks-neg", dict(num_blocks=-3), ValueError, "num_blocks"),
    ("num-blocks-bool", dict(num_blocks=True), ValueError, "num_blocks"),
    ("layout", dict(layout="THD"), ValueError, "layout"),
    ("scale-rule", dict(scale_rule="4over8"), ValueError, "scale_rule"),
    ("device", dict(device="tpu"), ValueError, "device"),
    ("k-scale-0", dict(k_scale=0.0), ValueError, "k_scale"),
    ("k-scale-neg", dict(k_scale=-1.0), ValueError, "k_scale"),
    ("k-scale-nan", dict(k_scale=float("nan")), ValueError, "k_scale"),
    ("k-scale-inf", dict(k_scale=float("inf")), ValueError, "k_scale"),
    ("k-scale-underflows-f32", dict(k_scale=1e-50), ValueError, "k_scale"),
    ("k-scale-overflows-f32", dict(k_scale=1e39), ValueError, "k_scale"),
    ("k-scale-str", dict(k_scale="one"), TypeError, "k_scale"),
    ("k-scale-none", dict(k_scale=None), TypeError, "k_scale"),
    ("v-scale-0", dict(v_scale=0.0), ValueError, "v_scale"),
    ("v-scale-neg-inf", dict(v_scale=-float("inf")), ValueError, "v_scale"),
    ("v-scale-nan", dict(v_scale=np.float32("nan")), ValueError, "v_scale"),
]


@pytest.mark.parametrize("kw, exc, fragment",
                         [pytest.param(*c[1:], id=c[0]) for c in CTOR_CASES])
def test_constructor_refuses(kw, exc, fragment):
    args = dict(num_blocks=NB, block_size=T, num_heads=H, head_dim=D, device="cpu")
    args.update(kw)
    with pytest.raises(exc, match=re.escape(fragment)):
        PagedKVCache(**args)


@pytest.mark.parametrize("kw", [dict(head_dim=48, swizzle_v_scales=False),
                                dict(block_size=6, swizzle_v_scales=False),
                                dict(head_dim=16, block_size=1, swizzle_v_scales=False),
                                dict(k_scale=2.0**-149, v_scale=3e38),
                                dict(k_scale=np.float32(0.5), v_scale=np.float64(2.0))])
def test_constructor_accepts_edge_values(kw):
    args = dict(num_blocks=NB, block_size=T, num_heads=H, head_dim=D, device="cpu")
    args.update(kw)
    c = PagedKVCache(**args)
    # taken as given: the geometry and float32 scales asked for, an all-zero pool of it
    want = PageGeometry(H, args["block_size"], args["head_dim"], "HND",
                        args.get("swizzle_v_scales", True))
    assert c.num_blocks == NB and c.geometry == want
    assert c.k_scale == float(np.float32(args.get("k_scale", 1.0)))
    assert c.v_scale == float(np.float32(args.get("v_scale", 1.0)))
    assert c.buffer.shape == (NB, 2, want.side_bytes) and not c.buffer.any()


# -- functional API and LongLive -----------------------------------------------------------
X = np.ones((2, 64), F32)


CODEC_CASES = [
    ("x-int", lambda: fp4cache.quantize(np.ones((2, 64), np.int32)), TypeError, "x"),
    ("x-float64", lambda: fp4cache.quantize(np.ones((2, 64))), TypeError, "x"),
    ("x-D-40", lambda: fp4cache.quantize(np.ones((2, 40), F32)), ValueError, "x"),
    ("x-D-0", lambda: fp4cache.quantize(np.ones((2, 0), F32)), ValueError, "x"),
    ("x-scalar", lambda: fp4cache.quantize(np.float32(1)), ValueError, "x"),
    ("scale-0", lambda: fp4cache.quantize(X, scale=0.0), ValueError, "scale"),
    ("scale-nan", lambda: fp4cache.quantize(X, scale=float("nan")), ValueError, "scale"),
    ("scale-inf", lambda: fp4cache.quantize(X, scale=float("inf")), ValueError, "scale"),
    ("scale-neg", lambda: fp4cache.quantize(X, scale=-2.0), ValueError, "scale"),
    ("rule", lambda: fp4cache.quantize(X, scale_rule="static4"), ValueError, "scale_rule"),
    ("data-dtype", lambda: fp4cache.dequantize(np.zeros((2, 32), np.int8),
                                               np.zeros((2, 4), np.uint8)), TypeError, "data"),
    ("scales-dtype", lambda: fp4cache.dequantize(np.zeros((2, 32), np.uint8),
                                                 np.zeros((2, 4), F32)), TypeError, "scales"),
    ("scales-shape", lambda: fp4cache.dequantize(np.zeros((2, 32), np.uint8),
                                                 np.zeros((2, 3), np.uint8)), ValueError,
     "scales"),
    ("scales-rank", lambda: fp4cache.dequantize(np.zeros((2, 32), np.uint8),
                                                np.zeros((8,), np.uint8)), ValueError, "scales"),
    ("deq-scale", lambda: fp4cache.dequantize(np.zeros((2, 32), np.uint8),
                                              np.zeros((2, 4), np.uint8), scale=-1.0),
     ValueError, "scale"),
    ("deq-dtype", lambda: fp4cache.dequantize(np.zeros((2, 32), np.uint8),
                                              np.zeros((2, 4), np.uint8), dtype="int32"),
     TypeError, "dtype"),
    ("deq-out-shape", lambda: fp4cache.dequantize(np.zeros((2, 32), np.uint8),
                                                  np.zeros((2, 4), np.uint8),
                                                  out=np.zeros((2, 32), F32)),
     ValueError, "out"),
    ("deq-out-dtype", lambda: fp4cache.dequantize(np.zeros((2, 32), np.uint8),
                                                  np.zeros((2, 4), np.uint8),
                                                  out=np.zeros((2, 64), np.float64)),
     TypeError, "out"),
    ("ll-rank", lambda: longlive.quantize_block(np.ones((4, 64), F32)), ValueError, "x"),
    ("ll-head-dim", lambda: longlive.quantize_block(np.ones((4, 2, 48), F32)), ValueError,
     "head_dim"),
    ("ll-empty", lambda: longlive.quantize_block(np.ones((0, 2, 64), F32)), ValueError, "x"),
    ("ll-rule", lambda: longlive.quantize_block(np.ones((4, 2, 64), F32), "x"), ValueError,
     "scale_rule"),
    ("ll-deq-lengths", lambda: longlive.dequantize([np.zeros((128, 32), np.uint8)], [], [],
                                                   2, 4, scale_rule="4over6"),
     ValueError, "same length"),
    ("ll-deq-empty", lambda: longlive.dequantize([], [], [], 2, 4, scale_rule="4over6"),
     ValueError, "values"),
    ("ll-deq-heads", lambda: longlive.dequantize(
        [np.zeros((128, 32), np.uint8)], [np.zeros(512, np.uint8)], [np.ones(1, F32)], 0, 4,
        scale_rule="4over6"),
     ValueError, "num_heads"),
    ("ll-deq-rows", lambda: longlive.dequantize(
        [np.zeros((100, 32), np.uint8)], [np.zeros(400, np.uint8)], [np.ones(1, F32)], 2, 4,
        scale_rule="4over6"),
     ValueError, "rows"),
    ("ll-deq-sf-size", lambda: longlive.dequantize(
        [np.zeros((128, 32), np.uint8)], [np.zeros(500, np.uint8)], [np.ones(1, F32)], 2, 4,
        scale_rule="4over6"),
     ValueError, "scale_factors"),
    ("ll-deq-amax", lambda: longlive.dequantize(
        [np.zeros((128, 32), np.uint8)], [np.zeros(512, np.uint8)], [np.ones(1)], 2, 4,
        scale_rule="4over6"),
     TypeError, "amax"),
    ("ll-deq-e4m3-max", lambda: longlive.dequantize(
        [np.zeros((128, 32), np.uint8)], [np.zeros(512, np.uint8)], [np.ones(1, F32)], 2, 4,
        e4m3_max=0.0), ValueError, "e4m3_max"),
    ("ll-deq-no-rule", lambda: longlive.dequantize(
        [np.zeros((128, 32), np.uint8)], [np.zeros(512, np.uint8)], [np.ones(1, F32)], 2, 4),
     TypeError, "scale_rule="),
    ("ll-pool-no-rule", lambda: longlive.dequantize_pool(
        np.zeros((1, 128, 32), np.uint8), np.zeros((1, 512), np.uint8), np.ones(1, F32), [0],
        2, 4), TypeError, "scale_rule="),
    ("ll-deq-rule-conflict", lambda: longlive.dequantize(
        [np.zeros((128, 32), np.uint8)], [np.zeros(512, np.uint8)], [np.ones(1, F32)], 2, 4,
        e4m3_max=256, scale_rule="static6"), ValueError, "e4m3_max=256 does not match"),
    ("ll-deq-bad-rule", lambda: longlive.dequantize(
        [np.zeros((128, 32), np.uint8)], [np.zeros(512, np.uint8)], [np.ones(1, F32)], 2, 4,
        scale_rule="6over4"), ValueError, "scale_rule"),
    ("ll-deq-e4m3-str", lambda: longlive.dequantize(
        [np.zeros((128, 32), np.uint8)], [np.zeros(512, np.uint8)], [np.ones(1, F32)], 2, 4,
        e4m3_max="448"), TypeError, "e4m3_max"),
]


@pytest.mark.parametrize("call, exc, fragment",
                         [pytest.param(*c[1:], id=c[0]) for c in CODEC_CASES])
def test_functional_api_refuses(call, exc, fragment):
    with pytest.raises(exc, match=re.escape(fragment)):
        call()


# -- empty inputs are no-ops ---------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_empty_inputs_are_noops(device, dtype):
    c = make_ctx(device)
    before = host(c.cache.buffer).copy()
    c.cache.store(c.arr([], dtype), c.kv((0, H, D)), c.kv((0, H, D)))
    k, v = c.cache.gather_dequant(c.arr([], dtype), dtype="float32")
    assert k.shape == (0, H, D) and v.shape == (0, H, D) and k.dtype == F32
    np.testing.assert_array_equal(host(c.cache.buffer), before)
    d, s = fp4cache.quantize(np.zeros((0, 3, 64), F32))
    assert d.shape == (0, 3, 32) and s.shape == (0, 3, 4)
    assert fp4cache.dequantize(d, s).shape == (0, 3, 64)


# -- non-finite values, duplicates and negative slots, on every backend --------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_nonfinite_groups_decode_to_nan_and_are_counted(device, layout):
    c = make_ctx(device, layout=layout)
    base = c.cache.nonfinite_groups
    k = np.full((4, H, D), 3.0, F32)
    v = np.full((4, H, D), -1.5, F32)
    k[0, 0, 0] = np.nan  # K group 0 of token 0, head 0
    k[1, 1, 33] = np.inf  # K group 2 of token 1, head 1
    k[1, 1, 34] = -np.inf  # same group: still one group
    v[2] = np.nan  # every V group of token 2
    v[3, 0, 63] = 2.0**-140  # subnormal: finite, not counted
    k[3, 1, 5] = 3e38  # huge: finite, not counted
    slots = c.arr([1, 2, 12, 13], np.int64)
    c.cache.store(slots, c.arr(k), c.arr(v))
    assert c.cache.nonfinite_groups == (base[0] + 2, base[1] + H * D // 16)
    gk, gv = (host(a) for a in c.cache.gather_dequant(c.arr([0, 1], np.int64),
                                                      dtype="float32"))
    assert np.isnan(gk[1, 0, :16]).all() and np.isnan(gk[2, 1, 32:48]).all()
    assert np.isnan(gk).sum() == 32
    assert np.isnan(gv[12]).all() and np.isnan(gv).sum() == H * D
    assert np.isfinite(gk[13]).all() and np.isfinite(gv[13]).all()
    c.cache.check()
    assert c.cache.nonfinite_groups == (base[0] + 2, base[1] + H * D // 16)  # cumulative
    c.cache.store(slots, c.arr(k), c.arr(v))
    assert c.cache.nonfinite_groups == (base[0] + 4, base[1] + 2 * H * D // 16)


@pytest.mark.parametrize("device", DEVICES)
def test_duplicates_and_negative_slots(device):
    c = make_ctx(device, layout="NHD")
    model = ref.PagedModel(NB, T, H, D, layout="NHD", scale_rule="4over6", k_scale=0.5,
                           v_scale=2.0)
    model.store(host(c.slots), host(c.k).astype(F32), host(c.v).astype(F32))
    rng = np.random.default_rng(1)
    slots = np.array([5, -1, 5, 20, 5, -1, 20, 0, 31], np.int64)
    k = rng.standard_normal((len(slots), H, D)).astype(BF16)
    v = rng.standard_normal((len(slots), H, D)).astype(BF16)
    c.cache.store(c.arr(slots), c.arr(k), c.arr(v), unique_slots=False)
    model.store(slots, k, v)
    np.testing.assert_array_equal(host(c.cache.buffer), model.buffer())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("unique", [True, False])
@pytest.mark.parametrize("n_pad", [0, 200])  # GPU: the scan path, then the claim path
def test_negative_slots_other_than_minus_one_are_bad(device, slot_dtype, unique, n_pad):
    """-1 is vLLM's padding id: skipped, not counted.  Any other negative slot is a bug
    in the caller's slot arithmetic: IndexError when validating (nothing stored), else
    skipped and counted in bad_slots like a slot >= num_slots, on both backends."""
    c = make_ctx(device, layout="HND", scale_rule="static6")
    base = c.cache.stats["bad_slots"]
    slots = np.concatenate([[-1, -7, 3, -(2**31), 70], np.full(n_pad, -1)]).astype(slot_dtype)
    k = np.full((len(slots), H, D), 6.0 * 0.5, F32)
    before = host(c.cache.buffer).copy()
    with pytest.raises(IndexError, match=r"slot_mapping\[1\] = -7 is out of range.*-1 for "
                                         "padding"):
        c.cache.store(c.arr(slots), c.arr(k), c.arr(k), unique_slots=unique, validate=True)
    np.testing.assert_array_equal(host(c.cache.buffer), before)
    c.cache.store(c.arr(slots), c.arr(k), c.arr(k), unique_slots=unique, validate=False)
    assert c.cache.stats["bad_slots"] == base + 3  # -7, -2**31, 70; -1 (x 1 + n_pad) not
    after = host(c.cache.buffer)
    changed = np.flatnonzero((after != before).any(axis=(1, 2)))
    assert changed.tolist() == [0]  # only slot 3 (page 0) was written
    with pytest.raises(IndexError, match=r"3 token\(s\) had a slot_mapping entry outside"):
        c.cache.check()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [7, 129, 1000])
def test_many_duplicates_last_wins(device, n):
    """Many tokens on few slots (the GPU switches duplicate strategies above 128 tokens)."""
    c = make_ctx(device, layout="HND", scale_rule="static6")
    model = ref.PagedModel(NB, T, H, D, layout="HND", scale_rule="static6", k_scale=0.5,
                           v_scale=2.0)
    model.store(host(c.slots), host(c.k), host(c.v))
    rng = np.random.default_rng(n)
    slots = rng.integers(-1, NB * T, n).astype(np.int32)  # -1: padding
    k = rng.standard_normal((n, H, D)).astype(np.float16)
    v = rng.standard_normal((n, H, D)).astype(np.float16)
    k[rng.integers(0, n, 5), 0, 3] = np.nan
    c.cache.store(c.arr(slots), c.arr(k), c.arr(v), unique_slots=False)
    model.store(slots, k, v)
    np.testing.assert_array_equal(host(c.cache.buffer), model.buffer())
    # counted: the non-finite groups of the rows actually written (last occurrences)
    last = {int(sl): i for i, sl in enumerate(slots) if sl >= 0}
    rows = k[sorted(last.values())]
    assert c.cache.nonfinite_groups[0] == int(np.isnan(rows[:, 0, :16]).any(axis=1).sum())
    # a second identical call gives identical bytes (deterministic)
    c.cache.store(c.arr(slots), c.arr(k), c.arr(v), unique_slots=False)
    np.testing.assert_array_equal(host(c.cache.buffer), model.buffer())


@pytest.mark.parametrize("device", DEVICES)
def test_unvalidated_faults_are_counted_not_written(device):
    """validate=False (the GPU default; a per-call override on the CPU): out-of-range
    slots are skipped and counted, out-of-range blocks gather as NaN and are counted;
    nothing outside the pool is touched; check() raises IndexError once, then is clear."""
    c = make_ctx(device)
    before = host(c.cache.buffer).copy()
    c.cache.store(c.arr([NB * T, 2**40, -1], np.int64), c.kv((3, H, D)), c.kv((3, H, D)),
                  validate=False)
    np.testing.assert_array_equal(host(c.cache.buffer), before)
    assert c.cache.stats["bad_slots"] == 2
    # valid tokens of the same call are still stored
    c.cache.store(c.arr([NB * T + 1, 4], np.int32), c.kv((2, H, D)), c.kv((2, H, D)),
                  validate=False)
    assert c.cache.stats["bad_slots"] == 3
    k, v = c.cache.gather_dequant(c.arr([0, NB, -2, 3], np.int64), dtype="float32",
                                  validate=False)
    k, v = host(k), host(v)
    assert c.cache.stats["bad_block_ids"] == 2
    assert np.isnan(k[T:3 * T]).all() and np.isnan(v[T:3 * T]).all()
    assert not np.isnan(k[:T]).any() and not np.isnan(k[3 * T:]).any()
    np.testing.assert_array_equal(k[4], 1.0)  # stored (4over6 represents 1.0 exactly)
    with pytest.raises(IndexError, match="slot"):
        c.cache.check()
    c.cache.check()  # cleared
    assert c.cache.stats["bad_slots"] == 0 and c.cache.stats["bad_block_ids"] == 0


# -- hypothesis fuzz: random calls, documented outcome -------------------------------------
VALUE_DTYPES = [BF16, np.dtype(np.float16), np.dtype(F32)]


OTHER_DTYPES = [np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.bool_)]
INDEX_DTYPES = [np.dtype(np.int32), np.dtype(np.int64)]
OTHER_INDEX = [np.dtype(np.int16), np.dtype(np.uint32), np.dtype(F32)]


SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 2.0**-149, 2.0**-130, 3e38, -3e38, 1e-30,
            65504.0, 1e5]


@st.composite
def store_calls(draw):
    swz = draw(st.booleans())
    geom = dict(num_blocks=draw(st.integers(1, 3)),
                block_size=draw(st.sampled_from([4, 8] if swz else [1, 3, 4])),
                num_heads=draw(st.integers(1, 3)),
                head_dim=draw(st.sampled_from([64, 128] if swz else [16, 32, 64])),
                layout=draw(st.sampled_from(["HND", "NHD"])),
                scale_rule=draw(st.sampled_from(["static6", "4over6"])),
                k_scale=draw(st.sampled_from([1.0, 2.0**-149, 1 / 2688, 3e38, 0.1])),
                v_scale=draw(st.sampled_from([1.0, 7.0, 2.0**-126])),
                swizzle_v_scales=swz)
    nslots = geom["num_blocks"] * geom["block_size"]
    n = draw(st.integers(0, 2 * nslots))
    slots = draw(st.lists(st.one_of(st.integers(-3, nslots - 1),
                                    st.integers(nslots, nslots + 3), st.just(2**31 - 1)),
                          min_size=n, max_size=n))
    H, Dm = geom["num_heads"], geom["head_dim"]
    # shapes: mostly right, sometimes wrong
    kshape = [n, H, Dm]
    vshape = [n, H, Dm]
    fault = draw(st.sampled_from(["none"] * 6 + ["k_heads", "v_dim", "rank", "v_tokens",
                                                 "slot_len"]))
    if fault == "k_heads":
        kshape[1] += 1
    elif fault == "v_dim":
        vshape[2] += 16
    elif fault == "rank":
        kshape = [n, H * Dm]
    elif fault == "v_tokens":
        vshape[0] += 1
    elif fault == "slot_len":
        slots = slots + [0]
    kd = draw(st.sampled_from(VALUE_DTYPES * 3 + OTHER_DTYPES))
    vd = kd if draw(st.integers(0, 5)) else draw(st.sampled_from(VALUE_DTYPES + OTHER_DTYPES))
    sd = draw(st.sampled_from(INDEX_DTYPES * 4 + OTHER_INDEX))
    seed = draw(st.integers(0, 2**32 - 1))
    specials = draw(st.lists(st.sampled_from(SPECIALS), max_size=6))
    blocks = draw(st.lists(st.integers(-2, geom["num_blocks"] + 1), max_size=4))
    return geom, slots, kshape, vshape, kd, vd, sd, seed, specials, fault, blocks


def values(shape, dtype, seed, specials):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 100.0])).astype(F32)
    flat = x.reshape(-1)
    for s in specials:
        if flat.size:
            flat[rng.integers(flat.size)] = s
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(dtype)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=store_calls())
def test_fuzz_store_and_gather(device, call):
    geom, slots, kshape, vshape, kd, vd, sd, seed, specials, fault, blocks = call
    xp = xp_of(device)
    cache = PagedKVCache(**geom, device=device,
                         **({"validate": True} if device == "cuda" else {}))
    model = ref.PagedModel(**geom)
    k = values(kshape, kd, seed, specials)
    v = values(vshape, vd, seed + 1, specials[::-1])
    sarr = np.array(slots, dtype=np.int64)
    nslots = geom["num_blocks"] * geom["block_size"]
    with np.errstate(over="ignore", invalid="ignore"):
        slot_in = sarr.astype(sd)  # int16/uint32/float32 may wrap or round: refused anyway
    # expected outcome, decided independently of the library
    expected = set()
    if kd not in VALUE_DTYPES or vd not in VALUE_DTYPES or kd != vd:
        expected.add(TypeError)
    if sd not in INDEX_DTYPES:
        expected.add(TypeError)
    if fault != "none":
        expected.add(ValueError)
    if not expected and ((sarr >= nslots) | (sarr < -1)).any():  # -1 alone is padding
        expected.add(IndexError)
    before = host(cache.buffer).copy()
    try:
        cache.store(xp.asarray(slot_in), xp.asarray(k), xp.asarray(v), unique_slots=False)
    except (TypeError, ValueError, IndexError) as e:
        assert type(e) in expected, (type(e), expected, e)
        np.testing.assert_array_equal(host(cache.buffer), before)
        assert cache.nonfinite_groups == (0, 0)
        return
    assert not expected, f"expected one of {expected}, the call succeeded"
    model.store(sarr, k, v)
    np.testing.assert_array_equal(host(cache.buffer), model.buffer())
    last = {int(sl): i for i, sl in enumerate(sarr) if sl >= 0}
    idx = np.array(sorted(last.values()), dtype=np.int64)
    counts = tuple(int((~np.isfinite(x[idx].astype(F32).reshape(-1, 16)).all(axis=1)).sum())
                   for x in (k, v))
    assert cache.nonfinite_groups == counts
    # gather: out-of-range ids refused (validated), else equal to the model
    barr = np.array(blocks, dtype=np.int64)
    if ((barr < 0) | (barr >= geom["num_blocks"])).any():
        with pytest.raises(IndexError, match="blocks"):
            cache.gather_dequant(xp.asarray(barr))
        return
    gk, gv = cache.gather_dequant(xp.asarray(barr), dtype=kd)
    wk, wv = model.gather(barr, {BF16: "bfloat16", np.dtype(np.float16): "float16",
                                 np.dtype(F32): "float32"}[kd])
    ref.assert_same_values(host(gk), wk)
    ref.assert_same_values(host(gv), wv)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots", [[3, 5, 3], [0, 7, -1, 7, -1]])
def test_store_unique_slots_refuses_repeats_when_validating(device, slots):
    """unique_slots=True with a repeated slot: ValueError naming the slot, buffer untouched;
    without a repeat it stores what the default path stores."""
    kw = dict(num_blocks=2, block_size=4, num_heads=2, head_dim=64, device=device,
              validate=True)
    cache, plain = PagedKVCache(**kw), PagedKVCache(**kw)
    xp = np if device == "cpu" else __import__("cupy")
    rng = np.random.default_rng(0)
    k = xp.asarray(rng.standard_normal((4, 2, 64)).astype(np.float32))
    cache.store(xp.arange(4), k, k)
    plain.store(xp.arange(4), k, k)
    before = cache.buffer.copy()
    x = xp.asarray(rng.standard_normal((len(slots), 2, 64)).astype(np.float32))
    with pytest.raises(ValueError, match=r"repeats slot \d+ but unique_slots=True"):
        cache.store(xp.asarray(slots), x, x, unique_slots=True)
    assert bool((cache.buffer == before).all())
    ok = xp.asarray([6, 1, -1])
    cache.store(ok, x[:3], x[:3], unique_slots=True)
    plain.store(ok, x[:3], x[:3])
    assert bool((cache.buffer == plain.buffer).all()) and not bool((cache.buffer == before).all())


# -- flags must be bools -------------------------------------------------------------------
FLAG_CALLS = {
    "store-unique_slots": ("unique_slots", lambda c, x: c.cache.store(
        c.slots, c.k, c.v, unique_slots=x)),
    "store-validate": ("validate", lambda c, x: c.cache.store(c.slots, c.k, c.v, validate=x)),
    "gather-validate": ("validate", lambda c, x: c.cache.gather_dequant(
        c.arr([0, 1], np.int64), validate=x)),
    "attention-validate": ("validate", lambda c, x: c.cache.decode_attention(
        c.arr(np.ones((1, H, D), F32)), c.arr([[0, 1]], np.int64), c.arr([9], np.int64),
        validate=x)),
    "attention-return_lse": ("return_lse", lambda c, x: c.cache.decode_attention(
        c.arr(np.ones((1, H, D), F32)), c.arr([[0, 1]], np.int64), c.arr([9], np.int64),
        return_lse=x)),
    "init-validate": ("validate", lambda c, x: PagedKVCache(
        NB, T, H, D, device=c.cache.device, validate=x)),
    "init-swizzle_v_scales": ("swizzle_v_scales", lambda c, x: PagedKVCache(
        NB, T, H, D, device=c.cache.device, swizzle_v_scales=x)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(FLAG_CALLS))
@pytest.mark.parametrize("bad", ["no", "False", 0, 1, 1.0, [True]])
def test_flags_must_be_bools(device, case, bad):
    """A string read as a flag used to act as True (``unique_slots="no"`` then even said
    ``unique_slots=True promises...``): a TypeError naming the parameter, the buffer
    untouched.  ``numpy.bool_`` is accepted."""
    name, call = FLAG_CALLS[case]
    c = make_ctx(device)
    before = host(c.cache.buffer).copy()
    with pytest.raises(TypeError, match=rf"{name} must be True or False") as err:
        call(c, bad)
    assert repr(bad) in str(err.value)
    np.testing.assert_array_equal(host(c.cache.buffer), before)
    call(c, np.bool_(True))  # NumPy's bool is a bool


@pytest.mark.parametrize("device", DEVICES)
def test_optional_flags_take_none_required_flags_do_not(device):
    c = make_ctx(device)
    c.cache.store(c.slots, c.k, c.v, validate=None)
    c.cache.gather_dequant(c.arr([0], np.int64), validate=None)
    for call in (lambda: c.cache.store(c.slots, c.k, c.v, unique_slots=None),
                 lambda: PagedKVCache(NB, T, H, D, device=device, swizzle_v_scales=None)):
        with pytest.raises(TypeError, match="must be True or False, got NoneType"):
            call()


# -- numbers must be numbers; lists name the parameter -------------------------------------
NUMBER_CALLS = {
    "k_scale": lambda c, x: PagedKVCache(NB, T, H, D, device=c.cache.device, k_scale=x),
    "v_scale": lambda c, x: PagedKVCache(NB, T, H, D, device=c.cache.device, v_scale=x),
    "sm_scale": lambda c, x: c.cache.decode_attention(
        c.arr(np.ones((1, H, D), F32)), c.arr([[0, 1]], np.int64), c.arr([9], np.int64),
        sm_scale=x),
    "scale": lambda c, x: fp4cache.quantize(c.arr(np.ones((2, 64), F32)), scale=x),
    "e2m1_max": lambda c, x: longlive.dequantize(
        [np.zeros((128, 32), np.uint8)], [np.zeros(512, np.uint8)], [np.ones(1, F32)], 2, 4,
        e2m1_max=x, e4m3_max=256),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(NUMBER_CALLS))
@pytest.mark.parametrize("bad", ["0.01", "0.1", b"1", True, None, [0.5]])
def test_numbers_must_be_real_numbers(device, name, bad):
    """``k_scale="0.01"`` or ``sm_scale="0.1"`` is refused like ``"abc"`` (float() would
    parse the first two): every number must be a real number, and the TypeError names
    the parameter."""
    c = make_ctx(device)
    before = host(c.cache.buffer).copy()
    if bad is None and name == "sm_scale":
        NUMBER_CALLS[name](c, bad)  # None: the default 1/sqrt(D)
        return
    with pytest.raises(TypeError, match=rf"^{name} must be a (positive finite|real) number"):
        NUMBER_CALLS[name](c, bad)
    np.testing.assert_array_equal(host(c.cache.buffer), before)
    NUMBER_CALLS[name](c, np.float32(0.5) if name != "e2m1_max" else 6)  # numbers still work


@pytest.mark.parametrize("device", DEVICES)
def test_lists_name_the_parameter(device):
    """A ragged block table used to give NumPy's raw 'inhomogeneous shape' error and a
    nested list for K '... got float64': both name the parameter now."""
    c = make_ctx(device)
    before = host(c.cache.buffer).copy()
    q = c.arr(np.ones((2, H, D), F32))
    with pytest.raises(ValueError, match=r"^block_tables must be a rectangular array: .*"
                                         r"\[1, 3\].*pad"):
        c.cache.decode_attention(q, [[0, 1, 2], [1]], [3, 3])
    with pytest.raises(ValueError, match=r"^slot_mapping must be a rectangular array"):
        c.cache.store([[0, 1], [2]], c.k, c.v)
    k_list = np.ones((2, H, D)).tolist()
    with pytest.raises(TypeError, match=r"^k must be an array .*got a Python list"):
        c.cache.store(c.arr([0, 1], np.int64), k_list, k_list)
    with pytest.raises(TypeError, match=r"^q must be an array .*got a Python list"):
        c.cache.decode_attention(np.ones((2, H, D)).tolist(), [[0], [1]], [3, 3])
    with pytest.raises(TypeError, match=r"^x must be an array .*got a Python tuple"):
        fp4cache.quantize(tuple(np.ones((2, 64)).tolist()))
    np.testing.assert_array_equal(host(c.cache.buffer), before)
    # index arrays as lists still work
    c.cache.decode_attention(q, [[0, 1], [1, -1]], [3, 3])
    c.cache.gather_dequant([0, 1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("call", [
    lambda c, x: c.cache.copy_blocks([0], [1], validate=x),
    lambda c, x: c.cache.read_blocks([0], validate=x),
    lambda c, x: c.cache.write_blocks([1], c.cache.read_blocks([0]), validate=x),
    lambda c, x: fp4cache.slot_mapping(np.array([[0, 1]]), np.array([[0, 3]]), block_size=T,
                                       validate=x),
], ids=["copy_blocks", "read_blocks", "write_blocks", "slot_mapping"])
def test_page_moving_flags_must_be_bools(device, call):
    c = make_ctx(device)
    before = host(c.cache.buffer).copy()
    with pytest.raises(TypeError, match=r"validate must be True or False.*'no'"):
        call(c, "no")
    np.testing.assert_array_equal(host(c.cache.buffer), before)
    call(c, np.bool_(True))


# -- device, pool size, byte order, autograd -----------------------------------------------
@pytest.mark.parametrize("device", [-1, -7])
def test_negative_device_index_is_a_value_error(device):
    """Refused as a bad index before any GPU is looked for, with or without CuPy."""
    with pytest.raises(ValueError, match=rf"device must be .*an int N >= 0.*got {device}: "
                                         "a GPU index cannot be negative"):
        PagedKVCache(4, 16, 2, 64, device=device)


@pytest.mark.parametrize("num_blocks, need", [(2**62, "9437184.00 PiB"),
                                              (10**12, "2.05 PiB")])
def test_a_pool_larger_than_memory_names_num_blocks(num_blocks, need):
    with pytest.raises(ValueError, match=rf"num_blocks = {num_blocks} is too many for this "
                                         rf"machine: its page pool needs {re.escape(need)} "
                                         rf"\({num_blocks * 2304} bytes.* available"):
        PagedKVCache(num_blocks, 16, 2, 64, device="cpu")


def test_the_pool_check_uses_the_memory_available(monkeypatch):
    import fp4cache._device as dev

    PagedKVCache(4, 16, 2, 64, device="cpu")
    monkeypatch.setattr(dev, "host_memory", lambda: 5000)
    with pytest.raises(ValueError, match=r"num_blocks = 4 .* needs 9.00 KiB \(9216 bytes: "
                                         r"num_blocks \* 2304 bytes a page\), but 4.88 KiB of "
                                         r"host memory is available; pass at most about "
                                         r"num_blocks = 2"):
        PagedKVCache(4, 16, 2, 64, device="cpu")
    monkeypatch.setattr(dev, "host_memory", lambda: None)  # unknown: nothing to compare
    PagedKVCache(4, 16, 2, 64, device="cpu")


@pytest.mark.parametrize("order", [">", "<"])
def test_index_arrays_of_either_byte_order_are_taken(order):
    """Ids in non-native byte order (read from a file, say) are converted like K/V; other
    dtypes are still refused whatever their order."""
    c = PagedKVCache(4, 16, 2, 64, device="cpu")
    ref_c = PagedKVCache(4, 16, 2, 64, device="cpu")
    kv = np.random.default_rng(0).standard_normal((40, 2, 64)).astype(np.float32)
    for dt in ("i8", "i4"):
        ids = np.arange(40).astype(order + dt)
        c.store(ids, kv, kv)
        ref_c.store(np.arange(40), kv, kv)
        assert np.array_equal(c.buffer, ref_c.buffer)
        k, _ = c.gather_dequant(np.array([2, 0]).astype(order + dt), dtype="float32")
        k_ref, _ = ref_c.gather_dequant(np.array([2, 0]), dtype="float32")
        assert np.array_equal(k, k_ref)
        q = np.ones((2, 4, 64), np.float32)
        tables, lens = np.array([[0, 1, 2], [1, 2, -1]]), np.array([40, 20])
        out = c.decode_attention(q, tables.astype(order + dt), lens.astype(order + dt))
        assert np.array_equal(out, ref_c.decode_attention(q, tables, lens))
        out = c.attention(q, np.array([0, 1, 2]).astype(order + dt),
                          tables.astype(order + dt), lens.astype(order + dt))
        assert np.array_equal(out, ref_c.attention(q, np.array([0, 1, 2]), tables, lens))
        c.copy_blocks(np.array([0]).astype(order + dt), np.array([3]).astype(order + dt))
        ref_c.copy_blocks([0], [3])
        assert np.array_equal(c.read_blocks(np.array([3, 1]).astype(order + dt)),
                              ref_c.read_blocks([3, 1]))
    before = c.buffer.copy()
    with pytest.raises(TypeError, match=r"slot_mapping must have dtype int32 or int64, got "
                                        r"(>f8|float64)"):
        c.store(np.arange(40).astype(order + "f8"), kv, kv)
    assert np.array_equal(before, c.buffer)


def test_a_tensor_that_requires_grad_names_the_parameter():
    torch = pytest.importorskip("torch")
    c = PagedKVCache(4, 16, 2, 64, device="cpu")
    before = c.buffer.copy()
    k = torch.ones((3, 2, 64), requires_grad=True)
    with pytest.raises(TypeError, match=r"k is a tensor with requires_grad=True.*pass "
                                        r"k\.detach\(\)"):
        c.store(np.arange(3), k, k.detach())
    with pytest.raises(TypeError, match=r"v is a tensor with requires_grad=True.*v\.detach"):
        c.store(np.arange(3), k.detach(), k)
    assert np.array_equal(before, c.buffer)
    q = torch.ones((1, 2, 64), requires_grad=True)
    with pytest.raises(TypeError, match=r"q is a tensor with requires_grad=True"):
        c.decode_attention(q, np.array([[0]]), np.array([3]))
    c.store(np.arange(3), k.detach(), k.detach())  # detached: taken without a copy
    assert c.buffer.any()


def test_check_says_what_happened_to_bad_block_ids_per_operation():
    """A skipped copy_blocks pair is not reported as a page "gathered as NaN"."""
    c = PagedKVCache(4, 16, 1, 64, device="cpu")
    kv = np.ones((64, 1, 64), np.float32)
    c.store(np.arange(64), kv, kv)
    before = c.buffer.copy()
    c.copy_blocks([99], [3], validate=False)
    assert np.array_equal(before, c.buffer) and c.stats["bad_block_ids"] == 1
    with pytest.raises(IndexError) as e:
        c.check()
    msg = str(e.value)
    assert "gathered as NaN" not in msg
    assert re.search(r"1 block id\(s\) were outside \[0, 4\) \(nothing outside the pool was "
                     r"read or written for them\): a read \(gather_dequant, decode_attention, "
                     r"attention, read_blocks\) gave NaN for each, a copy_blocks pair or "
                     r"write_blocks row with one was skipped \(its destination kept its "
                     r"bytes\)", msg), msg
    c.check()  # cleared


@pytest.mark.gpu
def test_a_gpu_pool_larger_than_the_gpu_names_num_blocks():
    with pytest.raises(ValueError, match=r"num_blocks = 1000000000000 is too many for this "
                                         r"machine: its page pool needs 2.10 PiB .* and its "
                                         r"claim table\), but GPU 0 has .* free"):
        PagedKVCache(10**12, 16, 2, 64, device="cuda:0")


# -- validate= on the CPU ------------------------------------------------------------------
def test_validate_false_on_the_cpu_warns_and_still_validates():
    with pytest.warns(UserWarning, match=r"validate=False\) has no effect on the CPU"):
        cache = PagedKVCache(2, 16, 1, 64, device="cpu", validate=False)
    assert cache.validate is True
    k = np.ones((1, 1, 64), F32)
    before = cache.buffer.copy()
    with pytest.raises(IndexError, match="slot_mapping"):
        cache.store(np.array([32]), k, k)  # validated all the same: nothing written
    np.testing.assert_array_equal(cache.buffer, before)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults and validate=True do not warn
        PagedKVCache(2, 16, 1, 64, device="cpu")
        PagedKVCache(2, 16, 1, 64, device="cpu", validate=True)
