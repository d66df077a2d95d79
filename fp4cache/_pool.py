"""The pool of one cache as its backend owns it: :class:`Pool`.

Each backend makes its own (:class:`fp4cache._cpu.HostPool`,
:class:`fp4cache._cuda.state.DevicePool`) and the front ends take it through
:mod:`fp4cache._backend` (the protocol re-exports it).  It sits below the backends so that
both can subclass it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from ._plans import PlanCache
from .formats import reciprocal_clamped
from .layout import PageGeometry

__all__ = ["Pool"]


class Pool:
    """One cache's page pool as its backend owns it: the pages, the counters, the global
    scales, the exact window and the prepared launches.  The backend makes it
    (``backend.new_pool``; :class:`fp4cache._cpu.HostPool` on the CPU,
    :class:`fp4cache._cuda.state.DevicePool` on a GPU) and every front end takes it; the
    few things that differ between devices (allocation, host copies, synchronization,
    the device guard, memory accounting) are its methods, so front ends never ask which
    device they run on.

    Attributes
    ----------
    backend : module
        The backend module that made the pool.
    device : str
        ``"cpu"`` or ``"cuda"``; ``device_id`` the GPU's ordinal (None on the CPU).
    geometry : PageGeometry
    num_blocks : int
    buffer : numpy.ndarray or cupy.ndarray
        The pages, uint8 ``(num_blocks, 2, geometry.side_bytes)``.
    owns_pages : bool
        False for pages the caller gave (not counted in :attr:`nbytes`).
    k_s, v_s, k_g, v_g : numpy.float32
        The global scales and their clamped reciprocals.
    stats : numpy.ndarray or cupy.ndarray
        The uint64 counters (``_abi.STAT_NAMES``).
    plans : PlanCache
        The prepared launches, by argument signature (the backend's one plan cache).
    workspace : Workspace or None
        The scratch memory the pool's kernels share (None where none is needed).
    validate : bool
        The default of ``validate=None``; always True where :attr:`checks_are_free`.
    scale_rule : str
        The store's scale rule (``"static6"`` or ``"4over6"``).
    rotation : str
        ``"none"`` or ``"hadamard"`` (K stored rotated, ``docs/window.md``).
    window_pages : int
        ``P``, the newest pages of a sequence read from the exact window (0: no window).
    window, window_map : array or None
        The window slots, uint16 bfloat16 bits ``(S, 2, T, H, D)``, and the int32 map
        ``(num_blocks,)`` from a block to its slot (-1: none); None without a window.
    """

    #: The backend reads ids and lengths on the host anyway, so checking them costs no
    #: synchronization: every call checks them and ``validate`` is always True.
    checks_are_free = False

    __slots__ = ("backend", "device", "device_id", "geometry", "num_blocks", "buffer",
                 "owns_pages", "k_s", "v_s", "k_g", "v_g", "stats", "plans", "workspace",
                 "validate", "scale_rule", "rotation", "window_pages", "window", "window_map")

    def __init__(self, backend: Any, device: str, device_id: int | None,
                 geometry: PageGeometry, buffer, stats, k_s, v_s, *, owns_pages: bool,
                 validate: bool, scale_rule: str, rotation: str = "none",
                 window_pages: int = 0, window=None, window_map=None, workspace=None,
                 plans: PlanCache | None = None) -> None:
        self.backend = backend
        self.device = device
        self.device_id = device_id
        self.geometry = geometry
        self.num_blocks = int(buffer.shape[0])
        self.buffer = buffer
        self.owns_pages = owns_pages
        self.k_s, self.v_s = np.float32(k_s), np.float32(v_s)
        self.k_g, self.v_g = reciprocal_clamped(self.k_s), reciprocal_clamped(self.v_s)
        self.stats = stats
        self.plans = PlanCache() if plans is None else plans
        self.workspace = workspace
        self.validate = bool(validate) or self.checks_are_free
        self.scale_rule = scale_rule
        self.rotation = rotation
        self.window_pages = window_pages
        self.window = window
        self.window_map = window_map

    @property
    def window_slots(self) -> int:
        """``S``, the slots of the exact window (0: none)."""
        return 0 if self.window is None else int(self.window.shape[0])

    @property
    def block_size(self) -> int:
        return self.geometry.block_size

    @property
    def rotated(self) -> bool:
        """K is stored rotated by the normalized Hadamard transform (``rotation``)."""
        return self.rotation == "hadamard"

    @property
    def window_args(self) -> dict:
        """The attention backends' keyword arguments for the exact window and the rotation
        (``docs/window.md``): ``window`` = ``(slots, map, pages)`` or None, ``rotate``."""
        window = None if self.window is None else (self.window, self.window_map,
                                                   self.window_pages)
        return {"window": window, "rotate": self.rotated}

    @property
    def store_window(self):
        """``(slots, map)`` of the exact window, which the store also writes, or None."""
        return None if self.window is None else (self.window, self.window_map)

    # -- what differs between devices ------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Memory the pool owns, in bytes: pages (when owned), counters, window, tables
        and workspace."""
        owned = (self.buffer if self.owns_pages else None, self.stats, self.window,
                 self.window_map, *self.tables())
        ws = self.workspace
        # a shared workspace counts a share in each pool: once, over the pools
        ws_bytes = 0 if ws is None else -(-ws.nbytes // ws.users)
        return ws_bytes + sum(a.nbytes for a in owned if a is not None)

    def tables(self) -> tuple:
        """The backend's own device tables (counted in :attr:`nbytes`)."""
        return ()

    def guard(self):
        """A context manager that makes the pool's device current (and restores it)."""
        return contextlib.nullcontext()

    @property
    def xp(self):
        """The array module of the pool's arrays (NumPy or CuPy)."""
        return np

    def to_host(self, a) -> np.ndarray:
        """``a`` (an array of the pool's device) as a NumPy array (a copy off the host)."""
        return np.asarray(a)

    def host_staging(self, shape, dtype=np.uint8):
        """Host memory the pool's transfers read and write fastest (pinned on a GPU), or
        None where plain NumPy memory is as good."""
        return None

    def synchronize(self) -> None:
        """Wait for the pool's work queued on the current stream (nothing on the CPU)."""

    def share_workspace(self, other: Pool) -> None:
        """Launch with ``other``'s workspace from now on (this pool's own is freed and its
        prepared launches dropped); nothing where the pools have no workspace."""
        ws = other.workspace
        if ws is None or self.workspace is None or self.workspace is ws:
            return
        self.release()
        self.workspace = ws.share()

    def release(self) -> None:
        """Drop the prepared launches and free the workspace (leave it, where other pools
        share it: they keep it, and this pool gets a new one)."""
        self.plans.clear()
        ws = self.workspace
        if ws is not None:
            if ws.users > 1:
                self.workspace = ws.leave()
            else:
                ws.release()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(device={self.device!r}, device_id={self.device_id}, "
                f"num_blocks={self.num_blocks}, geometry={self.geometry})")
