"""The backend protocol: what a front end may ask of a backend, and the pool it owns.

Imports run one way (``tests/test_layering.py`` checks it)::

    public      __init__, __main__, hf, vllm
    front ends  codec, calibrate, attention, store, pages, longlive, cache, engine
    protocol    _backend (this module)
    backends    _cpu | _cuda (state, paged, decode, varlen, pages, window, longlive,
                runners, launch)
    helpers     _pool, _hotpath, _plans, _device, _arrays, _kernels, layout
    constants   formats, _abi, typing

A front end checks the arguments (the exceptions of ``docs/errors.md``), computes the
float32 scalars, allocates the outputs and calls the backend of :func:`backend` with
validated arrays only, never asking which device it runs on: both backends implement
:class:`Backend` with the same names and signatures, and each makes and owns the
:class:`Pool` of a cache (its pages, counters, window, prepared launches and
workspace; what differs between devices is a method of the pool).

Prepared launches live in one place, the pool's ``plans``: a runner
(``store_runner``, ``gather_runner``, ``attention_runner``) returns the launch kept
under ``key`` (the front end's signature of the arguments, :mod:`fp4cache._hotpath`),
preparing and keeping it on a miss; the front ends' hot paths look it up there.  A
runner's launch allocates nothing and never synchronizes the host (CUDA-graph safe).
"""

from __future__ import annotations

from typing import Any, Protocol

from . import _arrays
from ._pool import Pool
from .layout import PageGeometry

__all__ = ["Backend", "Pool", "backend"]


class Backend(Protocol):
    """The operations both backends implement (:mod:`fp4cache._cpu`, :mod:`fp4cache._cuda`).

    Every array is on the backend's device, validated and of the documented shape and
    dtype; outputs are preallocated.  ``geom`` is the pool's :class:`PageGeometry`,
    ``k_s`` / ``v_s`` the global scales, ``k_g`` / ``v_g`` their clamped reciprocals and
    ``stats`` the pool's uint64 counters (``_abi.STAT_NAMES``)."""

    # -- the pool --------------------------------------------------------------------------
    PAGE_EXTRAS: str  # what allocation_bytes counts per page besides the page

    def new_pool(self, geom: PageGeometry, *, device_id: int | None,
                 num_blocks: int | None, pages, k_s, v_s, validate: bool, scale_rule: str,
                 rotation: str, window_pages: int, window_slots: int) -> Pool: ...

    def allocation_bytes(self, geom: PageGeometry, num_blocks: int,
                         own_pages: bool = True) -> int: ...

    def memory_available(self, device_id: int | None) -> tuple[int | None, str]: ...

    def workspace_bound(self, geom: PageGeometry, max_batch_size: int, max_seq_len: int,
                        num_query_heads: int) -> tuple[int, int]: ...

    # -- prepared launches, kept in pool.plans ---------------------------------------------
    def store_runner(self, pool: Pool, slots, k, v, *, unique_slots: bool,
                     key: Any = None) -> Any: ...

    def gather_runner(self, pool: Pool, blocks, out_k, out_v, *, key: Any = None) -> Any: ...

    def attention_runner(self, pool: Pool, q, query_start_loc, block_tables, seq_lens, *,
                         max_query_len: int, causal: bool, sm_scale, exact_new: bool = False,
                         key: Any = None) -> Any: ...
    # The launch: ``run(q, query_start_loc, block_tables, seq_lens, out, lse)``; prepared
    # with ``exact_new``, also ``new_kv=(k, v)``, the exact new tokens
    # (``fp4cache._cpu.attention``).  A backend without them raises NotImplementedError for
    # ``exact_new``, before anything is prepared or runs.

    # -- page moves and the exact window ---------------------------------------------------
    def copy_pages(self, pool: Pool, src, dst, host_src, host_dst) -> None: ...

    def read_pages(self, pool: Pool, blocks, host_blocks, out) -> None: ...

    def write_pages(self, pool: Pool, blocks, host_blocks, data) -> None: ...

    def map_window(self, pool: Pool, blocks, slots) -> None: ...

    def fill_window(self, pool: Pool, blocks) -> None: ...

    def copy_window(self, pool: Pool, src, dst) -> None: ...

    # -- the functional codec (no pool) ----------------------------------------------------
    def quantize(self, x, s, g, rule, data_out, scales_out) -> None: ...

    def dequantize(self, data, scales, s, out) -> None: ...

    def abs_max(self, x) -> Any: ...

    def longlive_quantize(self, x, rule, values_out, sf_out, amax_out) -> None: ...

    def store(self, buffer, slot_mapping, k, v, *, geom: PageGeometry, rule, k_s, k_g, v_s,
              v_g, stats, unique_slots: bool = False, rotate: bool = False,
              window=None) -> None: ...

    def gather_dequant(self, buffer, blocks, out_k, out_v, *, geom: PageGeometry, k_s, v_s,
                       stats, rotate: bool = False) -> None: ...


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
