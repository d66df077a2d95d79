"""What a cache keeps between calls.

On the CPU, the bound logic: the plan cache's eviction rule and bound, the workspace's
sizes, growth, retention and refusal under CUDA-graph capture (NumPy stand-ins for the
device allocation and the capture test), and the decode-attention workspace sizes computed
from the cache's hints.

Under the ``gpu`` marker, the hot path: repeated calls whose argument signature was
validated before skip the checks and (decode-step sizes) go straight to a prepared launch.
Results must not change, and a call with a new signature is validated again.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import DEVICES
from helpers import capture_stream, host, xp_of

import fp4cache
from fp4cache import PagedKVCache
from fp4cache import _kernels as K
from fp4cache._plans import ALIGN, MAX_PLANS, PlanCache, Workspace
from fp4cache.layout import PageGeometry


# -- PlanCache -----------------------------------------------------------------------------
def test_plan_cache_drops_the_least_recently_used_beyond_its_bound():
    plans = PlanCache(3)
    for k in "abc":
        plans.put(k, k.upper())
    assert plans.get("a") == "A"          # a is now the most recent: b is the oldest
    plans.put("d", "D")
    assert plans.keys() == ["c", "a", "d"] and "b" not in plans
    plans.put("c", "C2")                  # re-putting refreshes the value and the recency
    plans.put("e", "E")
    assert plans.keys() == ["d", "c", "e"] and plans.get("c") == "C2"
    assert plans.get("zz") is None and plans.get(None) is None
    assert len(plans) == 3


def test_plan_cache_stays_bounded_under_many_signatures():
    plans = PlanCache()
    assert plans.maxsize == MAX_PLANS
    hot = ("decode", 8)
    plans.put(hot, "hot")
    for i in range(10 * MAX_PLANS):
        plans.put(("shape", i), i)
        if i % 50 == 0:
            assert plans.get(hot) == "hot"  # used now and then: never evicted
        assert len(plans) <= MAX_PLANS
    assert plans.get(hot) == "hot" and len(plans) == MAX_PLANS
    assert plans.get(("shape", 0)) is None
    assert plans.pop(hot) == "hot" and plans.pop(hot) is None
    plans.clear()
    assert len(plans) == 0 and plans.values() == []


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, None])
def test_plan_cache_bound_must_be_positive(bad):
    with pytest.raises(ValueError, match="maxsize must be a positive integer"):
        PlanCache(bad)


# -- Workspace -----------------------------------------------------------------------------
class _Fake:
    """NumPy allocation (recording each call) and a settable capture flag."""

    def __init__(self):
        self.capturing = False
        self.allocs: list[tuple[int, str, bool]] = []

    def alloc(self, nbytes, dtype, zero):
        self.allocs.append((nbytes, np.dtype(dtype).name, zero))
        a = np.empty(nbytes // np.dtype(dtype).itemsize, dtype)
        a[...] = 0 if zero else 0x5A  # scratch contents are undefined: not zero here
        return a

    def workspace(self):
        return Workspace(0, alloc=self.alloc, capturing=lambda: self.capturing)


def _base(a):
    while a.base is not None:
        a = a.base
    return a


def test_workspace_layout_and_views():
    fake = _Fake()
    ws = fake.workspace()
    assert ws.nbytes == ws.scratch_bytes == ws.tickets == 0
    parts = [((3, 5), np.float32), (7, np.uint8), ((2, 16, 2), np.float32)]
    offsets, total = Workspace.layout(parts)
    assert offsets == [0, ALIGN, 2 * ALIGN] and total == 3 * ALIGN
    a, b, c, t = ws.get(parts, tickets=5)
    assert (a.shape, a.dtype, b.shape, b.dtype, c.shape, t.shape, t.dtype) == (
        (3, 5), np.float32, (7,), np.uint8, (2, 16, 2), (5,), np.uint32)
    scratch = _base(a)
    assert _base(b) is scratch and _base(c) is scratch and _base(t) is not scratch
    for view, off in zip((a, b, c), offsets):
        assert view.ctypes.data - scratch.ctypes.data == off
    assert not t.any()  # tickets start at zero
    assert fake.allocs == [(3 * ALIGN, "uint8", False), (20, "uint32", True)]
    assert ws.nbytes == 3 * ALIGN + 20 and ws.scratch_bytes == 3 * ALIGN and ws.tickets == 5
    assert ws.get([]) == ()  # nothing needed: nothing allocated
    assert len(fake.allocs) == 2


def test_workspace_reuses_for_smaller_requests_and_grows_at_least_twofold():
    fake = _Fake()
    ws = fake.workspace()
    (big,) = ws.get([(10 * ALIGN, np.uint8)])
    first = _base(big)
    for n in (1, ALIGN, 10 * ALIGN):  # smaller or equal: the same buffer, no allocation
        (v,) = ws.get([(n, np.uint8)])
        assert _base(v) is first
    assert len(fake.allocs) == 1
    (v,) = ws.get([(10 * ALIGN + 1, np.uint8)])  # one byte more: twice the buffer
    assert ws.scratch_bytes == 20 * ALIGN and _base(v) is not first
    # the outgrown buffer is kept (plans and graphs may hold its address) and counted
    assert any(r is first for r in ws._retired)
    assert ws.nbytes == 30 * ALIGN
    (v,) = ws.get([(50 * ALIGN, np.uint8)])      # beyond twice: exactly the request
    assert ws.scratch_bytes == 50 * ALIGN
    # held in all: the current buffer plus at most as much again in outgrown ones
    assert ws.nbytes == 80 * ALIGN <= 2 * ws.scratch_bytes
    ws.release()
    assert ws.nbytes == 0 and ws._retired == []


def test_shared_workspace_is_freed_by_its_last_owner():
    """``share`` adds an owner, ``leave`` takes one away (the buffers stay for the
    others, the leaving owner gets a new empty workspace), ``release`` frees only an
    unshared one."""
    fake = _Fake()
    ws = fake.workspace()
    (v,) = ws.get([(4 * ALIGN, np.uint8)])
    assert ws.share() is ws and ws.share() is ws and ws.users == 3
    with pytest.raises(RuntimeError, match="3 owners: leave"):
        ws.release()
    mine = ws.leave()
    assert ws.users == 2 and mine is not ws and mine.users == 1 and mine.nbytes == 0
    assert ws.nbytes == 4 * ALIGN and _base(ws.get([(ALIGN, np.uint8)])[0]) is _base(v)
    ws.leave()
    with pytest.raises(RuntimeError, match="leave\\(\\) is for a shared workspace"):
        ws.leave()
    ws.release()
    assert ws.nbytes == 0
    (w,) = mine.get([(ALIGN, np.uint8)])  # the new one allocates as any workspace
    assert mine.nbytes == ALIGN and len(fake.allocs) == 2


def test_workspace_refuses_to_grow_while_capturing():
    fake = _Fake()
    ws = fake.workspace()
    ws.reserve(4 * ALIGN, 8, hint="max_batch_size=4")
    assert ws.reserved_for == "max_batch_size=4"
    before = (ws.nbytes, list(fake.allocs))
    fake.capturing = True
    views = ws.get([(4 * ALIGN, np.uint8)], tickets=8)  # fits: no allocation, no error
    assert len(views) == 2
    with pytest.raises(RuntimeError, match=r"capturing a CUDA graph.*Raise the cache's "
                                           r"workspace hints \(max_batch_size >= 9\)"):
        ws.get([(4 * ALIGN + 1, np.uint8)], hint="max_batch_size >= 9")
    with pytest.raises(RuntimeError, match=r"9 merge tickets.*holds 1024 bytes and 8 "
                                           r"tickets"):
        ws.get([], tickets=9)
    with pytest.raises(RuntimeError, match="Run a call of this shape once before"):
        ws.reserve(10**6)
    assert (ws.nbytes, fake.allocs) == before  # nothing allocated, nothing moved
    fake.capturing = False
    ws.get([], tickets=9)
    assert ws.tickets == 16


# -- decode-attention workspace sizes from the hints ---------------------------------------
ca = pytest.importorskip("fp4cache._cuda.decode", reason="needs CuPy installed")


def test_workspace_parts_of_one_launch():
    assert ca.workspace_parts(4, 8, 1, 4, 128) == ((), 0)  # one split: nothing
    parts, tickets = ca.workspace_parts(4, 8, 3, 4, 128)
    assert tickets == 32
    assert parts == (((96, 512), np.float32), ((96, 4, 2), np.float32))
    assert Workspace.layout(parts)[1] == 96 * 512 * 4 + 96 * 8 * 4


def test_split_plan_short_contexts_and_longer_splits_at_2_ctas():
    """A short sequence alone is split until its CTAs fill SMs of their own (B=1 x 512: 4
    splits of 128, 8.3 against 9.6 us in one split on the H200), a batch whose CTAs fill
    the SMs already is not (B=16 and 64 x 512: CTAs sharing an SM slow each other, and
    merging costs SPLIT_FIXED_TOKENS); a kernel of 2 CTAs per SM may take splits twice as
    long (one wave of 4 splits of 8192 at B=8 x 32768); the 4-CTA plans keep
    SPLIT_TOKENS."""
    assert ca.split_plan(1, 8, 512, 528) == (4, 128)
    assert ca.split_plan(1, 8, 1024, 528) == (8, 128)
    assert ca.split_plan(16, 8, 512, 528) == (1, 512)
    assert ca.split_plan(64, 8, 1024, 528) == (1, 1024)
    assert ca.split_plan(1, 8, 16384, 528) == (32, 512)
    assert ca.split_plan(4, 8, 4096, 528) == (16, 256)
    assert ca.split_plan(8, 8, 32768, 528) == (8, 4096)
    assert ca.split_plan(8, 8, 32768, 264, per_sm=2) == (4, 8192)
    for per_sm in (3, 4, 5, 8):
        plan = ca.split_plan(8, 8, 32768, 132 * per_sm, per_sm=per_sm)
        assert plan.split_len <= ca.SPLIT_TOKENS
    assert ca.split_plan(1, 8, 1 << 20, 132, per_sm=1).split_len <= 4 * ca.SPLIT_TOKENS


def test_max_splits_bounds_every_split_plan():
    spec = K.decode_attention_spec("bf16", 128, 1)
    for cap in (1, 16, 255, 256, 257, 1000, 4096, 20000, 131072, 10**6):
        bound = ca.max_splits(cap)
        assert bound == max(1, min(128, -(-cap // ca.MIN_SPLIT_TOKENS)))
        for bh in (1, 3, 8, 64, 512, 4096):
            for resident in (50, 132, 528, 4224):
                for sp in (None, spec):
                    n = ca.split_plan(bh, 1, cap, resident, sp).nsplit
                    assert 1 <= n <= bound, (cap, bh, resident)


def test_workspace_bound_covers_every_call_within_the_hints():
    """What the cache reserves from its hints is at least what any call within them
    takes, whatever the GPU (resident CTAs); and it is exactly the largest call's parts."""
    geom = PageGeometry(8, 16, 128, "HND", True)
    nbytes, tickets = ca.workspace_bound(geom, 64, 4096, 32)
    # 64 * 8 (sequence, KV head) pairs, 4096 tokens -> at most 32 splits, group 4
    rows = 64 * 8 * 32
    assert (nbytes, tickets) == (rows * 4 * 128 * 4 + rows * 4 * 2 * 4, 512)
    spec = K.decode_attention_spec("bf16", 128, 1)
    rng = np.random.default_rng(0)
    for _ in range(300):
        B = int(rng.integers(1, 65))
        W = int(rng.integers(1, 257))
        group = int(rng.choice([1, 2, 4]))
        resident = int(rng.choice([66, 132, 528, 1056, 4224]))
        n = ca.split_plan(B, 8, W * 16, resident, spec).nsplit
        parts, t = ca.workspace_parts(B, 8, n, group, 128)
        assert Workspace.layout(parts)[1] <= nbytes and t <= tickets
    # max_seq_len not a multiple of the page: block tables of ceil(len / T) columns
    assert ca.workspace_bound(geom, 1, 4097, 8) == ca.workspace_bound(geom, 1, 4112, 8)
    assert ca.workspace_bound(geom, 1, 128, 8) == (0, 0)  # never more than one split


# -- the cache's hints (CPU: kept and shown, nothing to reserve) ---------------------------
def test_hints_are_checked_kept_and_shown():
    c = fp4cache.PagedKVCache(64, 16, 8, 128, device="cpu", max_batch_size=64,
                              max_seq_len=4096, num_query_heads=32)
    assert c.workspace_hints == {"max_batch_size": 64, "max_seq_len": 4096,
                                 "num_query_heads": 32}
    assert "max_batch_size=64, max_seq_len=4096, num_query_heads=32)" in repr(c)
    assert c.workspace_nbytes == 0 and c.nbytes == c.buffer.nbytes + c.pool.stats.nbytes
    c.release_workspace()  # nothing to free on the CPU
    d = fp4cache.PagedKVCache(64, 16, 8, 128, device="cpu", max_batch_size=2)
    assert d.workspace_hints == {"max_batch_size": 2, "max_seq_len": 64 * 16,
                                 "num_query_heads": 8 * 16}
    assert fp4cache.PagedKVCache(4, 16, 2, 64, device="cpu").workspace_hints == {}


@pytest.mark.parametrize("kw,match", [
    (dict(max_batch_size=0), "max_batch_size must be a positive integer"),
    (dict(max_batch_size=4, max_seq_len=-1), "max_seq_len must be a positive integer"),
    (dict(max_batch_size=True), "max_batch_size must be a positive integer"),
    (dict(max_seq_len=4096), "pass it too"),
    (dict(num_query_heads=16), "pass it too"),
    (dict(max_batch_size=4, num_query_heads=12), "multiple of num_heads"),
    (dict(max_batch_size=4, num_query_heads=8 * 17), "at most 16"),
])
def test_bad_hints_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        fp4cache.PagedKVCache(8, 16, 8, 128, device="cpu", **kw)


# -- the GPU hot path ----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 64, 128, 129, 1000])
def test_repeated_stores_and_gathers_match_cpu(n):
    """The prepared decode-step store and gather against the CPU backend."""
    import cupy


    rng = np.random.default_rng(n)
    nb, T, H, D = 128, 16, 4, 128
    gpu = PagedKVCache(nb, T, H, D, scale_rule="4over6", device="cuda")
    cpu = PagedKVCache(nb, T, H, D, scale_rule="4over6", device="cpu")
    out = None
    for step in range(6):
        # A fresh (n+1)-token array each step; odd steps pass an offset view (other
        # pointer alignment), so both the prepared launch and the full path are used.
        big = rng.standard_normal((n + 1, H, D), dtype=np.float32).astype(ml_dtypes.bfloat16)
        k_np = big[step % 2:step % 2 + n]
        v_np = (big[step % 2:step % 2 + n] * 0.5).astype(ml_dtypes.bfloat16)
        slots = rng.choice(nb * T, size=n, replace=n > nb * T).astype(np.int64)
        slots[rng.random(n) < 0.1] = -1
        cpu.store(slots, k_np, v_np)
        kd = cupy.asarray(big)[step % 2:step % 2 + n]
        gpu.store(cupy.asarray(slots), kd, cupy.asarray(v_np))
        blocks = rng.integers(0, nb, 8).astype(np.int32)
        if out is None:
            out = (cupy.empty((8 * T, H, D), ml_dtypes.bfloat16),
                   cupy.empty((8 * T, H, D), ml_dtypes.bfloat16))
        k_out, v_out = gpu.gather_dequant(cupy.asarray(blocks), out=out)
        k_ref, v_ref = cpu.gather_dequant(blocks)
        assert np.array_equal(k_out.get().view(np.uint16), k_ref.view(np.uint16)), step
        assert np.array_equal(v_out.get().view(np.uint16), v_ref.view(np.uint16)), step
    assert np.array_equal(gpu.buffer.get(), cpu.buffer)


@pytest.mark.gpu
def test_new_signature_is_validated_again():
    import cupy

    gpu = PagedKVCache(16, 16, 2, 64, device="cuda")
    k = cupy.ones((4, 2, 64), dtype=cupy.float32)
    slots = cupy.arange(4, dtype=cupy.int32)
    gpu.store(slots, k, k)
    gpu.store(slots, k, k)  # prepared launch
    before = gpu.buffer.copy()
    with pytest.raises(ValueError, match="k must have shape"):
        gpu.store(slots[:3], k[:3, :1], k[:3, :1])
    with pytest.raises(ValueError, match="slot_mapping"):
        gpu.store(slots[:3], k, k)
    with pytest.raises(TypeError, match="same dtype"):
        gpu.store(slots, k, k.astype(cupy.float16))
    assert cupy.array_equal(before, gpu.buffer)


@pytest.mark.gpu
def test_prepared_store_in_a_cuda_graph():
    """The prepared decode-step store captured into a CUDA graph and
    replayed with new slot and K/V contents writes what the CPU backend writes."""
    import cupy

    rng = np.random.default_rng(7)
    nb, T, H, D, n = 32, 16, 2, 64, 24
    gpu = PagedKVCache(nb, T, H, D, device="cuda")
    cpu = PagedKVCache(nb, T, H, D, device="cpu")
    stream = capture_stream()
    with stream:  # the inputs are made on the capture stream (it does not wait for others)
        slots = cupy.arange(n, dtype=cupy.int64)
        k = cupy.ones((n, H, D), ml_dtypes.bfloat16)
        v = cupy.ones((n, H, D), ml_dtypes.bfloat16)
        gpu.store(slots, k, v)  # validated once: the next calls take the prepared launch
        gpu.store(slots, k, v)
        cpu.store(np.arange(n), np.ones((n, H, D), ml_dtypes.bfloat16),
                  np.ones((n, H, D), ml_dtypes.bfloat16))
        stream.begin_capture()
        gpu.store(slots, k, v)
        graph = stream.end_capture()
        for _ in range(3):
            s_h = rng.permutation(nb * T)[:n]
            k_h = rng.standard_normal((n, H, D)).astype(ml_dtypes.bfloat16)
            v_h = rng.standard_normal((n, H, D)).astype(ml_dtypes.bfloat16)
            slots.set(s_h, stream=stream)
            k.set(k_h, stream=stream)
            v.set(v_h, stream=stream)
            graph.launch(stream)
            cpu.store(s_h, k_h, v_h)
        stream.synchronize()
    assert np.array_equal(gpu.buffer.get(), cpu.buffer)


@pytest.mark.parametrize("device", DEVICES)
def test_layers_share_one_workspace(device):
    """Three caches (the layers of a model) on one workspace: their attention equals that
    of caches with their own, bit for bit; ``nbytes`` counts the shared workspace once
    over the three; a cache that releases it leaves the others theirs, and they go on.
    On the CPU there is no workspace: sharing changes nothing."""
    rng = np.random.default_rng(5)
    nb, T, H, D, B = 32, 16, 2, 64, 4
    xp = xp_of(device)
    lens = np.array([200, 17, 64, 100])
    tables = np.arange(B * 13).reshape(B, 13) % nb
    hints = {"max_batch_size": B, "max_seq_len": 13 * T, "num_query_heads": 8}
    shared = [PagedKVCache(nb, T, H, D, device=device, **hints) for _ in range(3)]
    alone = [PagedKVCache(nb, T, H, D, device=device, **hints) for _ in range(3)]
    for layer in shared[1:]:
        layer.share_workspace(shared[0])
    qs = []
    for a, b in zip(shared, alone, strict=True):
        k = rng.standard_normal((nb * T, H, D)).astype(ml_dtypes.bfloat16)
        a.store(xp.arange(nb * T), xp.asarray(k), xp.asarray(k))
        b.store(xp.arange(nb * T), xp.asarray(k), xp.asarray(k))
        qs.append(xp.asarray(rng.standard_normal((B, 8, D)).astype(ml_dtypes.bfloat16)))
    for _ in range(2):  # the second round: the prepared launches
        for a, b, q in zip(shared, alone, qs, strict=True):
            got = a.decode_attention(q, xp.asarray(tables), xp.asarray(lens))
            want = b.decode_attention(q, xp.asarray(tables), xp.asarray(lens))
            assert np.array_equal(host(got).view(np.uint16), host(want).view(np.uint16))
    if device == "cpu":
        assert all(c.workspace_nbytes == 0 for c in shared)
    else:
        ws = shared[0].workspace_nbytes
        assert ws > 0 and all(c.workspace_nbytes == ws for c in shared)
        own = alone[0].nbytes - alone[0].workspace_nbytes
        assert abs(sum(c.nbytes for c in shared) - (3 * own + ws)) <= 3
    shared[0].release_workspace()  # leaves it to the others, takes a new one
    for a, b, q in zip(shared, alone, qs, strict=True):
        got = a.decode_attention(q, xp.asarray(tables), xp.asarray(lens))
        want = b.decode_attention(q, xp.asarray(tables), xp.asarray(lens))
        assert np.array_equal(host(got).view(np.uint16), host(want).view(np.uint16))
    with pytest.raises(TypeError, match="other must be a PagedKVCache"):
        shared[1].share_workspace("layer 0")


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
def test_prepared_gather_any_length_alignment_and_out(out_dtype):
    """The prepared gather (arguments packed once, one launch per call) for block lists of
    changing length (0 included), allocated outputs and ``out=`` views at 16-byte aligned
    and unaligned offsets (the vectorized and the scalar kernel), against the CPU."""
    import cupy

    rng = np.random.default_rng(11)
    nb, T, H, D = 64, 16, 2, 64
    gpu = PagedKVCache(nb, T, H, D, scale_rule="4over6", device="cuda")
    cpu = PagedKVCache(nb, T, H, D, scale_rule="4over6", device="cpu")
    slots = rng.permutation(nb * T)
    k = rng.standard_normal((nb * T, H, D)).astype(np.float32)
    v = (rng.standard_normal((nb * T, H, D)) * 4).astype(np.float32)
    cpu.store(slots, k, v)
    gpu.store(cupy.asarray(slots), cupy.asarray(k), cupy.asarray(v))
    dt = np.dtype(getattr(ml_dtypes, out_dtype, None) or out_dtype)
    for n in (3, 3, 7, 0, 40, 1, 7):  # the same signature, lengths change
        blocks = rng.integers(0, nb, n).astype(np.int32)
        k_out, v_out = gpu.gather_dequant(cupy.asarray(blocks), out_dtype)
        k_ref, v_ref = cpu.gather_dequant(blocks, out_dtype)
        assert k_out.shape == k_ref.shape and k_out.dtype == dt
        assert np.array_equal(k_out.get().view(np.uint8), k_ref.view(np.uint8)), n
        assert np.array_equal(v_out.get().view(np.uint8), v_ref.view(np.uint8)), n
    n = 5
    rows = n * T * H * D
    for offset in (0, 1, 0, 1):  # out= views: aligned, then one element off
        flat = cupy.zeros(2 * rows + 1, dt)
        out = (flat[offset:offset + rows].reshape(n * T, H, D),
               flat[rows + offset:2 * rows + offset].reshape(n * T, H, D))
        blocks = rng.integers(0, nb, n).astype(np.int64)
        gpu.gather_dequant(cupy.asarray(blocks), out=out)
        k_ref, v_ref = cpu.gather_dequant(blocks, out_dtype)
        assert np.array_equal(out[0].get().view(np.uint8), k_ref.view(np.uint8)), offset
        assert np.array_equal(out[1].get().view(np.uint8), v_ref.view(np.uint8)), offset


@pytest.mark.gpu
def test_prepared_gather_in_a_cuda_graph():
    """The prepared gather captured into a CUDA graph and replayed with new block ids
    decodes what the CPU backend decodes."""
    import cupy

    rng = np.random.default_rng(5)
    nb, T, H, D, n = 32, 16, 2, 64, 6
    gpu = PagedKVCache(nb, T, H, D, device="cuda")
    cpu = PagedKVCache(nb, T, H, D, device="cpu")
    slots = rng.permutation(nb * T)
    k = rng.standard_normal((nb * T, H, D)).astype(ml_dtypes.bfloat16)
    cpu.store(slots, k, k)
    gpu.store(cupy.asarray(slots), cupy.asarray(k), cupy.asarray(k))
    blocks = cupy.zeros(n, cupy.int32)
    out = (cupy.empty((n * T, H, D), ml_dtypes.bfloat16),
           cupy.empty((n * T, H, D), ml_dtypes.bfloat16))
    stream = capture_stream()
    with stream:
        gpu.gather_dequant(blocks, out=out)  # validated once: then the prepared launch
        stream.begin_capture()
        gpu.gather_dequant(blocks, out=out)
        graph = stream.end_capture()
        for _ in range(3):
            b = rng.integers(0, nb, n).astype(np.int32)
            blocks.set(b, stream=stream)
            graph.launch(stream)
            stream.synchronize()
            k_ref, _ = cpu.gather_dequant(b)
            assert np.array_equal(out[0].get().view(np.uint16), k_ref.view(np.uint16))
