"""Moving pages on the CPU backend: copy_blocks, read_blocks, write_blocks,
page_format, save / load / load_pages, slot_mapping, pinned_empty.

Every move is of raw page bytes, so every comparison is exact.  Every refusal leaves the
buffer byte-identical (compared before / after).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import fp4cache
from fp4cache import PagedKVCache, pages

GEOMETRIES = [  # (num_blocks, block_size, heads, head_dim, layout, swizzle)
    (12, 16, 2, 64, "HND", True),
    (9, 8, 3, 128, "NHD", True),
    (10, 4, 1, 16, "HND", False),
    (7, 3, 1, 16, "NHD", False),  # page_bytes 54: not a multiple of 4
]


def filled(nb, T, H, D, layout="HND", swizzle=True, *, rule="static6", k_scale=0.5,
           v_scale=0.25, seed=0, device="cpu"):
    """A cache whose every page holds distinct random K/V."""
    cache = PagedKVCache(nb, T, H, D, layout=layout, swizzle_v_scales=swizzle,
                         scale_rule=rule, k_scale=k_scale, v_scale=v_scale, device=device)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((nb * T, H, D)).astype(np.float32)
    v = rng.standard_normal((nb * T, H, D)).astype(np.float32)
    cache.store(rng.permutation(nb * T), k, v)
    return cache


def expected_copy(buffer, src, dst):
    want = buffer.copy()
    want[np.asarray(dst)] = buffer[np.asarray(src)]
    return want


# -- copy_blocks ---------------------------------------------------------------------------
@pytest.mark.parametrize("geom", GEOMETRIES)
@pytest.mark.parametrize("ids", [np.int32, np.int64])
def test_copy_blocks_matches_simultaneous_assignment(geom, ids):
    cache = filled(*geom)
    nb = cache.num_blocks
    rng = np.random.default_rng(1)
    for _ in range(5):  # random sets that overlap: a page is often both read and written
        n = int(rng.integers(1, nb + 1))
        dst = rng.permutation(nb)[:n].astype(ids)
        src = rng.integers(0, nb, n).astype(ids)
        before = cache.buffer.copy()
        cache.copy_blocks(src, dst)
        assert np.array_equal(cache.buffer, expected_copy(before, src, dst))
    assert cache.stats["bad_block_ids"] == 0


def test_copy_blocks_cycles_and_swaps_read_before_write():
    cache = filled(6, 16, 2, 64)
    before = cache.buffer.copy()
    cache.copy_blocks([0, 1, 2, 3], [1, 2, 3, 0])  # a 4-cycle: needs every read first
    for i in range(4):
        assert np.array_equal(cache.buffer[(i + 1) % 4], before[i])
    before = cache.buffer.copy()
    cache.copy_blocks([4, 5], [5, 4])
    assert np.array_equal(cache.buffer[4], before[5])
    assert np.array_equal(cache.buffer[5], before[4])
    before = cache.buffer.copy()
    cache.copy_blocks([2, 2, 2], [2, 0, 1])  # one source to several pages, itself included
    for p in (0, 1, 2):
        assert np.array_equal(cache.buffer[p], before[2])


def test_copy_blocks_fan_out_from_pages_that_are_written():
    """Sources read by several pairs and written by another (a swap inside a fan-out), and
    self-copies among them: every page gets the old bytes of its source."""
    cache = filled(6, 16, 2, 64)
    before = cache.buffer.copy()
    cache.copy_blocks([0, 0, 1, 3, 0], [1, 2, 0, 3, 4])
    for d, s in ((1, 0), (2, 0), (0, 1), (3, 3), (4, 0), (5, 5)):
        assert np.array_equal(cache.buffer[d], before[s]), d


def test_copy_blocks_decodes_like_the_source():
    cache = filled(8, 16, 2, 128, rule="4over6")
    k0, v0 = cache.gather_dequant([3, 5], dtype="float32")
    cache.copy_blocks(np.array([3, 5]), np.array([6, 7]))
    k1, v1 = cache.gather_dequant([6, 7], dtype="float32")
    assert np.array_equal(k0.view(np.uint32), k1.view(np.uint32))
    assert np.array_equal(v0.view(np.uint32), v1.view(np.uint32))


def test_copy_blocks_empty_and_lists():
    cache = filled(4, 16, 1, 64)
    before = cache.buffer.copy()
    cache.copy_blocks([], [])
    cache.copy_blocks(range(0), range(0))
    assert np.array_equal(before, cache.buffer)


@pytest.mark.parametrize("src, dst, exc, match", [
    ([0, 1], [2, 2], ValueError, "dst repeats block 2"),
    ([0, 1], [2], ValueError, "same length"),
    ([0, 9], [2, 3], IndexError, r"src\[1\] = 9 is out of range"),
    ([0, 1], [2, -1], IndexError, r"dst\[1\] = -1 is out of range"),
    (np.array([0.0]), np.array([1]), TypeError, "src must have dtype int32 or int64"),
    (np.array([[0]]), np.array([[1]]), ValueError, "src must be 1-D"),
])
def test_copy_blocks_refusals_write_nothing(src, dst, exc, match):
    cache = filled(8, 16, 2, 64)
    before = cache.buffer.copy()
    with pytest.raises(exc, match=match):
        cache.copy_blocks(src, dst)
    assert np.array_equal(before, cache.buffer)
    assert cache.stats["bad_block_ids"] == 0


def test_copy_blocks_unvalidated_counts_and_skips_bad_pairs():
    """What an unvalidated GPU call does (the CPU's per-call validate=False)."""
    cache = filled(8, 16, 2, 64)
    before = cache.buffer.copy()
    cache.copy_blocks(np.array([0, 9, 1, -3]), np.array([4, 5, 8, 6]), validate=False)
    want = before.copy()
    want[4] = before[0]  # only the pair with two valid ids
    assert np.array_equal(cache.buffer, want)
    assert cache.stats["bad_block_ids"] == 3
    with pytest.raises(IndexError):
        cache.check()


# -- read / write ----------------------------------------------------------------------------
@pytest.mark.parametrize("geom", GEOMETRIES)
def test_read_write_round_trip(geom):
    a = filled(*geom)
    b = PagedKVCache(*geom[:4], layout=geom[4], swizzle_v_scales=geom[5], k_scale=0.5,
                     v_scale=0.25, device="cpu")
    P = a.geometry.page_bytes
    blocks = np.array([2, 0, 2, 1])
    rows = a.read_blocks(blocks)
    assert rows.shape == (4, P) and rows.dtype == np.uint8
    for i, p in enumerate(blocks):
        assert np.array_equal(rows[i], a.buffer[p].reshape(-1))
    out = np.full((4, P), 0xAB, np.uint8)
    assert a.read_blocks(blocks.astype(np.int32), out=out) is out
    assert np.array_equal(out, rows)
    b.write_blocks([5, 3, 4], rows[[0, 1, 3]], page_format=a.page_format())
    for dst, src in ((5, 2), (3, 0), (4, 1)):
        assert np.array_equal(b.buffer[dst], a.buffer[src])
    assert not b.buffer[[0, 1, 2]].any()
    assert a.read_blocks([]).shape == (0, P)


def test_write_read_is_identity_on_random_bytes():
    cache = PagedKVCache(6, 16, 2, 64, device="cpu")
    data = np.random.default_rng(3).integers(0, 256, (3, cache.geometry.page_bytes),
                                             dtype=np.uint8)
    cache.write_blocks(np.array([5, 0, 2]), data)
    assert np.array_equal(cache.read_blocks([5, 0, 2]), data)


def nan_page(geom):
    side = np.zeros(geom.side_bytes, np.uint8)
    side[geom.data_bytes:] = 0x7F
    return np.concatenate([side, side])


def test_read_blocks_unvalidated_bad_id_reads_a_nan_page():
    cache = filled(4, 16, 2, 64)
    rows = cache.read_blocks(np.array([1, 7, -2]), validate=False)
    assert np.array_equal(rows[0], cache.buffer[1].reshape(-1))
    assert np.array_equal(rows[1], nan_page(cache.geometry))
    assert np.array_equal(rows[2], nan_page(cache.geometry))
    assert cache.stats["bad_block_ids"] == 2
    # such a page decodes to NaN everywhere
    other = PagedKVCache(1, 16, 2, 64, device="cpu")
    other.write_blocks([0], rows[1:2])
    k, v = other.gather_dequant([0], dtype="float32")
    assert np.isnan(k).all() and np.isnan(v).all()


def test_write_blocks_unvalidated_counts_and_skips():
    cache = filled(4, 16, 1, 64)
    before = cache.buffer.copy()
    data = np.zeros((2, cache.geometry.page_bytes), np.uint8)
    cache.write_blocks(np.array([4, 1]), data, validate=False)
    want = before.copy()
    want[1] = 0
    assert np.array_equal(cache.buffer, want)
    assert cache.stats["bad_block_ids"] == 1


@pytest.mark.parametrize("case", ["dtype", "shape", "rows", "noncontig", "repeat", "range",
                                  "kind", "2d_ids"])
def test_write_blocks_refusals_write_nothing(case):
    cache = filled(6, 16, 2, 64)
    P = cache.geometry.page_bytes
    blocks, data = np.array([1, 2]), np.ones((2, P), np.uint8)
    exc, match = {
        "dtype": (TypeError, "data must have dtype uint8"),
        "shape": (ValueError, r"data must have shape \(2, 2304\)"),
        "rows": (ValueError, r"data must have shape \(2, 2304\)"),
        "noncontig": (ValueError, "data must be C-contiguous"),
        "repeat": (ValueError, "blocks repeats block 1"),
        "range": (IndexError, r"blocks\[1\] = 6 is out of range"),
        "kind": (TypeError, "data must be a NumPy or CuPy uint8 array"),
        "2d_ids": (ValueError, "blocks must be 1-D"),
    }[case]
    if case == "dtype":
        data = data.view(np.int8)
    elif case == "shape":
        data = np.ones((2, P - 1), np.uint8)
    elif case == "rows":
        data = np.ones((3, P), np.uint8)
    elif case == "noncontig":
        data = np.ones((2, 2 * P), np.uint8)[:, ::2]
    elif case == "repeat":
        blocks = np.array([1, 1])
    elif case == "range":
        blocks = np.array([1, 6])
    elif case == "kind":
        data = [[1] * P, [1] * P]
    elif case == "2d_ids":
        blocks = np.array([[1, 2]])
    before = cache.buffer.copy()
    with pytest.raises(exc, match=match):
        cache.write_blocks(blocks, data)
    assert np.array_equal(before, cache.buffer)


@pytest.mark.parametrize("case", ["dtype", "shape", "noncontig", "pool", "range", "readonly"])
def test_read_blocks_refusals(case):
    cache = filled(6, 16, 2, 64)
    P = cache.geometry.page_bytes
    out = np.zeros((2, P), np.uint8)
    blocks = np.array([0, 1])
    exc, match = {
        "dtype": (TypeError, "out must have dtype uint8"),
        "shape": (ValueError, r"out must have shape \(2, 2304\)"),
        "noncontig": (ValueError, "out must be C-contiguous"),
        "pool": (ValueError, "out must not overlap the cache's page pool"),
        "range": (IndexError, r"blocks\[0\] = 6 is out of range"),
        "readonly": (ValueError, "out must be writeable"),
    }[case]
    if case == "dtype":
        out = np.zeros((2, P), np.int16)
    elif case == "shape":
        out = np.zeros((2, P, 1), np.uint8)
    elif case == "noncontig":
        out = np.zeros((2, 2 * P), np.uint8)[:, ::2]
    elif case == "pool":
        out = cache.buffer[2:4].reshape(2, P)
    elif case == "range":
        blocks = np.array([6, 0])
    elif case == "readonly":
        out.flags.writeable = False
    before = cache.buffer.copy()
    sentinel = out.copy()
    with pytest.raises(exc, match=match):
        cache.read_blocks(blocks, out=out)
    assert np.array_equal(before, cache.buffer)
    if case in ("range",):
        assert np.array_equal(out, sentinel)  # checked before anything was read


# -- page_format ---------------------------------------------------------------------------
def test_page_format_describes_the_page():
    cache = PagedKVCache(4, 8, 3, 64, layout="NHD", scale_rule="4over6", k_scale=0.1,
                         v_scale=3.0, swizzle_v_scales=False, device="cpu")
    fmt = cache.page_format()
    assert fmt == {"format": pages.FORMAT_NAME, "version": pages.FORMAT_VERSION,
                   "layout": "NHD", "block_size": 8, "num_heads": 3, "head_dim": 64,
                   "page_bytes": cache.geometry.page_bytes, "scale_rule": "4over6",
                   "swizzle_v_scales": False, "k_scale": float(np.float32(0.1)),
                   "v_scale": 3.0}
    assert json.loads(json.dumps(fmt)) == fmt  # JSON round trip is exact


DIFFERENT = {"format": "other", "version": 2, "layout": "NHD", "block_size": 8,
             "num_heads": 3, "head_dim": 128, "page_bytes": 1, "scale_rule": "4over6",
             "swizzle_v_scales": False, "k_scale": 0.25, "v_scale": 0.5}


@pytest.mark.parametrize("field", sorted(DIFFERENT))
def test_write_blocks_refuses_a_differing_format_field(field):
    cache = filled(4, 16, 2, 64)
    fmt = cache.page_format()
    fmt[field] = DIFFERENT[field]
    before = cache.buffer.copy()
    with pytest.raises(ValueError, match=f"field '{field}' differs"):
        cache.write_blocks([0], np.zeros((1, cache.geometry.page_bytes), np.uint8),
                           page_format=fmt)
    assert np.array_equal(before, cache.buffer)


def test_page_format_missing_unknown_and_type():
    cache = filled(4, 16, 2, 64)
    data = np.zeros((1, cache.geometry.page_bytes), np.uint8)
    before = cache.buffer.copy()
    fmt = cache.page_format()
    del fmt["v_scale"]
    with pytest.raises(ValueError, match="no field 'v_scale'"):
        cache.write_blocks([0], data, page_format=fmt)
    fmt = dict(cache.page_format(), extra=1)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['extra'\]"):
        cache.write_blocks([0], data, page_format=fmt)
    fmt = dict(cache.page_format(), swizzle_v_scales=1)  # 1 is not True
    with pytest.raises(TypeError, match="'swizzle_v_scales' must be a bool"):
        cache.write_blocks([0], data, page_format=fmt)
    fmt = dict(cache.page_format(), swizzle_v_scales=False)
    with pytest.raises(ValueError, match="'swizzle_v_scales' differs"):
        cache.write_blocks([0], data, page_format=fmt)
    with pytest.raises(TypeError, match="page_format must be a dict"):
        cache.write_blocks([0], data, page_format="HND")
    assert np.array_equal(before, cache.buffer)
    ok = dict(cache.page_format(), block_size=np.int64(16), k_scale=np.float32(0.5))
    cache.write_blocks([0], data, page_format=ok)  # NumPy scalars of equal value pass
    assert not cache.buffer[0].any()


@pytest.mark.parametrize("field, value", [
    ("version", True), ("block_size", 16.0), ("num_heads", np.float64(2)),
    ("page_bytes", "2304"), ("k_scale", "0.01"), ("v_scale", False),
    ("swizzle_v_scales", 1), ("swizzle_v_scales", "True"), ("layout", b"HND"),
    ("scale_rule", None), ("format", 1)])
def test_page_format_field_of_the_wrong_type_is_a_type_error(field, value):
    """Types are compared as well as values: ``version=True`` or ``block_size=16.0`` are
    not 1 and 16, and ``k_scale='0.01'`` is a wrong type, not a value that differs."""
    cache = filled(4, 16, 2, 64)
    data = np.ones((1, cache.geometry.page_bytes), np.uint8)
    before = cache.buffer.copy()
    fmt = dict(cache.page_format(), **{field: value})
    with pytest.raises(TypeError, match=rf"page_format field '{field}' must be (a|an) "):
        cache.write_blocks([0], data, page_format=fmt)
    assert np.array_equal(before, cache.buffer)
    with pytest.raises(TypeError, match=rf"field '{field}' must be"):
        pages.check_page_format(fmt, cache)


def test_page_format_numbers_of_the_right_kind_pass():
    cache = filled(4, 16, 2, 64)
    data = np.ones((1, cache.geometry.page_bytes), np.uint8)
    ok = dict(cache.page_format(), version=np.int32(1), k_scale=np.float64(0.5),
              v_scale=0.25, swizzle_v_scales=np.bool_(True))
    cache.write_blocks([0], data, page_format=ok)
    assert (cache.buffer[0] == 1).all()


# -- save / load ----------------------------------------------------------------------------
def _saved(tmp_path, name="c.safetensors"):
    pytest.importorskip("safetensors")
    cache = filled(4, 16, 2, 64)
    path = tmp_path / name
    cache.save(path)
    return cache, path


def _refused(cache, path, exc, match):
    """``PagedKVCache.load(path)`` and ``cache.load_pages(path)`` raise ``exc`` matching
    ``match``; the cache's bytes are unchanged."""
    before = cache.buffer.copy()
    with pytest.raises(exc, match=match):
        PagedKVCache.load(path, device="cpu")
    with pytest.raises(exc, match=match):
        cache.load_pages(path)
    assert np.array_equal(before, cache.buffer)


def test_load_names_a_missing_path_or_a_directory(tmp_path):
    cache, _ = _saved(tmp_path)
    _refused(cache, tmp_path / "nope.safetensors", FileNotFoundError,
             r"path '.*nope\.safetensors' does not exist")
    _refused(cache, tmp_path, IsADirectoryError, r"path '.*' is a directory")
    with pytest.raises(TypeError, match="path must be a str or an os.PathLike"):
        PagedKVCache.load(3, device="cpu")


@pytest.mark.parametrize("content, match", [
    (b"", "holds 0 byte"), (b"hello", "holds 5 byte"),
    (b"this is a text file, not pages\n" * 4, "no safetensors header length"),
    (b"\x05\x00\x00\x00\x00\x00\x00\x00nojsn", "header is not JSON"),
    (b"\x02\x00\x00\x00\x00\x00\x00\x00{}", "no 'fp4cache.page_format' metadata")])
def test_load_names_a_file_that_is_not_a_page_file(tmp_path, content, match):
    cache, _ = _saved(tmp_path)
    path = tmp_path / "text.txt"
    path.write_bytes(content)
    _refused(cache, path, ValueError, rf"path '.*text\.txt' is not an fp4cache page file.*{match}")


def test_load_names_a_truncated_file(tmp_path):
    cache, path = _saved(tmp_path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    for cut in (len(raw) - 1, len(raw) // 2, 8 + n):
        short = tmp_path / f"short{cut}.safetensors"
        short.write_bytes(raw[:cut])
        _refused(cache, short, ValueError,
                 rf"path '.*short{cut}\.safetensors' is truncated: {cut} of {len(raw)} bytes")
    short = tmp_path / "header.safetensors"
    short.write_bytes(raw[:20])
    _refused(cache, short, ValueError, rf"is truncated: 20 of at least {8 + n} bytes")


def test_save_names_a_missing_directory_or_a_directory(tmp_path):
    pytest.importorskip("safetensors")
    cache = filled(4, 16, 2, 64)
    with pytest.raises(FileNotFoundError, match=r"path '.*c\.safetensors': the directory "
                                                r"'.*missing' does not exist"):
        cache.save(tmp_path / "missing" / "c.safetensors")
    with pytest.raises(IsADirectoryError, match=r"path '.*' is a directory"):
        cache.save(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"is not a directory"):
        cache.save(tmp_path / "file" / "c.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    with pytest.raises(TypeError, match="path must be a str or an os.PathLike"):
        cache.save(None)


def test_load_of_a_file_whose_metadata_disagrees_names_the_file(tmp_path):
    """A file's format fields that contradict each other or its pages: the error names the
    file and says nothing was loaded (there is no existing cache in ``load``)."""
    stn = pytest.importorskip("safetensors.numpy")
    cache, path = _saved(tmp_path)
    t = stn.load_file(str(path))
    fmt = cache.page_format()
    bad = tmp_path / "bad.safetensors"
    for meta, match in (
            (dict(fmt, page_bytes=999), r"field 'page_bytes' is 999, but its other fields "
                                        r"make it 2304: the file's metadata disagrees"),
            (dict(fmt, block_size=0), r"page format does not describe a cache \(block_size"),
            (dict(fmt, k_scale="0.5"), r"field 'k_scale' must be a real number"),
            ({k: v for k, v in fmt.items() if k != "layout"},
             r"lacks the field\(s\) \['layout'\]")):
        stn.save_file(t, str(bad), metadata={"fp4cache.page_format": json.dumps(meta),
                                             "fp4cache.num_blocks": "4"})
        with pytest.raises(ValueError, match=match) as e:
            PagedKVCache.load(bad, device="cpu")
        assert "bad.safetensors" in str(e.value) and "this cache has" not in str(e.value)
    stn.save_file({"pages": t["pages"][:, :100].copy(), "blocks": t["blocks"]}, str(bad),
                  metadata={"fp4cache.page_format": json.dumps(fmt)})
    with pytest.raises(ValueError, match=r"its pages have 100 bytes each, but its page "
                                         r"format gives page_bytes 2304; nothing was loaded"):
        PagedKVCache.load(bad, device="cpu")
    stn.save_file(t, str(bad), metadata={"fp4cache.page_format": json.dumps(fmt),
                                         "fp4cache.num_blocks": "2"})
    with pytest.raises(ValueError, match=r"block id 2 \(entry 2\) is outside the saved "
                                         r"num_blocks = 2"):
        PagedKVCache.load(bad, device="cpu")


def test_load_checks_device_before_the_file(tmp_path):
    with pytest.raises(ValueError, match="device must be"):
        PagedKVCache.load(tmp_path / "nope.safetensors", device="tpu")


@pytest.mark.parametrize("geom", GEOMETRIES)
def test_save_load_round_trip(tmp_path, geom):
    pytest.importorskip("safetensors")
    cache = filled(*geom, rule="4over6", k_scale=0.125, v_scale=3.5)
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    back = PagedKVCache.load(path, device="cpu")
    assert back.page_format() == cache.page_format()
    assert back.num_blocks == cache.num_blocks
    assert np.array_equal(back.buffer, cache.buffer)
    assert back.scale_rule == "4over6" and back.layout == cache.layout


def test_save_some_blocks_and_load_pages_elsewhere(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file

    cache = filled(10, 16, 2, 64)
    path = str(tmp_path / "prompt.safetensors")
    cache.save(path, blocks=np.array([7, 2, 5], np.int32))
    t = load_file(path)
    assert t["blocks"].tolist() == [7, 2, 5] and t["blocks"].dtype == np.int64
    assert np.array_equal(t["pages"], cache.buffer[[7, 2, 5]].reshape(3, -1))
    back = PagedKVCache.load(path, device="cpu")  # the saved pages at their ids
    assert back.num_blocks == 10
    assert np.array_equal(back.buffer[[7, 2, 5]], cache.buffer[[7, 2, 5]])
    assert not back.buffer[[0, 1, 3, 4, 6, 8, 9]].any()
    other = PagedKVCache(4, 16, 2, 64, k_scale=0.5, v_scale=0.25, device="cpu")
    ids = other.load_pages(path, blocks=[0, 3, 1])
    assert ids.tolist() == [0, 3, 1]
    assert np.array_equal(other.buffer[[0, 3, 1]], cache.buffer[[7, 2, 5]])
    with pytest.raises(IndexError, match="out of range"):  # saved ids 7, 5 > 3
        other.load_pages(path)
    with pytest.raises(ValueError, match="one id per saved page"):
        other.load_pages(path, blocks=[0, 1])


def test_save_refuses_bad_blocks(tmp_path):
    pytest.importorskip("safetensors")
    cache = filled(4, 16, 1, 64)
    path = tmp_path / "c.safetensors"
    with pytest.raises(ValueError, match="blocks repeats block 1"):
        cache.save(path, blocks=[1, 2, 1])
    with pytest.raises(IndexError, match=r"blocks\[0\] = 4 is out of range"):
        cache.save(path, blocks=[4])
    assert not path.exists()


@pytest.mark.parametrize("kwargs, field", [
    ({"k_scale": 0.25}, "k_scale"), ({"scale_rule": "4over6"}, "scale_rule"),
    ({"layout": "NHD"}, "layout"), ({"swizzle_v_scales": False}, "swizzle_v_scales"),
    ({"v_scale": 1.0}, "v_scale")])
def test_load_pages_refuses_another_format(tmp_path, kwargs, field):
    pytest.importorskip("safetensors")
    cache = filled(4, 16, 2, 64)
    path = tmp_path / "c.safetensors"
    cache.save(path)
    args = dict(layout="HND", scale_rule="static6", k_scale=0.5, v_scale=0.25,
                swizzle_v_scales=True)
    args.update(kwargs)
    other = filled(4, 16, 2, 64, layout=args["layout"], swizzle=args["swizzle_v_scales"],
                   rule=args["scale_rule"], k_scale=args["k_scale"], v_scale=args["v_scale"],
                   seed=9)
    before = other.buffer.copy()
    with pytest.raises(ValueError, match=f"field '{field}' differs"):
        other.load_pages(path)
    assert np.array_equal(before, other.buffer)


def test_load_refuses_foreign_files(tmp_path):
    stn = pytest.importorskip("safetensors.numpy")
    path = str(tmp_path / "x.safetensors")
    stn.save_file({"pages": np.zeros((1, 4), np.uint8)}, path)
    with pytest.raises(ValueError, match="holds no fp4cache pages"):
        PagedKVCache.load(path, device="cpu")
    fmt = dict(PagedKVCache(1, 16, 1, 64, device="cpu").page_format(), version=99)
    stn.save_file({"pages": np.zeros((1, 4), np.uint8), "blocks": np.zeros(1, np.int64)},
                  path, metadata={"fp4cache.page_format": json.dumps(fmt)})
    with pytest.raises(ValueError, match="version 99"):
        PagedKVCache.load(path, device="cpu")


def test_loaded_cache_attends_like_the_saved_one(tmp_path):
    pytest.importorskip("safetensors")
    cache = filled(8, 16, 2, 64)
    path = tmp_path / "c.safetensors"
    cache.save(path)
    back = PagedKVCache.load(path, device="cpu")
    q = np.random.default_rng(2).standard_normal((2, 4, 64)).astype(np.float32)
    tables = np.array([[0, 3, 5], [7, 1, -1]])
    lens = np.array([40, 30])
    a = cache.decode_attention(q, tables, lens)
    b = back.decode_attention(q, tables, lens)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


# -- slot_mapping ---------------------------------------------------------------------------
def slot_loop(tables, positions, T):
    out = np.full(positions.shape, -1, np.int64)
    for b in range(positions.shape[0]):
        for j in range(positions.shape[1]):
            p = int(positions[b, j])
            if p >= 0:
                out[b, j] = int(tables[b, p // T]) * T + p % T
    return out


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("T", [1, 3, 16])
def test_slot_mapping_is_vllms_formula(dtype, T):
    rng = np.random.default_rng(T)
    B, max_blocks, n = 5, 6, 9
    tables = rng.permutation(100)[:B * max_blocks].reshape(B, max_blocks).astype(dtype)
    positions = rng.integers(-1, max_blocks * T, (B, n)).astype(dtype)
    got = fp4cache.slot_mapping(tables, positions, block_size=T)
    assert got.dtype == np.int64 and got.shape == (B, n)
    assert np.array_equal(got, slot_loop(tables, positions, T))


def test_slot_mapping_feeds_store():
    cache = PagedKVCache(8, 4, 1, 16, swizzle_v_scales=False, device="cpu")
    tables = np.array([[5, 2], [7, -1]])
    positions = np.array([[4, 5, 6], [0, 1, -1]])
    slots = fp4cache.slot_mapping(tables, positions, block_size=cache.block_size)
    assert slots.tolist() == [[8, 9, 10], [28, 29, -1]]
    k = np.full((6, 1, 16), 6.0, np.float32)
    cache.store(slots.reshape(-1), k, k)
    assert cache.buffer[2].any() and cache.buffer[7].any() and not cache.buffer[5].any()


@pytest.mark.parametrize("tables, positions, exc, match", [
    ([[1, 2]], [[-2]], ValueError, r"positions\[0, 0\] = -2 is below -1"),
    ([[1, 2]], [[0, 32]], IndexError, r"positions\[0, 1\] = 32 is past the block table"),
    ([[1, -1]], [[17]], ValueError, r"positions\[0, 0\] = 17 falls in a block table entry"),
    ([[1, 2]], [[0], [1]], ValueError, "one row per block_tables row"),
    ([1, 2], [[0]], ValueError, "block_tables must be 2-D"),
    ([[1.0]], [[0]], TypeError, "block_tables must have dtype int32 or int64"),
])
def test_slot_mapping_errors(tables, positions, exc, match):
    with pytest.raises(exc, match=match):
        fp4cache.slot_mapping(np.array(tables), np.array(positions), block_size=16)


def test_slot_mapping_unvalidated_and_block_size():
    tables = np.array([[1, -1]])
    got = fp4cache.slot_mapping(tables, np.array([[-5, 40, 17, 3]]), block_size=16,
                                validate=False)
    assert got.tolist() == [[-1, -1, -1, 19]]
    for bad in (0, -16, 2.0, True):
        with pytest.raises(ValueError, match="block_size must be a positive integer"):
            fp4cache.slot_mapping(tables, np.array([[0]]), block_size=bad)


def test_pinned_empty_and_nbytes():
    a = fp4cache.pinned_empty((3, 5), np.uint8)
    assert isinstance(a, np.ndarray) and a.shape == (3, 5) and a.dtype == np.uint8
    cache = filled(4, 16, 1, 64)
    n0 = cache.nbytes
    cache.read_blocks([0, 1], out=fp4cache.pinned_empty((2, cache.geometry.page_bytes)))
    assert cache.nbytes == n0  # the CPU backend stages nothing
