"""The exact window on the GPU: ``map_window``, ``fill_window`` and ``copy_window``
(``kernels/window.cu``, ``docs/window.md``).

Every function takes the pool view of the cache (:class:`fp4cache._backend.Pool`) with its
``window`` (uint16 bf16 bits ``(S, 2, T, H, D)``) and ``window_map`` (int32
``(num_blocks,)``); the front end has validated the ids (blocks in ``[0, num_blocks)``,
slots in ``[-1, S)``).  One launch each (``copy_window``: two, through staging rows of the
cache's workspace), no host synchronization and no allocation once the workspace fits
(CUDA-graph safe).  A slot's values are its page's dequantized values in the stored basis
(a rotated K stays rotated) rounded to bf16, NaN as ``0x7FC0``.
"""

from __future__ import annotations

import numpy as np

from .. import _abi
from .. import _kernels as K
from .._device import by_value
from ..layout import GROUP
from .launch import BLOCK, MAX_THREADS, THREADS, index_name
from .paged import _page_args

__all__ = ["map_window", "fill_window", "copy_window", "window_workspace"]

_PARAMS = _abi.struct_dtype("WindowParams")
_U16 = np.dtype(np.uint16)


def _groups_per_slot(geom) -> int:
    return 2 * geom.block_size * geom.num_heads * (geom.head_dim // GROUP)


def _params(pool, *, mode: int = 0, staging: int = 0):
    """The WindowParams of ``pool`` (``total`` is set per launch)."""
    g = pool.geometry
    pa = _page_args(g, pool.num_blocks)
    p = np.zeros((), dtype=_PARAMS)
    for name, value in (("buffer", pool.buffer.data.ptr), ("win", pool.window.data.ptr),
                        ("win_map", pool.window_map.data.ptr), ("staging", staging),
                        ("num_blocks", pool.num_blocks), ("side_bytes", g.side_bytes),
                        ("data_bytes", g.data_bytes),
                        ("qg", _abi.fastdiv(_groups_per_slot(g))), ("g", pa["fG"]),
                        ("h", pa["fH"]), ("t", pa["fT"]), ("nhd", pa["nhd"]),
                        ("swizzle", pa["swz"]), ("swz_m", pa["swz_m"]),
                        ("win_slots", pool.window_slots), ("mode", mode),
                        ("k_s", pool.k_s), ("v_s", pool.v_s)):
        p[name] = value
    return p


def _aligned(pool) -> bool:
    """Whether every group's 8 code bytes are 8-byte aligned (8-byte loads)."""
    return pool.geometry.side_bytes % 8 == 0 and pool.buffer.data.ptr % 8 == 0


def _contig(a):
    return a if a.flags.c_contiguous else a.copy()


def _launch(fn, p, n: int, a, b) -> None:
    """``fn`` over ``n`` pairs (entries) in launches of fewer than 2^31 threads."""
    qg = _groups_per_slot_of(p)
    per = max(1, MAX_THREADS // qg)
    for s in range(0, n, per):
        c = min(per, n - s)
        p["total"] = c * qg
        fn((-(-c * qg // THREADS),), BLOCK,
           (a[s:s + c], b[s:s + c], by_value(p)))


def _groups_per_slot_of(p) -> int:
    return int(p["qg"]["d"])


def _same_ids(a, b):
    """``a``, ``b`` of one id dtype (int64 if they differ), C-contiguous."""
    if a.dtype != b.dtype:
        a, b = a.astype(np.int64), b.astype(np.int64)
    return _contig(a), _contig(b)


def map_window(pool, blocks, slots) -> None:
    """``window_map[blocks[i]] = slots[i]`` and every slot ``slots[i] >= 0`` filled from
    page ``blocks[i]``, one launch (blocks should not repeat: the map keeps one of the
    repeated entries' slots)."""
    b, s = _same_ids(blocks, slots)
    n = b.shape[0]
    if n == 0:
        return
    ids = index_name(b.dtype, "blocks")
    fn = K.get_kernel(K.window_fill_spec(ids, _aligned(pool)))
    _launch(fn, _params(pool, mode=0), n, b, s)


def fill_window(pool, blocks) -> None:
    """Refill the slot of every mapped page among ``blocks`` from the page (after
    ``write_blocks`` / ``load_pages``), one launch."""
    b = _contig(blocks)
    n = b.shape[0]
    if n == 0:
        return
    ids = index_name(b.dtype, "blocks")
    fn = K.get_kernel(K.window_fill_spec(ids, _aligned(pool)))
    _launch(fn, _params(pool, mode=1), n, b, b)


def window_workspace(pool, n: int):
    """The ``(n, 2*T*H*D)`` uint16 staging rows of a ``copy_window`` of ``n`` pairs: a view
    of the cache's workspace (scratch), kept and grown to the largest ``n``."""
    g = pool.geometry
    (rows,) = pool.workspace.get(
        [((n, 2 * g.block_size * g.num_heads * g.head_dim), _U16)],
        hint=f"copy_blocks of {n} pages with a window: run one before capturing")
    return rows


def copy_window(pool, src, dst) -> None:
    """After ``copy_pages(src, dst)`` (pages ``dst[i]`` hold ``src[i]``'s bytes): each pair
    whose destination is mapped gets the source's slot values when the source is mapped,
    else values filled from page ``dst[i]``; every read before any write.  Two launches:
    stage the source slots in the workspace, then write the destinations."""
    s, d = _same_ids(src, dst)
    n = s.shape[0]
    if n == 0:
        return
    staging = window_workspace(pool, n)
    ids = index_name(s.dtype, "src")
    stage = K.get_kernel(K.window_stage_spec(ids))
    write = K.get_kernel(K.window_write_spec(ids, _aligned(pool)))
    qg = _groups_per_slot(pool.geometry)
    per = max(1, MAX_THREADS // qg)
    if n > per:  # staging row i is pair i's: the chunks keep their own rows
        raise ValueError(f"copy_window moves fewer than {per} pages per call, got {n}")
    p = _params(pool, staging=staging.data.ptr)
    p["total"] = n * qg
    grid, args = (-(-n * qg // THREADS),), (s, d, by_value(p))
    stage(grid, BLOCK, args)
    write(grid, BLOCK, args)
