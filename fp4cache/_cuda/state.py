"""What a :class:`~fp4cache.PagedKVCache` owns on the GPU: :class:`CacheState`.

The page pool, the uint64 counters, the encode table of the global scales, the
duplicate-slot claim table, the prepared launches (plans) and the workspace the kernels
share; created by and owned by the cache, freed with it.
"""

from __future__ import annotations

import cupy
import ml_dtypes
import numpy as np

from .. import _abi
from .._plans import PlanCache, Workspace
from ..formats import reciprocal_clamped
from ..layout import PageGeometry

__all__ = ["CacheState", "os_table_values"]

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


class CacheState:
    """The GPU resources one :class:`~fp4cache.PagedKVCache` owns, all on ``device``: the
    page pool, the uint64 counters, the encode table of its scales, the uint32
    duplicate-slot claim table (one entry per slot, zero between calls), its launch
    plans (:class:`~fp4cache._plans.PlanCache`, bounded) and the workspace its kernels
    share (:class:`~fp4cache._plans.Workspace`).  Freed with the cache.  It is also the
    ``scratch`` of :func:`decode_attention` (it has ``plans`` and ``workspace``)."""

    def __init__(self, device: int, geom: PageGeometry, num_blocks: int, k_s, k_g, v_s,
                 v_g, *, buffer=None, stats=None, tables: bool = True, rotation: str = "none",
                 window_pages: int = 0, window_slots: int = 0) -> None:
        self.device = device
        self.rotation = rotation  # "none" or "hadamard" (K stored rotated, docs/window.md)
        self.window_pages = window_pages  # P: pages per sequence read from the window
        self.geom = geom
        self.num_blocks = num_blocks
        self.scalars = (_F32(k_s), _F32(k_g), _F32(v_s), _F32(v_g))
        with cupy.cuda.Device(device):
            self.buffer = (cupy.zeros((num_blocks, 2, geom.side_bytes), dtype=np.uint8)
                           if buffer is None else buffer)
            self.stats = (cupy.zeros(len(_abi.STAT_NAMES), dtype=np.uint64)
                          if stats is None else stats)
            # the store's tables (a gather-only state has none)
            self.os_tab = cupy.asarray(os_table_values(k_s, v_s)) if tables else None
            self.claim = (cupy.zeros(num_blocks * geom.block_size, dtype=np.uint32)
                          if tables else None)
            # the exact window: bf16 bits (slots, 2, T, H, D) and block -> slot (-1: none)
            self.window = (cupy.zeros((window_slots, 2, geom.block_size, geom.num_heads,
                                       geom.head_dim), dtype=np.uint16)
                           if window_slots else None)
            self.window_map = (cupy.full(num_blocks, -1, dtype=np.int32)
                               if window_slots else None)
        self.plans = PlanCache()
        self.workspace = Workspace(device)

    @property
    def nbytes(self) -> int:
        """Device bytes held: pool, counters, encode table, claim table, window and
        workspace."""
        return self.workspace.nbytes + sum(
            a.nbytes for a in (self.buffer, self.stats, self.os_tab, self.claim, self.window,
                               self.window_map)
            if a is not None)
