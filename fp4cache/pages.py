"""Moving whole pages: copy inside the pool, read to / write from host or device memory,
save and load, and the page format a receiver checks.

What :class:`~fp4cache.PagedKVCache`'s ``copy_blocks``, ``read_blocks``, ``write_blocks``,
``page_format``, ``save``, ``load`` and ``load_pages`` do; the methods delegate here with
the cache's :class:`~fp4cache._backend.Pool`.  A page is moved as its raw bytes
(``PageGeometry.page_bytes`` of them: K side, V side, data and scales), so every move is
byte-exact and both backends give identical bytes.  This module checks the arguments
and the formats and does the file I/O; the moves are the backends' ``copy_pages``,
``read_pages`` and ``write_pages`` (on the GPU :mod:`fp4cache._cuda.pages`: a copy in
two launches through the cache's workspace, host transfers through staging rows or
directly for runs of consecutive ids).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from . import _arrays
from ._backend import Pool

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "page_format", "check_page_format",
           "copy_blocks", "read_blocks", "write_blocks", "save", "load", "load_pages"]

#: ``page_format()["format"]``: what the bytes are.
FORMAT_NAME = "fp4cache.nvfp4_paged"
#: ``page_format()["version"]``: bumped whenever a page's byte layout changes.
FORMAT_VERSION = 1
#: safetensors metadata keys and tensor names of a saved cache.
META_FORMAT = "fp4cache.page_format"
META_NUM_BLOCKS = "fp4cache.num_blocks"
TENSOR_PAGES = "pages"
TENSOR_BLOCKS = "blocks"
META_WINDOW_SLOTS = "fp4cache.window_slots"
TENSOR_WINDOW = "window"  # the saved pages' window rows (uint16 bf16 bits), where mapped
TENSOR_WINDOW_SLOTS = "window_slots"  # each saved page's slot (int32, -1: not mapped)

_U8 = np.dtype(np.uint8)


# -- format --------------------------------------------------------------------------------
def page_format(pool: Pool) -> dict[str, Any]:
    """Everything needed to read a page of ``pool``: see :meth:`PagedKVCache.page_format`."""
    g = pool.geometry
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "layout": g.layout,
        "block_size": g.block_size,
        "num_heads": g.num_heads,
        "head_dim": g.head_dim,
        "page_bytes": g.page_bytes,
        "scale_rule": pool.scale_rule,
        "swizzle_v_scales": bool(g.swizzle_v_scales),
        "k_scale": float(pool.k_s),  # the float32 value, exactly
        "v_scale": float(pool.v_s),
        # only where they are on: a plain cache's format is vLLM's, unchanged
        **({"rotation": pool.rotation} if pool.rotation != "none" else {}),
        **({"window_pages": pool.window_pages} if pool.window_pages else {}),
    }


#: Fields a format holds only where they differ from these defaults (a plain cache's format
#: is the one it always was).
OPTIONAL_FIELDS = {"rotation": "none", "window_pages": 0}

#: Fields that describe the cache, not the page bytes: pages move between caches that
#: differ in them (the receiver's window is filled from the pages).
INFO_FIELDS = frozenset({"window_pages"})


#: The type of each ``page_format()`` field: ``int`` fields take Python or NumPy integers
#: (not bools, not floats such as 16.0), ``bool`` ones bools, ``str`` ones strings, and
#: ``float`` ones real numbers (Python or NumPy floats or integers; not bools, not strings).
FIELD_TYPES = {"format": str, "version": int, "layout": str, "block_size": int,
               "num_heads": int, "head_dim": int, "page_bytes": int, "scale_rule": str,
               "swizzle_v_scales": bool, "k_scale": float, "v_scale": float,
               "rotation": str, "window_pages": int}
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


def check_page_format(fmt: Any, pool, *, what: str = "page_format") -> None:
    """Raise ``TypeError`` naming the first field of ``fmt`` of the wrong type (see
    :data:`FIELD_TYPES`), else ``ValueError`` naming the first field where ``fmt``
    differs from ``page_format(pool)`` (a missing or unknown field counts as
    different)."""
    if not isinstance(fmt, dict):
        raise TypeError(f"{what} must be a dict as returned by page_format(), got "
                        f"{type(fmt).__name__}")
    check_page_format_types(fmt, what=what)
    mine = {**OPTIONAL_FIELDS, **page_format(pool)}
    fmt = {**{k: v for k, v in OPTIONAL_FIELDS.items() if k not in INFO_FIELDS}, **fmt}
    for key, want in mine.items():
        if key in INFO_FIELDS:
            continue
        if key not in fmt:
            raise ValueError(f"{what} has no field {key!r} (this cache's is {want!r}); "
                             "nothing was written")
        got = fmt[key]
        if not _same(got, want):
            raise ValueError(f"{what} field {key!r} differs: the pages have {got!r}, this "
                             f"cache has {want!r}; pages of another format would decode "
                             "wrong, so nothing was written")
    extra = sorted(set(fmt) - set(mine) - INFO_FIELDS)
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
def _ids(pool, ids, name: str):
    """``(ids on the cache's backend, the same ids on the host or None)``: the host copy
    exists when the caller gave host ids (free to check) and is None for device ids."""
    host = None
    if not _arrays.is_cupy(ids) and _arrays.backend_of(ids) == "cpu":
        host = _arrays.to_backend(ids, "cpu", name, allow_convert=True)
        _arrays.check_index_array(host, name)
    a = _arrays.to_backend(ids, pool.device, name, allow_convert=True)
    _arrays.check_index_array(a, name)
    if isinstance(a, np.ndarray):
        host = a
    return a, host


def _host_ids(a, host, check: bool):
    """The ids on the host: given there, or read back (a host sync) when validating."""
    if host is not None:
        return host
    return a.get() if check else None


def _check_range(host: np.ndarray, num_blocks: int, name: str,
                 outcome: str = "nothing was written") -> None:
    """``IndexError`` for the first id of ``host`` outside ``[0, num_blocks)``; its message
    ends with ``outcome`` (what the refused call did not do)."""
    bad = (host < 0) | (host >= num_blocks)
    if bad.any():
        i = int(bad.argmax())
        raise IndexError(f"{name}[{i}] = {int(host[i])} is out of range: block ids must be "
                         f"in [0, {num_blocks}); {outcome}")


def _check_unique(host: np.ndarray, name: str) -> None:
    if host.size < 2:
        return
    srt = np.sort(host)
    rep = srt[1:][srt[1:] == srt[:-1]]
    if rep.size:
        i = int(np.flatnonzero(host == rep[0])[1])
        raise ValueError(f"{name} repeats block {int(rep[0])} (again at {name}[{i}]): each "
                         "page can be written once per call; nothing was written")


def _overlaps_pool(pool, a) -> bool:
    buf = pool.buffer
    if _arrays.is_cupy(a):
        pa, pb = a.data.ptr, buf.data.ptr
        return a.nbytes > 0 and pa < pb + buf.nbytes and pb < pa + a.nbytes
    return isinstance(a, np.ndarray) and isinstance(buf, np.ndarray) and \
        bool(np.shares_memory(a, buf))


# -- copy ----------------------------------------------------------------------------------
def copy_blocks(pool, src, dst, validate: bool | None = None) -> None:
    """See :meth:`PagedKVCache.copy_blocks`."""
    validate = _arrays.check_bool(validate, "validate", optional=True)
    check = pool.validate if validate is None else validate
    s, hs = _ids(pool, src, "src")
    d, hd = _ids(pool, dst, "dst")
    if s.shape != d.shape:
        raise ValueError(f"src and dst must have the same length, got {s.shape[0]} and "
                         f"{d.shape[0]}")
    _arrays.check_device({"src": s, "dst": d}, pool.buffer)
    hs, hd = _host_ids(s, hs, check), _host_ids(d, hd, check)
    if check:
        _check_range(hs, pool.num_blocks, "src")
        _check_range(hd, pool.num_blocks, "dst")
    if hd is not None:
        _check_unique(hd, "dst")
    if s.shape[0]:
        pool.backend.copy_pages(pool, s, d, hs, hd)
        if pool.window is not None:
            pool.backend.copy_window(pool, s, d)


def map_window(pool, blocks, slots, validate: bool | None = None) -> None:
    """See :meth:`PagedKVCache.map_window`."""
    validate = _arrays.check_bool(validate, "validate", optional=True)
    check = pool.validate if validate is None else validate
    if pool.window is None:
        raise ValueError("map_window needs a cache with an exact window: "
                         "PagedKVCache(..., window_pages=P, window_slots=S)")
    b, hb = _ids(pool, blocks, "blocks")
    sl, hs = _ids(pool, slots, "slots")
    if b.shape != sl.shape:
        raise ValueError(f"blocks and slots must have the same length, got {b.shape[0]} and "
                         f"{sl.shape[0]}")
    _arrays.check_device({"blocks": b, "slots": sl}, pool.buffer)
    hb, hs = _host_ids(b, hb, check), _host_ids(sl, hs, check)
    if hb is not None:
        _check_range(hb, pool.num_blocks, "blocks")
        _check_unique(hb, "blocks")
    if hs is not None:
        S = pool.window_slots
        bad = (hs < -1) | (hs >= S)
        if bad.any():
            i = int(bad.argmax())
            raise IndexError(f"slots[{i}] = {int(hs[i])} is out of range: window slots must "
                             f"be in [0, window_slots = {S}), or -1 to unmap; nothing was "
                             "written")
    if check and hb is not None and hs is not None:
        wm = pool.window_map
        after = (wm.get() if _arrays.is_cupy(wm) else np.array(wm))
        after[hb] = hs
        live = np.sort(after[after >= 0])
        rep = live[1:][live[1:] == live[:-1]]
        if rep.size:
            owners = np.flatnonzero(after == rep[0])
            raise ValueError(f"window slot {int(rep[0])} would hold blocks "
                             f"{owners.tolist()}: a slot holds one page (unmap the old page "
                             "with slot -1 in the same call); nothing was written")
    if b.shape[0]:
        pool.backend.map_window(pool, b, sl)


# -- read / write --------------------------------------------------------------------------
def read_blocks(pool, blocks, out=None, validate: bool | None = None):
    """See :meth:`PagedKVCache.read_blocks`."""
    validate = _arrays.check_bool(validate, "validate", optional=True)
    check = pool.validate if validate is None else validate
    b, hb = _ids(pool, blocks, "blocks")
    _arrays.check_device({"blocks": b}, pool.buffer)
    n, P = b.shape[0], pool.geometry.page_bytes
    shape = (n, P)
    if out is None:
        out = pool.xp.empty(shape, _U8)
    else:
        _check_rows(pool, out, "out", shape, writable=True)
        if _overlaps_pool(pool, out):
            raise ValueError("out must not overlap the cache's page pool")
    hb = _host_ids(b, hb, check)
    if check:
        _check_range(hb, pool.num_blocks, "blocks", "nothing was read")
    if n == 0:
        return out
    pool.backend.read_pages(pool, b, hb, out)
    return out


def write_blocks(pool, blocks, data, page_format: Any = None,
                 validate: bool | None = None) -> None:
    """See :meth:`PagedKVCache.write_blocks`."""
    validate = _arrays.check_bool(validate, "validate", optional=True)
    check = pool.validate if validate is None else validate
    if page_format is not None:
        check_page_format(page_format, pool)
    b, hb = _ids(pool, blocks, "blocks")
    _arrays.check_device({"blocks": b}, pool.buffer)
    n, P = b.shape[0], pool.geometry.page_bytes
    if _arrays.is_cupy(data) and not _arrays.is_cupy(pool.buffer):
        data = data.get()  # a device array for host pages
    elif not (isinstance(data, np.ndarray) or _arrays.is_cupy(data)) \
            and hasattr(data, "__dlpack__"):  # another library's array, zero copy
        data = _arrays.to_backend(data, _arrays.backend_of(data), "data")
    _check_rows(pool, data, "data", (n, P), writable=False)
    _arrays.check_device({"data": data}, pool.buffer)
    hb = _host_ids(b, hb, check)
    if check:
        _check_range(hb, pool.num_blocks, "blocks")
    if hb is not None:
        _check_unique(hb, "blocks")
    if n == 0:
        return
    if _arrays.is_cupy(data) and _overlaps_pool(pool, data):
        data = data.copy()  # rows read from pages that the same call writes
    pool.backend.write_pages(pool, b, hb, data)
    if pool.window is not None:
        pool.backend.fill_window(pool, b)


def _check_rows(pool, a, name: str, shape: tuple[int, int], *, writable: bool) -> None:
    """``a``: a NumPy or (GPU cache) CuPy uint8 array of ``shape``, C-contiguous."""
    if not (isinstance(a, np.ndarray) or _arrays.is_cupy(a)):
        raise TypeError(f"{name} must be a NumPy or CuPy uint8 array, got "
                        f"{type(a).__module__}.{type(a).__name__}")
    if _arrays.is_cupy(a) and not _arrays.is_cupy(pool.buffer):
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


def save(pool, path: str | os.PathLike, blocks=None) -> None:
    """See :meth:`PagedKVCache.save`."""
    stn, _ = _safetensors()
    path = _fspath(path)
    if blocks is None:
        blocks = np.arange(pool.num_blocks, dtype=np.int64)
    hb = _arrays.to_backend(blocks, "cpu", "blocks", allow_convert=True)
    _arrays.check_index_array(hb, "blocks")
    _check_range(hb, pool.num_blocks, "blocks", "nothing was saved")
    _check_unique(hb, "blocks")  # a file of repeated ids could not be loaded
    _check_save_path(path)
    pages = read_blocks(pool, hb, pool.host_staging((hb.shape[0], pool.geometry.page_bytes)),
                        validate=True)
    pool.synchronize()
    meta = {META_FORMAT: json.dumps(page_format(pool)),
            META_NUM_BLOCKS: str(pool.num_blocks)}
    tensors = {TENSOR_PAGES: np.asarray(pages), TENSOR_BLOCKS: hb.astype(np.int64)}
    if pool.window is not None:  # the exact window of the saved pages travels with them
        wmap, win = pool.to_host(pool.window_map), pool.to_host(pool.window)
        slots = wmap[hb].astype(np.int32)
        tensors[TENSOR_WINDOW_SLOTS] = slots
        tensors[TENSOR_WINDOW] = np.ascontiguousarray(win[np.maximum(slots, 0)])
        tensors[TENSOR_WINDOW][slots < 0] = 0
        meta[META_WINDOW_SLOTS] = str(pool.window_slots)
    stn.save_file(tensors, path, metadata=meta)


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


def _read_file(path) -> tuple[str, dict, int, np.ndarray, np.ndarray, Any]:
    """``(path as str, page format, saved num_blocks (0: not saved), pages, ids, window)``
    of a file written by :func:`save` (``window``: ``(window_slots, slot per page, window
    rows)`` when the cache had an exact window, else None); every problem of the file is
    an exception naming ``path`` and nothing is written anywhere."""
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
    window = None
    if TENSOR_WINDOW_SLOTS in tensors and TENSOR_WINDOW in tensors:
        wslots, wrows = tensors[TENSOR_WINDOW_SLOTS], tensors[TENSOR_WINDOW]
        if (wslots.dtype != np.int32 or wslots.shape != ids.shape or wrows.dtype != np.uint16
                or wrows.ndim != 5 or wrows.shape[0] != ids.shape[0]):
            raise _not_page_file(path, f"its {TENSOR_WINDOW!r} tensors do not hold one int32 "
                                       "slot and one uint16 window row per page")
        try:
            num_slots = int(meta.get(META_WINDOW_SLOTS, 0))
        except (TypeError, ValueError):
            raise _not_page_file(path, f"its {META_WINDOW_SLOTS!r} metadata is not an "
                                       "integer") from None
        window = (num_slots, wslots, wrows)
    return path, fmt, num_blocks, pages, ids, window


def _put_window(pool, ids: np.ndarray, window, *, remap: bool) -> None:
    """The saved window rows of pages ``ids`` into ``pool``'s window: ``remap`` (a cache
    made by :func:`load`) maps each page to its saved slot; otherwise the rows go to the
    slots the pages are mapped to now (those without saved rows keep the values
    :func:`write_blocks` filled from the pages)."""
    if window is None or pool.window is None:
        return
    _, slots, rows = window
    slots = slots.astype(np.int64)
    xp = pool.xp
    if remap:
        live = (slots >= 0) & (slots < pool.window_slots)
        pool.window_map[xp.asarray(ids[live])] = xp.asarray(slots[live].astype(np.int32))
        dest = slots
    else:
        wm = pool.window_map
        dest = pool.to_host(wm)[ids].astype(np.int64)
    use = (slots >= 0) & (dest >= 0) & (dest < pool.window_slots)
    if use.any():
        if rows.shape[1:] != pool.window.shape[1:]:
            raise ValueError(f"the saved window rows have shape {rows.shape[1:]}, this "
                             f"cache's {pool.window.shape[1:]}")
        pool.window[xp.asarray(dest[use])] = xp.asarray(rows[use])


def _check_file_format(path: str, fmt: dict, pool) -> None:
    """``fmt`` (a file's page format) agrees with the cache it describes, field by field,
    with the types :func:`check_page_format` takes."""
    for key, want in page_format(pool).items():
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
    path, fmt, num_blocks, pages, ids, window = _read_file(path)
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
                    validate=validate, rotation=fmt.get("rotation", "none"),
                    window_pages=fmt.get("window_pages", 0),
                    window_slots=window[0] if window is not None else 0)
    except (TypeError, ValueError) as e:
        raise ValueError(f"path {path!r}: its page format does not describe a cache "
                         f"({e}); nothing was loaded") from None
    pool = cache.pool
    _check_file_format(path, fmt, pool)
    if pages.shape[1] != pool.geometry.page_bytes:
        raise ValueError(f"path {path!r}: its pages have {pages.shape[1]} bytes each, but "
                         f"its page format gives page_bytes {pool.geometry.page_bytes}; "
                         "nothing was loaded")
    write_blocks(pool, ids, pages, validate=True)
    _put_window(pool, ids, window, remap=True)
    return cache


def load_pages(pool, path, blocks=None) -> np.ndarray:
    """See :meth:`PagedKVCache.load_pages`."""
    path, fmt, _, pages, ids, window = _read_file(path)
    check_page_format(fmt, pool, what=f"the page format of {path!r}")
    if blocks is not None:
        ids = _arrays.to_backend(blocks, "cpu", "blocks", allow_convert=True)
        _arrays.check_index_array(ids, "blocks")
        if ids.shape[0] != pages.shape[0]:
            raise ValueError(f"blocks must have one id per saved page ({pages.shape[0]}), "
                             f"got {ids.shape[0]}")
    write_blocks(pool, ids, pages, validate=True)
    _put_window(pool, np.asarray(ids, dtype=np.int64), window, remap=False)
    pool.synchronize()  # `pages` is freed on return
    return np.asarray(ids, dtype=np.int64)
