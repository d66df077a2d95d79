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
    """Independent count: saturated iff fl(g * fl(m * c)) > 448 for the candidate the
    store chose (read back from its scale byte); underflow iff m > 0 and the stored byte
    is below 0x08 (2^-6, E4M3's smallest normal)."""
    g = np.float32(1) / np.float32(scale)
    m = np.abs(x.astype(F32)).reshape(-1, 16).max(axis=1)
    sf = scale_bytes.reshape(-1)
    arg6 = g * (m * np.float32(1 / 6))
    if rule == "static6":
        sat = arg6 > 448
    else:
        arg4 = g * (m * np.float32(0.25))
        e4 = ml_dtypes.float8_e4m3fn
        b4 = np.minimum(arg4, 448).astype(e4).view(np.uint8)
        b6 = np.minimum(arg6, 448).astype(e4).view(np.uint8)
        chose4 = (sf == b4) & (b4 != b6)
        sat = np.where(chose4, arg4 > 448, arg6 > 448)
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
