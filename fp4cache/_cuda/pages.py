"""Page moves on the GPU: ``copy_blocks``, ``read_blocks`` / ``write_blocks`` between
pages and device rows, and page transfers to and from host memory
(``kernels/page_copy.cu``).

Every function takes the pool view of the cache (:class:`fp4cache._backend.Pool`): its
``buffer``, ``stats``, ``geometry``, ``num_blocks`` and its ``workspace``.
No host synchronization and no allocation once the workspace fits (CUDA-graph safe).
"""

from __future__ import annotations

import cupy
import numpy as np

from .. import _abi
from .. import _kernels as K
from .._device import num_sms
from .launch import index_name

__all__ = ["copy_pages", "read_pages", "write_pages", "copy_workspace", "STAGING_BYTES"]

#: Largest staging buffer of a transfer between pages and scattered host rows.
STAGING_BYTES = 64 << 20

_U8 = np.dtype(np.uint8)
_PARAMS = _abi.struct_dtype("PageMoveParams")
_THREADS = _abi.PAGE_MOVE_THREADS


def _vec_width(*sizes: int) -> int:
    """Largest access width of :data:`fp4cache._kernels.PAGE_VEC_BYTES` dividing all."""
    return next(w for w in K.PAGE_VEC_BYTES if all(s % w == 0 for s in sizes))


def _params(pool, n: int, tables: int = 0, staging: int = 0):
    g = pool.geometry
    p = np.zeros((), dtype=_PARAMS)
    for name, value in (("buffer", pool.buffer.data.ptr), ("stats", pool.stats.data.ptr),
                        ("tables", tables), ("staging", staging),
                        ("num_blocks", pool.num_blocks), ("page_bytes", g.page_bytes),
                        ("side_bytes", g.side_bytes), ("data_bytes", g.data_bytes),
                        ("n", n)):
        p[name] = value
    return p[()]


def _contig_ids(a):
    return a if a.flags.c_contiguous else a.copy()


def copy_workspace(pool, n: int):
    """``(staging, tables)`` of a GPU copy of ``n`` pairs, views of the cache's workspace:
    ``(n, page_bytes)`` uint8 staging rows (scratch) and the ``COPY_TABLES * num_blocks``
    uint32 tables pending, dst_of (tickets: zero before and after every call).
    Taken at the first call, kept (and grown to the largest ``n``) by the workspace."""
    P = pool.geometry.page_bytes
    return pool.workspace.get(
        [((n, P), _U8)], tickets=_abi.COPY_TABLES * pool.num_blocks,
        hint=f"copy_blocks of {n} pages: run one before capturing")


def copy_pages(pool, src, dst, host_src, host_dst) -> None:
    """Copy pages ``src`` to pages ``dst`` (device ids; the host copies are unused here).
    Launch 1 marks each page's readers and writer, launch 2 copies (see
    ``kernels/page_copy.cu``); an id outside the pool is counted and skipped."""
    s, d = src, dst
    if s.dtype != d.dtype:
        s, d = s.astype(np.int64), d.astype(np.int64)
    s, d = _contig_ids(s), _contig_ids(d)
    n = s.shape[0]
    if n >= 2**31:
        raise ValueError(f"copy_blocks copies fewer than 2**31 pages per call, got {n}")
    staging, tables = copy_workspace(pool, n)
    ids = index_name(s.dtype, "src")
    p = _params(pool, n, tables.data.ptr, staging.data.ptr)
    mark = K.get_kernel(K.page_mark_spec(ids))
    copy = K.get_kernel(K.page_copy_spec(ids, _vec_width(pool.geometry.page_bytes)))
    mark(((n + _THREADS - 1) // _THREADS,), (_THREADS,), (s, d, p))
    copy((n,), (_THREADS,), (s, d, p))  # a CTA per pair


def read_pages(pool, blocks, host_blocks, out) -> None:
    """Pages ``blocks`` into the rows of ``out`` (device or host memory)."""
    if isinstance(out, cupy.ndarray):
        _move(pool, "read", blocks, out)
    else:
        _host_transfer(pool, "read", blocks, host_blocks, out)


def write_pages(pool, blocks, host_blocks, data) -> None:
    """The rows of ``data`` (device or host memory) into pages ``blocks``."""
    if isinstance(data, cupy.ndarray):
        _move(pool, "write", blocks, data)
    else:
        _host_transfer(pool, "write", blocks, host_blocks, data)


def _grid_pages(n: int) -> int:
    return max(1, min(n, 16 * num_sms()))


def _move(pool, kind: str, b, rows) -> None:
    """Launch read (pages -> rows) or write (rows -> pages) for device ``rows``."""
    b = _contig_ids(b)
    n = b.shape[0]
    vw = _vec_width(pool.geometry.page_bytes, rows.data.ptr)
    build = K.page_read_spec if kind == "read" else K.page_write_spec
    spec = build(index_name(b.dtype, "blocks"), vw)
    K.get_kernel(spec)((_grid_pages(n),), (_THREADS,), (b, rows, _params(pool, n)))


def _staging(pool, pages: int):
    """``(pages, page_bytes)`` uint8 staging rows in the cache's workspace (shared with
    every other launch of the cache, on the same stream-ordering terms)."""
    P = pool.geometry.page_bytes
    (rows,) = pool.workspace.get([((pages, P), _U8)],
                                       hint=f"page transfers of {pages} pages")
    return rows


def _runs(host: np.ndarray | None, num_blocks: int) -> list[tuple[int, int, int]] | None:
    """``[(first row, first page, pages)]`` when host ids form few runs of consecutive
    valid pages (a direct transfer each), else None."""
    if host is None or host.size == 0 or not ((host >= 0) & (host < num_blocks)).all():
        return None
    h = host.astype(np.int64)
    cut = np.flatnonzero(np.diff(h) != 1) + 1
    if cut.size >= 8:
        return None
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [h.size]])
    return [(int(a), int(h[a]), int(e - a)) for a, e in zip(starts, ends)]


def _host_transfer(pool, kind: str, b, hb, host) -> None:
    """Pages <-> host rows on the current stream: direct ``cudaMemcpyAsync`` per run of
    consecutive host ids, else chunks through the staging buffer (gather + one copy)."""
    rt = cupy.cuda.runtime
    stream = cupy.cuda.get_current_stream().ptr
    P = pool.geometry.page_bytes
    base = pool.buffer.data.ptr
    hptr = host.ctypes.data
    runs = _runs(hb, pool.num_blocks)
    if runs is not None:
        for row, page, count in runs:
            dev, hst = base + page * P, hptr + row * P
            if kind == "read":
                rt.memcpyAsync(hst, dev, count * P, rt.memcpyDeviceToHost, stream)
            else:
                rt.memcpyAsync(dev, hst, count * P, rt.memcpyHostToDevice, stream)
        return
    n = b.shape[0]
    chunk = max(1, min(n, STAGING_BYTES // P))
    stage = _staging(pool, chunk)
    b = _contig_ids(b)
    for a in range(0, n, chunk):
        c = min(chunk, n - a)
        rows = stage[:c]
        if kind == "read":
            _move(pool, "read", b[a:a + c], rows)
            rt.memcpyAsync(hptr + a * P, rows.data.ptr, c * P, rt.memcpyDeviceToHost, stream)
        else:
            rt.memcpyAsync(rows.data.ptr, hptr + a * P, c * P, rt.memcpyHostToDevice, stream)
            _move(pool, "write", b[a:a + c], rows)
