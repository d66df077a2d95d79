"""Moving whole pages: copy inside the pool, read to / write from host or device memory,
save and load, the page format a receiver checks, and vLLM's slot mapping.

What :class:`~fp4cache.PagedKVCache`'s ``copy_blocks``, ``read_blocks``, ``write_blocks``,
``page_format``, ``save``, ``load`` and ``load_pages`` do; the methods delegate here.  A
page is moved as its raw bytes (``PageGeometry.page_bytes`` of them: K side, V side, data
and scales), so every move is byte-exact and both backends give identical bytes.

GPU kernels: ``kernels/page_copy.cu`` (copy in two launches, mark and copy; read;
write), loaded by :mod:`fp4cache._kernels`.  A copy of ``n`` pairs takes ``n`` staging
rows and two uint32 counters per page (zero between calls) from the cache's workspace
(:func:`copy_workspace`).  Host transfers go through staging rows in the cache's workspace
(at most :data:`STAGING_BYTES`, counted in ``cache.nbytes``): a chunk of
pages is gathered into it on the device and copied with one ``cudaMemcpyAsync``; a run of
consecutive page ids given on the host is copied directly, in one transfer.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from . import _abi, _arrays
from . import _kernels as K
from .layout import PageGeometry

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "STAGING_BYTES", "page_format",
           "check_page_format", "copy_blocks", "read_blocks", "write_blocks", "save", "load",
           "load_pages", "slot_mapping", "pinned_empty"]

#: ``page_format()["format"]``: what the bytes are.
FORMAT_NAME = "fp4cache.nvfp4_paged"
#: ``page_format()["version"]``: bumped whenever a page's byte layout changes.
FORMAT_VERSION = 1
#: Most workspace bytes one chunk of a host transfer stages.
STAGING_BYTES = 64 << 20
#: safetensors metadata keys and tensor names of a saved cache.
META_FORMAT = "fp4cache.page_format"
META_NUM_BLOCKS = "fp4cache.num_blocks"
TENSOR_PAGES = "pages"
TENSOR_BLOCKS = "blocks"

_U8 = np.dtype(np.uint8)


# -- format --------------------------------------------------------------------------------
def page_format(cache) -> dict[str, Any]:
    """Everything needed to read a page of ``cache``: see :meth:`PagedKVCache.page_format`."""
    g = cache.geometry
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "layout": g.layout,
        "block_size": g.block_size,
        "num_heads": g.num_heads,
        "head_dim": g.head_dim,
        "page_bytes": g.page_bytes,
        "scale_rule": cache.scale_rule,
        "swizzle_v_scales": bool(g.swizzle_v_scales),
        "k_scale": float(cache.k_scale),  # the float32 value, exactly
        "v_scale": float(cache.v_scale),
    }


#: The type of each ``page_format()`` field: ``int`` fields take Python or NumPy integers
#: (not bools, not floats such as 16.0), ``bool`` ones bools, ``str`` ones strings, and
#: ``float`` ones real numbers (Python or NumPy floats or integers; not bools, not strings).
FIELD_TYPES = {"format": str, "version": int, "layout": str, "block_size": int,
               "num_heads": int, "head_dim": int, "page_bytes": int, "scale_rule": str,
               "swizzle_v_scales": bool, "k_scale": float, "v_scale": float}
_TYPE_WORDS = {str: "a str", int: "an int", bool: "a bool (True or False)",
               float: "a real number (float or int)"}


def _has_type(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, (bool, np.bool_))
    if isinstance(value, (bool, np.bool_)):
        return False
    if kind is int:
        return isinstance(value, (int, np.integer))
    if kind is float:
        return isinstance(value, (int, float, np.integer, np.floating))
    return isinstance(value, str)


def check_page_format_types(fmt: dict, *, what: str = "page_format") -> None:
    """Raise ``TypeError`` naming the first field of ``fmt`` whose value has the wrong type
    for :data:`FIELD_TYPES` (``version=True``, ``block_size=16.0``, ``k_scale='0.01'``);
    fields ``fmt`` lacks or that are unknown are left to :func:`check_page_format`."""
    for key, kind in FIELD_TYPES.items():
        if key in fmt and not _has_type(fmt[key], kind):
            got = fmt[key]
            raise TypeError(f"{what} field {key!r} must be {_TYPE_WORDS[kind]}, got "
                            f"{type(got).__name__} {got!r}; nothing was written")


def check_page_format(fmt: Any, cache, *, what: str = "page_format") -> None:
    """Raise ``TypeError`` naming the first field of ``fmt`` of the wrong type (see
    :data:`FIELD_TYPES`), else ``ValueError`` naming the first field where ``fmt``
    differs from ``cache.page_format()`` (a missing or unknown field counts as
    different)."""
    if not isinstance(fmt, dict):
        raise TypeError(f"{what} must be a dict as returned by page_format(), got "
                        f"{type(fmt).__name__}")
    check_page_format_types(fmt, what=what)
    mine = page_format(cache)
    for key, want in mine.items():
        if key not in fmt:
            raise ValueError(f"{what} has no field {key!r} (this cache's is {want!r}); "
                             "nothing was written")
        got = fmt[key]
        if not _same(got, want):
            raise ValueError(f"{what} field {key!r} differs: the pages have {got!r}, this "
                             f"cache has {want!r}; pages of another format would decode "
                             "wrong, so nothing was written")
    extra = sorted(set(fmt) - set(mine))
    if extra:
        raise ValueError(f"{what} has unknown field(s) {extra} (format version "
                         f"{fmt.get('version')!r}; this fp4cache reads version "
                         f"{FORMAT_VERSION}); nothing was written")


def _same(got, want) -> bool:
    """Equal values of the same kind (the field's type, :data:`FIELD_TYPES`)."""
    if isinstance(want, bool):
        return isinstance(got, (bool, np.bool_)) and bool(got) == want
    if isinstance(got, (bool, np.bool_)):
        return False
    if isinstance(want, int):
        return isinstance(got, (int, np.integer)) and int(got) == want
    if isinstance(want, float):
        return isinstance(got, (int, float, np.integer, np.floating)) and float(got) == want
    return isinstance(got, str) and got == want


# -- argument checks --------------------------------------------------------------------
def _ids(cache, ids, name: str):
    """``(ids on the cache's backend, the same ids on the host or None)``: the host copy
    exists when the caller gave host ids (free to check) and is None for device ids."""
    host = None
    if not _arrays.is_cupy(ids) and _arrays.backend_of(ids) == "cpu":
        host = _arrays.to_backend(ids, "cpu", name, allow_convert=True)
        _arrays.check_index_array(host, name)
    a = _arrays.to_backend(ids, cache.device, name, allow_convert=True)
    _arrays.check_index_array(a, name)
    if cache.device == "cpu":
        host = a
    return a, host


def _host_ids(a, host, check: bool):
    """The ids on the host: given there, or read back (a host sync) when validating."""
    if host is not None:
        return host
    return a.get() if check else None


def _check_range(host: np.ndarray, num_blocks: int, name: str) -> None:
    bad = (host < 0) | (host >= num_blocks)
    if bad.any():
        i = int(bad.argmax())
        raise IndexError(f"{name}[{i}] = {int(host[i])} is out of range: block ids must be "
                         f"in [0, {num_blocks}); nothing was written")


def _check_unique(host: np.ndarray, name: str) -> None:
    if host.size < 2:
        return
    srt = np.sort(host)
    rep = srt[1:][srt[1:] == srt[:-1]]
    if rep.size:
        i = int(np.flatnonzero(host == rep[0])[1])
        raise ValueError(f"{name} repeats block {int(rep[0])} (again at {name}[{i}]): each "
                         "page can be written once per call; nothing was written")


def _valid(host: np.ndarray, num_blocks: int) -> np.ndarray:
    return (host >= 0) & (host < num_blocks)


def _count_bad(cache, n_bad: int) -> None:
    if n_bad:
        cache._stats[_abi.STAT["bad_block_ids"]] += np.uint64(n_bad)


def _nan_page(geom: PageGeometry) -> np.ndarray:
    """The bytes of a page that decodes to NaN everywhere: data 0, scale bytes 0x7F."""
    side = np.zeros(geom.side_bytes, _U8)
    side[geom.data_bytes:] = 0x7F
    return np.concatenate([side, side])


def _overlaps_pool(cache, a) -> bool:
    buf = cache.buffer
    if _arrays.is_cupy(a):
        pa, pb = a.data.ptr, buf.data.ptr
        return a.nbytes > 0 and pa < pb + buf.nbytes and pb < pa + a.nbytes
    return isinstance(a, np.ndarray) and isinstance(buf, np.ndarray) and \
        bool(np.shares_memory(a, buf))


# -- copy ----------------------------------------------------------------------------------
def copy_blocks(cache, src, dst, validate: bool | None = None) -> None:
    """See :meth:`PagedKVCache.copy_blocks`."""
    validate = _arrays.check_bool(validate, "validate", optional=True)
    check = cache.validate if validate is None else validate
    s, hs = _ids(cache, src, "src")
    d, hd = _ids(cache, dst, "dst")
    if s.shape != d.shape:
        raise ValueError(f"src and dst must have the same length, got {s.shape[0]} and "
                         f"{d.shape[0]}")
    _arrays.check_device({"src": s, "dst": d}, cache.buffer)
    hs, hd = _host_ids(s, hs, check), _host_ids(d, hd, check)
    if check:
        _check_range(hs, cache.num_blocks, "src")
        _check_range(hd, cache.num_blocks, "dst")
    if hd is not None:
        _check_unique(hd, "dst")
    n = s.shape[0]
    if cache.device == "cpu":
        ok = _valid(hs, cache.num_blocks) & _valid(hd, cache.num_blocks)
        _count_bad(cache, int((~_valid(hs, cache.num_blocks)).sum()
                              + (~_valid(hd, cache.num_blocks)).sum()))
        if ok.any():
            pool = cache.buffer
            pool[hd[ok]] = pool[hs[ok]]  # the right side is a copy: reads before writes
        return
    if n:
        _gpu_copy(cache, s, d)


# -- read / write --------------------------------------------------------------------------
def read_blocks(cache, blocks, out=None, validate: bool | None = None):
    """See :meth:`PagedKVCache.read_blocks`."""
    validate = _arrays.check_bool(validate, "validate", optional=True)
    check = cache.validate if validate is None else validate
    b, hb = _ids(cache, blocks, "blocks")
    _arrays.check_device({"blocks": b}, cache.buffer)
    n, P = b.shape[0], cache.geometry.page_bytes
    shape = (n, P)
    if out is None:
        out = _arrays.array_module(cache.device).empty(shape, _U8)
    else:
        _check_rows(cache, out, "out", shape, writable=True)
        if _overlaps_pool(cache, out):
            raise ValueError("out must not overlap the cache's page pool")
    hb = _host_ids(b, hb, check)
    if check:
        _check_range(hb, cache.num_blocks, "blocks")
    if n == 0:
        return out
    if cache.device == "cpu":
        ok = _valid(hb, cache.num_blocks)
        pool = cache.buffer.reshape(cache.num_blocks, P)
        out[ok] = pool[hb[ok]]
        if not ok.all():
            out[~ok] = _nan_page(cache.geometry)
            _count_bad(cache, int((~ok).sum()))
        return out
    if _arrays.is_cupy(out):
        _gpu_move(cache, "read", b, out)
    else:
        _gpu_host_transfer(cache, "read", b, hb, out)
    return out


def write_blocks(cache, blocks, data, page_format: Any = None,
                 validate: bool | None = None) -> None:
    """See :meth:`PagedKVCache.write_blocks`."""
    validate = _arrays.check_bool(validate, "validate", optional=True)
    check = cache.validate if validate is None else validate
    if page_format is not None:
        check_page_format(page_format, cache)
    b, hb = _ids(cache, blocks, "blocks")
    _arrays.check_device({"blocks": b}, cache.buffer)
    n, P = b.shape[0], cache.geometry.page_bytes
    if cache.device == "cpu" and _arrays.is_cupy(data):
        data = data.get()
    elif not (isinstance(data, np.ndarray) or _arrays.is_cupy(data)) \
            and hasattr(data, "__dlpack__"):  # another library's array, zero copy
        data = _arrays.to_backend(data, _arrays.backend_of(data), "data")
    _check_rows(cache, data, "data", (n, P), writable=False)
    _arrays.check_device({"data": data}, cache.buffer)
    hb = _host_ids(b, hb, check)
    if check:
        _check_range(hb, cache.num_blocks, "blocks")
    if hb is not None:
        _check_unique(hb, "blocks")
    if n == 0:
        return
    if cache.device == "cpu":
        ok = _valid(hb, cache.num_blocks)
        _count_bad(cache, int((~ok).sum()))
        cache.buffer.reshape(cache.num_blocks, P)[hb[ok]] = data[ok]
        return
    if _arrays.is_cupy(data):
        if _overlaps_pool(cache, data):
            data = data.copy()  # rows read from pages that the same call writes
        _gpu_move(cache, "write", b, data)
    else:
        _gpu_host_transfer(cache, "write", b, hb, data)


def _check_rows(cache, a, name: str, shape: tuple[int, int], *, writable: bool) -> None:
    """``a``: a NumPy or (GPU cache) CuPy uint8 array of ``shape``, C-contiguous."""
    if not (isinstance(a, np.ndarray) or _arrays.is_cupy(a)):
        raise TypeError(f"{name} must be a NumPy or CuPy uint8 array, got "
                        f"{type(a).__module__}.{type(a).__name__}")
    if cache.device == "cpu" and _arrays.is_cupy(a):
        raise TypeError(f"{name} must be a NumPy array for a cache on device='cpu', got a "
                        "CuPy array")
    if a.dtype != _U8:
        raise TypeError(f"{name} must have dtype uint8 (raw page bytes), got {a.dtype}")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (pages, page_bytes), got "
                         f"{tuple(a.shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if writable and isinstance(a, np.ndarray) and not a.flags.writeable:
        raise ValueError(f"{name} must be writeable")


# -- GPU -----------------------------------------------------------------------------------
_PARAMS = _abi.struct_dtype("PageMoveParams")
_THREADS = _abi.PAGE_MOVE_THREADS
_IDS = {np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}


def _vec_width(*sizes: int) -> int:
    """Largest access width of :data:`fp4cache._kernels.PAGE_VEC_BYTES` dividing all."""
    return next(w for w in K.PAGE_VEC_BYTES if all(s % w == 0 for s in sizes))


def _params(cache, n: int, tables: int = 0, staging: int = 0):
    g = cache.geometry
    p = np.zeros((), dtype=_PARAMS)
    for name, value in (("buffer", cache.buffer.data.ptr), ("stats", cache._stats.data.ptr),
                        ("tables", tables), ("staging", staging),
                        ("num_blocks", cache.num_blocks), ("page_bytes", g.page_bytes),
                        ("side_bytes", g.side_bytes), ("data_bytes", g.data_bytes),
                        ("n", n)):
        p[name] = value
    return p[()]


def _contig_ids(a):
    return a if a.flags.c_contiguous else a.copy()


def copy_workspace(cache, n: int):
    """``(staging, tables)`` of a GPU copy of ``n`` pairs, views of the cache's workspace:
    ``(n, page_bytes)`` uint8 staging rows (scratch) and the ``COPY_TABLES * num_blocks``
    uint32 tables pending, dst_of (tickets: zero before and after every call).
    Taken at the first call, kept (and grown to the largest ``n``) by the workspace."""
    P = cache.geometry.page_bytes
    return cache._state.workspace.get(
        [((n, P), _U8)], tickets=_abi.COPY_TABLES * cache.num_blocks,
        hint=f"copy_blocks of {n} pages: run one before capturing")


def _gpu_copy(cache, s, d) -> None:
    """Launch 1 marks each page's readers and writer, launch 2 copies (see
    ``kernels/page_copy.cu``); no host sync, no allocation once the workspace fits."""
    if s.dtype != d.dtype:
        s, d = s.astype(np.int64), d.astype(np.int64)
    s, d = _contig_ids(s), _contig_ids(d)
    n = s.shape[0]
    if n >= 2**31:
        raise ValueError(f"copy_blocks copies fewer than 2**31 pages per call, got {n}")
    staging, tables = copy_workspace(cache, n)
    ids = _IDS[s.dtype]
    p = _params(cache, n, tables.data.ptr, staging.data.ptr)
    mark = K.get_kernel(K.page_mark_spec(ids))
    copy = K.get_kernel(K.page_copy_spec(ids, _vec_width(cache.geometry.page_bytes)))
    mark(((n + _THREADS - 1) // _THREADS,), (_THREADS,), (s, d, p))
    copy((n,), (_THREADS,), (s, d, p))  # a CTA per pair


def _grid_pages(n: int) -> int:
    from ._device import num_sms

    return max(1, min(n, 16 * num_sms()))


def _gpu_move(cache, kind: str, b, rows) -> None:
    """Launch read (pages -> rows) or write (rows -> pages) for device ``rows``."""
    b = _contig_ids(b)
    n = b.shape[0]
    vw = _vec_width(cache.geometry.page_bytes, rows.data.ptr)
    spec = (K.page_read_spec if kind == "read" else K.page_write_spec)(_IDS[b.dtype], vw)
    K.get_kernel(spec)((_grid_pages(n),), (_THREADS,), (b, rows, _params(cache, n)))


def _staging(cache, pages: int):
    """``(pages, page_bytes)`` uint8 staging rows in the cache's workspace (shared with
    every other launch of the cache, on the same stream-ordering terms)."""
    P = cache.geometry.page_bytes
    (rows,) = cache._state.workspace.get([((pages, P), _U8)],
                                         hint=f"page transfers of {pages} pages")
    return rows


def _runs(host: np.ndarray | None, num_blocks: int) -> list[tuple[int, int, int]] | None:
    """``[(first row, first page, pages)]`` when host ids form few runs of consecutive
    valid pages (a direct transfer each), else None."""
    if host is None or host.size == 0 or not _valid(host, num_blocks).all():
        return None
    h = host.astype(np.int64)
    cut = np.flatnonzero(np.diff(h) != 1) + 1
    if cut.size >= 8:
        return None
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [h.size]])
    return [(int(a), int(h[a]), int(e - a)) for a, e in zip(starts, ends)]


def _gpu_host_transfer(cache, kind: str, b, hb, host) -> None:
    """Pages <-> host rows on the current stream: direct ``cudaMemcpyAsync`` per run of
    consecutive host ids, else chunks through the staging buffer (gather + one copy)."""
    import cupy

    rt = cupy.cuda.runtime
    stream = cupy.cuda.get_current_stream().ptr
    P = cache.geometry.page_bytes
    pool = cache.buffer.data.ptr
    hptr = host.ctypes.data
    runs = _runs(hb, cache.num_blocks)
    if runs is not None:
        for row, page, count in runs:
            dev, hst = pool + page * P, hptr + row * P
            if kind == "read":
                rt.memcpyAsync(hst, dev, count * P, rt.memcpyDeviceToHost, stream)
            else:
                rt.memcpyAsync(dev, hst, count * P, rt.memcpyHostToDevice, stream)
        return
    n = b.shape[0]
    chunk = max(1, min(n, STAGING_BYTES // P))
    stage = _staging(cache, chunk)
    b = _contig_ids(b)
    for a in range(0, n, chunk):
        c = min(chunk, n - a)
        rows = stage[:c]
        if kind == "read":
            _gpu_move(cache, "read", b[a:a + c], rows)
            rt.memcpyAsync(hptr + a * P, rows.data.ptr, c * P, rt.memcpyDeviceToHost, stream)
        else:
            rt.memcpyAsync(rows.data.ptr, hptr + a * P, c * P, rt.memcpyHostToDevice, stream)
            _gpu_move(cache, "write", b[a:a + c], rows)


# -- save / load ----------------------------------------------------------------------------
def _safetensors():
    try:
        import safetensors.numpy as stn
        from safetensors import safe_open
    except ImportError:
        raise ImportError("saving and loading pages needs safetensors: pip install "
                          "'fp4cache[io]' (or pip install safetensors)") from None
    return stn, safe_open


def _fspath(path) -> str:
    """``path`` as a ``str`` (a ``TypeError`` naming ``path`` for anything not path-like)."""
    try:
        p = os.fspath(path)
    except TypeError:
        raise TypeError(f"path must be a str or an os.PathLike (a file name), got "
                        f"{type(path).__name__} {path!r}") from None
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    return p


def _check_save_path(path: str) -> None:
    """Where ``save`` writes: not a directory, in a directory that exists."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"path {path!r} is a directory: save writes one file, give "
                                "its name (e.g. os.path.join(path, 'pages.safetensors')); "
                                "nothing was saved")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        raise FileNotFoundError(f"path {path!r}: the directory {parent!r} does not exist "
                                "(create it first, e.g. os.makedirs); nothing was saved")
    if not os.path.isdir(parent):
        raise NotADirectoryError(f"path {path!r}: {parent!r} is not a directory; nothing "
                                 "was saved")


def save(cache, path: str | os.PathLike, blocks=None) -> None:
    """See :meth:`PagedKVCache.save`."""
    stn, _ = _safetensors()
    path = _fspath(path)
    if blocks is None:
        blocks = np.arange(cache.num_blocks, dtype=np.int64)
    hb = _arrays.to_backend(blocks, "cpu", "blocks", allow_convert=True)
    _arrays.check_index_array(hb, "blocks")
    _check_range(hb, cache.num_blocks, "blocks")
    _check_unique(hb, "blocks")  # a file of repeated ids could not be loaded
    _check_save_path(path)
    pages = pinned_empty((hb.shape[0], cache.geometry.page_bytes), _U8) \
        if cache.device == "cuda" else None
    pages = read_blocks(cache, hb, pages, validate=True)
    if cache.device == "cuda":
        import cupy

        cupy.cuda.get_current_stream().synchronize()
    meta = {META_FORMAT: json.dumps(page_format(cache)), META_NUM_BLOCKS: str(cache.num_blocks)}
    stn.save_file({TENSOR_PAGES: np.asarray(pages), TENSOR_BLOCKS: hb.astype(np.int64)},
                  path, metadata=meta)


#: safetensors refuses headers above 100 MB; a larger length field is not a header.
_MAX_HEADER = 100_000_000


def _not_page_file(path: str, why: str) -> ValueError:
    return ValueError(f"path {path!r} is not an fp4cache page file (a safetensors file "
                      f"written by PagedKVCache.save): {why}")


def _check_load_path(path: str) -> dict:
    """The safetensors header of the file at ``path``, after checking that the file
    exists, is a file, starts with a safetensors header holding fp4cache's metadata and
    is as long as that header says (``FileNotFoundError``, ``IsADirectoryError``,
    ``ValueError``), so that safetensors' own errors never reach the caller."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"path {path!r} does not exist (no such file)")
    if os.path.isdir(path):
        raise IsADirectoryError(f"path {path!r} is a directory, not an fp4cache page file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _not_page_file(path, f"it holds {size} byte(s), fewer than the 8 of a "
                                       "safetensors header length")
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER or n < 2:
            raise _not_page_file(path, f"its first 8 bytes {head!r} are no safetensors "
                                       "header length")
        if size < 8 + n:
            raise ValueError(f"path {path!r} is truncated: {size} of at least {8 + n} bytes "
                             f"(its header alone takes {n} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _not_page_file(path, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _not_page_file(path, "its header is not a JSON object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or META_FORMAT not in meta:
        raise _not_page_file(path, f"it holds no fp4cache pages (no {META_FORMAT!r} "
                                   "metadata)")
    try:
        end = max([int(t["data_offsets"][1]) for k, t in header.items()
                   if k != "__metadata__"], default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise _not_page_file(path, "its header lists a tensor without data_offsets") from None
    if size < 8 + n + end:
        raise ValueError(f"path {path!r} is truncated: {size} of {8 + n + end} bytes")
    return meta


def _read_file(path) -> tuple[str, dict, int, np.ndarray, np.ndarray]:
    """``(path as str, page format, saved num_blocks (0: not saved), pages, ids)`` of a
    file written by :func:`save`; every problem of the file is an exception naming
    ``path`` and nothing is written anywhere."""
    stn, _ = _safetensors()
    path = _fspath(path)
    meta = _check_load_path(path)
    try:
        fmt = json.loads(meta[META_FORMAT])
    except (TypeError, ValueError):
        raise _not_page_file(path, f"its {META_FORMAT!r} metadata is not JSON") from None
    if not isinstance(fmt, dict):
        raise _not_page_file(path, f"its {META_FORMAT!r} metadata is not a JSON object")
    if fmt.get("format") != FORMAT_NAME or fmt.get("version") != FORMAT_VERSION:
        raise ValueError(f"path {path!r}: page format {fmt.get('format')!r} version "
                         f"{fmt.get('version')!r}; this fp4cache reads {FORMAT_NAME!r} "
                         f"version {FORMAT_VERSION}")
    try:
        num_blocks = int(meta.get(META_NUM_BLOCKS, 0))
    except (TypeError, ValueError):
        raise _not_page_file(path, f"its {META_NUM_BLOCKS!r} metadata "
                                   f"{meta.get(META_NUM_BLOCKS)!r} is not an integer") from None
    try:
        tensors = stn.load_file(path)
    except Exception as e:  # noqa: BLE001 - SafetensorError and friends: say which file
        raise _not_page_file(path, f"safetensors cannot read it ({type(e).__name__}: "
                                   f"{e})") from None
    pages, ids = tensors.get(TENSOR_PAGES), tensors.get(TENSOR_BLOCKS)
    if pages is None or ids is None:
        lacks = [t for t in (TENSOR_PAGES, TENSOR_BLOCKS) if t not in tensors]
        raise _not_page_file(path, f"it lacks the tensor(s) {lacks}")
    if pages.dtype != _U8 or pages.ndim != 2:
        raise _not_page_file(path, f"its {TENSOR_PAGES!r} tensor must be 2-D uint8 (pages, "
                                   f"page_bytes), got {pages.dtype} {pages.shape}")
    if ids.dtype != np.int64 or ids.shape != (pages.shape[0],):
        raise _not_page_file(path, f"its {TENSOR_BLOCKS!r} tensor must be int64 with one id "
                                   f"per page ({pages.shape[0]}), got {ids.dtype} "
                                   f"{ids.shape}")
    return path, fmt, num_blocks, pages, ids


def _check_file_format(path: str, fmt: dict, cache) -> None:
    """``fmt`` (a file's page format) agrees with the cache it describes, field by field,
    with the types :func:`check_page_format` takes."""
    for key, want in page_format(cache).items():
        if key not in fmt:
            raise ValueError(f"path {path!r}: its page format has no field {key!r}; nothing "
                             "was loaded")
        if not _same(fmt[key], want):
            raise ValueError(f"path {path!r}: its page format field {key!r} is "
                             f"{fmt[key]!r}, but its other fields make it {want!r}: the "
                             "file's metadata disagrees with itself; nothing was loaded")


def load(cls, path, device=None, validate: bool | None = None):
    """See :meth:`PagedKVCache.load`."""
    if device is not None:
        from ._device import parse_device

        parse_device(device)  # the caller's argument: its own error, before the file's
    validate = _arrays.check_bool(validate, "validate", optional=True)
    path, fmt, num_blocks, pages, ids = _read_file(path)
    if num_blocks <= 0:
        num_blocks = int(ids.max()) + 1 if ids.size else 1
    bad = (ids < 0) | (ids >= num_blocks)
    if bad.any():
        i = int(bad.argmax())
        raise ValueError(f"path {path!r}: its block id {int(ids[i])} (entry {i}) is outside "
                         f"the saved num_blocks = {num_blocks}; nothing was loaded")
    if np.unique(ids).size != ids.size:
        raise ValueError(f"path {path!r}: its block ids repeat; nothing was loaded")
    names = ("block_size", "num_heads", "head_dim", "layout", "scale_rule", "k_scale",
             "v_scale", "swizzle_v_scales")
    missing = [k for k in names if k not in fmt]
    if missing:
        raise ValueError(f"path {path!r}: its page format lacks the field(s) {missing}; "
                         "nothing was loaded")
    try:
        check_page_format_types(fmt, what=f"the page format of {path!r}")
        cache = cls(num_blocks, fmt["block_size"], fmt["num_heads"], fmt["head_dim"],
                    layout=fmt["layout"], scale_rule=fmt["scale_rule"],
                    k_scale=fmt["k_scale"], v_scale=fmt["v_scale"],
                    swizzle_v_scales=fmt["swizzle_v_scales"], device=device,
                    validate=validate)
    except (TypeError, ValueError) as e:
        raise ValueError(f"path {path!r}: its page format does not describe a cache "
                         f"({e}); nothing was loaded") from None
    _check_file_format(path, fmt, cache)
    if pages.shape[1] != cache.geometry.page_bytes:
        raise ValueError(f"path {path!r}: its pages have {pages.shape[1]} bytes each, but "
                         f"its page format gives page_bytes {cache.geometry.page_bytes}; "
                         "nothing was loaded")
    write_blocks(cache, ids, pages, validate=True)
    return cache


def load_pages(cache, path, blocks=None) -> np.ndarray:
    """See :meth:`PagedKVCache.load_pages`."""
    path, fmt, _, pages, ids = _read_file(path)
    check_page_format(fmt, cache, what=f"the page format of {path!r}")
    if blocks is not None:
        ids = _arrays.to_backend(blocks, "cpu", "blocks", allow_convert=True)
        _arrays.check_index_array(ids, "blocks")
        if ids.shape[0] != pages.shape[0]:
            raise ValueError(f"blocks must have one id per saved page ({pages.shape[0]}), "
                             f"got {ids.shape[0]}")
    write_blocks(cache, ids, pages, validate=True)
    if cache.device == "cuda":
        import cupy

        cupy.cuda.get_current_stream().synchronize()  # `pages` is freed on return
    return np.asarray(ids, dtype=np.int64)


# -- host memory -----------------------------------------------------------------------------
def pinned_empty(shape, dtype=np.uint8) -> np.ndarray:
    """An uninitialized NumPy array in page-locked (pinned) host memory.

    Transfers between pinned memory and the GPU run asynchronously at full bus speed
    (:meth:`PagedKVCache.read_blocks` / ``write_blocks`` with a host array).  Made with
    ``cupyx.empty_pinned`` (CuPy's pinned memory pool keeps the memory for reuse); without
    a usable GPU this is plain ``numpy.empty`` (nothing to pin for).

    Examples
    --------
    >>> import fp4cache
    >>> a = fp4cache.pinned_empty((2, 3), "uint8")
    >>> a.shape, str(a.dtype)
    ((2, 3), 'uint8')
    """
    if _arrays.gpu_available():
        import cupyx

        return cupyx.empty_pinned(shape, dtype=dtype)
    return np.empty(shape, dtype=dtype)


# -- slot mapping -----------------------------------------------------------------------------
def slot_mapping(block_tables, positions, *, block_size: int, validate: bool = True):
    """vLLM's slot of every token position: ``block_tables[b, p // block_size] *
    block_size + p % block_size``, and -1 where ``p`` is -1 (padding).

    Parameters
    ----------
    block_tables : array of int32 or int64, shape (B, max_blocks)
        Row ``b`` lists the pages of sequence ``b`` in order (vLLM's block table).
    positions : array of int32 or int64, shape (B, n)
        Token positions of each sequence, -1 for padding.  NumPy or CuPy, the same
        backend as ``block_tables``.
    block_size : int
        Tokens per page (the cache's ``block_size``).
    validate : bool, default True
        Check the values: a position below -1 or a used table entry below 0 is a
        ``ValueError``, a position past the table (``p >= max_blocks * block_size``) an
        ``IndexError``.  On CuPy arrays the checks read a result back (a host sync);
        with ``validate=False`` such positions give slot -1 (the store skips them).

    Returns
    -------
    slots : array of int64, shape (B, n), on the inputs' backend
        Flatten it (``slots.reshape(-1)``) to get the ``slot_mapping`` of
        :meth:`PagedKVCache.store` for the tokens in row-major order.

    Examples
    --------
    >>> import numpy as np, fp4cache
    >>> tables = np.array([[7, 2], [5, -1]])
    >>> fp4cache.slot_mapping(tables, np.array([[0, 17, 18], [3, -1, -1]]), block_size=16)
    array([[112,  33,  34],
           [ 83,  -1,  -1]])
    """
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    T = int(block_size)
    on_gpu = _arrays.is_cupy(block_tables) or _arrays.is_cupy(positions)
    be = "cuda" if on_gpu else "cpu"
    tables = _arrays.to_backend(block_tables, be, "block_tables",
                                allow_convert=isinstance(block_tables, (list, tuple)))
    pos = _arrays.to_backend(positions, be, "positions",
                             allow_convert=isinstance(positions, (list, tuple)))
    for name, a in (("block_tables", tables), ("positions", pos)):
        if a.dtype not in (np.int32, np.int64):
            raise TypeError(f"{name} must have dtype int32 or int64, got {a.dtype}")
        if a.ndim != 2:
            raise ValueError(f"{name} must be 2-D (sequences, ...), got shape {tuple(a.shape)}")
    if pos.shape[0] != tables.shape[0]:
        raise ValueError(f"positions must have one row per block_tables row "
                         f"({tables.shape[0]}), got {pos.shape[0]}")
    xp = _arrays.array_module(be)
    max_blocks = tables.shape[1]
    limit = max_blocks * T
    pos = pos.astype(np.int64)
    pad = pos < 0
    past = pos >= limit
    col = xp.where(pad | past, 0, pos // T)
    if max_blocks == 0:
        blk = xp.full(pos.shape, -1, np.int64)
    else:
        blk = xp.take_along_axis(tables, col, axis=1).astype(np.int64)
    if _arrays.check_bool(validate, "validate"):
        for bad, exc, what in (
                (pos < -1, ValueError, "is below -1 (only -1 marks padding)"),
                (past, IndexError, f"is past the block table ({max_blocks} pages of "
                                   f"{T} tokens: positions must be < {limit})"),
                (~pad & ~past & (blk < 0), ValueError,
                 "falls in a block table entry below 0 (no page)")):
            if bool(bad.any()):
                b, j = (int(x) for x in np.unravel_index(int(bad.argmax()), bad.shape))
                raise exc(f"positions[{b}, {j}] = {int(pos[b, j])} {what}")
    slots = blk * T + pos % T
    return xp.where(pad | past | (blk < 0), -1, slots)
