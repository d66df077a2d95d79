"""Counters of badly scaled groups: block scales that saturated at E4M3's 448 (the global
scale is too small for the data) and nonzero groups whose block scale is zero or
subnormal (too large), per K and V, on both backends."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fp4cache import PagedKVCache, calibrate_scale

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.float32
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
    counted; above 464 it is.  The issue's case: the group holding the calibration
    maximum wants fl(g * fl(amax/6)) = 448.00003."""
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
    """The issue's false alarm: with calibrate_scale's scale, the group holding amax
    wants 448.00003 in float32 (static6), which still encodes as 448."""
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
