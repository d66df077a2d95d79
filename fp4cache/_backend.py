"""The backend protocol: what a front end may ask of a backend, and the view of a pool.

Imports run one way (``tests/test_layering.py`` checks it)::

    public      __init__, __main__, hf
    front ends  cache, codec, calibrate, longlive, pages, attention
    protocol    _backend (this module)
    backends    _cpu | _cuda (state, paged, decode, varlen, pages, window, longlive, launch)
    helpers     _hotpath, _plans, _device, _arrays, _kernels
    constants   layout, formats, _abi, typing

A front end checks the arguments (the exceptions of ``docs/errors.md``), computes the
float32 scalars, allocates the outputs, makes the arrays' device current and calls the
backend of :func:`backend` with validated arrays only.  Both backends implement
:class:`Backend` with the same names and signatures; the CUDA one also implements
:class:`PreparedBackend`, the launches a cache prepares once per argument signature.
A :class:`~fp4cache.PagedKVCache` hands its front ends a :class:`Pool`: the pool and
what its kernels need, never the cache itself.
"""

from __future__ import annotations

from typing import Any, Protocol

from . import _arrays
from .layout import PageGeometry

__all__ = ["Backend", "PreparedBackend", "Pool", "backend"]


class Backend(Protocol):
    """The operations both backends implement (:mod:`fp4cache._cpu`, :mod:`fp4cache._cuda`).

    Every array is on the backend's device, validated and of the documented shape and
    dtype; outputs are preallocated.  ``geom`` is the pool's :class:`PageGeometry`,
    ``k_s`` / ``v_s`` the global scales, ``k_g`` / ``v_g`` their clamped reciprocals and
    ``stats`` the pool's uint64 counters (``_abi.STAT_NAMES``)."""

    def quantize(self, x, s, g, rule, data_out, scales_out) -> None: ...

    def dequantize(self, data, scales, s, out) -> None: ...

    def abs_max(self, x) -> Any: ...

    def store(self, buffer, slot_mapping, k, v, *, geom: PageGeometry, rule, k_s, k_g, v_s,
              v_g, stats, unique_slots: bool = False, rotate: bool = False,
              window=None) -> None: ...

    def gather_dequant(self, buffer, blocks, out_k, out_v, *, geom: PageGeometry, k_s, v_s,
                       stats, rotate: bool = False) -> None: ...

    def decode_attention(self, buffer, q, block_tables, seq_lens, out, lse, *,
                         geom: PageGeometry, k_s, v_s, sm_scale, stats, scratch, window=None,
                         rotate: bool = False) -> None: ...

    def attention(self, buffer, q, query_start_loc, block_tables, seq_lens, out, lse, *,
                  geom: PageGeometry, k_s, v_s, sm_scale, stats, causal: bool,
                  max_query_len: int, scratch, window=None, rotate: bool = False) -> None: ...

    def longlive_quantize(self, x, rule, values_out, sf_out, amax_out) -> None: ...

    def copy_pages(self, pool: Pool, src, dst, host_src, host_dst) -> None: ...

    def read_pages(self, pool: Pool, blocks, host_blocks, out) -> None: ...

    def write_pages(self, pool: Pool, blocks, host_blocks, data) -> None: ...

    def map_window(self, pool: Pool, blocks, slots) -> None: ...

    def fill_window(self, pool: Pool, blocks) -> None: ...

    def copy_window(self, pool: Pool, src, dst) -> None: ...


class PreparedBackend(Backend, Protocol):
    """The CUDA backend's prepared launches: what a cache owns on the device (``CacheState``:
    pool, counters, tables, ``plans``, ``workspace``) and launches prepared once per
    argument signature, each an immutable callable (one kernel launch per call, no
    allocation, no host synchronization: CUDA-graph safe)."""

    CacheState: type

    def store_plan(self, st, slots, k, v, *, rule: str, unique_slots: bool) -> Any: ...

    def gather_plan(self, st, blocks, out_k, out_v) -> Any: ...

    def decode_runner(self, buffer, q, block_tables, seq_lens, *, geom: PageGeometry, k_s,
                      v_s, sm_scale, stats, scratch) -> Any: ...

    def varlen_runner(self, buffer, q, query_start_loc, block_tables, seq_lens, *,
                      max_query_len: int, causal: bool, geom: PageGeometry, k_s, v_s,
                      sm_scale, stats, scratch) -> Any: ...

    def workspace_bound(self, geom: PageGeometry, max_batch_size: int, max_seq_len: int,
                        num_query_heads: int) -> tuple[int, int]: ...


def backend(kind: str) -> Backend:
    """The backend of device kind ``"cpu"`` or ``"cuda"`` (imported on first use)."""
    if kind == "cpu":
        from . import _cpu

        return _cpu  # type: ignore[return-value]
    if kind == "cuda":
        why = _arrays.gpu_unavailable_reason()
        if why is not None:
            raise RuntimeError(f"device='cuda' needs CuPy and a CUDA GPU: {why}")
        from . import _cuda

        return _cuda  # type: ignore[return-value]
    raise ValueError(f"device must be 'cpu', 'cuda' or None, got {kind!r}")


class Pool:
    """What the front ends (and integrations, benchmarks, tests) see of a cache's page
    pool: :attr:`PagedKVCache.pool <fp4cache.PagedKVCache.pool>`.

    Attributes
    ----------
    backend : Backend
        The backend module of ``device``.
    device : str
        ``"cpu"`` or ``"cuda"``; ``device_id`` the GPU's ordinal (None on the CPU).
    geometry : PageGeometry
    num_blocks : int
    buffer : numpy.ndarray or cupy.ndarray
        The pages, uint8 ``(num_blocks, 2, geometry.side_bytes)``.
    k_s, v_s, k_g, v_g : numpy.float32
        The global scales and their clamped reciprocals.
    stats : numpy.ndarray or cupy.ndarray
        The uint64 counters (``_abi.STAT_NAMES``).
    state : CacheState or None
        The GPU resources of the cache (``plans``, ``workspace``, tables); None on the CPU.
    validate : bool
        The cache's default for ``validate=None``.
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

    __slots__ = ("backend", "device", "device_id", "geometry", "num_blocks", "buffer",
                 "k_s", "v_s", "k_g", "v_g", "stats", "state", "validate", "scale_rule",
                 "rotation", "window_pages", "window", "window_map")

    def __init__(self, backend: Backend, device: str, device_id: int | None,
                 geometry: PageGeometry, num_blocks: int, buffer, k_s, v_s, k_g, v_g, stats,
                 state, validate: bool, scale_rule: str, rotation: str = "none",
                 window_pages: int = 0, window=None, window_map=None) -> None:
        self.backend = backend
        self.device = device
        self.device_id = device_id
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.buffer = buffer
        self.k_s, self.v_s, self.k_g, self.v_g = k_s, v_s, k_g, v_g
        self.stats = stats
        self.state = state
        self.validate = validate
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
    def window_args(self) -> dict:
        """The attention backends' keyword arguments for the exact window and the rotation
        (``docs/window.md``): ``window`` = ``(slots, map, pages)`` or None, ``rotate``."""
        window = None if self.window is None else (self.window, self.window_map,
                                                   self.window_pages)
        return {"window": window, "rotate": self.rotation == "hadamard"}

    @property
    def store_window(self):
        """``(slots, map)`` of the exact window, which the store also writes, or None."""
        return None if self.window is None else (self.window, self.window_map)

    def __repr__(self) -> str:
        return (f"Pool(device={self.device!r}, device_id={self.device_id}, "
                f"num_blocks={self.num_blocks}, geometry={self.geometry})")
