"""What a :class:`~fp4cache.PagedKVCache` owns on a GPU: its :class:`DevicePool`.

The page pool, the uint64 counters, the encode table of the global scales, the
duplicate-slot claim table, the exact window, the prepared launches (plans) and the
workspace the kernels share; made by the backend (:func:`new_pool`) for the cache,
freed with it.
"""

from __future__ import annotations

import sys

import cupy
import ml_dtypes
import numpy as np

from .. import _abi
from .._device import DeviceGuard, format_bytes, pinned_empty
from .._plans import Workspace
from .._pool import Pool
from ..formats import reciprocal_clamped
from ..layout import PageGeometry

__all__ = ["DevicePool", "os_table_values", "new_pool", "allocation_bytes",
           "memory_available", "PAGE_EXTRAS"]

_F32 = np.float32


def os_table_values(k_s: float, v_s: float) -> np.ndarray:
    """EncodeAux::os_tab for (k_s, v_s): os = min(fl(1/fl(f*s)), FLT_MAX), 0 for f = 0,
    for the 128 non-negative E4M3 scale bytes f, K's then V's (IEEE float32, numpy)."""
    f = np.arange(128, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    f[127] = 0  # 0x7F is NaN; never looked up (non-finite groups skip the table)
    out = []
    for s in (np.float32(k_s), np.float32(v_s)):
        with np.errstate(under="ignore"):
            fs = f * s
        out.append(np.where(f == 0, np.float32(0), reciprocal_clamped(fs)).astype(np.float32))
    return np.concatenate(out)


class DevicePool(Pool):
    """The pool of one :class:`~fp4cache.PagedKVCache` on a GPU (``device_id``): the pages
    (its own, zeroed, or the caller's ``pages``), the uint64 counters, the encode table of
    its scales (``os_tab``), the uint32 duplicate-slot claim table (one entry per slot,
    zero between calls), the exact window, its prepared launches and the workspace its
    kernels share (:class:`~fp4cache._plans.Workspace`).  Freed with the cache.  It is
    also the ``scratch`` of the functional ``decode_attention`` / ``attention`` (it has
    ``plans`` and ``workspace``).  ``tables=False``: a gather-only pool (no store
    tables)."""

    __slots__ = ("os_tab", "claim")

    def __init__(self, backend, device_id: int, geom: PageGeometry, k_s, v_s, *,
                 num_blocks: int | None = None, pages=None, stats=None, k_g=None, v_g=None,
                 tables: bool = True, validate: bool = False, scale_rule: str = "static6",
                 rotation: str = "none", window_pages: int = 0,
                 window_slots: int = 0) -> None:
        with cupy.cuda.Device(device_id):
            buffer = (cupy.zeros((num_blocks, 2, geom.side_bytes), dtype=np.uint8)
                      if pages is None else pages)
            n = int(buffer.shape[0])
            if stats is None:
                stats = cupy.zeros(len(_abi.STAT_NAMES), dtype=np.uint64)
            window = (cupy.zeros((window_slots, 2, geom.block_size, geom.num_heads,
                                  geom.head_dim), dtype=np.uint16)
                      if window_slots else None)
            window_map = cupy.full(n, -1, dtype=np.int32) if window_slots else None
            # the store's tables (a gather-only pool has none)
            self.os_tab = cupy.asarray(os_table_values(k_s, v_s)) if tables else None
            self.claim = cupy.zeros(n * geom.block_size, dtype=np.uint32) if tables else None
        super().__init__(backend, "cuda", device_id, geom, buffer, stats, k_s, v_s,
                         owns_pages=pages is None, validate=validate, scale_rule=scale_rule,
                         rotation=rotation, window_pages=window_pages, window=window,
                         window_map=window_map, workspace=Workspace(device_id))
        if k_g is not None:
            self.k_g = _F32(k_g)
        if v_g is not None:
            self.v_g = _F32(v_g)

    @property
    def geom(self) -> PageGeometry:
        return self.geometry

    @property
    def scalars(self) -> tuple:
        """``(k_s, k_g, v_s, v_g)`` as the kernels' float32 arguments."""
        return (self.k_s, self.k_g, self.v_s, self.v_g)

    def tables(self) -> tuple:
        return tuple(a for a in (self.os_tab, self.claim) if a is not None)

    def guard(self):
        return DeviceGuard(self.device_id)

    @property
    def xp(self):
        return cupy

    def to_host(self, a) -> np.ndarray:
        return a.get() if isinstance(a, cupy.ndarray) else np.asarray(a)

    def host_staging(self, shape, dtype=np.uint8):
        return pinned_empty(shape, dtype)

    def synchronize(self) -> None:
        cupy.cuda.get_current_stream().synchronize()

    def release(self) -> None:
        with self.guard():
            super().release()


#: What :func:`allocation_bytes` counts per page besides the page.
PAGE_EXTRAS = " and its claim table"


def allocation_bytes(geom: PageGeometry, num_blocks: int, own_pages: bool = True) -> int:
    """Bytes a GPU pool of ``num_blocks`` pages allocates at construction: its pages
    (unless given) and the claim table of 4 bytes per slot."""
    return (num_blocks * 2 * geom.side_bytes if own_pages else 0) + \
        4 * num_blocks * geom.block_size


def memory_available(device_id: int) -> tuple[int, str]:
    """``(bytes, where)``: the GPU's free memory plus what CuPy's pool keeps free."""
    with DeviceGuard(device_id):
        have = (int(cupy.cuda.runtime.memGetInfo()[0])
                + int(cupy.get_default_memory_pool().free_bytes()))
    return have, f"GPU {device_id} has {format_bytes(have)} free"


def new_pool(geom: PageGeometry, *, device_id: int, num_blocks: int | None, pages, k_s, v_s,
             validate: bool, scale_rule: str, rotation: str, window_pages: int,
             window_slots: int) -> DevicePool:
    """The pool of a new cache on GPU ``device_id``."""
    return DevicePool(sys.modules[__package__], device_id, geom, k_s, v_s, num_blocks=num_blocks,
                      pages=pages, validate=validate, scale_rule=scale_rule,
                      rotation=rotation, window_pages=window_pages, window_slots=window_slots)
