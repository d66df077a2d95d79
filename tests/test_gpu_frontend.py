"""Public API with device="cuda" equals device="cpu" byte for byte.

PagedKVCache (store / gather_dequant, stats, out=), fp4cache.codec and
fp4cache.longlive (quantize_block, dequantize, dequantize_pool) on CuPy arrays
against the same calls on NumPy arrays.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from nvfp4_ref import assert_same_values

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

from fp4cache import PagedKVCache, codec, longlive  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


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
