"""Storing K/V into the NVFP4 pages of a :class:`~fp4cache.PagedKVCache`, and reading them
back.

The front ends of ``PagedKVCache.store``, of the store inside
:meth:`fp4cache.AttentionPlan.run` and of ``PagedKVCache.gather_dequant``: argument checks
(the exceptions of ``docs/errors.md``) and the call into the backend's prepared store or
gather (``store_runner`` / ``gather_runner``: :mod:`fp4cache._cpu`,
:mod:`fp4cache._cuda.runners`), which keeps the launch in the pool's plans under the
signature of the arguments (:mod:`fp4cache._hotpath`: the methods' hot paths find it
there).  Every function takes the cache's :class:`~fp4cache._backend.Pool`.
"""

from __future__ import annotations

import numpy as np

from . import _arrays, _hotpath
from ._backend import Pool
from .formats import resolve_dtype

__all__ = ["check_args", "check_slots", "store", "gather"]


def check_args(pool: Pool, slot_mapping, k, v):
    """``(slots, k, v)`` as the backend reads them: on the pool's backend, ``k`` / ``v`` of
    the pool's heads and head_dim, the same shape and dtype, ``slots`` int32 / int64, one
    per token; on the GPU values contiguous along head_dim at their alignment and
    ``slots`` C-contiguous (copied where not: the kernels read them in place)."""
    be, g = pool.device, pool.geometry
    k = _arrays.to_backend(k, be, "k")
    v = _arrays.to_backend(v, be, "v")
    shape = (None, g.num_heads, g.head_dim)
    _arrays.check_values(k, "k", shape)
    _arrays.check_values(v, "v", shape)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if k.dtype != v.dtype:
        raise TypeError(f"k and v must have the same dtype, got {k.dtype} and {v.dtype}")
    slots = _arrays.to_backend(slot_mapping, be, "slot_mapping", allow_convert=True)
    _arrays.check_index_array(slots, "slot_mapping", length=k.shape[0])
    _arrays.check_device({"k": k, "v": v, "slot_mapping": slots}, pool.buffer)
    _arrays.check_strides(k, "k")
    _arrays.check_strides(v, "v")
    if _arrays.is_cupy(k):  # the kernels read rows of contiguous values at their alignment
        k = _arrays.aligned(k, "k")
        v = _arrays.aligned(v, "v")
        if k.strides[-1] != k.itemsize:
            k = k.copy()
        if v.strides[-1] != v.itemsize:
            v = v.copy()
        if not slots.flags.c_contiguous:
            slots = slots.copy()
    return slots, k, v


def check_slots(pool: Pool, slots, unique_slots: bool) -> None:
    """Slot values on the host: in ``[0, num_slots)`` or -1, and (``unique_slots``) no
    repeat; ``IndexError`` / ``ValueError`` before anything is written."""
    num_slots = pool.num_blocks * pool.geometry.block_size
    host = pool.to_host(slots)
    if host.size == 0:
        return
    lo, hi = int(host.min()), int(host.max())
    if hi >= num_slots or lo < -1:
        i = int(((host >= num_slots) | (host < -1)).argmax())
        raise IndexError(
            f"slot_mapping[{i}] = {int(host[i])} is out of range: slots must be "
            f"in [0, num_slots = {num_slots}), or -1 for padding (skipped); "
            "nothing was stored"
        )
    if unique_slots:
        valid = np.sort(host[host >= 0])
        rep = valid[1:][valid[1:] == valid[:-1]]
        if rep.size:
            raise ValueError(
                f"slot_mapping repeats slot {int(rep[0])} but unique_slots=True "
                "promises that no slot repeats (pass unique_slots=False to let the "
                "last occurrence win); nothing was stored"
            )


def store(pool: Pool, slot_mapping, k, v, unique_slots: bool, check: bool):
    """The checked path of :meth:`PagedKVCache.store` (see its docstring), run with the
    cache's device current.  Returns the ``(slots, k, v)`` stored (None when no token was
    given)."""
    slots, k, v = check_args(pool, slot_mapping, k, v)
    if k.shape[0] == 0:
        return None
    if check:
        check_slots(pool, slots, unique_slots)
    key = _hotpath.store_signature(slots, k, v, unique_slots)
    run = pool.backend.store_runner(pool, slots, k, v, unique_slots=unique_slots, key=key)
    run(slots, k, v)
    return slots, k, v


def gather(pool: Pool, blocks, dtype, out, check: bool):
    """The checked path of :meth:`PagedKVCache.gather_dequant` (see its docstring), run
    with the cache's device current: ``(k, v)``."""
    g = pool.geometry
    blocks = _arrays.to_backend(blocks, pool.device, "blocks", allow_convert=True)
    _arrays.check_index_array(blocks, "blocks")
    n = blocks.shape[0]
    shape = (n * g.block_size, g.num_heads, g.head_dim)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("out must be a tuple (k_out, v_out)")
        dt = (resolve_dtype(out[0].dtype, name="out[0].dtype") if dtype is None
              else resolve_dtype(dtype, name="dtype"))
        out_k = _arrays.check_out(out[0], "out[0]", shape, dt, pool.device)
        out_v = _arrays.check_out(out[1], "out[1]", shape, dt, pool.device)
        if _arrays.share_bytes(out_k, out_v):
            raise ValueError("out[0] and out[1] must not overlap (K and V need their own "
                             "arrays)")
    else:
        dt = resolve_dtype("bfloat16" if dtype is None else dtype, name="dtype")
        out_k = pool.xp.empty(shape, dtype=dt)
        out_v = pool.xp.empty(shape, dtype=dt)
    _arrays.check_device({"blocks": blocks, "out[0]": out_k, "out[1]": out_v}, pool.buffer)
    if n == 0:
        return out_k, out_v
    if check:
        host = pool.to_host(blocks)
        bad = (host < 0) | (host >= pool.num_blocks)
        if bad.any():
            i = int(bad.argmax())
            raise IndexError(f"blocks[{i}] = {int(host[i])} is out of range: block ids must "
                             f"be in [0, {pool.num_blocks})")
    if not blocks.flags.c_contiguous:
        blocks = blocks.copy()
    key = _hotpath.gather_signature(blocks, dtype, None if out is None else (out_k, out_v))
    pool.backend.gather_runner(pool, blocks, out_k, out_v, key=key)(blocks, out_k, out_v)
    return out_k, out_v
