"""Edge cases: empty gathers, ``validate=`` on the CPU, ``quantize(out=)``."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from conftest import DEVICES

import fp4cache
from fp4cache import PagedKVCache
from fp4cache._arrays import array_module, ceil_div, share_bytes

F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)


def _xp(device):
    return array_module(device)


def _host(a):
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty", [[], (), range(0), "int32", "int64"])
@pytest.mark.parametrize("validate", [None, True, False])
def test_empty_gather_is_an_empty_result(device, empty, validate):
    xp = _xp(device)
    cache = PagedKVCache(4, 16, 2, 64, device=device)
    if isinstance(empty, str):
        empty = xp.zeros(0, dtype=empty)
    before = _host(cache.buffer).copy()
    k, v = cache.gather_dequant(empty, validate=validate)
    assert k.shape == v.shape == (0, 2, 64) and k.dtype == BF16
    k, v = cache.gather_dequant(empty, dtype="float32", validate=validate)
    assert k.shape == (0, 2, 64) and k.dtype == F32
    out = (xp.empty((0, 2, 64), F32), xp.empty((0, 2, 64), F32))
    got = cache.gather_dequant(empty, out=out, validate=validate)
    assert got[0] is out[0] and got[1] is out[1]
    np.testing.assert_array_equal(_host(cache.buffer), before)
    # an empty store is a no-op too
    cache.store([], xp.zeros((0, 2, 64), F32), xp.zeros((0, 2, 64), F32))
    np.testing.assert_array_equal(_host(cache.buffer), before)
    # a list of floats is still refused: only the empty list means "no ids"
    with pytest.raises(TypeError, match="blocks must have dtype int32 or int64"):
        cache.gather_dequant([0.0, 1.0])


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", ["static6", "4over6"])
def test_quantize_out_writes_the_same_bytes(device, rule):
    xp = _xp(device)
    rng = np.random.default_rng(30)
    x = xp.asarray((rng.standard_normal((3, 5, 64)) * 4).astype(BF16))
    want_d, want_s = fp4cache.quantize(x, 0.5, rule)
    data = xp.full((3, 5, 32), 0xAA, dtype=np.uint8)
    scales = xp.full((3, 5, 4), 0xAA, dtype=np.uint8)
    got = fp4cache.quantize(x, 0.5, rule, out=(data, scales))
    assert got[0] is data and got[1] is scales
    np.testing.assert_array_equal(_host(data), _host(want_d))
    np.testing.assert_array_equal(_host(scales), _host(want_s))
    empty = (xp.empty((0, 32), np.uint8), xp.empty((0, 4), np.uint8))
    assert fp4cache.quantize(xp.zeros((0, 64), F32), out=empty)[0] is empty[0]


def test_quantize_out_float8_scales_view():
    x = np.random.default_rng(31).standard_normal((4, 32)).astype(F32)
    want_d, want_s = fp4cache.quantize(x)
    data = np.empty((4, 16), np.uint8)
    scales = np.empty((4, 2), ml_dtypes.float8_e4m3fn)
    got = fp4cache.quantize(x, out=(data, scales))
    assert got[1] is scales
    np.testing.assert_array_equal(scales.view(np.uint8), want_s)
    np.testing.assert_array_equal(data, want_d)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make_out, exc, match", [
    (lambda xp: xp.empty((2, 32), np.uint8), TypeError, "out must be a tuple"),
    (lambda xp: (xp.empty((2, 32), np.uint8),), TypeError, "out must be a tuple"),
    (lambda xp: (xp.empty((2, 16), np.uint8), xp.empty((2, 4), np.uint8)), ValueError,
     r"out\[0\] must have shape \(2, 32\)"),
    (lambda xp: (xp.empty((2, 32), np.uint8), xp.empty((2, 2), np.uint8)), ValueError,
     r"out\[1\] must have shape \(2, 4\)"),
    (lambda xp: (xp.empty((2, 32), np.int8), xp.empty((2, 4), np.uint8)), TypeError,
     r"out\[0\] must have dtype uint8"),
    (lambda xp: (xp.empty((2, 32), np.uint8), xp.empty((2, 4), np.float32)), TypeError,
     r"out\[1\] must have dtype uint8 or float8_e4m3fn"),
    (lambda xp: (xp.empty((2, 64), np.uint8)[:, ::2], xp.empty((2, 4), np.uint8)), ValueError,
     r"out\[0\] must be C-contiguous"),
    (lambda xp: (xp.empty((2, 32), np.uint8), xp.empty((4, 4), np.uint8)[::2]), ValueError,
     r"out\[1\] must be C-contiguous"),
])
def test_quantize_out_is_checked_before_writing(device, make_out, exc, match):
    xp = _xp(device)
    x = xp.ones((2, 64), F32)
    out = make_out(xp)
    parts = out if isinstance(out, tuple) else (out,)
    for p in parts:
        p[...] = 7
    with pytest.raises(exc, match=match):
        fp4cache.quantize(x, out=out)
    for p in parts:
        assert (_host(p) == 7).all()  # untouched


@pytest.mark.gpu
def test_quantize_out_on_the_other_backend_is_refused():
    import cupy

    x = cupy.ones((2, 64), F32)
    with pytest.raises(TypeError, match=r"out\[0\] must be a CuPy"):
        fp4cache.quantize(x, out=(np.empty((2, 32), np.uint8), np.empty((2, 4), np.uint8)))


def test_share_bytes_and_ceil_div():
    buf = np.zeros(64, dtype=np.uint8)
    assert share_bytes(buf[:32], buf[31:40])
    assert not share_bytes(buf[:32], buf[32:40])  # adjacent: no common byte
    assert share_bytes(buf[8:16], buf)
    assert not share_bytes(buf[8:8], buf)  # empty arrays share nothing
    assert not share_bytes(buf, np.zeros(64, dtype=np.uint8))
    assert [ceil_div(a, 4) for a in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
