"""The exact window and the Hadamard rotation (``docs/window.md``) on the CPU backend:
bit-exact stores, gathers and window rows, attention against a float64 reference that
applies the same exact / NVFP4 split, page moves and files, and bad input."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from helpers import bf16_values, capture_stream, sylvester, window_reference

from fp4cache import PagedKVCache, formats

try:  # CuPy, for the GPU cases (which skip by their marker where there is no GPU)
    import cupy as cp
except ImportError:
    cp = None

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)


def kv(rng, n, H, D, dtype=F32, outliers=True):
    k = rng.standard_normal((n, H, D), dtype=np.float32)
    if outliers:
        k[:, :, :: max(1, D // 4)] *= 8
    v = rng.standard_normal((n, H, D), dtype=np.float32)
    return k.astype(dtype), v.astype(dtype)


# -- the transform ---------------------------------------------------------------------------
@pytest.mark.parametrize("d", [1, 2, 4, 16, 32, 64, 128, 256])
def test_hadamard_is_the_normalized_matrix(d):
    x = np.random.default_rng(d).standard_normal((7, d)).astype(np.float32)
    got = formats.hadamard(x)
    assert got.dtype == F32
    np.testing.assert_allclose(got, x.astype(np.float64) @ sylvester(d).T, rtol=0,
                               atol=1e-5 * max(1.0, float(np.abs(x).max())))
    np.testing.assert_allclose(formats.hadamard(got), x, rtol=0, atol=1e-5)


def test_hadamard_stage_order_is_the_contract():
    # the butterflies of strides 1, 2, ..., D/2 in float32, then fl32(1/sqrt(D)): a float32
    # loop written out element by element gives the same bits
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 128)) * 10.0 ** rng.integers(-3, 4, (5, 128))).astype(F32)
    y = x.copy()
    s = 1
    while s < 128:
        for i in range(128):
            if i & s == 0:
                a, b = y[:, i].copy(), y[:, i + s].copy()
                y[:, i], y[:, i + s] = a + b, a - b
        s *= 2
    y = y * np.float32(1 / math.sqrt(128))
    assert np.array_equal(formats.hadamard(x).view(np.uint32), y.view(np.uint32))


def test_hadamard_rejects_other_lengths():
    with pytest.raises(ValueError, match="power-of-two"):
        formats.hadamard(np.zeros((2, 96), np.float32))


def test_bf16_bits_every_bfloat16_and_rounding():
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    vals = bf16_values(every)
    bits = formats.bf16_bits(vals)
    finite = ~np.isnan(vals)
    assert np.array_equal(bits[finite], every[finite])  # exact values stay
    assert np.all(bits[~finite] == 0x7FC0)  # NaN -> the one quiet NaN
    x = np.random.default_rng(0).standard_normal(100000).astype(np.float32)
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)  # ml_dtypes: round to nearest even
    assert np.array_equal(formats.bf16_bits(x), want)


# -- options ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    ({"rotation": "random"}, "rotation must be"),
    ({"rotation": "hadamard", "head_dim": 192}, "power-of-two head_dim"),
    ({"window_pages": 2}, "both 0"),
    ({"window_slots": 2}, "both 0"),
    ({"window_pages": -1, "window_slots": 2}, "non-negative"),
    ({"window_pages": 2, "window_slots": 2, "block_size": 8}, "block_size % 16"),
    ({"window_pages": 65, "window_slots": 2}, "at most 64"),
    ({"window_pages": True, "window_slots": 2}, "non-negative integer"),
])
def test_bad_options(kw, match):
    args = {"num_blocks": 4, "block_size": 16, "num_heads": 2, "head_dim": 64}
    kw = dict(kw)
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    with pytest.raises(ValueError, match=match):
        PagedKVCache(args["num_blocks"], args["block_size"], args["num_heads"],
                     args["head_dim"], device="cpu", **kw)


def test_nbytes_counts_the_window():
    plain = PagedKVCache(10, 16, 2, 64, device="cpu")
    win = PagedKVCache(10, 16, 2, 64, device="cpu", window_pages=3, window_slots=6)
    assert win.nbytes - plain.nbytes == 6 * 2 * 16 * 2 * 64 * 2 + 10 * 4
    assert win.window.shape == (6, 2, 16, 2, 64) and win.window.dtype == np.uint16
    assert win.window_map.tolist() == [-1] * 10
    assert (win.rotation, win.window_pages, win.window_slots) == ("none", 3, 6)


# -- store and gather ------------------------------------------------------------------------
@pytest.mark.parametrize("D", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("rule", ["static6", "4over6"])
def test_rotated_store_is_the_plain_store_of_rotated_keys(D, dtype, rule):
    rng = np.random.default_rng(D)
    k, v = kv(rng, 40, 2, D, dtype)
    kw = dict(scale_rule=rule, k_scale=0.02, v_scale=0.01, device="cpu",
              swizzle_v_scales=D % 64 == 0)
    rot = PagedKVCache(4, 16, 2, D, rotation="hadamard", **kw)
    plain = PagedKVCache(4, 16, 2, D, **kw)
    slots = rng.permutation(64)[:40]
    rot.store(slots, k, v)
    plain.store(slots, formats.hadamard(k), v.astype(np.float32))
    assert np.array_equal(rot.buffer, plain.buffer)
    assert rot.stats == plain.stats
    for out in (BF16, F16, F32):
        kr, vr = rot.gather_dequant(np.array([3, 0, 2]), dtype=out)
        kp, vp = plain.gather_dequant(np.array([3, 0, 2]), dtype="float32")
        assert np.array_equal(formats.float32_to(formats.hadamard(kp), out).view(np.uint8),
                              kr.view(np.uint8))
        assert np.array_equal(vr.view(np.uint8), formats.float32_to(vp, out).view(np.uint8))


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_store_writes_mapped_pages_to_the_window(rotation, dtype):
    rng = np.random.default_rng(1)
    H, D, T = 2, 64, 16
    c = PagedKVCache(6, T, H, D, device="cpu", rotation=rotation, window_pages=2,
                     window_slots=3, k_scale=0.02, v_scale=0.01)
    c.map_window([4, 1], [2, 0])
    before = c.window.copy()
    k, v = kv(rng, 50, H, D, dtype)
    k[7, 1, 20] = np.nan  # a group of token 7 (page 0: not mapped)
    v[20, 0, 33] = np.inf  # token 20: page 1, slot 0
    slots = np.arange(50)
    slots[3] = -1
    c.store(slots, k, v)
    kr = formats.hadamard(k) if rotation == "hadamard" else k.astype(np.float32)
    for page, slot in ((1, 0), (4, 2)):
        toks = np.arange(page * T, min(50, (page + 1) * T))
        rows = toks - page * T
        want_k = formats.bf16_bits(kr[toks])
        want_v = formats.bf16_bits(v[toks].astype(np.float32))
        if page == 1:
            want_v[20 - 16, 0, 32:48] = 0x7FC0  # the whole group of 16
        assert np.array_equal(c.window[slot, 0, rows], want_k)
        assert np.array_equal(c.window[slot, 1, rows], want_v)
        assert not c.window[slot, :, len(rows):].any()
    assert np.array_equal(c.window[1], before[1])  # slot 1 holds no page


def test_store_window_last_occurrence_wins_and_padding():
    rng = np.random.default_rng(2)
    c = PagedKVCache(4, 16, 1, 64, device="cpu", window_pages=1, window_slots=1)
    c.map_window([2], [0])
    k, v = kv(rng, 3, 1, 64)
    c.store(np.array([33, -1, 33]), k, v, unique_slots=False)
    assert np.array_equal(c.window[0, 0, 1], formats.bf16_bits(k[2]))
    assert not c.window[0, :, 0].any() and not c.window[0, :, 2:].any()


# -- map_window ------------------------------------------------------------------------------
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_map_window_fills_from_the_pages(rotation):
    rng = np.random.default_rng(4)
    c = PagedKVCache(5, 16, 2, 64, device="cpu", rotation=rotation, window_pages=2,
                     window_slots=2, k_scale=0.02, v_scale=0.01)
    k, v = kv(rng, 80, 2, 64)
    k[5, 0, :16] = np.nan
    c.store(np.arange(80), k, v)
    c.map_window(np.array([3, 1]), np.array([1, 0]))
    twin = PagedKVCache(5, 16, 2, 64, device="cpu", k_scale=0.02, v_scale=0.01)
    twin.buffer[:] = c.buffer  # the pages decoded in the stored basis
    kd, vd = twin.gather_dequant(np.array([1, 3]), dtype="float32")
    assert np.array_equal(c.window[0, 0], formats.bf16_bits(kd[:16]))
    assert np.array_equal(c.window[1, 1], formats.bf16_bits(vd[16:]))
    # unmapping leaves the map at -1; mapping page 0 fills its NaN group with 0x7FC0
    c.map_window([1, 0], [-1, 0])
    assert c.window_map.tolist() == [0, -1, -1, 1, -1]
    assert np.all(c.window[0, 0, 5, 0, :16] == 0x7FC0)


def test_map_window_bad_input_changes_nothing():
    c = PagedKVCache(5, 16, 1, 64, device="cpu", window_pages=2, window_slots=2)
    c.map_window([0], [1])
    snap = (c.window_map.copy(), c.window.copy(), c.buffer.copy())
    cases = [
        (([0, 1], [0]), ValueError, "same length"),
        (([5], [0]), IndexError, "blocks"),
        (([1], [2]), IndexError, "window_slots = 2"),
        (([1], [-2]), IndexError, "slots"),
        (([1, 1], [0, -1]), ValueError, "repeats block"),
        (([2], [1]), ValueError, "slot 1 would hold blocks \\[0, 2\\]"),
        (([2, 3], [0, 0]), ValueError, "slot 0 would hold"),
    ]
    for (b, s), exc, match in cases:
        with pytest.raises(exc, match=match):
            c.map_window(b, s)
        assert np.array_equal(c.window_map, snap[0])
        assert np.array_equal(c.window, snap[1]) and np.array_equal(c.buffer, snap[2])
    c.map_window([0, 2], [-1, 1])  # the ring's move: unmap and map in one call
    assert c.window_map.tolist() == [-1, -1, 1, -1, -1]
    with pytest.raises(ValueError, match="exact window"):
        PagedKVCache(4, 16, 1, 64, device="cpu").map_window([0], [0])


# -- attention -------------------------------------------------------------------------------
def filled_window_cache(rng, *, rotation, T=16, H=2, D=64, num_blocks=24, P=3, lens=(),
                        unmapped=(), layout="HND"):
    """A cache whose sequences (one table row each) were stored with the window ring in
    use: each page mapped before it is written, the page P back unmapped."""
    c = PagedKVCache(num_blocks, T, H, D, device="cpu", rotation=rotation, window_pages=P,
                     window_slots=P * len(lens), k_scale=0.03, v_scale=0.01, layout=layout,
                     scale_rule="4over6")
    width = max(-(-n // T) for n in lens)
    tab = np.zeros((len(lens), width), np.int32)
    perm = rng.permutation(num_blocks)
    used = 0
    for b, n in enumerate(lens):
        npg = -(-n // T)
        tab[b, :npg] = perm[used:used + npg]
        used += npg
        for p in range(npg):
            blocks, slots = [int(tab[b, p])], [b * P + p % P]
            if p >= P:
                blocks.append(int(tab[b, p - P]))
                slots.append(-1)
            c.map_window(blocks, slots)
            toks = np.arange(p * T, min(n, (p + 1) * T))
            k, v = kv(rng, len(toks), H, D)
            c.store(tab[b, p] * T + toks % T, k, v)
    for b, p in unmapped:  # a page of the window lost its slot
        c.map_window([int(tab[b, p])], [-1])
    return c, tab, np.asarray(lens, np.int32)


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_decode_reads_the_window(rotation, dtype):
    rng = np.random.default_rng(6)
    lens = (1, 15, 16, 17, 40, 48, 100)
    c, tab, sl = filled_window_cache(rng, rotation=rotation, lens=lens,
                                     unmapped=[(5, 1), (6, 6)])
    q = rng.standard_normal((len(lens), 8, 64)).astype(dtype)
    out, lse = c.decode_attention(q, tab, sl, return_lse=True)
    ref, ref_lse = window_reference(c, q, np.arange(len(lens) + 1), tab, sl, causal=False)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=1e-2 if dtype == BF16 else
                               2e-3 if dtype == F16 else 1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_any_length_attention_reads_the_window(rotation, layout):
    rng = np.random.default_rng(7)
    lens = (3, 33, 64, 130, 47)
    nq = np.array([3, 1, 20, 70, 0])
    c, tab, sl = filled_window_cache(rng, rotation=rotation, lens=lens, layout=layout,
                                     unmapped=[(3, 8)])
    qsl = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
    q = rng.standard_normal((int(nq.sum()), 4, 64)).astype(np.float32)
    for causal in (True, False):
        out, lse = c.attention(q, qsl, tab, sl, causal=causal, return_lse=True)
        ref, ref_lse = window_reference(c, q, qsl, tab, sl, causal=causal)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_window_changes_only_what_it_should():
    # mapped pages that are not among a sequence's last window_pages pages change nothing;
    # the last pages mapped are read exactly, and the outputs get closer to exact K/V
    rng = np.random.default_rng(8)
    T, H, D, B = 16, 2, 64, 100
    n = 64
    k, v = kv(rng, n, H, D)
    q = rng.standard_normal((B, 4, D)).astype(np.float32)
    tab = np.tile(np.array([[3, 1, 0, 2]], np.int32), (B, 1))
    slots = tab[0, np.arange(n) // T] * T + np.arange(n) % T
    res = {}
    for mapped in ((), (3,), (2, 0), (0, 2), (3, 1, 0, 2)):
        c = PagedKVCache(4, T, H, D, device="cpu", window_pages=2, window_slots=4,
                         k_scale=0.03, v_scale=0.01)
        if mapped:
            c.map_window(list(mapped), list(range(len(mapped))))
        c.store(slots, k, v)
        res[mapped] = c.decode_attention(q, tab, np.full(B, n))
    assert np.array_equal(res[()], res[(3,)])  # page 3 is the sequence's first
    assert not np.array_equal(res[()], res[(2, 0)])
    assert np.array_equal(res[(2, 0)], res[(0, 2)])
    assert np.array_equal(res[(2, 0)], res[(3, 1, 0, 2)])  # at most window_pages pages
    s = (q.astype(np.float64).reshape(B, H, 2, D) @ k.transpose(1, 2, 0)[None]) / 8
    w = np.exp(s - s.max(-1, keepdims=True))
    exact = (w / w.sum(-1, keepdims=True)) @ v.transpose(1, 0, 2)[None]
    err = {m: np.abs(res[m].reshape(B, H, 2, D) - exact).mean() for m in res}
    assert err[(2, 0)] < 0.8 * err[()], err


# -- page moves and files --------------------------------------------------------------------
def test_copy_blocks_carries_the_window():
    rng = np.random.default_rng(9)
    c = PagedKVCache(6, 16, 2, 64, device="cpu", rotation="hadamard", window_pages=2,
                     window_slots=4, k_scale=0.03, v_scale=0.01)
    c.map_window([0, 1, 4], [0, 1, 2])
    k, v = kv(rng, 96, 2, 64)
    c.store(np.arange(96), k, v)
    before = c.window.copy()
    # 0 -> 4 (both mapped: the exact rows), 3 -> 1 (source not mapped: filled from the
    # copied page), 1 -> 5 (destination not mapped: nothing), every read before any write
    c.copy_blocks([0, 3, 1], [4, 1, 5])
    assert np.array_equal(c.window[2], before[0])
    twin = PagedKVCache(6, 16, 2, 64, device="cpu", k_scale=0.03, v_scale=0.01)
    twin.buffer[:] = c.buffer
    kd, vd = twin.gather_dequant([1], dtype="float32")
    assert np.array_equal(c.window[1, 0], formats.bf16_bits(kd))
    assert np.array_equal(c.window[1, 1], formats.bf16_bits(vd))
    assert np.array_equal(c.window[0], before[0]) and np.array_equal(c.window[3], before[3])
    # a chain in one call: 4 -> 0 and 0 -> 4 swap the exact rows
    c.copy_blocks([4, 0], [0, 4])
    assert np.array_equal(c.window[0], before[0]) and np.array_equal(c.window[2], before[0])


def test_write_blocks_fills_mapped_windows():
    rng = np.random.default_rng(10)
    src = PagedKVCache(4, 16, 1, 64, device="cpu", k_scale=0.03, v_scale=0.01)
    k, v = kv(rng, 64, 1, 64)
    src.store(np.arange(64), k, v)
    dst = PagedKVCache(4, 16, 1, 64, device="cpu", window_pages=1, window_slots=1,
                       k_scale=0.03, v_scale=0.01)
    dst.map_window([2], [0])
    dst.write_blocks([2, 3], src.read_blocks([0, 1]), page_format=src.page_format())
    kd, vd = src.gather_dequant([0], dtype="float32")
    assert np.array_equal(dst.window[0, 0], formats.bf16_bits(kd))
    assert np.array_equal(dst.window[0, 1], formats.bf16_bits(vd))


def test_save_load_keeps_window_and_rotation(tmp_path):
    rng = np.random.default_rng(11)
    c, tab, sl = filled_window_cache(rng, rotation="hadamard", lens=(40, 70))
    f = tmp_path / "w.safetensors"
    c.save(f)
    d = PagedKVCache.load(f, device="cpu")
    assert (d.rotation, d.window_pages, d.window_slots) == ("hadamard", 3, 6)
    assert np.array_equal(d.buffer, c.buffer)
    assert np.array_equal(d.window_map, c.window_map)
    live = np.unique(c.window_map[c.window_map >= 0])
    assert np.array_equal(d.window[live], c.window[live])
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    assert np.array_equal(d.decode_attention(q, tab, sl), c.decode_attention(q, tab, sl))
    # load_pages into a cache whose pages are mapped elsewhere: the saved rows land in the
    # slots the pages hold now
    e = PagedKVCache(c.num_blocks, 16, 2, 64, device="cpu", rotation="hadamard",
                     window_pages=3, window_slots=6, k_scale=c.k_scale, v_scale=c.v_scale,
                     scale_rule="4over6")
    m = np.flatnonzero(c.window_map >= 0)
    e.map_window(m, np.arange(m.size)[::-1])
    e.load_pages(f)
    for j, b in enumerate(m):
        assert np.array_equal(e.window[m.size - 1 - j], c.window[c.window_map[b]])
    assert np.array_equal(e.decode_attention(q, tab, sl), c.decode_attention(q, tab, sl))


def test_page_format_names_rotation_and_window():
    plain = PagedKVCache(4, 16, 2, 64, device="cpu")
    rot = PagedKVCache(4, 16, 2, 64, device="cpu", rotation="hadamard")
    win = PagedKVCache(4, 16, 2, 64, device="cpu", window_pages=2, window_slots=2)
    assert "rotation" not in plain.page_format() and "window_pages" not in plain.page_format()
    assert rot.page_format()["rotation"] == "hadamard"
    assert win.page_format()["window_pages"] == 2
    data = plain.read_blocks([0])
    for a, b in ((rot, plain), (plain, rot)):
        before = a.buffer.copy()
        with pytest.raises(ValueError, match="'rotation' differs"):
            a.write_blocks([1], b.read_blocks([0]), page_format=b.page_format())
        assert np.array_equal(a.buffer, before)
    # the window is not part of the page bytes: pages move both ways
    win.write_blocks([1], data, page_format=plain.page_format())
    plain.write_blocks([1], win.read_blocks([1]), page_format=win.page_format())


# -- the GPU backend against the CPU backend -------------------------------------------------
def gpu_twins(num_blocks=6, T=16, H=2, D=64, **kw):
    """A CPU and a GPU cache of the same options."""
    kw = {"k_scale": 0.02, "v_scale": 0.01, **kw}
    return (PagedKVCache(num_blocks, T, H, D, device="cpu", **kw),
            PagedKVCache(num_blocks, T, H, D, device="cuda", **kw))


def assert_same_pool(gpu, cpu, what=""):
    """Pages, window slots, window map and counters byte for byte."""
    assert np.array_equal(cp.asnumpy(gpu.buffer), cpu.buffer), f"{what}: pages"
    if cpu.window is not None:
        gw, cw = cp.asnumpy(gpu.window), cpu.window
        bad = np.argwhere(gw != cw)
        assert bad.size == 0, f"{what}: window differs at {bad[:4].tolist()}"
        assert np.array_equal(cp.asnumpy(gpu.window_map), cpu.window_map), f"{what}: map"
    assert gpu.stats == cpu.stats, what


def gpu_store_inputs(rng, n, H, D, dtype, num_slots):
    """K, V with a NaN and an infinity, slots with repeats, padding (-1) and bad ones."""
    k, v = kv(rng, n, H, D, dtype)
    k[n // 2, H - 1, D // 3] = np.nan
    v[n // 3, 0, D - 1] = np.inf
    slots = rng.integers(0, num_slots, n).astype(np.int64)
    if n > 2:
        slots[1] = -1
        slots[2] = num_slots + 3 if n % 2 else -7
    return k, v, slots


def store_both(cpu, gpu, k, v, slots, unique_slots=False):
    """The same store on both (bad slots are counted, not raised: validate=False)."""
    cpu.store(slots, k, v, unique_slots=unique_slots, validate=False)
    gpu.store(cp.asarray(slots), cp.asarray(k), cp.asarray(v), unique_slots=unique_slots,
              validate=False)


def _store_cases():
    # every head_dim with the transform; every dtype, rule and layout at 128; odd H (one
    # head per thread) and even H (two heads per thread for 16-bit static6)
    for D in (16, 32, 64, 256):
        yield D, BF16, "static6", "HND" if D < 64 else "NHD", 2
    for dtype in (BF16, F16, F32):
        for rule in ("static6", "4over6"):
            for layout in ("HND", "NHD"):
                yield 128, dtype, rule, layout, 2
    yield 64, BF16, "static6", "HND", 3
    yield 64, F16, "4over6", "NHD", 1


@pytest.mark.gpu
class TestGpu:
    """The CuPy backend's store, gather and window functions against the CPU backend,
    through the public methods: pages, window bits, map and counters byte for byte."""

    @pytest.mark.parametrize("D, dtype, rule, layout, H", list(_store_cases()),
                             ids=lambda x: str(x))
    @pytest.mark.parametrize("rotation, window", [("hadamard", False), ("none", True),
                                                  ("hadamard", True)])
    def test_store_and_gather_equal_cpu(self, D, dtype, rule, layout, H, rotation, window):
        rng = np.random.default_rng(D * 7 + H)
        nb, T = 6, 16
        opts = dict(rotation=rotation, scale_rule=rule, layout=layout,
                    swizzle_v_scales=D % 64 == 0 and layout == "HND")
        if window:
            opts.update(window_pages=2, window_slots=3)
        cpu, gpu = gpu_twins(nb, T, H, D, **opts)
        if window:  # pages 2 and 5 stay unmapped
            for c in (cpu, gpu):
                c.map_window(np.array([1, 4, 0]), np.array([0, 2, 1]))
        # n = 1: no duplicate pass, a grid tail of one token; 50: the scan; 300: the claim
        for n in (1, 50, 300):
            k, v, slots = gpu_store_inputs(rng, n, H, D, dtype, nb * T)
            store_both(cpu, gpu, k, v, slots)
            assert_same_pool(gpu, cpu, f"store of {n}")
        # unique slots (no duplicate pass), one token per page of the pool
        k, v, _ = gpu_store_inputs(rng, nb * T, H, D, dtype, nb * T)
        store_both(cpu, gpu, k, v, rng.permutation(nb * T), unique_slots=True)
        assert_same_pool(gpu, cpu, "unique")
        blocks = np.array([3, 0, 5, 0, 1, 4, 2])
        for out in (BF16, F16, F32):
            ck, cv = cpu.gather_dequant(blocks, dtype=out)
            gk, gv = gpu.gather_dequant(cp.asarray(blocks), dtype=out)
            same_bits(gk, ck, "gather K")
            same_bits(gv, cv, "gather V")

    @pytest.mark.parametrize("rotation", ["none", "hadamard"])
    @pytest.mark.parametrize("D, H, layout", [(16, 1, "NHD"), (64, 2, "HND"),
                                              (256, 3, "HND")])
    @pytest.mark.parametrize("itype", [np.int32, np.int64])
    def test_map_fill_and_copy_equal_cpu(self, rotation, D, H, layout, itype):
        rng = np.random.default_rng(D + H)
        nb, T = 8, 16
        cpu, gpu = gpu_twins(nb, T, H, D, rotation=rotation, layout=layout,
                             swizzle_v_scales=layout == "HND", window_pages=2,
                             window_slots=5)
        k, v, slots = gpu_store_inputs(rng, nb * T, H, D, BF16, nb * T)
        store_both(cpu, gpu, k, v, rng.permutation(nb * T))

        def both(name, *ids):
            getattr(cpu, name)(*ids)
            getattr(gpu, name)(*(cp.asarray(np.asarray(a, itype)) for a in ids))
            assert_same_pool(gpu, cpu, name)

        both("map_window", [0, 2, 3, 6], [1, 0, 4, 2])
        both("map_window", [3, 5], [-1, 4])  # unmap and map in one call
        # chains and swaps: 2 -> 0 (both mapped), 0 -> 2, 1 -> 6 (source unmapped),
        # 6 -> 7 (destination unmapped), 5 -> 5 (itself)
        both("copy_blocks", [2, 0, 1, 6, 5], [0, 2, 6, 7, 5])
        both("copy_blocks", [7, 3], [5, 0])
        rows = cpu.read_blocks([4, 1])
        cpu.write_blocks([2, 3], rows, page_format=cpu.page_format())
        gpu.write_blocks(cp.asarray(np.array([2, 3], itype)), cp.asarray(rows),
                         page_format=gpu.page_format())
        assert_same_pool(gpu, cpu, "write_blocks")

    def test_window_calls_in_a_cuda_graph(self):
        cpu, gpu = gpu_twins(8, 16, 2, 64, rotation="hadamard", window_pages=2,
                             window_slots=4)
        rng = np.random.default_rng(5)
        k, v, slots = gpu_store_inputs(rng, 128, 2, 64, BF16, 128)
        store_both(cpu, gpu, k, v, np.arange(128))
        dk, dv, ds = cp.asarray(k[:20]), cp.asarray(v[:20]), cp.asarray(np.arange(20) + 40)
        b, s = cp.asarray(np.array([2, 3])), cp.asarray(np.array([0, 1]))
        src, dst = cp.asarray(np.array([2, 5])), cp.asarray(np.array([3, 2]))
        # the first calls prepare plans and workspace; the capture allocates nothing
        gpu.map_window(b, s, validate=False)
        gpu.copy_blocks(src, dst, validate=False)
        gpu.store(ds, dk, dv)
        cp.cuda.Device().synchronize()
        stream = capture_stream()
        with stream:
            stream.begin_capture()
            gpu.map_window(b, s, validate=False)
            gpu.copy_blocks(src, dst, validate=False)
            gpu.store(ds, dk, dv)
            graph = stream.end_capture()
            graph.launch(stream)
        stream.synchronize()
        for _ in range(2):
            cpu.map_window([2, 3], [0, 1])
            cpu.copy_blocks([2, 5], [3, 2])
            cpu.store(np.arange(20) + 40, k[:20], v[:20])
        assert_same_pool(gpu, cpu, "graph")


def same_bits(gpu, ref, what=""):
    """Bit-identical float arrays, NaN anywhere the reference has NaN (payloads apart)."""
    g = cp.asnumpy(gpu)
    assert g.shape == ref.shape and g.dtype == ref.dtype, what
    gn, rn = np.isnan(g.astype(np.float32)), np.isnan(ref.astype(np.float32))
    assert np.array_equal(gn, rn), f"{what}: NaN positions differ ({gn.sum()} vs {rn.sum()})"
    u = {2: np.uint16, 4: np.uint32}[ref.dtype.itemsize]
    bad = np.flatnonzero(np.where(rn, 0, g.view(u)) != np.where(rn, 0, ref.view(u)))
    assert bad.size == 0, f"{what}: {bad.size} values differ, first at {bad[:5]}"
