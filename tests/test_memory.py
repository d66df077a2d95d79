"""Device memory of a cache under a server's call pattern, and CUDA graphs across it.

* 2,000 steps of random shapes (a store of 1-4,095 tokens, a decode attention of 1-64
  sequences over block tables of 1-256 columns, a gather of 1-300 pages) on a cache of
  8,192 pages x 16 tokens x 8 heads x 128 with workspace hints: the CuPy pool's used
  bytes and ``cache.nbytes`` stay flat, and sampled steps equal the CPU backend (store
  and gather byte for byte; attention within the tolerance of test_attention_decode.py:
  relative 2-norm error per row <= 1e-2 for bf16 outputs).
* The same pattern without hints: the workspace grows to the largest call and stays
  within twice its current buffer (outgrown buffers kept for graphs).
* A decode step captured in a CUDA graph, then 500 calls of other shapes (the workspace
  grows, the captured plan is evicted), then the graph replayed: the same bits.
* A call that needs more workspace while the stream is capturing raises RuntimeError
  naming the hints; with hints, a first call inside a capture allocates nothing.

Run under ``compute-sanitizer --tool memcheck`` too (``bash bench/device_check.sh tests``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import capture_stream

from fp4cache import PagedKVCache

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

from fp4cache._cuda import decode as ca  # noqa: E402  (imports CuPy)

BF16 = np.dtype(ml_dtypes.bfloat16)
NB, T, H, D, HQ = 8192, 16, 8, 128, 32
HINTS = dict(max_batch_size=64, max_seq_len=256 * T, num_query_heads=HQ)
SCALES = dict(k_scale=4.5 / (6 * 448), v_scale=4.5 / (6 * 448))
TOL = 1e-2  # bf16 outputs: test_attention_decode.py's bound on the row's relative error
MiB = 2**20


def randn_bf16(rs, shape):
    """Unit-normal bf16 values made on the device (float32 truncated by bit ops)."""
    x = rs.standard_normal(shape, dtype=np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(BF16)


def draw(rng, rs):
    """One step's arguments: a server's call pattern (as ``bench/soak_bench.py``)."""
    n = int(rng.integers(1, 4096))
    B = int(rng.integers(1, 65))
    W = int(rng.integers(1, 257))
    m = int(rng.integers(1, 301))
    return dict(
        slots=cp.asarray(rng.choice(NB * T, size=n, replace=False).astype(np.int64)),
        k=randn_bf16(rs, (n, H, D)), v=randn_bf16(rs, (n, H, D)),
        q=randn_bf16(rs, (B, HQ, D)),
        tables=cp.asarray(rng.integers(0, NB, (B, W)).astype(np.int32)),
        lens=cp.asarray(rng.integers(0, W * T + 1, B).astype(np.int32)),
        blocks=cp.asarray(rng.integers(0, NB, m).astype(np.int32)))


def step(cache, a):
    cache.store(a["slots"], a["k"], a["v"])
    out = cache.decode_attention(a["q"], a["tables"], a["lens"])
    k, v = cache.gather_dequant(a["blocks"])
    return out, k, v


def rel_err(got, ref):
    g = cp.asnumpy(got).astype(np.float64)
    r = np.asarray(ref).astype(np.float64)
    num = np.linalg.norm(g - r, axis=-1)
    den = np.linalg.norm(r, axis=-1)
    return float(np.where(den > 0, num / np.maximum(den, 1e-300), num).max())


def checked_step(cache, cpu, a):
    """One step on the GPU and, from the same pages, on the CPU backend."""
    cpu.buffer[...] = cp.asnumpy(cache.buffer)
    cpu.store(cp.asnumpy(a["slots"]), cp.asnumpy(a["k"]), cp.asnumpy(a["v"]))
    out, k, v = step(cache, a)
    assert np.array_equal(cp.asnumpy(cache.buffer), cpu.buffer), "store"
    ref = cpu.decode_attention(cp.asnumpy(a["q"]), cp.asnumpy(a["tables"]),
                               cp.asnumpy(a["lens"]))
    assert rel_err(out, ref) <= TOL, "decode_attention"
    rk, rv = cpu.gather_dequant(cp.asnumpy(a["blocks"]))
    assert np.array_equal(cp.asnumpy(k).view(np.uint16), rk.view(np.uint16)), "gather k"
    assert np.array_equal(cp.asnumpy(v).view(np.uint16), rv.view(np.uint16)), "gather v"


def test_random_shapes_keep_memory_flat_and_results_right():
    rng = np.random.default_rng(26)
    rs = cp.random.RandomState(26)
    cache = PagedKVCache(NB, T, H, D, device="cuda", **SCALES, **HINTS)
    cpu = PagedKVCache(NB, T, H, D, device="cpu", **SCALES)
    bound = ca.workspace_bound(cache.geometry, **HINTS)
    ws = cache.pool.workspace
    assert (ws.scratch_bytes, ws.tickets) == bound  # reserved at construction
    nbytes0 = cache.nbytes
    assert nbytes0 == cache.buffer.nbytes + cache.workspace_nbytes + sum(
        a.nbytes for a in (cache.pool.stats, cache.pool.os_tab, cache.pool.claim))
    assert f"workspace {cache.workspace_nbytes / MiB:.1f} MiB" in repr(cache)
    pool = cp.get_default_memory_pool()
    steps, warm, sampled = 2000, 200, {0, 3, 401, 999, 1500, 1999}
    used = []
    for i in range(steps):
        a = draw(rng, rs)
        if i in sampled:
            checked_step(cache, cpu, a)
        else:
            step(cache, a)
        del a
        if i >= warm:
            used.append(pool.used_bytes())
        assert cache.nbytes == nbytes0, f"step {i}: cache.nbytes grew"
        assert len(cache.pool.plans) <= cache.pool.plans.maxsize
    cp.cuda.Device().synchronize()
    assert max(used) - min(used) <= MiB, f"pool grew by {(max(used) - min(used)) / MiB} MiB"
    assert (ws.scratch_bytes, ws.tickets) == bound and not ws._retired
    cache.check()


def test_without_hints_the_workspace_grows_to_the_largest_call_only():
    rng = np.random.default_rng(27)
    rs = cp.random.RandomState(27)
    cache = PagedKVCache(NB, T, H, D, device="cuda", **SCALES)
    ws = cache.pool.workspace
    assert cache.workspace_nbytes == 0
    bound_bytes, bound_tickets = ca.workspace_bound(cache.geometry, **HINTS)
    for _ in range(300):
        a = draw(rng, rs)
        step(cache, a)
        del a
        # the current buffers at most twice the largest need so far (which is within
        # the hints' bound), outgrown ones at most as much again
        assert ws.scratch_bytes <= 2 * bound_bytes and ws.tickets <= 2 * bound_tickets
        assert cache.workspace_nbytes <= 2 * (ws.scratch_bytes + 4 * ws.tickets)
    assert 0 < ws.scratch_bytes and cache.nbytes == cache.pool.nbytes
    cache.release_workspace()
    assert cache.workspace_nbytes == 0 and len(cache.pool.plans) == 0
    step(cache, draw(rng, rs))  # works again after a release: takes a new workspace


def _decode_inputs(rng, cache, B, W, lens):
    tab = cp.asarray(rng.integers(0, cache.num_blocks, (B, W)).astype(np.int32))
    q = cp.asarray(rng.standard_normal((B, HQ, D)).astype(BF16))
    return q, tab, cp.asarray(np.asarray(lens, np.int32))


def _fill(cache, rng, n):
    slots = cp.arange(n, dtype=cp.int64)
    k = cp.asarray(rng.standard_normal((n, H, D)).astype(BF16))
    v = cp.asarray(rng.standard_normal((n, H, D)).astype(BF16))
    cache.store(slots, k, v)


def test_captured_decode_step_survives_other_shapes_growth_and_eviction():
    rng = np.random.default_rng(28)
    nb = 1024
    cache = PagedKVCache(nb, T, H, D, device="cuda", **SCALES)  # no hints: grows
    cpu = PagedKVCache(nb, T, H, D, device="cpu", **SCALES)
    _fill(cache, rng, nb * T)
    cpu.buffer[...] = cp.asnumpy(cache.buffer)
    q, tab, lens = _decode_inputs(rng, cache, 1, 64, [1000])  # 1024 tokens: split-KV
    out = cp.empty(q.shape, BF16)
    lse = cp.empty(q.shape[:2], np.float32)
    stream = capture_stream()
    with stream:
        cache.decode_attention(q, tab, lens, out=out, lse_out=lse, return_lse=True)  # warm
        (plan,) = ca.attention_plans(cache.pool)
        assert plan.grid[0] > 1  # the captured step uses the workspace
        ws_before = cache.workspace_nbytes
        stream.begin_capture()
        cache.decode_attention(q, tab, lens, out=out, lse_out=lse, return_lse=True)
        graph = stream.end_capture()
        out.fill(0)
        graph.launch(stream)
        stream.synchronize()
        first = (cp.asnumpy(out).view(np.uint16), cp.asnumpy(lse))
        ref = cpu.decode_attention(cp.asnumpy(q), cp.asnumpy(tab), cp.asnumpy(lens))
        assert rel_err(out, ref) <= TOL
        # 500 calls of other shapes: more than the plan cache holds (the captured plan is
        # evicted), and larger ones (the workspace grows; the old buffer must stay)
        for i in range(500):
            B, W = (8, 512) if i % 50 == 0 else (int(rng.integers(1, 65)),
                                                 int(rng.integers(1, 513)))
            q2, tab2, lens2 = _decode_inputs(rng, cache, B, W, rng.integers(0, W * T + 1, B))
            cache.decode_attention(q2, tab2, lens2)
        assert cache.workspace_nbytes > ws_before and cache.pool.workspace._retired
        assert all(p is not plan for p in ca.attention_plans(cache.pool))  # evicted
        assert len(cache.pool.plans) <= cache.pool.plans.maxsize
        out.fill(0)
        lse.fill(0)
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(cp.asnumpy(out).view(np.uint16), first[0])
    assert np.array_equal(cp.asnumpy(lse), first[1])


def test_growth_under_capture_raises_and_hints_make_capture_allocation_free():
    rng = np.random.default_rng(29)
    nb = 1024
    out = cp.empty((8, HQ, D), BF16)
    stream = capture_stream()
    # no hints, a shape never run: its workspace does not exist yet
    cache = PagedKVCache(nb, T, H, D, device="cuda", **SCALES)
    _fill(cache, rng, nb * T)
    q, tab, lens = _decode_inputs(rng, cache, 1, 8, [100])  # one split: no workspace
    cache.decode_attention(q, tab, lens, out=out[:1])  # compiles the kernel
    q, tab, lens = _decode_inputs(rng, cache, 8, 512, rng.integers(0, 512 * T, 8))
    before = cache.nbytes
    with stream:
        stream.begin_capture()
        try:
            out.fill(0)  # a node before the refused call: the graph is not empty
            with pytest.raises(RuntimeError, match=r"capturing a CUDA graph.*"
                                                   r"max_batch_size >= 8, max_seq_len >= "
                                                   r"8192, num_query_heads >= 32"):
                cache.decode_attention(q, tab, lens, out=out)
        finally:
            stream.end_capture()
    assert cache.nbytes == before
    # with hints covering it, the same first call inside a capture takes no memory
    hinted = PagedKVCache(nb, T, H, D, device="cuda", **SCALES, max_batch_size=8,
                          max_seq_len=512 * T, num_query_heads=HQ)
    hinted.buffer[...] = cache.buffer
    cp.cuda.Device().synchronize()
    pool = cp.get_default_memory_pool()
    with stream:
        stream.synchronize()
        used, total = pool.used_bytes(), hinted.nbytes
        stream.begin_capture()
        hinted.decode_attention(q, tab, lens, out=out)
        graph = stream.end_capture()
        assert pool.used_bytes() == used and hinted.nbytes == total
        out.fill(0)
        graph.launch(stream)
        stream.synchronize()
    (plan,) = ca.attention_plans(hinted.pool)
    assert plan.grid[0] > 1
    cpu = PagedKVCache(nb, T, H, D, device="cpu", **SCALES)
    cpu.buffer[...] = cp.asnumpy(hinted.buffer)
    ref = cpu.decode_attention(cp.asnumpy(q), cp.asnumpy(tab), cp.asnumpy(lens))
    assert rel_err(out, ref) <= TOL
