"""Moving pages on the GPU, against the NumPy backend byte for byte:
copy_blocks (overlapping sets, cycles, fan-out, self-copies, repeated destinations, bad
ids, CUDA-graph capture and replay; the copy's tables are zero after every call),
read_blocks / write_blocks (device and host memory, pinned and pageable, staged and
direct), save / load across backends, slot_mapping on CuPy.  Every refusal leaves the
pool byte-identical."""

from __future__ import annotations

import numpy as np
import pytest

import fp4cache
from fp4cache import PagedKVCache, _abi, pages

pytestmark = pytest.mark.gpu

GEOMETRIES = [  # (num_blocks, block_size, heads, head_dim, layout, swizzle): page bytes
    (64, 16, 8, 128, "HND", True),   # 18432: 16-byte vectors, 1152 per page
    (40, 16, 2, 64, "NHD", True),    # 2304
    (33, 8, 1, 16, "HND", False),    # 144: 9 vectors
    (50, 3, 1, 16, "NHD", False),    # 54: 2-byte accesses
    (21, 1, 1, 16, "HND", False),    # 18
]


def pair(nb, T, H, D, layout="HND", swizzle=True, *, seed=0, rule="static6"):
    """The same random pages in a GPU cache and a CPU cache."""
    import cupy

    kw = dict(layout=layout, swizzle_v_scales=swizzle, scale_rule=rule, k_scale=0.5,
              v_scale=0.25)
    gpu = PagedKVCache(nb, T, H, D, device="cuda", **kw)
    cpu = PagedKVCache(nb, T, H, D, device="cpu", **kw)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((nb * T, H, D)).astype(np.float32)
    v = rng.standard_normal((nb * T, H, D)).astype(np.float32)
    slots = rng.permutation(nb * T)
    cpu.store(slots, k, v)
    gpu.store(cupy.asarray(slots), cupy.asarray(k), cupy.asarray(v))
    assert np.array_equal(gpu.buffer.get(), cpu.buffer)
    return gpu, cpu


def copy_tables(gpu):
    """The copy's uint32 tables (pending, dst_of) in the cache's workspace tickets."""
    (t,) = gpu._state.workspace.get([], tickets=_abi.COPY_TABLES * gpu.num_blocks)
    return t


def assert_tables_zero(gpu):
    t = copy_tables(gpu).get()
    assert t.size == _abi.COPY_TABLES * gpu.num_blocks
    assert not t.any(), np.flatnonzero(t)[:8]


# -- copy_blocks ---------------------------------------------------------------------------
@pytest.mark.parametrize("geom", GEOMETRIES)
@pytest.mark.parametrize("ids", [np.int32, np.int64])
def test_copy_blocks_matches_cpu_with_overlapping_sets(geom, ids):
    import cupy

    gpu, cpu = pair(*geom)
    nb = gpu.num_blocks
    rng = np.random.default_rng(3)
    for step in range(6):
        n = int(rng.integers(1, nb + 1))
        dst = rng.permutation(nb)[:n].astype(ids)
        src = rng.integers(0, nb, n).astype(ids)
        if step == 0:  # a full rotation: every page both read and written
            dst = np.arange(nb, dtype=ids)
            src = np.roll(dst, 1)
        cpu.copy_blocks(src, dst)
        if step % 2:
            gpu.copy_blocks(src, dst)  # host ids
        else:
            gpu.copy_blocks(cupy.asarray(src), cupy.asarray(dst))  # device ids
        assert np.array_equal(gpu.buffer.get(), cpu.buffer), step
        assert_tables_zero(gpu)
    assert gpu.stats["bad_block_ids"] == 0


def test_copy_blocks_mixed_id_dtypes_and_empty():
    import cupy

    gpu, cpu = pair(16, 16, 2, 64)
    src, dst = np.array([3, 4, 5], np.int32), np.array([4, 5, 3], np.int64)
    gpu.copy_blocks(cupy.asarray(src), cupy.asarray(dst))
    cpu.copy_blocks(src, dst)
    gpu.copy_blocks(cupy.zeros(0, cupy.int32), cupy.zeros(0, cupy.int32))
    assert np.array_equal(gpu.buffer.get(), cpu.buffer)


def expected_copy(before, src, dst):
    want = before.copy()
    want[np.asarray(dst)] = before[np.asarray(src)]
    return want


@pytest.mark.parametrize("case", ["swap", "cycle", "reverse", "permutation", "fan_out",
                                  "self", "self_and_readers", "chain", "disjoint",
                                  "fan_out_into_sources"])
@pytest.mark.parametrize("on_device", [True, False])
def test_copy_blocks_overlap_patterns(case, on_device):
    """Every way src and dst can overlap: each result equals NumPy's ``pool[dst] =
    pool[src]`` (a copy of the old pool), and the copy's tables are all zero after it."""
    import cupy

    nb = 300
    gpu, _ = pair(nb, 16, 2, 64, seed=4)
    rng = np.random.default_rng(9)
    ids = rng.permutation(nb)
    src, dst = {
        "swap": ([4, 5], [5, 4]),
        "cycle": (ids[:50], np.roll(ids[:50], 1)),  # a 50-page cycle
        "reverse": (np.arange(nb), np.arange(nb)[::-1]),  # every page swapped with its mirror
        "permutation": (np.arange(nb), ids),  # every page read and written
        "fan_out": ([7] * 40, ids[ids != 7][:40]),  # one page copied to 40
        "self": ([3, 9, 12], [3, 9, 12]),  # every pair a self-copy: nothing changes
        "self_and_readers": ([3, 3, 3, 8], [3, 20, 21, 33]),  # 3 -> 3, and read twice
        "chain": (ids[:100], ids[1:101]),  # page k+1 <- page k: a path, not a cycle
        "disjoint": (ids[:120], ids[120:240]),
        "fan_out_into_sources": (np.repeat(ids[:10], 10), ids[:100]),  # dst 0-9 are sources
    }[case]
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    assert len(np.unique(dst)) == len(dst)
    before = gpu.buffer.get()
    if on_device:
        gpu.copy_blocks(cupy.asarray(src), cupy.asarray(dst))
    else:
        gpu.copy_blocks(src, dst)
    assert np.array_equal(gpu.buffer.get(), expected_copy(before, src, dst))
    assert_tables_zero(gpu)
    assert gpu.stats["bad_block_ids"] == 0


def test_copy_blocks_whole_pool_permutations_repeatedly():
    """A large pool permuted many times in a row on the stream (no sync in between): the
    tables each call leaves must be zero for the next one to be right."""
    import cupy

    nb = 4096
    gpu = PagedKVCache(nb, 16, 2, 64, device="cuda")
    rng = np.random.default_rng(11)
    P = gpu.geometry.page_bytes
    gpu.write_blocks(cupy.arange(nb), cupy.asarray(rng.integers(0, 256, (nb, P), np.uint8)))
    want = gpu.buffer.get().reshape(nb, P)
    for _ in range(8):
        src, dst = rng.permutation(nb), rng.permutation(nb)
        gpu.copy_blocks(cupy.asarray(src.astype(np.int32)), cupy.asarray(dst.astype(np.int32)))
        want = expected_copy(want, src, dst)
    assert np.array_equal(gpu.buffer.get().reshape(nb, P), want)
    assert_tables_zero(gpu)


def test_copy_blocks_repeated_dst_unvalidated_device_ids():
    """Unchecked device ids that repeat a destination: that page gets one of its sources
    whole, no other page changes, and the tables still end at zero."""
    import cupy

    gpu, _ = pair(32, 16, 2, 64, seed=3)
    before = gpu.buffer.get()
    src = np.array([1, 2, 3, 4, 9, 5])
    dst = np.array([9, 9, 9, 6, 1, 6])  # 9 written three times (and read), 6 twice
    gpu.copy_blocks(cupy.asarray(src), cupy.asarray(dst))
    got = gpu.buffer.get()
    assert any(np.array_equal(got[9], before[s]) for s in (1, 2, 3))
    assert any(np.array_equal(got[6], before[s]) for s in (4, 5))
    assert np.array_equal(got[1], before[9])  # read before 9 was written
    keep = np.setdiff1d(np.arange(32), [9, 6, 1])
    assert np.array_equal(got[keep], before[keep])
    assert_tables_zero(gpu)
    assert gpu.stats["bad_block_ids"] == 0


def test_copy_blocks_workspace_is_kept_and_counted():
    import cupy

    gpu, _ = pair(64, 16, 2, 64)
    P = gpu.geometry.page_bytes
    n0 = gpu.nbytes
    gpu.copy_blocks(cupy.asarray([1, 2, 3]), cupy.asarray([2, 3, 1]))
    n1 = gpu.nbytes  # staging rows and tables, taken at the first call
    assert n1 >= n0 + 3 * P + _abi.COPY_TABLES * 4 * 64
    gpu.copy_blocks(cupy.asarray([5, 6]), cupy.asarray([6, 5]))  # fits: kept, not grown
    assert gpu.nbytes == n1
    assert_tables_zero(gpu)


def test_copy_blocks_unvalidated_bad_ids_counted_and_skipped():
    import cupy

    gpu, cpu = pair(16, 16, 2, 64)
    src = np.array([0, 99, 1, -3, 2], np.int64)
    dst = np.array([4, 5, 16, 6, -1], np.int64)
    gpu.copy_blocks(cupy.asarray(src), cupy.asarray(dst))
    cpu.copy_blocks(src, dst, validate=False)
    assert np.array_equal(gpu.buffer.get(), cpu.buffer)
    assert gpu.stats["bad_block_ids"] == cpu.stats["bad_block_ids"] == 4
    assert_tables_zero(gpu)
    with pytest.raises(IndexError):
        gpu.check()


@pytest.mark.parametrize("src, dst, exc, match, validate", [
    ([0, 1], [2, 2], ValueError, "dst repeats block 2", False),  # host ids: always
    ([0, 1], [2, 2], ValueError, "dst repeats block 2", True),
    ([0, 40], [2, 3], IndexError, r"src\[1\] = 40 is out of range", True),
    ([0, 1], [2, -1], IndexError, r"dst\[1\] = -1 is out of range", True),
    ([0, 1], [2], ValueError, "same length", False),
])
@pytest.mark.parametrize("on_device", [False, True])
def test_copy_blocks_refusals_write_nothing(src, dst, exc, match, validate, on_device):
    import cupy

    if on_device and not validate and "repeats" in match:
        pytest.skip("repeats among unvalidated device ids are not checked (no host sync)")
    gpu, _ = pair(16, 16, 2, 64)
    before = gpu.buffer.get()
    s, d = np.array(src), np.array(dst)
    if on_device:
        s, d = cupy.asarray(s), cupy.asarray(d)
    with pytest.raises(exc, match=match):
        gpu.copy_blocks(s, d, validate=validate)
    assert np.array_equal(before, gpu.buffer.get())
    assert gpu.stats["bad_block_ids"] == 0


@pytest.mark.parametrize("ids", [np.int32, np.int64])
def test_copy_blocks_in_a_cuda_graph(ids):
    """copy_blocks captured once, replayed many times with new ids written into the same
    device arrays (disjoint, overlapping, cycles, fan-out, self-copies, a bad id): each
    replay equals the CPU's copy, which holds only if every replay leaves the tables at
    zero for the next."""
    import cupy

    gpu, cpu = pair(48, 16, 4, 128, seed=2)
    n = 20
    src = cupy.arange(n, dtype=ids)
    dst = cupy.arange(n, 2 * n, dtype=ids)
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(8)
    with stream:
        gpu.copy_blocks(src, dst)  # compiles the kernels, takes the workspace
        cpu.copy_blocks(np.arange(n), np.arange(n, 2 * n))
        stream.begin_capture()
        gpu.copy_blocks(src, dst)
        graph = stream.end_capture()
        for step in range(12):
            d = rng.permutation(48)[:n]
            s = [rng.integers(0, 48, n),  # random, overlapping
                 np.roll(d, 1),  # a cycle through the destinations
                 np.full(n, d[0]),  # fan-out of a page that is also written
                 d.copy(),  # all self-copies
                 rng.permutation(48)[:n]][step % 5]
            if step == 7:
                s = s.copy()
                s[3] = 48  # unvalidated bad id: counted, pair skipped
            src.set(s.astype(ids), stream=stream)
            dst.set(d.astype(ids), stream=stream)
            graph.launch(stream)
            cpu.copy_blocks(s, d, validate=False)
            stream.synchronize()
            assert np.array_equal(gpu.buffer.get(), cpu.buffer), step
            assert_tables_zero(gpu)
    assert gpu.stats["bad_block_ids"] == cpu.stats["bad_block_ids"] == 1


# -- read / write ----------------------------------------------------------------------------
@pytest.mark.parametrize("geom", GEOMETRIES)
def test_read_blocks_every_destination(geom):
    import cupy

    gpu, cpu = pair(*geom)
    P = gpu.geometry.page_bytes
    rng = np.random.default_rng(4)
    blocks = rng.integers(0, gpu.num_blocks, 11)
    want = cpu.read_blocks(blocks)
    got = gpu.read_blocks(cupy.asarray(blocks))  # allocated on the device
    assert isinstance(got, cupy.ndarray) and np.array_equal(got.get(), want)
    for ids in (blocks, cupy.asarray(blocks)):
        for host in (fp4cache.pinned_empty((11, P)), np.empty((11, P), np.uint8)):
            assert gpu.read_blocks(ids, out=host) is host
            cupy.cuda.get_current_stream().synchronize()
            assert np.array_equal(host, want)
    flat = cupy.zeros(11 * P + 1, np.uint8)  # a device out= at an odd address
    out = flat[1:].reshape(11, P)
    gpu.read_blocks(cupy.asarray(blocks.astype(np.int32)), out=out)
    assert np.array_equal(out.get(), want)
    # consecutive host ids: direct transfers from the pool, no staging
    host = fp4cache.pinned_empty((5, P))
    gpu.read_blocks(np.array([2, 3, 4, 0, 1]), out=host)
    cupy.cuda.get_current_stream().synchronize()
    assert np.array_equal(host, cpu.read_blocks([2, 3, 4, 0, 1]))


def test_host_transfers_in_several_staging_chunks(monkeypatch):
    import cupy

    gpu, cpu = pair(40, 16, 2, 64)
    P = gpu.geometry.page_bytes
    monkeypatch.setattr(pages, "STAGING_BYTES", 3 * P)  # chunks of 3 pages
    rng = np.random.default_rng(6)
    blocks = rng.permutation(40)[:17]
    host = fp4cache.pinned_empty((17, P))
    gpu.read_blocks(cupy.asarray(blocks), out=host)
    cupy.cuda.get_current_stream().synchronize()
    assert np.array_equal(host, cpu.read_blocks(blocks))
    assert gpu._state.workspace.scratch_bytes >= 3 * P
    data = rng.integers(0, 256, (17, P), dtype=np.uint8)
    pinned = fp4cache.pinned_empty((17, P))
    pinned[...] = data
    dst = rng.permutation(40)[:17]
    gpu.write_blocks(dst, pinned)
    cpu.write_blocks(dst, data)
    cupy.cuda.get_current_stream().synchronize()
    assert np.array_equal(gpu.buffer.get(), cpu.buffer)


def test_nbytes_counts_the_staging_buffer():
    import cupy

    gpu, _ = pair(16, 16, 2, 64)
    n0 = gpu.nbytes
    host = fp4cache.pinned_empty((3, gpu.geometry.page_bytes))
    gpu.read_blocks(cupy.asarray([5, 1, 9]), out=host)
    n1 = gpu.nbytes  # the workspace holds the staged rows
    assert n1 >= n0 + 3 * gpu.geometry.page_bytes
    assert gpu.workspace_nbytes >= 3 * gpu.geometry.page_bytes
    gpu.read_blocks(cupy.asarray([5, 1]), out=host[:2])  # reused, not grown
    assert gpu.nbytes == n1


@pytest.mark.parametrize("source", ["device", "pinned", "pageable"])
@pytest.mark.parametrize("ids_on_device", [False, True])
def test_write_blocks_matches_cpu(source, ids_on_device):
    import cupy

    gpu, cpu = pair(24, 16, 2, 128)
    P = gpu.geometry.page_bytes
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, (9, P), dtype=np.uint8)
    blocks = rng.permutation(24)[:9]
    src = {"device": lambda: cupy.asarray(data), "pageable": lambda: data.copy(),
           "pinned": lambda: fp4cache.pinned_empty((9, P))}[source]()
    if source == "pinned":
        src[...] = data
    gpu.write_blocks(cupy.asarray(blocks) if ids_on_device else blocks, src,
                     page_format=cpu.page_format())
    cpu.write_blocks(blocks, data)
    cupy.cuda.get_current_stream().synchronize()
    assert np.array_equal(gpu.buffer.get(), cpu.buffer)


def test_write_blocks_from_the_pool_itself():
    """Rows that are pages of the same pool (a copy through write_blocks)."""
    gpu, cpu = pair(8, 16, 2, 64)
    P = gpu.geometry.page_bytes
    gpu.write_blocks([1, 2, 3], gpu.buffer[0:3].reshape(3, P))
    cpu.write_blocks([1, 2, 3], cpu.buffer[0:3].reshape(3, P).copy())
    assert np.array_equal(gpu.buffer.get(), cpu.buffer)


def test_unvalidated_bad_ids_read_nan_pages_and_skip_writes():
    import cupy

    gpu, cpu = pair(8, 16, 2, 64)
    ids = np.array([1, 8, -1, 3], np.int64)
    got = gpu.read_blocks(cupy.asarray(ids))
    want = cpu.read_blocks(ids, validate=False)
    assert np.array_equal(got.get(), want)
    data = np.full((4, gpu.geometry.page_bytes), 7, np.uint8)
    gpu.write_blocks(cupy.asarray(ids), cupy.asarray(data))
    cpu.write_blocks(ids, data, validate=False)
    assert np.array_equal(gpu.buffer.get(), cpu.buffer)
    assert gpu.stats["bad_block_ids"] == cpu.stats["bad_block_ids"] == 4


@pytest.mark.parametrize("case", ["dtype", "shape", "format", "range", "repeat", "device_cpu"])
def test_write_blocks_refusals_write_nothing(case):
    import cupy

    gpu, cpu = pair(8, 16, 2, 64)
    P = gpu.geometry.page_bytes
    blocks, data, kw = cupy.asarray([1, 2]), cupy.ones((2, P), np.uint8), {}
    exc, match = {"dtype": (TypeError, "data must have dtype uint8"),
                  "shape": (ValueError, "data must have shape"),
                  "format": (ValueError, "field 'k_scale' differs"),
                  "range": (IndexError, "out of range"),
                  "repeat": (ValueError, "blocks repeats block 1"),
                  "device_cpu": (ValueError, "data must have shape")}[case]
    if case == "dtype":
        data = data.view(np.int8)
    elif case == "shape":
        data = cupy.ones((2, P + 16), np.uint8)
    elif case == "format":
        kw["page_format"] = dict(gpu.page_format(), k_scale=1.0)
    elif case == "range":
        blocks = cupy.asarray([1, 8])
        kw["validate"] = True
    elif case == "repeat":
        blocks = np.array([1, 1])
    elif case == "device_cpu":
        data = np.ones((3, P), np.uint8)
    before = gpu.buffer.get()
    with pytest.raises(exc, match=match):
        gpu.write_blocks(blocks, data, **kw)
    assert np.array_equal(before, gpu.buffer.get())


@pytest.mark.parametrize("case", ["dtype", "shape", "pool", "cpu_cache_cupy_out"])
def test_read_blocks_refusals(case):
    import cupy

    gpu, cpu = pair(8, 16, 2, 64)
    P = gpu.geometry.page_bytes
    cache, out = gpu, cupy.zeros((2, P), np.uint8)
    exc, match = {"dtype": (TypeError, "out must have dtype uint8"),
                  "shape": (ValueError, "out must have shape"),
                  "pool": (ValueError, "must not overlap"),
                  "cpu_cache_cupy_out": (TypeError, "must be a NumPy array")}[case]
    if case == "dtype":
        out = cupy.zeros((2, P), np.float32)
    elif case == "shape":
        out = np.zeros((2, P + 1), np.uint8)
    elif case == "pool":
        out = gpu.buffer[:2].reshape(2, P)
    else:
        cache = cpu
    before = gpu.buffer.get()
    with pytest.raises(exc, match=match):
        cache.read_blocks([0, 1], out=out)
    assert np.array_equal(before, gpu.buffer.get())


# -- across backends ---------------------------------------------------------------------------
def test_pages_move_between_backends_byte_exact():
    import cupy

    gpu, cpu = pair(12, 16, 4, 128, rule="4over6")
    fresh_gpu = PagedKVCache(12, 16, 4, 128, scale_rule="4over6", k_scale=0.5,
                             v_scale=0.25, device="cuda")
    fresh_cpu = PagedKVCache(12, 16, 4, 128, scale_rule="4over6", k_scale=0.5,
                             v_scale=0.25, device="cpu")
    blocks = np.array([11, 0, 5, 6])
    fresh_cpu.write_blocks(blocks, gpu.read_blocks(cupy.asarray(blocks)).get(),
                           page_format=gpu.page_format())
    fresh_gpu.write_blocks(blocks, cpu.read_blocks(blocks), page_format=cpu.page_format())
    assert np.array_equal(fresh_cpu.buffer[blocks], cpu.buffer[blocks])
    assert np.array_equal(fresh_gpu.buffer.get(), fresh_cpu.buffer)


@pytest.mark.parametrize("direction", ["gpu_to_cpu", "cpu_to_gpu"])
def test_save_on_one_backend_load_on_the_other(tmp_path, direction):
    pytest.importorskip("safetensors")
    import cupy

    gpu, cpu = pair(10, 16, 2, 128, seed=11)
    path = tmp_path / "c.safetensors"
    src, dev = (gpu, "cpu") if direction == "gpu_to_cpu" else (cpu, "cuda")
    src.save(path)
    back = PagedKVCache.load(path, device=dev)
    assert back.device == dev and back.page_format() == src.page_format()
    buf = back.buffer.get() if dev == "cuda" else back.buffer
    assert np.array_equal(buf, cpu.buffer)
    # attention over the reloaded pages equals attention over the originals
    q = np.random.default_rng(1).standard_normal((2, 4, 128)).astype(np.float32)
    tables, lens = np.array([[0, 3, 5], [7, 1, 9]]), np.array([40, 48])
    ref = cpu.decode_attention(q, tables, lens)
    xp = cupy if dev == "cuda" else np
    got = back.decode_attention(xp.asarray(q), xp.asarray(tables), xp.asarray(lens))
    got = got.get() if dev == "cuda" else got
    if dev == "cpu":
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    else:
        gpu_ref = gpu.decode_attention(cupy.asarray(q), cupy.asarray(tables),
                                       cupy.asarray(lens)).get()
        assert np.array_equal(got.view(np.uint32), gpu_ref.view(np.uint32))
    # load_pages into a GPU cache at new ids
    other = PagedKVCache(20, 16, 2, 128, k_scale=0.5, v_scale=0.25, device="cuda")
    other.load_pages(path, blocks=np.arange(10, 20))
    assert np.array_equal(other.buffer[10:].get(), cpu.buffer)


def test_slot_mapping_on_cupy_matches_numpy():
    import cupy

    rng = np.random.default_rng(0)
    tables = rng.permutation(500)[:40].reshape(4, 10).astype(np.int32)
    positions = rng.integers(-1, 160, (4, 33))
    want = fp4cache.slot_mapping(tables, positions, block_size=16)
    got = fp4cache.slot_mapping(cupy.asarray(tables), cupy.asarray(positions), block_size=16)
    assert isinstance(got, cupy.ndarray) and np.array_equal(got.get(), want)
    got = fp4cache.slot_mapping(cupy.asarray(tables), cupy.asarray(positions), block_size=16,
                                validate=False)
    assert np.array_equal(got.get(), want)
    with pytest.raises(IndexError, match="past the block table"):
        fp4cache.slot_mapping(cupy.asarray(tables), cupy.asarray([[0]] * 3 + [[160]]),
                              block_size=16)


def test_pinned_empty_is_page_locked():
    import cupy

    a = fp4cache.pinned_empty((4, 1000), np.uint8)
    attrs = cupy.cuda.runtime.pointerGetAttributes(a.ctypes.data)
    assert attrs.type == cupy.cuda.runtime.memoryTypeHost
