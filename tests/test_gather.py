"""PagedKVCache.gather_dequant: decoded pages in every output dtype and into ``out=``,
repeated and empty block lists (the values against the reference model of
``nvfp4_ref.PagedModel``).

Under the ``gpu`` marker the GPU's decode equals the CPU's bit for bit: at extreme global
scales through the public method, and one layer down (``TestCupyBackend``) on pages of
random bytes (every E4M3 scale byte: NaN, negative, subnormal) and in a CUDA graph
replayed with new pages and ids.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import nvfp4_ref as ref
import pytest
from conftest import DEVICES
from helpers import (
    capture_stream,
    check_against_model,
    host,
    make_pair,
    poisoned_elements,
    rand_kv,
    same_values,
    xp_of,
)
from nvfp4_ref import assert_same_values

from fp4cache import PagedKVCache
from fp4cache import _cpu as nb
from fp4cache._abi import STAT, STAT_NAMES
from fp4cache.layout import PageGeometry

try:  # CuPy and its backend modules, for the GPU cases (which skip by their marker
    # where there is no GPU: collection needs no CuPy)
    import cupy as cp

    from fp4cache import _cuda as cb
except ImportError:
    cb = cp = None


BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = ("bfloat16", "float16", "float32")
F32 = np.float32


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty", [[], (), range(0), "int32", "int64"])
@pytest.mark.parametrize("validate", [None, True, False])
def test_empty_gather_is_an_empty_result(device, empty, validate):
    xp = xp_of(device)
    cache = PagedKVCache(4, 16, 2, 64, device=device)
    if isinstance(empty, str):
        empty = xp.zeros(0, dtype=empty)
    before = host(cache.buffer).copy()
    k, v = cache.gather_dequant(empty, validate=validate)
    assert k.shape == v.shape == (0, 2, 64) and k.dtype == BF16
    k, v = cache.gather_dequant(empty, dtype="float32", validate=validate)
    assert k.shape == (0, 2, 64) and k.dtype == F32
    out = (xp.empty((0, 2, 64), F32), xp.empty((0, 2, 64), F32))
    got = cache.gather_dequant(empty, out=out, validate=validate)
    assert got[0] is out[0] and got[1] is out[1]
    np.testing.assert_array_equal(host(cache.buffer), before)
    # an empty store is a no-op too
    cache.store([], xp.zeros((0, 2, 64), F32), xp.zeros((0, 2, 64), F32))
    np.testing.assert_array_equal(host(cache.buffer), before)
    # a list of floats is still refused: only the empty list means "no ids"
    with pytest.raises(TypeError, match="blocks must have dtype int32 or int64"):
        cache.gather_dequant([0.0, 1.0])


# -- on the GPU, against the CPU -----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("k_scale", [2.0**-130, 1.0, 2.0**117])
def test_gather_at_extreme_global_scales(k_scale):
    rng = np.random.default_rng(3)
    kw = dict(num_blocks=8, block_size=16, num_heads=2, head_dim=64, k_scale=k_scale,
              v_scale=k_scale)
    c_cpu = PagedKVCache(**kw, device="cpu")
    c_gpu = PagedKVCache(**kw, device="cuda")
    k = (rng.standard_normal((40, 2, 64)) * k_scale).astype(np.float32)
    v = (rng.standard_normal((40, 2, 64)) * k_scale).astype(np.float32)
    slots = rng.permutation(128)[:40]
    c_cpu.store(slots, k, v)
    c_gpu.store(cp.asarray(slots), cp.asarray(k), cp.asarray(v))
    blocks = np.array([3, 0, 7, 3])
    for dt in ("bfloat16", "float32"):
        rk, rv = c_cpu.gather_dequant(blocks, dtype=dt)
        gk, gv = c_gpu.gather_dequant(cp.asarray(blocks), dtype=dt)
        assert_same_values(gk, rk)
        assert_same_values(gv, rv)


NSTATS = len(STAT_NAMES)
VALUE_DTYPES = [BF16, np.dtype(np.float16), np.dtype(np.float32)]


@pytest.mark.gpu
class TestCupyBackend:
    """The CuPy backend against the NumPy backend on the same inputs, byte for
    byte (float outputs as unsigned-integer views, NaN positions compared apart:
    their payloads differ between CPU and GPU arithmetic)."""

    @pytest.mark.parametrize("dtype", VALUE_DTYPES, ids=str)
    @pytest.mark.parametrize("layout,swizzle", [("HND", True), ("NHD", False), ("NHD", True)])
    def test_gather_random_bytes_every_scale_byte(self, dtype, layout, swizzle):
        """Pages of random bytes: every E4M3 byte (NaN, negative, subnormal) decodes alike."""
        rng = np.random.default_rng(3)
        geom = PageGeometry(4, 16, 128, layout, swizzle)
        buf0 = rng.integers(0, 256, (9, 2, geom.side_bytes), dtype=np.uint8)
        blocks = np.array([3, 0, 8, 8, 1, -2, 9, 4], np.int64)
        shape = (len(blocks) * 16, 4, 128)
        rk, rv = np.empty(shape, dtype), np.empty(shape, dtype)
        st_ref = np.zeros(NSTATS, np.uint64)
        s = np.float32(0.37)
        nb.gather_dequant(buf0, blocks, rk, rv, geom=geom, k_s=s, v_s=np.float32(1.0),
                          stats=st_ref)
        gk, gv = poisoned_elements(shape, dtype), poisoned_elements(shape, dtype)
        st = cp.zeros(NSTATS, cp.uint64)
        cb.gather_dequant(cp.asarray(buf0), cp.asarray(blocks), gk, gv, geom=geom, k_s=s,
                          v_s=np.float32(1.0), stats=st)
        same_values(gk, rk, "k")
        same_values(gv, rv, "v")
        bad = STAT["bad_block_ids"]
        assert int(cp.asnumpy(st)[bad]) == 2 == int(st_ref[bad])

    @pytest.mark.parametrize("dtype", VALUE_DTYPES, ids=str)
    @pytest.mark.parametrize("D, H, layout", [(16, 3, "HND"), (64, 2, "NHD"), (128, 4, "HND"),
                                              (256, 1, "NHD")])
    def test_rotated_gather_random_bytes(self, dtype, D, H, layout):
        """rotation="hadamard": K is the transform of the float32 decoded row, rounded once
        (pages of random bytes, bad ids, the grid's tail)."""
        rng = np.random.default_rng(D + H)
        geom = PageGeometry(H, 16, D, layout, layout == "HND" and D >= 64)
        buf0 = rng.integers(0, 256, (9, 2, geom.side_bytes), dtype=np.uint8)
        blocks = np.array([3, 0, 8, 8, 1, -2, 9, 4], np.int32)
        shape = (len(blocks) * 16, H, D)
        rk, rv = np.empty(shape, dtype), np.empty(shape, dtype)
        st_ref = np.zeros(NSTATS, np.uint64)
        s = np.float32(0.37)
        nb.gather_dequant(buf0, blocks, rk, rv, geom=geom, k_s=s, v_s=np.float32(1.0),
                          stats=st_ref, rotate=True)
        gk, gv = poisoned_elements(shape, dtype), poisoned_elements(shape, dtype)
        st = cp.zeros(NSTATS, cp.uint64)
        cb.gather_dequant(cp.asarray(buf0), cp.asarray(blocks), gk, gv, geom=geom, k_s=s,
                          v_s=np.float32(1.0), stats=st, rotate=True)
        same_values(gk, rk, "k")
        same_values(gv, rv, "v")
        assert np.array_equal(cp.asnumpy(st), st_ref)

    def test_gather_dequant_cuda_graph_capture_and_replay(self):
        rng = np.random.default_rng(21)
        geom = PageGeometry(8, 16, 128, "HND", True)
        num_blocks = 32
        buf = cp.asarray(rng.integers(0, 256, (num_blocks, 2, geom.side_bytes), dtype=np.uint8))
        blocks = cp.asarray(np.array([5, 1, 31, 1, 40, 0], np.int32))
        shape = (6 * 16, 8, 128)
        ok, ov = cp.empty(shape, BF16), cp.empty(shape, BF16)
        st = cp.zeros(NSTATS, cp.uint64)
        ks, vs = np.float32(0.5), np.float32(2.0)
        stream = capture_stream()
        with stream:
            cb.gather_dequant(buf, blocks, ok, ov, geom=geom, k_s=ks, v_s=vs, stats=st)  # warm
            stream.synchronize()
            stream.begin_capture()
            cb.gather_dequant(buf, blocks, ok, ov, geom=geom, k_s=ks, v_s=vs, stats=st)
            graph = stream.end_capture()
        for rep in range(3):
            # new page contents and new block ids between replays
            host = rng.integers(0, 256, (num_blocks, 2, geom.side_bytes), dtype=np.uint8)
            ids = rng.integers(-1, num_blocks + 1, 6).astype(np.int32)
            buf[...] = cp.asarray(host)
            blocks[...] = cp.asarray(ids)
            ok.view(cp.uint16).fill(0)
            ov.view(cp.uint16).fill(0)
            cp.cuda.get_current_stream().synchronize()
            graph.launch(stream)
            stream.synchronize()
            rk, rv = np.empty(shape, BF16), np.empty(shape, BF16)
            st_ref = np.zeros(NSTATS, np.uint64)
            nb.gather_dequant(host, ids.astype(np.int64), rk, rv, geom=geom, k_s=ks, v_s=vs,
                              stats=st_ref)
            same_values(ok, rk, f"replay {rep} k")
            same_values(ov, rv, f"replay {rep} v")
        # the warm-up call already saw block id 40
        assert int(cp.asnumpy(st)[STAT["bad_block_ids"]]) >= 1
