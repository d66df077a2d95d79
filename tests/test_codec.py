"""fp4cache.quantize / dequantize (the flat codec, spec section 2) against the
independent reference of ``nvfp4_ref``, and ``quantize(out=)``.

Under the ``gpu`` marker the same calls on CuPy arrays equal the CPU's byte for byte: the
public functions, every (code, scale byte) pair at extreme scales through the decoder's
fast and plain paths, and one layer down (``TestCupyBackend``) the CuPy backend's flat
kernels against the NumPy backend's, unaligned inputs and outputs included.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import nvfp4_ref as ref
import pytest
from conftest import DEVICES
from helpers import host, make_values, poisoned_elements, same_bytes, same_values, scales_for, xp_of
from nvfp4_ref import assert_same_values, bits

import fp4cache
from fp4cache import _cpu as nb
from fp4cache import codec

try:  # CuPy and its backend modules, for the GPU cases (which skip by their marker
    # where there is no GPU: collection needs no CuPy)
    import cupy as cp

    from fp4cache import _cuda as cb
except ImportError:
    cb = cp = None


BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.float32
RULES = ("static6", "4over6")
DTYPES = ("bfloat16", "float16", "float32")
TINY = F32(np.uint32(1).view(F32))  # smallest float32 subnormal


def assert_matches_reference(x, scale, rule):
    data, scales = fp4cache.quantize(x, scale=scale, scale_rule=rule)
    rdata, rscales = ref.quantize(x, scale, rule)
    assert data.dtype == np.uint8 and scales.dtype == np.uint8
    assert data.shape == x.shape[:-1] + (x.shape[-1] // 2,)
    assert scales.shape == x.shape[:-1] + (x.shape[-1] // 16,)
    np.testing.assert_array_equal(scales, rscales)
    np.testing.assert_array_equal(data, rdata)
    return data, scales


# -- adversarial groups --------------------------------------------------------------------
def adversarial_groups() -> np.ndarray:
    """float32 groups [N, 16] chosen to hit every branch of spec section 2."""
    rng = np.random.default_rng(11)
    g = []
    base = rng.standard_normal(16).astype(F32)
    g += [np.zeros(16, F32), np.full(16, -0.0, F32), np.where(np.arange(16) % 2, -0.0, 0.0)]
    for c in (6.0, 4.0, 1.0, 3.0, 0.5, 448 * 6, 448 * 4, 1e-3, 2.0**-9, 7.0, -5.0):
        g.append(np.full(16, c, F32))  # all equal: both candidates exact -> tie keeps 6
    for c in (1.0, 100.0, 1e4, 1e-4):
        x = np.full(16, 1e-3 * c, F32)
        x[5] = c  # single outlier
        g += [x, -x]
    # values on E2M1 ties after scaling by the 6- and 4-candidates
    g.append(np.array([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -1.25, -1.75,
                       -2.5, -3.5, -5, 0], F32))
    g.append(np.array([4, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -1.25, -1.75,
                       -2.5, -3.5, -5, -0.0], F32) * F32(1.5))
    g.append(np.array([4, 6, 5, 3, 2, 1, 0, 0, -1, -2, -3, -4, -5, -6, 0.1, -0.1], F32))
    # negative values that round to zero: code 8 must survive
    x = np.full(16, -0.01, F32)
    x[0] = 6.0
    g.append(x)
    # subnormal and tiny magnitudes, huge magnitudes
    g.append(np.array([TINY * k for k in range(-8, 8)], F32))
    g.append(np.full(16, F32(1e-38), F32))
    g.append((base * F32(1e-40)).astype(F32))
    g.append((base * F32(1e38)).astype(F32))
    g.append(np.full(16, np.finfo(F32).max, F32))
    g.append(np.array([np.finfo(F32).max, -np.finfo(F32).max] * 8, F32))
    # groups where the 4-candidate's error is lower / higher
    g.append(np.array([4.0] + [2.0] * 15, F32))
    g.append(np.array([6.0] + [3.0] * 15, F32))
    g.append(np.linspace(-1, 1, 16).astype(F32))
    g.append(np.linspace(0, 6, 16).astype(F32))
    g.append(np.geomspace(1e-3, 1e3, 16).astype(F32))
    # random at many magnitudes
    for e in range(-30, 31, 3):
        g.append((rng.standard_normal(16) * 2.0**e).astype(F32))
        g.append((rng.uniform(-1, 1, 16) * 2.0**e).astype(F32))
    return np.stack(g).astype(F32)


def nonfinite_groups() -> np.ndarray:
    g = []
    for bad in (np.nan, np.inf, -np.inf):
        for pos in (0, 7, 15):
            x = np.linspace(-3, 3, 16).astype(F32)
            x[pos] = bad
            g.append(x)
    g.append(np.full(16, np.nan, F32))
    g.append(np.full(16, np.inf, F32))
    return np.stack(g)


SCALES = [1.0, 0.5, 3.0, 1 / 2688, 1e-3, 7.25e-5, 1e4, 1e-30, 1e-38, float(TINY), 1e30, 3e38]


# -- the reference against itself ----------------------------------------------------------
@pytest.mark.parametrize("rule", RULES)
def test_reference_scalar_equals_vectorized(rule):
    groups = adversarial_groups()
    for scale in (1.0, 1e-3, 1e-38, float(TINY), 3e38):
        g = ref.encode_multiplier(scale)
        codes, sf = ref.encode_groups(groups, scale, g, rule)
        for i, x in enumerate(groups):
            c, b = ref.encode_group_scalar(x, scale, g, rule)
            assert b == sf[i], (scale, i)
            assert list(codes[i]) == c, (scale, i)


# -- quantize vs reference -----------------------------------------------------------------
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("scale", SCALES)
def test_quantize_adversarial_groups(rule, scale):
    x = adversarial_groups()  # rows of 16: D = 16
    assert_matches_reference(x, scale, rule)
    # the same groups, 8 per row (D = 128): grouping along the last axis only
    pad = (-len(x)) % 8
    wide = np.concatenate([x, x[:pad]]).reshape(-1, 128)
    assert_matches_reference(wide, scale, rule)


@pytest.mark.parametrize("rule", RULES)
def test_nonfinite_groups_are_nan_scale_zero_data(rule):
    bad = nonfinite_groups()
    good = adversarial_groups()[:len(bad)]
    x = np.stack([good, bad], axis=1).reshape(len(bad), 32)  # finite group then bad group
    data, scales = assert_matches_reference(x, 1.0, rule)
    np.testing.assert_array_equal(scales[:, 1], 0x7F)
    np.testing.assert_array_equal(data[:, 8:], 0)
    assert np.all(scales[:, 0] != 0x7F)
    out = fp4cache.dequantize(data, scales, dtype="float32")
    assert np.isnan(out[:, 16:]).all()
    assert np.isfinite(out[:, :16]).all()


def test_known_bytes():
    # all-6 group: s = 1 -> sf = e4m3(fl(6 * fl(1/6))) = 1.0 (0x38), codes 7 -> 0x77
    data, scales = fp4cache.quantize(np.full((1, 16), 6.0, F32))
    assert scales.tolist() == [[0x38]] and data.tolist() == [[0x77] * 8]
    # 4over6 ties keep 6: the 4-candidate (sf = 1.5, codes 6) is exact too
    data, scales = fp4cache.quantize(np.full((1, 16), 6.0, F32), scale_rule="4over6")
    assert scales.tolist() == [[0x38]] and data.tolist() == [[0x77] * 8]
    # [4, 2, 2, ...]: 6-candidate sf = 0.6875 -> 4 -> 4/0.6875 = 5.8 -> 6 (err), while the
    # 4-candidate sf = 1.0 represents 4 and 2 exactly -> 4over6 picks it
    x = np.array([[4.0] + [2.0] * 15], F32)
    data, scales = fp4cache.quantize(x, scale_rule="4over6")
    assert scales.tolist() == [[0x38]]
    assert data.tolist() == [[0x46] + [0x44] * 7]
    data6, scales6 = fp4cache.quantize(x, scale_rule="static6")
    assert scales6.tolist() != scales.tolist()
    # zeros, and negative zeros keep their sign bit (code 8)
    d, s = fp4cache.quantize(np.array([[0.0] * 8 + [-0.0] * 8], F32))
    assert s.tolist() == [[0]] and d.tolist() == [[0] * 4 + [0x88] * 4]
    # NaN group
    d, s = fp4cache.quantize(np.array([[1.0] * 15 + [np.nan]], F32))
    assert s.tolist() == [[0x7F]] and d.tolist() == [[0] * 8]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rule", RULES)
def test_quantize_random_dtypes_and_shapes(dtype, rule):
    rng = np.random.default_rng(5)
    dt = ref.DTYPES[dtype]
    for shape in [(16,), (3, 32), (2, 3, 64), (5, 128), (2, 2, 2, 256), (0, 64)]:
        x = (rng.standard_normal(shape) * rng.uniform(0.01, 100)).astype(dt)
        for scale in (1.0, 0.0123, 20.0):
            assert_matches_reference(x, scale, rule)


@pytest.mark.parametrize("rule", RULES)
def test_quantize_non_contiguous_input(rule):
    rng = np.random.default_rng(6)
    big = rng.standard_normal((8, 6, 256)).astype(ml_dtypes.bfloat16)
    for view in (big[::2], big[:, ::3], big.transpose(1, 0, 2), big[..., ::2][..., :64],
                 big[:, :, 64:192]):
        want = ref.quantize(np.ascontiguousarray(view), 0.25, rule)
        got = fp4cache.quantize(view, scale=0.25, scale_rule=rule)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_quantize_does_not_modify_input():
    x = np.linspace(-10, 10, 256, dtype=F32).reshape(2, 128)
    x[0, 3] = np.nan
    before = x.copy()
    fp4cache.quantize(x, scale_rule="4over6")
    np.testing.assert_array_equal(bits(x), bits(before))


# -- 4over6 picks the better candidate -----------------------------------------------------
def candidate_bytes(x16, scale, c):
    """(codes, sf) of one candidate, straight from the spec (no selection)."""
    s, g = F32(scale), ref.encode_multiplier(scale)
    m = np.max(np.abs(x16))
    sf = int(ref.e4m3_encode(F32(g * F32(m * c))))
    f = F32(ref.e4m3_value(sf))
    os_ = F32(0) if f == 0 else min(F32(F32(1) / F32(f * s)), ref.FLT_MAX)
    return [ref.e2m1_encode_scalar(F32(v * os_)) for v in x16], sf


def seq_err(decoded, x16) -> np.float32:
    e = F32(0)
    for a, b in zip(decoded, x16):
        d = F32(F32(a) - F32(b))
        e = F32(e + F32(d * d))
    return e


@pytest.mark.parametrize("scale", [1.0, 1e-3, 17.0])
def test_4over6_choice_is_brute_force_minimum(scale):
    rng = np.random.default_rng(7)
    groups = np.concatenate([adversarial_groups(),
                             rng.standard_normal((300, 16)).astype(F32),
                             rng.laplace(size=(300, 16)).astype(F32) * 30])
    groups = groups[np.all(np.abs(groups) < 1e30, axis=1)]  # keep the error sums finite
    data, scales = fp4cache.quantize(groups, scale=scale, scale_rule="4over6")
    dec = fp4cache.dequantize(data, scales, scale=scale, dtype="float32")
    picked4 = ties = 0
    with np.errstate(all="ignore"):
        for i, x in enumerate(groups):
            errs = {}
            for E, c in ((6, ref.C6), (4, ref.C4)):
                codes, sf = candidate_bytes(x, scale, c)
                vals = ref.decode_values(ref.pack(np.array(codes, np.uint8)),
                                         np.array([sf], np.uint8), scale)
                errs[E] = (seq_err(vals, x), sf, ref.pack(np.array(codes, np.uint8)))
            got_err = seq_err(dec[i], x)
            want = 4 if errs[4][0] < errs[6][0] else 6
            assert scales[i, 0] == errs[want][1], i
            np.testing.assert_array_equal(data[i], errs[want][2])
            assert got_err == min(errs[4][0], errs[6][0])
            picked4 += want == 4
            ties += errs[4][0] == errs[6][0]
    # both branches and ties are exercised
    assert 0 < picked4 < len(groups) and ties > 0


def test_4over6_beats_static6_on_gaussian_data():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4096, 128)).astype(F32)
    results = {}
    for label, scale in (("scale=1", 1.0), ("calibrated", float(np.abs(x).max()) / (6 * 448))):
        mse = {}
        for rule in RULES:
            d, s = fp4cache.quantize(x, scale=scale, scale_rule=rule)
            xh = fp4cache.dequantize(d, s, scale=scale, dtype="float32")
            mse[rule] = float(np.mean((xh.astype(np.float64) - x) ** 2))
        results[label] = mse
        print(f"Gaussian N(0,1) 4096x128, {label}: static6 MSE = {mse['static6']:.6g}, "
              f"4over6 MSE = {mse['4over6']:.6g}, ratio = {mse['4over6'] / mse['static6']:.4f}")
        assert mse["4over6"] < mse["static6"]
        # 4over6 picks per group the smaller error, so it can never be worse per group
        assert mse["static6"] < 0.02  # sane magnitude for NVFP4 on unit Gaussians


# -- dequantize ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_exhaustive_bytes(dtype):
    """Every data byte against every scale byte (NaN scales included)."""
    data = np.tile(np.arange(256, dtype=np.uint8), (256, 1))  # [256, 256] -> D = 512
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 32, axis=1)
    for s in (1.0, 0.37, 1e-30, float(TINY), 3e38):
        got = fp4cache.dequantize(data, scales, scale=s, dtype=dtype)
        assert got.shape == (256, 512)
        assert_same_values(got, ref.dequantize(data, scales, s, dtype))


def test_dequantize_default_dtype_out_and_fp8_scales():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 4, 64)).astype(F32)
    d, s = fp4cache.quantize(x, scale=0.5)
    y = fp4cache.dequantize(d, s, scale=0.5)
    assert y.dtype == np.dtype(ml_dtypes.bfloat16) and y.shape == x.shape
    assert_same_values(y, ref.dequantize(d, s, 0.5, "bfloat16"))
    for dt in DTYPES:
        out = np.full(x.shape, 7, dtype=ref.DTYPES[dt])
        r = fp4cache.dequantize(d, s, 0.5, out=out)
        assert r is out or np.shares_memory(r, out)
        assert_same_values(out, ref.dequantize(d, s, 0.5, dt))
    y8 = fp4cache.dequantize(d, s.view(ml_dtypes.float8_e4m3fn), 0.5, dtype="float32")
    assert_same_values(y8, ref.dequantize(d, s, 0.5, "float32"))


def test_dequantize_non_contiguous_inputs():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((6, 5, 128)).astype(F32)
    d, s = fp4cache.quantize(x)
    got = fp4cache.dequantize(d[::2].transpose(1, 0, 2), s[::2].transpose(1, 0, 2),
                              dtype="float32")
    want = ref.dequantize(d[::2].transpose(1, 0, 2), s[::2].transpose(1, 0, 2), 1.0, "float32")
    assert_same_values(got, want)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_equals_reference_decode(rule, dtype):
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((64, 128)) * 3).astype(ref.DTYPES[dtype])
    for scale in (1.0, 1 / 2688, 2.5):
        d, s = fp4cache.quantize(x, scale, rule)
        got = fp4cache.dequantize(d, s, scale, dtype=dtype)
        want = ref.dequantize(*ref.quantize(x, scale, rule), scale, dtype)
        assert_same_values(got, want)


def test_static6_requantize_is_idempotent():
    """With s = 1 and normal E4M3 scales, decoding and re-encoding gives the same bytes."""
    rng = np.random.default_rng(13)
    x = (rng.standard_normal((256, 64)) * np.geomspace(0.1, 400, 256)[:, None]).astype(F32)
    d, s = fp4cache.quantize(x)
    assert np.all((s & 0x78) != 0) and np.all(s != 0x7E)  # normal, unsaturated scales
    xh = fp4cache.dequantize(d, s, dtype="float32")
    d2, s2 = fp4cache.quantize(xh)
    np.testing.assert_array_equal(s2, s)
    np.testing.assert_array_equal(d2, d)


def test_tiny_scale_clamps_keep_zero_groups_zero():
    """g = min(1/scale, FLT_MAX) and os clamps: zero groups stay zero, no NaN appears."""
    x = np.zeros((4, 32), F32)
    x[1, :16] = 1.0
    x[2, 16:] = -1e-30
    x[3] = 3e38
    for scale in (float(TINY), 1e-44, 1e-40):
        d, s = fp4cache.quantize(x, scale=scale, scale_rule="4over6")
        assert s[0].tolist() == [0, 0] and d[0].tolist() == [0] * 16
        assert s[1, 1] == 0 and s[1, 0] == 0x7E  # g*m*c6 overflows -> saturates to 448
        assert 0x7F not in s and 0xFF not in s
        y = fp4cache.dequantize(d, s, scale=scale, dtype="float32")
        assert not np.isnan(y).any()
        assert_matches_reference(x, scale, "4over6")
        assert_matches_reference(x, scale, "static6")


# -- quantize(out=) ------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", ["static6", "4over6"])
def test_quantize_out_writes_the_same_bytes(device, rule):
    xp = xp_of(device)
    rng = np.random.default_rng(30)
    x = xp.asarray((rng.standard_normal((3, 5, 64)) * 4).astype(BF16))
    want_d, want_s = fp4cache.quantize(x, 0.5, rule)
    data = xp.full((3, 5, 32), 0xAA, dtype=np.uint8)
    scales = xp.full((3, 5, 4), 0xAA, dtype=np.uint8)
    got = fp4cache.quantize(x, 0.5, rule, out=(data, scales))
    assert got[0] is data and got[1] is scales
    np.testing.assert_array_equal(host(data), host(want_d))
    np.testing.assert_array_equal(host(scales), host(want_s))
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
    xp = xp_of(device)
    x = xp.ones((2, 64), F32)
    out = make_out(xp)
    parts = out if isinstance(out, tuple) else (out,)
    for p in parts:
        p[...] = 7
    with pytest.raises(exc, match=match):
        fp4cache.quantize(x, out=out)
    for p in parts:
        assert (host(p) == 7).all()  # untouched


@pytest.mark.gpu
def test_quantize_out_on_the_other_backend_is_refused():
    import cupy

    x = cupy.ones((2, 64), F32)
    with pytest.raises(TypeError, match=r"out\[0\] must be a CuPy"):
        fp4cache.quantize(x, out=(np.empty((2, 32), np.uint8), np.empty((2, 4), np.uint8)))


# -- on the GPU, against the CPU -----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["static6", "4over6"])
@pytest.mark.parametrize("dtype", [BF16, np.float16, np.float32], ids=str)
def test_codec_cuda_equals_cpu(rule, dtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 33, 64)) * 7).astype(dtype)
    d_c, s_c = codec.quantize(x, 0.25, rule)
    d_g, s_g = codec.quantize(cp.asarray(x), 0.25, rule)
    assert_same_values(d_g, d_c)
    assert_same_values(s_g, s_c)
    for dt in ("bfloat16", "float16", "float32"):
        assert_same_values(codec.dequantize(d_g, s_g, 0.25, dt),
                           codec.dequantize(d_c, s_c, 0.25, dt))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("scale", [1e-45, 3e-39, 1 / 448, 1.0, 2.0**115, 2.0**116, 1e37, 3e38])
def test_decode_every_code_and_scale_byte_at_extreme_scales(dtype, scale):
    """Every (code, scale byte) pair through the flat decoder, fast and plain paths."""
    # row r: scale byte r // 4 for all 8 groups; its 64 data bytes are (r % 4)*64 + 0..63,
    # so every (code byte, scale byte) pair occurs
    r = np.arange(1024)
    data = ((r[:, None] % 4) * 64 + np.arange(64)[None, :]).astype(np.uint8)
    scales = np.repeat((r // 4).astype(np.uint8)[:, None], 8, axis=1)
    ref = codec.dequantize(data, scales, scale, dtype=dtype)
    got = codec.dequantize(cp.asarray(data), cp.asarray(scales), scale, dtype=dtype)
    assert_same_values(got, ref)


VALUE_DTYPES = [BF16, np.dtype(np.float16), np.dtype(np.float32)]


@pytest.mark.gpu
class TestCupyBackend:
    """The CuPy backend against the NumPy backend on the same inputs, byte for
    byte (float outputs as unsigned-integer views, NaN positions compared apart:
    their payloads differ between CPU and GPU arithmetic)."""

    @pytest.mark.parametrize("dtype", VALUE_DTYPES, ids=str)
    @pytest.mark.parametrize("rule", RULES)
    @pytest.mark.parametrize("scale", ["one", "calib", "tiny", "huge"])
    @pytest.mark.parametrize("D", [16, 48, 128])
    def test_flat_quantize_dequantize(self, dtype, rule, scale, D):
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
        for out_dt in VALUE_DTYPES:
            ref = np.empty((n, D), out_dt)
            nb.dequantize(data_r, sc_r, s, ref)
            out = poisoned_elements((n, D), out_dt)
            cb.dequantize(data, sc, s, out)
            same_values(out, ref, f"dequantize {out_dt}")

    def test_flat_unaligned_and_random_bytes(self):
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
