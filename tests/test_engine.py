"""The engine-facing API: ``AttentionPlan`` (plan once per step, run per layer), a cache
over page memory its caller owns (``PagedKVCache(buffer=...)``) and ``WindowRing``.

A plan's ``run`` must write the bytes ``PagedKVCache.store`` writes and return the output
``PagedKVCache.attention`` returns, bit for bit, on both backends (they run the same
kernels); captured in a CUDA graph (CuPy's stream capture, ``torch.cuda.graph``) and
replayed after the next ``plan``, it must give what an eager run of that step gives.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import capture_stream

import fp4cache
from fp4cache import AttentionPlan, PagedKVCache, WindowRing
from tests.conftest import DEVICES

NB, T, H, D = 24, 16, 2, 64


def _xp(device):
    if device == "cpu":
        return np
    import cupy

    return cupy


def _step(rng, lens_before, new_tokens, table_width=6):
    """Metadata of one step: each sequence ``b`` owns pages ``b * table_width ...``."""
    B = len(lens_before)
    before = np.asarray(lens_before, np.int64)
    n = np.asarray(new_tokens, np.int64)
    after = before + n
    qsl = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    tables = (np.arange(B)[:, None] * table_width + np.arange(table_width)).astype(np.int32)
    pos = np.concatenate([np.arange(before[b], after[b]) for b in range(B)])
    seq = np.repeat(np.arange(B), n)
    slots = tables[seq, pos // T].astype(np.int64) * T + pos % T
    return qsl, after.astype(np.int32), tables, slots


def _kv(rng, n, dtype, heads=H):
    return rng.standard_normal((n, heads, D)).astype(dtype)


def _caches(device, layers, **kw):
    return [PagedKVCache(NB, T, H, D, scale_rule="4over6", k_scale=0.01, v_scale=0.01,
                         device=device, **kw) for _ in range(layers)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("new_tokens", [[1, 1, 1], [3, 1, 17], [40, 0, 2]],
                         ids=["decode", "mixed", "prefill"])
@pytest.mark.parametrize("extras", [{}, {"rotation": "hadamard", "window_pages": 2,
                                         "window_slots": 6}], ids=["plain", "window"])
def test_run_is_store_then_attention(device, new_tokens, extras):
    """Two layers run from one plan write the pages and return the outputs of
    ``store`` + ``attention`` on twin caches, bit for bit."""
    xp = _xp(device)
    rng = np.random.default_rng(1)
    dtype = ml_dtypes.bfloat16
    qsl, sl, bt, slots = _step(rng, [20, 5, 31], new_tokens)
    N = int(qsl[-1])
    mine, ref = _caches(device, 2, **extras), _caches(device, 2, **extras)
    if extras:
        for c in mine + ref:
            c.map_window(np.array([1, 6, 12]), np.array([0, 1, 2]))
    plan = AttentionPlan(max_batch_size=4, max_num_tokens=64, max_blocks_per_seq=8,
                         device=device)
    plan.plan(qsl, sl, bt, slots)
    for layer in range(2):
        q = xp.asarray(_kv(rng, N, dtype, 4 * H))
        k, v = xp.asarray(_kv(rng, N, dtype)), xp.asarray(_kv(rng, N, dtype))
        out = plan.run(mine[layer], q, k, v)
        ref[layer].store(xp.asarray(slots), k, v)
        want = ref[layer].attention(q, xp.asarray(qsl), xp.asarray(bt), xp.asarray(sl),
                                    max_query_len=max(new_tokens))
        assert type(out) is type(q)
        assert bool((mine[layer].buffer == ref[layer].buffer).all())
        assert np.array_equal(_host(out).view(np.uint16), _host(want).view(np.uint16))


def _host(a):
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


@pytest.mark.parametrize("device", DEVICES)
def test_a_new_plan_is_read_by_the_same_run(device):
    """The second step's metadata (same shapes) reach the launches prepared in the first
    (they read the plan's buffers); attend-only runs (no k / v) work too."""
    xp = _xp(device)
    rng = np.random.default_rng(2)
    caches = _caches(device, 1)
    ref = _caches(device, 1)[0]
    plan = AttentionPlan(4, 8, 8, device=device)
    lens = [17, 3]
    for _ in range(3):
        qsl, sl, bt, slots = _step(rng, lens, [1, 1])
        plan.plan(qsl, sl, bt, slots, max_query_len=1)
        q = xp.asarray(_kv(rng, 2, np.float32, 2 * H))
        k = xp.asarray(_kv(rng, 2, np.float32))
        out = xp.empty_like(q)
        assert plan.run(caches[0], q, k, k, out=out) is out
        again = plan.run(caches[0], q)  # attend only: the same pages
        ref.store(xp.asarray(slots), k, k)
        want = ref.decode_attention(q, xp.asarray(bt), xp.asarray(sl))
        assert np.array_equal(_host(out), _host(want))
        assert np.array_equal(_host(again), _host(want))
        lens = list(sl)


@pytest.mark.parametrize("device", DEVICES)
def test_plan_from_device_metadata(device):
    """Metadata given on the device (an engine's persistent tensors) are copied as is;
    ``max_query_len`` is computed when omitted."""
    xp = _xp(device)
    rng = np.random.default_rng(3)
    qsl, sl, bt, slots = _step(rng, [9, 30], [4, 2])
    cache, ref = _caches(device, 1)[0], _caches(device, 1)[0]
    plan = AttentionPlan(2, 16, 6, device=device)
    plan.plan(xp.asarray(qsl), xp.asarray(sl), xp.asarray(bt.astype(np.int64)),
              xp.asarray(slots))
    assert plan.max_query_len == 4 and plan.batch_size == 2
    q = xp.asarray(_kv(rng, 6, np.float16, 2 * H))
    k = xp.asarray(_kv(rng, 6, np.float16))
    out = plan.run(cache, q, k, k)
    ref.store(xp.asarray(slots), k, k)
    want = ref.attention(q, xp.asarray(qsl), xp.asarray(bt), xp.asarray(sl), max_query_len=4)
    assert np.array_equal(_host(out), _host(want))


def test_plan_refuses_bad_metadata():
    plan = AttentionPlan(2, 8, 4, device="cpu")
    with pytest.raises(RuntimeError, match="before plan"):
        plan.run(_caches("cpu", 1)[0], np.zeros((1, 4, D), np.float32))
    with pytest.raises(ValueError, match="max_batch_size = 2"):
        plan.plan([0, 1, 2, 3], [1, 1, 1], [[0], [1], [2]])
    with pytest.raises(ValueError, match="B \\+ 1 = 2"):
        plan.plan([0, 1, 2], [1], [[0]])
    with pytest.raises(ValueError, match="max_blocks_per_seq = 4"):
        plan.plan([0, 1], [1], [[0, 1, 2, 3, 4]])
    with pytest.raises(ValueError, match="slot_mapping must have one entry per query"):
        plan.plan([0, 2], [2], [[0]], [0])
    with pytest.raises(ValueError, match="max_num_tokens = 8"):
        plan.plan([0, 9], [9], [[0]])
    with pytest.raises(ValueError, match="query_start_loc"):
        plan.plan([0, 2, 1], [2, 2], [[0], [1]])
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
        AttentionPlan(0, 8, 4, device="cpu")


def test_run_refuses_bad_arguments_and_writes_nothing():
    rng = np.random.default_rng(4)
    cache = _caches("cpu", 1)[0]
    plan = AttentionPlan(2, 8, 4, device="cpu").plan([0, 2], [2], [[0]], [0, 1])
    q = _kv(rng, 2, np.float32, 2 * H)
    k = _kv(rng, 2, np.float32)
    with pytest.raises(ValueError, match="k and v are given together"):
        plan.run(cache, q, k)
    with pytest.raises(ValueError, match="q holds 3 tokens"):
        plan.run(cache, _kv(rng, 3, np.float32, 2 * H), k, k)
    with pytest.raises(ValueError, match="head_dim"):
        plan.run(cache, q, np.ones((2, H, 2 * D), np.float32)[:, :, ::2],
                 np.ones((2, H, 2 * D), np.float32)[:, :, ::2])
    with pytest.raises(TypeError, match="PagedKVCache"):
        plan.run(object(), q, k, k)
    bad = AttentionPlan(2, 8, 4, device="cpu").plan([0, 2], [2], [[NB]], [0, 1])
    with pytest.raises(IndexError):
        bad.run(cache, q, k, k)
    out_of_pool = AttentionPlan(2, 8, 4, device="cpu").plan([0, 2], [2], [[0]],
                                                            [0, NB * T])
    with pytest.raises(IndexError, match="slot_mapping"):
        out_of_pool.run(cache, q, k, k)
    assert not cache.buffer.any()
    no_slots = AttentionPlan(2, 8, 4, device="cpu").plan([0, 2], [2], [[0]])
    with pytest.raises(ValueError, match="pass slot_mapping to plan"):
        no_slots.run(cache, q, k, k)
    assert plan.nbytes == 3 * 4 + 2 * 4 + 2 * 4 * 4 + 8 * 8


# -- a cache over the caller's page memory -----------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_cache_over_external_pages(device):
    """vLLM's NVFP4 cache shape, allocated by the caller: the cache stores into and
    attends from it in place, as a cache over its own pool does, and does not count it."""
    xp = _xp(device)
    rng = np.random.default_rng(5)
    mem = xp.zeros((NB, 2, T, H, D // 2 + D // 16), dtype=xp.uint8)
    ext = PagedKVCache(None, T, H, D, buffer=mem, k_scale=0.01, v_scale=0.01,
                       scale_rule="4over6")
    own = _caches(device, 1)[0]
    assert ext.num_blocks == NB and ext.device == device and not ext.owns_pages
    assert ext.nbytes == own.nbytes - own.buffer.nbytes
    slots = xp.asarray(np.arange(40))
    k = xp.asarray(_kv(rng, 40, np.float32))
    for c in (ext, own):
        c.store(slots, k, k)
    assert bool((mem.reshape(NB, 2, -1) == own.buffer).all())
    q = xp.asarray(_kv(rng, 1, np.float32, 2 * H))
    a = ext.decode_attention(q, xp.asarray([[0, 1, 2]]), xp.asarray([40]))
    b = own.decode_attention(q, xp.asarray([[0, 1, 2]]), xp.asarray([40]))
    assert np.array_equal(_host(a), _host(b))


def test_external_pages_are_checked():
    good = np.zeros((4, 2, T * H * (D // 2 + D // 16)), np.uint8)
    for buf, kind, match in (
            (np.zeros(100, np.uint8), ValueError, "pages of 2304 bytes"),
            (good.view(np.float32), TypeError, "uint8 or int8"),
            (np.zeros((4, 2, 2 * good.shape[2]), np.uint8)[:, :, ::2], ValueError,
             "C-contiguous"),
            (np.zeros(good.size + 1, np.uint8)[1:].reshape(good.shape), ValueError,
             "16-byte aligned")):
        with pytest.raises(kind, match=match):
            PagedKVCache(None, T, H, D, buffer=buf, device="cpu")
    with pytest.raises(ValueError, match="num_blocks = 3"):
        PagedKVCache(3, T, H, D, buffer=good, device="cpu")
    assert PagedKVCache(None, T, H, D, buffer=good.view(np.int8), device="cpu").num_blocks == 4


# -- the exact window's ring ---------------------------------------------------------------------
def test_window_ring_maps_the_newest_pages():
    ring = WindowRing(2, 16)
    tables = np.arange(16).reshape(2, 8)
    moves = ring.step(tables, np.array([0, 1]), np.array([0, 0]), np.array([40, 5]), 16)
    blocks, slots = moves
    # row 0: pages 0..2 in use, the newest two (1, 2) mapped; row 1: page 8
    assert blocks.tolist() == [1, 2, 8] and slots.tolist() == [1, 0, 2]
    assert ring.step(tables, np.array([0, 1]), np.array([40, 5]), np.array([41, 6]), 16) is None
    blocks, slots = ring.step(tables, np.array([0, 1]), np.array([41, 6]), np.array([49, 6]),
                              16)
    assert blocks.tolist() == [1, 3] and slots.tolist() == [-1, 1]
    assert ring.mapped.tolist() == [2, 3, 8]
    assert ring.unmap_all().tolist() == [2, 3, 8] and ring.mapped.size == 0
    assert WindowRing(0, 4).step(tables, [0, 1], [0, 0], [1, 1], 16) is None


# -- CUDA graphs -------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cupy_graph_of_a_step_replays_the_next_plan():
    """A decode step of three layers (store + attention each) captured once in CuPy's
    stream capture, replayed after ``plan`` of the next steps with new K/V and queries,
    equals eager runs of those steps on twin caches."""
    import cupy

    rng = np.random.default_rng(6)
    layers, B = 3, 3
    graph_caches, eager_caches = _caches("cuda", layers), _caches("cuda", layers)
    graph_plan = AttentionPlan(B, B, 6, device="cuda")
    eager_plan = AttentionPlan(B, B, 6, device="cuda")
    dt = ml_dtypes.bfloat16
    q = cupy.zeros((layers, B, 2 * H, D), dt)
    k = cupy.zeros((layers, B, H, D), dt)
    out = cupy.zeros((layers, B, 2 * H, D), dt)
    stream = capture_stream()
    lens = [5, 16, 40]
    graph = None
    with stream:
        for _ in range(4):
            qsl, sl, bt, slots = _step(rng, lens, [1] * B)
            graph_plan.plan(qsl, sl, bt, slots, max_query_len=1)
            eager_plan.plan(qsl, sl, bt, slots, max_query_len=1)
            q.set(_kv(rng, layers * B, dt, 2 * H).reshape(q.shape), stream=stream)
            k.set(_kv(rng, layers * B, dt).reshape(k.shape), stream=stream)
            if graph is None:  # the first step runs eagerly, preparing the launches
                for i in range(layers):
                    graph_plan.run(graph_caches[i], q[i], k[i], k[i], out=out[i])
                stream.begin_capture()
                for i in range(layers):
                    graph_plan.run(graph_caches[i], q[i], k[i], k[i], out=out[i])
                graph = stream.end_capture()
                graph.launch(stream)  # repeats the eager step: the same bytes
            else:
                graph.launch(stream)
            for i in range(layers):
                want = eager_plan.run(eager_caches[i], q[i], k[i], k[i])
                assert cupy.array_equal(out[i].view(cupy.uint16), want.view(cupy.uint16))
                assert bool((graph_caches[i].buffer == eager_caches[i].buffer).all())
            lens = list(sl)
        stream.synchronize()


@pytest.mark.gpu
def test_torch_graph_of_a_step_with_torch_tensors():
    """The way a PyTorch user captures a step: torch tensors in, no ``out=``, inside
    ``torch.cuda.graph`` (its own side stream); replayed after the next plans it equals
    eager runs, and the capture allocated nothing outside PyTorch's graph pool."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA")
    import cupy

    rng = np.random.default_rng(7)
    layers, B = 2, 4
    graph_caches, eager_caches = _caches("cuda", layers), _caches("cuda", layers)
    graph_plan = AttentionPlan(B, B, 6, device="cuda")
    eager_plan = AttentionPlan(B, B, 6, device="cuda")
    q = torch.zeros((layers, B, 2 * H, D), dtype=torch.bfloat16, device="cuda")
    k = torch.zeros((layers, B, H, D), dtype=torch.bfloat16, device="cuda")
    lens = [3, 15, 16, 33]

    def fill():
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda").to(torch.bfloat16))
        k.copy_(torch.randn(k.shape, generator=gen, device="cuda").to(torch.bfloat16))

    gen = torch.Generator(device="cuda").manual_seed(0)
    qsl, sl, bt, slots = _step(rng, lens, [1] * B)
    for p in (graph_plan, eager_plan):
        p.plan(qsl, sl, bt, slots, max_query_len=1)
    fill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: prepares the launches
        for i in range(layers):
            graph_plan.run(graph_caches[i], q[i], k[i], k[i])
            eager_plan.run(eager_caches[i], q[i], k[i], k[i])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool_before = cupy.get_default_memory_pool().used_bytes()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [graph_plan.run(graph_caches[i], q[i], k[i], k[i]) for i in range(layers)]
    assert cupy.get_default_memory_pool().used_bytes() == pool_before
    assert all(isinstance(o, torch.Tensor) for o in outs)
    lens = list(sl)
    for _ in range(3):
        qsl, sl, bt, slots = _step(rng, lens, [1] * B)
        for p in (graph_plan, eager_plan):
            p.plan(qsl, sl, bt, slots, max_query_len=1)
        fill()
        graph.replay()
        for i in range(layers):
            want = eager_plan.run(eager_caches[i], q[i], k[i], k[i])
            assert torch.equal(outs[i].view(torch.int16), want.view(torch.int16))
            assert bool((graph_caches[i].buffer == eager_caches[i].buffer).all())
        lens = list(sl)
    torch.cuda.synchronize()


def test_public_names():
    assert fp4cache.AttentionPlan is AttentionPlan and "AttentionPlan" in fp4cache.__all__
