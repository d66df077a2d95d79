"""PagedKVCache.store (spec section 4): the page bytes a store writes, its slots
(padding, bad, repeated) and its counters.

The expected page bytes are built from ``fp4cache.quantize`` output with the test's own
layout code (``nvfp4_ref.build_page_side``: array transposes and the reshape/permute form
of the V swizzle), never with ``fp4cache.layout``.  The counters of badly scaled groups:
block scales that saturated at E4M3's 448 (the global scale is too small for the data)
and nonzero groups whose block scale is zero or subnormal (too large), per K and V.

Under the ``gpu`` marker the GPU's pages and counters equal the CPU backend's byte for
byte: through the public method (both store kernel shapes, the scan and the claim paths,
plans made during graph capture, the claim table across calls and caches) and one layer
down (``TestCupyBackend``: the CuPy backend against the NumPy backend on the same random
initial pages, so that stray writes show up).
"""

from __future__ import annotations

import itertools
import random
import zlib

import hypothesis as hyp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    capture_stream,
    check_against_model,
    make_pair,
    make_values,
    poisoned_elements,
    rand_kv,
    same_bytes,
    same_values,
    scales_for,
)
from hypothesis import strategies as st_
from nvfp4_ref import assert_same_values

import fp4cache
from fp4cache import PagedKVCache, calibrate_scale
from fp4cache import _cpu as nb
from fp4cache._abi import STAT_NAMES
from fp4cache.formats import reciprocal_clamped
from fp4cache.layout import PageGeometry

try:  # CuPy and its backend modules, for the GPU cases (which skip by their marker
    # where there is no GPU: collection needs no CuPy)
    import cupy as cp

    from fp4cache import _cuda as cb
except ImportError:
    cb = cp = None


F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)


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


# -- counters of badly scaled groups -------------------------------------------------------
H, D, T, NB = 2, 64, 16, 8


def _expected(x, scale, rule, scale_bytes):
    """Independent count: saturated iff fl(g * fl(m * c)) > 464 for the candidate the
    store chose (read back from its scale byte): only then would the wanted scale round
    above 448 (464 is the midpoint of 448 and 480 and rounds to the even 448); underflow
    iff m > 0 and the stored byte is below 0x08 (2^-6, E4M3's smallest normal)."""
    g = np.float32(1) / np.float32(scale)
    m = np.abs(x.astype(F32)).reshape(-1, 16).max(axis=1)
    sf = scale_bytes.reshape(-1)
    arg6 = g * (m * np.float32(1 / 6))
    if rule == "static6":
        sat = arg6 > 464
    else:
        arg4 = g * (m * np.float32(0.25))
        e4 = ml_dtypes.float8_e4m3fn
        b4 = np.minimum(arg4, 448).astype(e4).view(np.uint8)
        b6 = np.minimum(arg6, 448).astype(e4).view(np.uint8)
        chose4 = (sf == b4) & (b4 != b6)
        sat = np.where(chose4, arg4 > 464, arg6 > 464)
    under = (m > 0) & (sf < 8)
    return int(sat.sum()), int(under.sum())


def _scale_bytes(cache, side, n):
    """Scale bytes of tokens 0..n-1, in (token, head, group) order (HND, linear V)."""
    g = cache.geometry
    t = np.arange(n)[:, None, None]
    h = np.arange(H)[None, :, None]
    s = np.arange(D // 16)[None, None, :]
    buf = cache.buffer if cache.device == "cpu" else cache.buffer.get()
    return buf[t // T, side, g.scale_offset(t % T, h, s, side=side)]


@pytest.mark.filterwarnings("ignore:PagedKVCache.store:UserWarning")  # badly scaled on purpose
@pytest.mark.parametrize("rule", ["static6", "4over6"])
@pytest.mark.parametrize("std", [1e-4, 1e-2, 1.0, 1e4])
def test_counts_match_the_stored_scales(rule, std):
    rng = np.random.default_rng(int(std * 1e4) % 97)
    n = 40
    k = (rng.standard_normal((n, H, D)) * std).astype(F32)
    v = (rng.standard_normal((n, H, D)) * std * 3).astype(F32)
    k[0, 0, :16] = 0  # an all-zero group never counts as underflow
    c = PagedKVCache(NB, T, H, D, scale_rule=rule, swizzle_v_scales=False, device="cpu")
    c.store(np.arange(n), k, v)
    ks, vs = _expected(k, 1.0, rule, _scale_bytes(c, 0, n)), \
        _expected(v, 1.0, rule, _scale_bytes(c, 1, n))
    assert c.saturated_groups == (ks[0], vs[0])
    assert c.underflow_groups == (ks[1], vs[1])
    if std == 1e-4:  # every nonzero group underflows with k_scale = 1
        assert c.underflow_groups[0] == n * H * D // 16 - 1
    if std == 1e4:
        assert c.saturated_groups[0] > 0 and c.saturated_groups[1] > 0
    if std == 1.0:
        assert c.saturated_groups == (0, 0)
    text = repr(c)
    assert ("underflow groups" in text) == any(c.underflow_groups)
    assert ("saturated groups" in text) == any(c.saturated_groups)
    c.reset_counters()
    assert c.saturated_groups == c.underflow_groups == (0, 0)


@pytest.mark.parametrize("rule", ["static6", "4over6"])
@pytest.mark.parametrize("std", [1e-4, 1e4])
def test_calibrated_scales_count_nothing(rule, std):
    rng = np.random.default_rng(1)
    k = (rng.standard_normal((64, H, D)) * std).astype(F32)
    c = PagedKVCache(NB, T, H, D, scale_rule=rule, k_scale=calibrate_scale(k, rule),
                     v_scale=calibrate_scale(k, rule), device="cpu")
    c.store(np.arange(64), k, k)
    assert c.saturated_groups == (0, 0)
    assert c.underflow_groups == (0, 0)


def test_badly_scaled_stores_warn_once_per_cache():
    """Most nonzero groups of a call saturated or underflowed: one UserWarning naming the
    counts and calibrate_scale, then none for that cache; calibrated data and a minority
    of badly scaled groups do not warn."""
    import warnings

    rng = np.random.default_rng(5)
    tiny = (rng.standard_normal((32, H, D)) * 1e-4).astype(F32)
    groups = 32 * H * D // 16
    c = PagedKVCache(NB, T, H, D, device="cpu")  # static6, k_scale = v_scale = 1
    with pytest.warns(UserWarning, match=rf"K: 0 saturated and {groups} underflowed of "
                                         rf"{groups} nonzero groups \(k_scale = 1\).*"
                                         r"fp4cache.calibrate_scale") as rec:
        c.store(np.arange(32), tiny, tiny)
    assert len(rec) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.store(np.arange(32), tiny, tiny)  # once per cache
    assert c.underflow_groups == (2 * groups, 2 * groups)
    sparse = np.zeros_like(tiny)  # one value per head: rotated, it spreads over its groups
    sparse[:, :, 0] = 1e-3
    with pytest.warns(UserWarning, match=rf"K: 0 saturated and {groups} underflowed of "
                                         rf"{groups} nonzero groups"):
        PagedKVCache(NB, T, H, D, rotation="hadamard", device="cpu").store(
            np.arange(32), sparse, sparse)
    huge = tiny * 1e8
    with pytest.warns(UserWarning, match=r"V: \d+ saturated and 0 underflowed"):
        PagedKVCache(NB, T, H, D, device="cpu").store(np.arange(32), tiny * 1e4, huge)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = calibrate_scale(tiny, "static6")
        PagedKVCache(NB, T, H, D, k_scale=s, v_scale=s, device="cpu").store(
            np.arange(32), tiny, tiny)
        few = tiny * 1e4  # std 1: fits the default scale, but 4 of 32 tokens are tiny
        few[:4] = tiny[:4]
        c = PagedKVCache(NB, T, H, D, device="cpu")
        c.store(np.arange(32), few, few)
        assert c.underflow_groups == (4 * H * D // 16,) * 2


def _boundary_groups():
    """K rows whose groups want block scales around 448 and 464 with k_scale = 1: group
    maxima m with fl(m * fl(1/6)) = 448, 448.00003, 463.99997, 464 (not saturated: they
    round to 448) and 464.00006, 480, 10^4 (saturated), and with m/4 at 464 / above it
    for 4over6's 4-candidate; each group's other values spread below m."""
    up = np.float32(np.inf)
    sixes = [np.float32(2688), np.nextafter(np.float32(2688), up), np.float32(2784),
             np.nextafter(np.float32(2784), -up), np.nextafter(np.float32(2784), up),
             np.float32(2880), np.float32(6e4)]
    fours = [np.float32(1856), np.nextafter(np.float32(1856), up), np.float32(1900)]
    groups = []
    for m in sixes + fours:
        for shape in (np.linspace(-1, 1, 16), np.r_[np.full(15, 0.3), 1.0],
                      np.r_[np.full(15, 0.66), 1.0]):
            groups.append((shape * np.float64(m)).astype(F32))
            groups[-1][np.argmax(np.abs(groups[-1]))] = m
    x = np.concatenate(groups)
    n = -(-x.size // (H * D))
    x = np.concatenate([x, np.ones(n * H * D - x.size, F32)])
    return x.reshape(n, H, D)


@pytest.mark.parametrize("rule", ["static6", "4over6"])
def test_saturation_counts_only_scales_that_round_above_448(rule):
    """A wanted scale in (448, 464] encodes exactly as 448 (no value is clipped): not
    counted; above 464 it is.  The case that matters: the group holding
    the calibration maximum wants fl(g * fl(amax/6)) = 448.00003."""
    k = _boundary_groups()
    n = k.shape[0]
    c = PagedKVCache(NB, T, H, D, scale_rule=rule, swizzle_v_scales=False, device="cpu")
    c.store(np.arange(n), k, -k)
    sb = _scale_bytes(c, 0, n)
    want = _expected(k, 1.0, rule, sb)[0]
    assert c.saturated_groups == (want, want)
    m = np.abs(k).reshape(-1, 16).max(axis=1)
    if rule == "static6":  # 3 groups each of m = 2784 + 1 ulp, 2880 and 6e4, none below
        assert want == 9
        assert (sb.reshape(-1)[m <= 2784] <= 0x7E).all()
    else:
        assert 0 < want < 3 * 10


@pytest.mark.parametrize("rule", ["static6", "4over6"])
def test_calibrated_maximum_is_not_saturated(rule):
    """No false alarm: with calibrate_scale's scale, the group holding amax wants
    448.00003 in float32 (static6), which still encodes as 448."""
    x = np.linspace(-1, 1, 64 * H * D, dtype=F32).reshape(64, H, D)
    x[5, 1, 17] = np.float32(56.140755)  # calibrate_scale -> g * fl(amax * fl(1/6)) > 448
    s = np.float32(calibrate_scale(x, rule))
    g = np.float32(1) / s
    if rule == "static6":
        assert g * (np.float32(56.140755) * (np.float32(1) / np.float32(6))) > 448
    c = PagedKVCache(NB, T, H, D, scale_rule=rule, k_scale=float(s), v_scale=float(s),
                     swizzle_v_scales=False, device="cpu")
    c.store(np.arange(64), x, x)
    assert c.saturated_groups == (0, 0)
    assert "saturated" not in repr(c)
    if rule == "static6":
        assert int(_scale_bytes(c, 0, 64).max()) == 0x7E


# -- on the GPU, against the CPU -----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), np.dtype(F32)])
@pytest.mark.parametrize("rule", ["static6", "4over6"])
@pytest.mark.parametrize("rep", [1, 40])  # unique slots; repeated: claim path (>128)
def test_gpu_saturation_boundary_equals_cpu(dtype, rule, rep):
    """The store kernels count saturation with the CPU's threshold (464) on the groups
    around it, calibrated maxima included: same bytes, same counters."""
    import cupy

    k = _boundary_groups()
    k = np.concatenate([k, k * np.float32(1 / 64)]).astype(dtype)  # f16: 2784 is finite
    n = k.shape[0]
    kw = dict(num_blocks=NB * 4, block_size=T, num_heads=H, head_dim=D, scale_rule=rule)
    for k_scale in (1.0, calibrate_scale(k, rule)):
        cpu = PagedKVCache(**kw, k_scale=k_scale, v_scale=k_scale, device="cpu")
        gpu = PagedKVCache(**kw, k_scale=k_scale, v_scale=k_scale, device="cuda")
        slots = np.tile(np.arange(n), rep)
        kk = np.tile(k, (rep, 1, 1))
        cpu.store(slots, kk, -kk, unique_slots=rep == 1)
        gpu.store(cupy.asarray(slots), cupy.asarray(kk), cupy.asarray(-kk),
                  unique_slots=rep == 1)
        assert np.array_equal(cupy.asnumpy(gpu.buffer), cpu.buffer)
        assert gpu.stats == cpu.stats
    assert cpu.saturated_groups == (0, 0)  # calibrated


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16), np.dtype(F32)])
@pytest.mark.parametrize("rule", ["static6", "4over6"])
@pytest.mark.parametrize("n", [40, 300])  # scan path and claim path of the store
def test_gpu_counts_equal_cpu(dtype, rule, n):
    """The GPU counts on the device (one atomic per warp and counter) what the CPU
    counts, for data spread over 16 decades."""
    import cupy

    rng = np.random.default_rng(n)
    mag = np.exp2(rng.integers(-30, 30, (n, H, 1)).astype(F32))
    k = (rng.standard_normal((n, H, D)) * mag).astype(dtype)
    v = (rng.standard_normal((n, H, D)) * mag[::-1]).astype(dtype)
    kw = dict(num_blocks=64, block_size=T, num_heads=H, head_dim=D, scale_rule=rule,
              k_scale=0.01, v_scale=3.0)
    cpu, gpu = PagedKVCache(**kw, device="cpu"), PagedKVCache(**kw, device="cuda")
    slots = rng.permutation(64 * T)[:n]
    cpu.store(slots, k, v)
    gpu.store(cupy.asarray(slots), cupy.asarray(k), cupy.asarray(v))
    assert gpu.stats == cpu.stats
    assert all(cpu.saturated_groups) and all(cpu.underflow_groups)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,swizzle,rule", [("HND", True, "4over6"),
                                                  ("NHD", False, "static6"),
                                                  ("NHD", True, "4over6")])
@pytest.mark.parametrize("dtype", [BF16, np.float16, np.float32], ids=str)
def test_paged_cache_cuda_equals_cpu(layout, swizzle, rule, dtype):
    rng = np.random.default_rng(0)
    nblk, T, H, D = 12, 16, 4, 128
    kw = dict(layout=layout, scale_rule=rule, swizzle_v_scales=swizzle, k_scale=0.02,
              v_scale=0.5)
    cpu = PagedKVCache(nblk, T, H, D, device="cpu", **kw)
    gpu = PagedKVCache(nblk, T, H, D, device="cuda", **kw)
    for step, n in enumerate((150, 7, 1, 64)):
        k = (rng.standard_normal((n, H, D)) * 4).astype(dtype)
        v = (rng.standard_normal((n, H, D)) * 0.1).astype(dtype)
        if step == 1:
            k[0, 0, 3] = np.nan
        slots = rng.integers(-1, nblk * T, n).astype(np.int64)
        cpu.store(slots, k, v, unique_slots=False)
        gpu.store(cp.asarray(slots), cp.asarray(k), cp.asarray(v), unique_slots=False)
        assert_same_values(gpu.buffer, cpu.buffer)
    assert gpu.stats == cpu.stats
    blocks = rng.integers(0, nblk, 9).astype(np.int32)
    for dt in ("bfloat16", "float16", "float32"):
        rk, rv = cpu.gather_dequant(blocks, dtype=dt)
        gk, gv = gpu.gather_dequant(cp.asarray(blocks), dtype=dt)
        assert_same_values(gk, rk)
        assert_same_values(gv, rv)
    # out= buffers, strided (non-contiguous) K/V input
    ok = cp.empty((9 * T, H, D), BF16)
    ov = cp.empty((9 * T, H, D), BF16)
    gpu.gather_dequant(cp.asarray(blocks), out=(ok, ov))
    assert_same_values(ok, cpu.gather_dequant(blocks, dtype="bfloat16")[0])
    big = (rng.standard_normal((20, H, 2 * D))).astype(dtype)
    slots = np.arange(20, dtype=np.int32) * 3
    cpu.store(slots, big[:, :, :D], big[:, :, D:])
    gpu.store(cp.asarray(slots), cp.asarray(big)[:, :, :D], cp.asarray(big)[:, :, D:])
    assert_same_values(gpu.buffer, cpu.buffer)


@pytest.mark.gpu
def test_store_plan_made_during_graph_capture():
    """New scales -> new plan and os table, made inside the capture; replay is exact."""
    rng = np.random.default_rng(12)
    kw = dict(num_blocks=6, block_size=16, num_heads=2, head_dim=64, k_scale=0.0123,
              v_scale=3.5e-3)
    c_cpu = PagedKVCache(**kw, device="cpu")
    c_gpu = PagedKVCache(**kw, device="cuda")
    n = 24
    slots = cp.asarray(rng.permutation(96)[:n])
    k = cp.asarray(rng.standard_normal((n, 2, 64)).astype(np.float32))
    v = cp.asarray(rng.standard_normal((n, 2, 64)).astype(np.float32))
    stream = capture_stream()
    with stream:
        stream.begin_capture()
        c_gpu.store(slots, k, v)
        graph = stream.end_capture()
        for _ in range(2):  # replay with new contents in the same device arrays
            s_h = rng.permutation(96)[:n]
            k_h = rng.standard_normal((n, 2, 64)).astype(np.float32)
            v_h = rng.standard_normal((n, 2, 64)).astype(np.float32)
            slots.set(s_h, stream=stream)
            k.set(k_h, stream=stream)
            v.set(v_h, stream=stream)
            graph.launch(stream)
            stream.synchronize()
            c_cpu.store(s_h, k_h, v_h)
            assert np.array_equal(cp.asnumpy(c_gpu.buffer), c_cpu.buffer)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16), np.dtype(np.float32)])
@pytest.mark.parametrize("rule", ["static6", "4over6"])
@pytest.mark.parametrize("D,layout,swz,H", [(64, "HND", True, 4), (128, "NHD", True, 6),
                                            (192, "HND", False, 2), (80, "NHD", False, 3),
                                            (128, "HND", True, 3)])
@pytest.mark.parametrize("n", [40, 300, 2000])
def test_store_one_or_two_heads_per_thread(dtype, rule, D, layout, swz, H, n):
    """Both store kernel shapes (the same group of heads h and h + H/2 per thread for
    16-bit static6 with an even H, else one group per thread) write the NumPy backend's
    bytes and counters, with padding (-1) and duplicate slots, through the scan (40) and
    the claim + clear (300, 2000) paths."""
    rng = np.random.default_rng(n + D + H)
    T, nb = 16, 160
    kw = dict(num_blocks=nb, block_size=T, num_heads=H, head_dim=D, layout=layout,
              scale_rule=rule, k_scale=0.02, v_scale=0.5, swizzle_v_scales=swz)
    c_cpu = PagedKVCache(**kw, device="cpu")
    c_gpu = PagedKVCache(**kw, device="cuda")
    slots = rng.permutation(nb * T)[:n]
    slots[::7] = -1
    slots[5::11] = slots[3]  # duplicates: the last occurrence wins
    k = (rng.standard_normal((n, H, D)) * rng.choice([0.01, 1, 30], (n, H, 1))).astype(dtype)
    v = (rng.standard_normal((n, H, D)) * 3).astype(dtype)
    c_cpu.store(slots, k, v, unique_slots=False)
    c_gpu.store(cp.asarray(slots), cp.asarray(k), cp.asarray(v), unique_slots=False)
    assert np.array_equal(cp.asnumpy(c_gpu.buffer), c_cpu.buffer)
    assert c_gpu.stats == c_cpu.stats
    assert not c_gpu.pool.claim.any()  # the clear pass leaves the claim table zero


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["static6", "4over6"])
@pytest.mark.parametrize("n", [1, 40, 300, 2000])
@pytest.mark.parametrize("validate", [True, False])
def test_store_unique_slots_skips_the_duplicate_pass(rule, n, validate):
    """unique_slots=True (no scan, no claim pass) writes the same bytes as the default
    store for slot mappings without repeats, also through the prepared fast path."""
    rng = np.random.default_rng(n)
    H, D, T, nb = 8, 128, 16, 160
    kw = dict(num_blocks=nb, block_size=T, num_heads=H, head_dim=D, scale_rule=rule,
              k_scale=0.05, v_scale=0.3, validate=validate)
    c_cpu = PagedKVCache(**kw, device="cpu")
    c_gpu = PagedKVCache(**kw, device="cuda")
    for step in range(3):  # repeated calls: the fast path when not validating
        slots = rng.permutation(nb * T)[:n]
        slots[::9] = -1
        k = (rng.standard_normal((n, H, D)) * 2).astype(BF16)
        v = rng.standard_normal((n, H, D)).astype(BF16)
        c_cpu.store(slots, k, v)
        c_gpu.store(cp.asarray(slots), cp.asarray(k), cp.asarray(v), unique_slots=True)
        assert np.array_equal(cp.asnumpy(c_gpu.buffer), c_cpu.buffer), step


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
@pytest.mark.parametrize("H", [2, 3])  # two heads per thread (static6) or one
@pytest.mark.parametrize("rule", ["static6", "4over6"])
def test_store_group_max_special_values(dtype, H, rule):
    """The group max |x| (packed 16-bit maxima on sm_86+) with the largest magnitude, a
    NaN, +Inf or -Inf at every position of a group, negative maxima, -0, subnormal-only
    groups and the largest finite value: same bytes and counters (non-finite, saturated,
    underflow) as the NumPy backend."""
    finfo = ml_dtypes.finfo(dtype) if dtype == BF16 else np.finfo(dtype)
    tiny = np.float32(finfo.smallest_subnormal)
    rows = []
    for pos in range(16):
        base = np.linspace(-1, 1, 16, dtype=np.float32)
        for special in (np.float32(-7.5), np.nan, np.inf, -np.inf):
            g = base.copy()
            g[pos] = special
            rows.append(g)
        rows.append(np.where(np.arange(16) == pos, -tiny * 3, tiny).astype(np.float32))
    rows.append(np.full(16, np.float32(finfo.max)))
    rows.append(np.full(16, -np.float32(finfo.max)))
    rows.append(np.full(16, np.float32(-0.0)))
    D = 64
    x = np.array(rows, np.float32).reshape(-1)
    n = -(-x.size // (H * D))
    x = np.concatenate([x, np.ones(n * H * D - x.size, np.float32)]).reshape(n, H, D)
    k, v = x.astype(dtype), (-x[::-1]).astype(dtype)
    kw = dict(num_blocks=8, block_size=16, num_heads=H, head_dim=D, scale_rule=rule,
              k_scale=1 / 448, v_scale=0.02)
    for rep in (1, 15):  # scan path, then claim path (165 tokens, repeated slots)
        slots = np.arange(n).repeat(rep) % (8 * 16)
        kk, vv = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
        c_cpu = PagedKVCache(**kw, device="cpu")
        c_gpu = PagedKVCache(**kw, device="cuda")
        c_cpu.store(slots, kk, vv, unique_slots=False)
        c_gpu.store(cp.asarray(slots), cp.asarray(kk), cp.asarray(vv), unique_slots=False)
        assert np.array_equal(cp.asnumpy(c_gpu.buffer), c_cpu.buffer)
        assert c_gpu.stats == c_cpu.stats


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["static6", "4over6"])
def test_large_stores_with_and_without_repeats_keep_pages_and_counters(rule):
    """Large stores (claim pass, store, clear pass; the store encodes every group before
    it looks at the claims): calls with and without repeated slots, with non-finite
    groups in winning and in losing tokens.  After every call the pages and every counter
    equal the NumPy backend's: a losing token's non-finite groups are not counted."""
    rng = np.random.default_rng(7)
    H, D, T, nb, n = 4, 64, 16, 64, 400
    kw = dict(num_blocks=nb, block_size=T, num_heads=H, head_dim=D, scale_rule=rule,
              k_scale=0.05, v_scale=0.5)
    c_cpu = PagedKVCache(**kw, device="cpu")
    c_gpu = PagedKVCache(**kw, device="cuda")
    for call, repeats in enumerate([True, False, False, True, True, False, True, False]):
        slots = rng.permutation(nb * T)[:n].astype(np.int64)
        slots[::13] = -1
        k = rng.standard_normal((n, H, D)).astype(BF16)
        v = (rng.standard_normal((n, H, D)) * 3).astype(BF16)
        k[rng.choice(n, 6, replace=False), 1, 16:32] = np.nan
        v[rng.choice(n, 4, replace=False), 2, :16] = np.inf
        if repeats:
            slots[7::17] = slots[3]  # token 3 and most of these lose to the last one
            k[3, 0, :16] = np.nan
            v[7, 3, 5] = -np.inf
        c_cpu.store(slots, k, v, unique_slots=False)
        c_gpu.store(cp.asarray(slots), cp.asarray(k), cp.asarray(v), unique_slots=False)
        assert np.array_equal(cp.asnumpy(c_gpu.buffer), c_cpu.buffer), f"call {call}"
        assert c_gpu.stats == c_cpu.stats, f"call {call}"
    assert c_cpu.nonfinite_groups[0] > 0 and c_cpu.nonfinite_groups[1] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 31, 64, 127, 128])
@pytest.mark.parametrize("pattern", ["all_same", "pairs", "random_repeats", "padding"])
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_decode_step_scan_of_repeated_slots(n, pattern, slot_dtype):
    """Stores of up to 128 tokens find repeated slots in one launch (each CTA compares
    the slots in shared memory): the last occurrence wins for every pattern and length,
    also through the prepared decode-step launch (second call), against the NumPy
    backend."""
    rng = np.random.default_rng(n)
    H, D, T, nb = 8, 128, 16, 12
    if pattern == "all_same":
        slots = np.full(n, 37)
    elif pattern == "pairs":
        slots = np.arange(n) // 2 * 3
    elif pattern == "random_repeats":
        slots = rng.integers(0, 20, n)
    else:
        slots = rng.permutation(nb * T)[:n]
        slots[::3] = -1
        slots[1::5] = slots[-1]
    slots = slots.astype(slot_dtype)
    kw = dict(num_blocks=nb, block_size=T, num_heads=H, head_dim=D, k_scale=0.01,
              v_scale=0.02)
    c_cpu = PagedKVCache(**kw, device="cpu")
    c_gpu = PagedKVCache(**kw, device="cuda")
    for call in range(2):  # the second call takes the prepared launch
        k = rng.standard_normal((n, H, D)).astype(BF16)
        v = rng.standard_normal((n, H, D)).astype(BF16)
        c_cpu.store(slots, k, v, unique_slots=False)
        c_gpu.store(cp.asarray(slots), cp.asarray(k), cp.asarray(v), unique_slots=False)
        assert np.array_equal(cp.asnumpy(c_gpu.buffer), c_cpu.buffer), f"call {call}"


@pytest.mark.gpu
def test_claim_table_across_calls_graph_replays_and_freed_caches():
    """Large stores with repeated slots (claim, store, clear) through caches: stale claims
    of earlier calls never win a slot, in eager calls, graph replays and eager calls after
    replays; graphs captured from caches of different sizes on one stream replay
    correctly after the other caches are freed; the claim tables end all zero."""
    import gc

    from fp4cache import PagedKVCache

    rng = np.random.default_rng(99)
    H, D, T, n = 2, 64, 16, 300
    stream = capture_stream()
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
        assert not gpu.pool.claim.any()


# -- the CuPy backend against the NumPy backend --------------------------------------------
NSTATS = len(STAT_NAMES)
VALUE_DTYPES = [BF16, np.dtype(np.float16), np.dtype(np.float32)]
RULES = ["static6", "4over6"]


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
    dtype = VALUE_DTYPES[case["dtype"]]
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


@pytest.mark.gpu
class TestCupyBackend:
    """The CuPy backend against the NumPy backend on the same inputs, byte for
    byte (float outputs as unsigned-integer views, NaN positions compared apart:
    their payloads differ between CPU and GPU arithmetic)."""

    @pytest.mark.parametrize("case", _store_cases(), ids=lambda c: "-".join(
        str(c[k]) for k in ("dtype", "layout", "swizzle", "rule", "D", "T", "H", "pattern",
                            "noncontig", "scale", "ntok")))
    def test_store_and_gather_match_numpy(self, case):
        geom, buf, buf_ref, num_blocks = _run_store(case, seed=zlib.crc32(str(case).encode()))
        # gather the pages back, including repeats and (for some cases) bad ids
        rng = np.random.default_rng(7)
        n = int(rng.integers(1, 2 * num_blocks + 1))
        blocks = rng.integers(0, num_blocks, n)
        if case["pattern"] == "oob":
            blocks[rng.random(n) < 0.3] = rng.choice([-1, num_blocks, num_blocks + 7])
        blocks = blocks.astype(case["slot_dtype"])
        out_dt = VALUE_DTYPES[(case["dtype"] + 1) % 3]
        shape = (n * geom.block_size, geom.num_heads, geom.head_dim)
        rk, rv = np.empty(shape, out_dt), np.empty(shape, out_dt)
        st_ref = np.zeros(NSTATS, np.uint64)
        ks, vs = np.float32(0.75), np.float32(1.5)
        nb.gather_dequant(buf_ref, blocks, rk, rv, geom=geom, k_s=ks, v_s=vs, stats=st_ref)
        gk, gv = poisoned_elements(shape, out_dt), poisoned_elements(shape, out_dt)
        st = cp.zeros(NSTATS, cp.uint64)
        cb.gather_dequant(buf, cp.asarray(blocks), gk, gv, geom=geom, k_s=ks, v_s=vs, stats=st)
        same_values(gk, rk, "out_k")
        same_values(gv, rv, "out_v")
        assert np.array_equal(cp.asnumpy(st), st_ref)

    @pytest.mark.parametrize("dtype", [BF16, np.float16, np.float32], ids=str)
    @pytest.mark.parametrize("rotate, window", [(True, False), (False, True), (True, True)])
    @pytest.mark.parametrize("n, H, layout", [(1, 2, "HND"), (77, 3, "NHD"), (300, 2, "HND")])
    def test_rotated_and_window_store_match_numpy(self, dtype, rotate, window, n, H, layout):
        """Random initial pages and window slots (stray writes show), repeated, padding and
        bad slots, NaN and infinite groups, tokens of unmapped pages."""
        rng = np.random.default_rng(n + H)
        T, D, num_blocks = 16, 128, 5
        geom = PageGeometry(H, T, D, layout, layout == "HND")
        buf0 = rng.integers(0, 256, (num_blocks, 2, geom.side_bytes), dtype=np.uint8)
        win0 = rng.integers(0, 1 << 16, (3, 2, T, H, D), dtype=np.uint16)
        wmap = np.array([-1, 0, 2, -1, 1], np.int32)
        slots = rng.integers(0, num_blocks * T, n).astype(np.int64)
        if n > 2:
            slots[[1, 2, 3]] = [-1, num_blocks * T, -9]
        k = make_values(rng, (n, H, D), dtype, nonfinite=0.001)
        v = make_values(rng, (n, H, D), dtype, nonfinite=0.003)
        ks, kg = scales_for(rng, "calib")
        vs, vg = scales_for(rng, "calib")
        rule = "4over6" if dtype == np.float32 else "static6"
        buf_ref, win_ref = buf0.copy(), win0.copy()
        st_ref = np.zeros(NSTATS, np.uint64)
        nb.store(buf_ref, slots, k, v, geom=geom, rule=rule, k_s=ks, k_g=kg, v_s=vs, v_g=vg,
                 stats=st_ref, rotate=rotate, window=(win_ref, wmap) if window else None)
        buf, win = cp.asarray(buf0), cp.asarray(win0)
        st = cp.zeros(NSTATS, cp.uint64)
        cb.store(buf, cp.asarray(slots), cp.asarray(k), cp.asarray(v), geom=geom, rule=rule,
                 k_s=ks, k_g=kg, v_s=vs, v_g=vg, stats=st, rotate=rotate,
                 window=(win, cp.asarray(wmap)) if window else None)
        same_bytes(buf, buf_ref, "pages")
        same_bytes(win, win_ref, "window")
        assert np.array_equal(cp.asnumpy(st), st_ref)

    @pytest.mark.parametrize("n", [5, 128, 129, 1000])
    def test_duplicate_slots_last_occurrence_wins(self, n):
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
    def test_hypothesis_store_gather(self, dt, rule, layout, swizzle, H, T, G, n, seed, i64):
        rng = np.random.default_rng(seed)
        D = 16 * G
        dtype = VALUE_DTYPES[dt]
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
        gk, gv = poisoned_elements(shape, dtype), poisoned_elements(shape, dtype)
        cb.gather_dequant(buf, cp.asarray(blocks), gk, gv, geom=geom, k_s=s, v_s=s, stats=st)
        same_values(gk, rk, "k")
        same_values(gv, rv, "v")
        assert np.array_equal(cp.asnumpy(st), st_ref)
