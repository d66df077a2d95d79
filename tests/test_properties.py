"""Hypothesis properties over shapes, scales and values (CPU backend vs the reference)."""

from __future__ import annotations

import numpy as np
import nvfp4_ref as ref
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fp4cache
from fp4cache import PagedKVCache, longlive

F32 = np.float32
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                       HealthCheck.data_too_large])

rules = st.sampled_from(["static6", "4over6"])
dtypes = st.sampled_from(["bfloat16", "float16", "float32"])
# decode multipliers: any positive finite float32, subnormals included
scales = st.one_of(
    st.floats(min_value=2.0**-149, max_value=float(np.finfo(F32).max), width=32,
              allow_subnormal=True),
    st.sampled_from([1.0, 1 / 2688, 0.5, 2.0**-126, 2.0**-149, 1e30]),
)
any_f32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


@st.composite
def value_arrays(draw, shape, finite=False):
    """float32 arrays mixing 'nice' Gaussian data at one magnitude with wild elements."""
    n = int(np.prod(shape, dtype=np.int64))
    seed = draw(st.integers(0, 2**32 - 1))
    mag = draw(st.sampled_from([1.0, 1e-3, 1e3, 2.0**-130, 1e30, 6.0, 448.0 * 6]))
    x = (np.random.default_rng(seed).standard_normal(n) * mag).astype(F32)
    wild = draw(st.lists(st.tuples(st.integers(0, max(n - 1, 0)),
                                   finite_f32 if finite else any_f32), max_size=8))
    for i, val in wild:
        if n:
            x[i] = val
    return x.reshape(shape)


@settings(max_examples=300, **SETTINGS)
@given(data=st.data(), D=st.sampled_from([16, 32, 48, 64, 128]), rule=rules, dtype=dtypes,
       scale=scales, lead=st.lists(st.integers(0, 3), max_size=3))
def test_quantize_matches_reference(data, D, rule, dtype, scale, lead):
    x32 = data.draw(value_arrays(tuple(lead) + (D,)))
    with np.errstate(over="ignore"):
        x = x32.astype(ref.DTYPES[dtype])
    d, s = fp4cache.quantize(x, scale=scale, scale_rule=rule)
    rd, rs = ref.quantize(x, scale, rule)
    np.testing.assert_array_equal(s, rs)
    np.testing.assert_array_equal(d, rd)


@settings(max_examples=100, **SETTINGS)
@given(data=hnp.arrays(np.uint8, st.tuples(st.integers(0, 6), st.sampled_from([8, 32, 64]))),
       seed=st.integers(0, 2**32 - 1), scale=scales, dtype=dtypes)
def test_dequantize_any_bytes_matches_reference(data, seed, scale, dtype):
    sc = np.random.default_rng(seed).integers(0, 256, (data.shape[0], data.shape[1] // 8),
                                              dtype=np.uint8)
    got = fp4cache.dequantize(data, sc, scale=scale, dtype=dtype)
    ref.assert_same_values(got, ref.dequantize(data, sc, scale, dtype))


@settings(max_examples=100, **SETTINGS)
@given(data=st.data(), rows=st.integers(1, 40))
def test_static6_error_bound_and_4over6_never_worse(data, rows):
    """static6, s = 1, normal unsaturated scales: |x^ - x| <= 1.0625 * m/6 per element
    (half an E2M1 step at the top of the range); 4over6's float32 error sum per group is
    never above static6's (it picks min(err4, err6) and err6 is static6's error)."""
    x = data.draw(value_arrays((rows, 16), finite=True))
    m = np.abs(x).max(axis=1)
    keep = (m / 6 >= 2.0**-6) & (m / 6 <= 440)
    x, m = x[keep], m[keep]
    d6, s6 = fp4cache.quantize(x)
    y6 = fp4cache.dequantize(d6, s6, dtype="float32")
    bound = (m.astype(np.float64) / 6 * 1.0625 * (1 + 2.0**-20))[:, None]
    assert np.all(np.abs(y6.astype(np.float64) - x) <= bound)
    d4, s4 = fp4cache.quantize(x, scale_rule="4over6")
    y4 = fp4cache.dequantize(d4, s4, dtype="float32")

    def seq_err(y):
        e = np.zeros(len(x), F32)
        with np.errstate(over="ignore"):
            for i in range(16):
                di = y[:, i] - x[:, i]
                e = e + di * di
        return e

    assert np.all(seq_err(y4) <= seq_err(y6))


@st.composite
def cache_cases(draw):
    T = draw(st.sampled_from([4, 8, 12]))
    H = draw(st.integers(1, 3))
    D = draw(st.sampled_from([64, 128]))
    nb = draw(st.integers(1, 4))
    swz = draw(st.booleans())
    if not swz:
        D = draw(st.sampled_from([16, 48, 64]))
    n = draw(st.integers(0, 2 * nb * T))
    slots = draw(st.lists(st.integers(-1, nb * T - 1), min_size=n, max_size=n))  # -1: padding
    return dict(num_blocks=nb, block_size=T, num_heads=H, head_dim=D,
                layout=draw(st.sampled_from(["HND", "NHD"])), scale_rule=draw(rules),
                k_scale=draw(scales), v_scale=draw(scales), swizzle_v_scales=swz), slots


@pytest.mark.filterwarnings("ignore:PagedKVCache.store:UserWarning")  # badly scaled on purpose
@settings(max_examples=150, **SETTINGS)
@given(case=cache_cases(), data=st.data(), in_dtype=dtypes, out_dtype=dtypes)
def test_cache_matches_reference_model(case, data, in_dtype, out_dtype):
    kw, slots = case
    H, D = kw["num_heads"], kw["head_dim"]
    n = len(slots)
    with np.errstate(over="ignore"):
        k = data.draw(value_arrays((n, H, D))).astype(ref.DTYPES[in_dtype])
        v = data.draw(value_arrays((n, H, D))).astype(ref.DTYPES[in_dtype])
    cache = PagedKVCache(**kw, device="cpu")
    model = ref.PagedModel(**kw)  # encodes with the reference, not the library
    slot_arr = np.array(slots, dtype=data.draw(st.sampled_from([np.int32, np.int64])))
    cache.store(slot_arr, k, v, unique_slots=False)
    model.store(slot_arr, k, v)
    np.testing.assert_array_equal(cache.buffer, model.buffer())
    blocks = data.draw(st.lists(st.integers(0, kw["num_blocks"] - 1), max_size=6))
    gk, gv = cache.gather_dequant(np.array(blocks, np.int64), dtype=out_dtype)
    wk, wv = model.gather(blocks, out_dtype)
    ref.assert_same_values(gk, wk)
    ref.assert_same_values(gv, wv)
    # non-finite groups of the tokens that were written (last occurrence of each slot)
    last = {s: i for i, s in enumerate(slots) if s >= 0}
    idx = np.array(sorted(last.values()), dtype=np.int64)
    counts = tuple(int((~np.isfinite(x[idx].astype(F32).reshape(-1, 16)).all(axis=1)).sum())
                   for x in (k, v))
    assert cache.nonfinite_groups == counts


@settings(max_examples=100, **SETTINGS)
@given(data=st.data(), Tb=st.integers(1, 20), H=st.integers(1, 4),
       D=st.sampled_from([64, 128, 256]), rule=rules, dtype=dtypes)
def test_longlive_block_matches_reference(data, Tb, H, D, rule, dtype):
    from nvfp4_ref import longlive_dequantize as ref_dequantize
    from nvfp4_ref import longlive_quantize_block as ref_quantize_block

    with np.errstate(over="ignore"):
        x = data.draw(value_arrays((Tb, H, D))).astype(ref.DTYPES[dtype])
    vals, sf, am = longlive.quantize_block(x, scale_rule=rule)
    rv, rsf, ram = ref_quantize_block(x, rule)
    np.testing.assert_array_equal(vals, rv)
    np.testing.assert_array_equal(sf, rsf)
    ref.assert_same_values(am, ram)
    e4m3_max = 256.0 if rule == "4over6" else 448.0
    got = longlive.dequantize([vals], [sf], [am], H, Tb, dtype=dtype, e4m3_max=e4m3_max)
    ref.assert_same_values(got, ref_dequantize([vals], [sf], [am], H, Tb, dtype,
                                               e4m3_max=e4m3_max))
