"""The hot path of every GPU API: a call signature -> the launch prepared for it.

A checked call that may repeat (``store``, ``gather_dequant``, ``decode_attention``,
``attention``, LongLive's ``dequantize`` / ``dequantize_pool``) leaves its prepared launch
under the signature of its arguments: everything the checks and the launch depend on
(kinds, shapes, dtypes, strides, pointer alignment, devices, scalars), never the values.
The next unvalidated call with the same signature skips the checks and runs the launch:
one lookup and its kernel launches (one to three) of host time.  A signature is None for
arguments the hot path does not take (not all CuPy arrays, an unhashable scalar): those
always take the checked path.

Where the launches live: a cache's in its pool's bounded plan cache (``pool.plans``,
where the backend's runners keep them under the signature the front end passes as their
key; :func:`run`, :func:`gather`, :func:`attention` look them up); the functional
LongLive APIs, which have no owner object, in the two bounded caches of this module
(:data:`LONGLIVE_POOL`, :data:`LONGLIVE_LISTS`).
"""

from __future__ import annotations

import functools
import weakref
from itertools import chain

import numpy as np

from ._arrays import is_cupy
from ._device import DeviceGuard
from ._plans import PlanCache
from .formats import resolve_dtype

_F32 = np.dtype(np.float32)

__all__ = ["MISS", "run", "gather", "attention", "store_signature", "gather_signature",
           "decode_signature", "varlen_signature", "LONGLIVE_POOL",
           "LONGLIVE_LISTS", "longlive_signature", "longlive_list_hit",
           "longlive_list_remember"]

#: What :func:`run` returns when no launch is prepared for a signature.
MISS = object()


@functools.cache
def _cupy():
    import cupy

    return cupy


@functools.cache
def _get_device():
    return _cupy().cuda.runtime.getDevice


def _current_device() -> int:
    return _get_device()()


def run(pool, sig, *args):
    """The launch a checked call left under signature ``sig`` in the plans of ``pool`` (a
    cache's :class:`~fp4cache._backend.Pool`), run with the pool's GPU current
    (switching only when another is); else :data:`MISS`."""
    launch = pool.plans.get(sig) if sig is not None else None
    if launch is None:
        return MISS
    if _get_device()() == pool.device_id:
        return launch(*args)
    with DeviceGuard(pool.device_id):
        return launch(*args)


# -- store and gather ------------------------------------------------------------------------
def store_signature(slot_mapping, k, v, unique_slots):
    """Everything a prepared store launch depends on, for CuPy arrays (else None): kinds,
    shapes, dtypes, strides, pointer alignment, devices."""
    try:
        nd = _cupy().ndarray
        if not (type(k) is nd and type(v) is nd and type(slot_mapping) is nd):
            return None
        kd, vd, sd = k.data, v.data, slot_mapping.data
        return (k.shape, k.dtype, k.strides, v.shape, v.dtype, v.strides, slot_mapping.shape,
                slot_mapping.dtype, slot_mapping.strides, kd.ptr & 15, vd.ptr & 15,
                kd.device_id, vd.device_id, sd.device_id, bool(unique_slots))
    except (AttributeError, ImportError):
        return None


def gather_signature(blocks, dtype, out):
    """Everything a prepared gather depends on, for CuPy arrays (else None)."""
    try:
        nd = _cupy().ndarray
        if type(blocks) is not nd:
            return None
        sig = ("gather", blocks.ndim, blocks.dtype, blocks.strides, blocks.data.device_id, dtype)
        hash(sig)  # an unhashable dtype argument just takes the checked path
        if out is None:
            return sig
        if not (isinstance(out, tuple) and len(out) == 2 and type(out[0]) is nd
                and type(out[1]) is nd):
            return None
        a, b = out
        return sig + (blocks.shape, a.shape, a.dtype, a.strides, a.data.device_id,
                      a.data.ptr & 15, b.shape, b.dtype, b.strides, b.data.device_id,
                      b.data.ptr & 15, a.data.ptr == b.data.ptr)
    except (AttributeError, TypeError, ImportError):
        return None


@functools.lru_cache(maxsize=64)
def _out_dtype(dtype) -> np.dtype:
    return resolve_dtype("bfloat16" if dtype is None else dtype, name="dtype")


def gather(pool, sig, blocks, dtype, out):
    """The hot path of ``gather_dequant``: the kept launch for ``sig`` writes ``out`` (or
    new outputs of ``dtype``, on the pool's device) and returns them; else :data:`MISS`."""
    launch = pool.plans.get(sig) if sig is not None else None
    if launch is None:
        return MISS
    if _get_device()() != pool.device_id:
        with DeviceGuard(pool.device_id):
            return gather(pool, sig, blocks, dtype, out)
    if out is None:
        g = pool.geometry
        shape = (blocks.shape[0] * g.block_size, g.num_heads, g.head_dim)
        dt = _out_dtype(dtype)
        empty = _cupy().empty
        out = (empty(shape, dtype=dt), empty(shape, dtype=dt))
    launch(blocks, out[0], out[1])
    return out[0], out[1]


# -- attention -------------------------------------------------------------------------------
def decode_signature(q, block_tables, seq_lens, sm_scale, out, lse_out, return_lse):
    """What ``decode_attention``'s checks depend on (kinds, shapes, dtypes, strides,
    devices, the scale), or None for arguments that are not all CuPy arrays or an
    unhashable scale.  The stream is not part of it: the workspace is the cache's, one
    for every stream."""
    try:
        nd = _cupy().ndarray
    except ImportError:
        return None
    if type(q) is not nd or type(block_tables) is not nd or type(seq_lens) is not nd:
        return None
    if out is None:
        o = None
    elif type(out) is nd:
        o = (out.shape, out.dtype, out.strides, out.data.device_id, out.data.ptr & 15)
    else:
        return None
    if lse_out is None:
        e = None
    elif type(lse_out) is nd:
        e = (lse_out.shape, lse_out.dtype, lse_out.strides, lse_out.data.device_id,
             lse_out.data.ptr & 15)
    else:
        return None
    try:
        hash(sm_scale)
    except TypeError:
        return None
    return ("decode_attention", q.shape, q.dtype, q.strides, q.data.device_id,
            q.data.ptr & 15, block_tables.shape, block_tables.dtype, block_tables.strides,
            block_tables.data.device_id, seq_lens.shape, seq_lens.dtype, seq_lens.strides,
            seq_lens.data.device_id, type(sm_scale), sm_scale, bool(return_lse), o, e)


def varlen_signature(q, query_start_loc, block_tables, seq_lens, sm_scale, out, lse_out,
                     return_lse: bool, causal: bool, max_query_len: int):
    """:func:`decode_signature` for ``attention``: plus ``query_start_loc``'s kind, shape,
    dtype, strides and device, ``causal`` and ``max_query_len`` (None for arguments the
    hot path cannot take: not all CuPy arrays, or no ``max_query_len``)."""
    base = decode_signature(q, block_tables, seq_lens, sm_scale, out, lse_out, return_lse)
    if (base is None or max_query_len is None
            or type(query_start_loc) is not _cupy().ndarray):
        return None
    return ("attention",) + base[1:] + (
        query_start_loc.shape, query_start_loc.dtype, query_start_loc.strides,
        query_start_loc.data.device_id, causal, max_query_len)


def attention(pool, sig, return_lse: bool, q, query_start_loc, block_tables, seq_lens,
              out, lse_out):
    """The hot path of ``decode_attention`` (``query_start_loc`` None) and ``attention``:
    the kept launch for ``sig``, with the outputs not given allocated (on the pool's
    device); else :data:`MISS`."""
    launch = pool.plans.get(sig) if sig is not None else None
    if launch is None:
        return MISS
    if _get_device()() != pool.device_id:
        with DeviceGuard(pool.device_id):
            return attention(pool, sig, return_lse, q, query_start_loc, block_tables,
                             seq_lens, out, lse_out)
    if out is None:
        out = _cupy().empty(q.shape, dtype=q.dtype)
    if return_lse:
        if lse_out is None:
            lse_out = _cupy().empty(q.shape[:2], dtype=_F32)
        launch(q, query_start_loc, block_tables, seq_lens, out, lse_out)
        return out, lse_out
    launch(q, query_start_loc, block_tables, seq_lens, out, None)
    return out


# -- LongLive --------------------------------------------------------------------------------
#: Prepared GPU launches of LongLive's ``dequantize`` (block arrays) / ``dequantize_pool``,
#: keyed by :func:`longlive_signature`: the type, address, shape, strides and dtype of
#: every array, the counts (with their types), the dtype and maxima, and the device.  The
#: kernels read the arrays' current contents, so new data is decoded.  Entries hold
#: addresses, not the arrays: they are only used for live arrays at those addresses, and
#: no device memory (block_ids is read in place), so dropping one (least recently used
#: first, beyond 256) frees nothing a captured graph uses.
LONGLIVE_POOL = PlanCache(256)

#: Prepared launches of LongLive's ``dequantize`` over a list of blocks, keyed by the
#: identity of the list's arrays (weakly referenced: an entry goes with its arrays, whose
#: addresses and size never change) and the other arguments.  A hit costs three
#: ``map(id, ...)`` and one lookup.  The launches own their small pointer tables (device
#: memory), so the list API is not for CUDA-graph capture (it allocates its output
#: anyway); at most 32 are kept, least recently used dropped first.
LONGLIVE_LISTS = PlanCache(32)

_SEQ = (list, tuple)


def longlive_signature(api, arrays, num_heads, block_token_size, dtype, e2m1_max, e4m3_max,
                       out, *extra):
    """Hashable signature of a LongLive GPU call, or None (CPU arrays, unhashable
    arguments)."""
    try:
        if not arrays or not is_cupy(arrays[0]):
            return None
        parts = [api, type(num_heads), num_heads, type(block_token_size), block_token_size,
                 type(e2m1_max), e2m1_max, type(e4m3_max), e4m3_max, extra,
                 _current_device()]
        for a in arrays:
            parts.append((type(a), a.data.ptr, a.shape, a.strides, a.dtype))
        if out is None:
            parts.append(("new", type(dtype), dtype))
        else:
            parts.append((type(out), out.data.ptr, out.shape, out.strides, out.dtype))
        key = tuple(parts)
        hash(key)
        return key
    except (AttributeError, TypeError, ImportError):
        return None


def _list_key(vals, sfs, ams, args: tuple):
    try:
        key = (tuple(map(id, vals)), tuple(map(id, sfs)), tuple(map(id, ams)),
               tuple((type(a), a) for a in args))
        hash(key)
        return key
    except TypeError:  # an unhashable argument (a dtype object, say): no fast path
        return None


def longlive_list_hit(vals, sfs, ams, args: tuple):
    """The prepared launch of an earlier checked list call with these arrays, or None."""
    if not LONGLIVE_LISTS or type(vals) not in _SEQ or type(sfs) not in _SEQ \
            or type(ams) not in _SEQ:
        return None
    key = _list_key(vals, sfs, ams, args)
    entry = LONGLIVE_LISTS.get(key) if key is not None else None
    if entry is None or entry[0] != _current_device():
        return None
    return entry[2]


def longlive_list_remember(vals, sfs, ams, args, launch) -> None:
    """Keep ``launch`` for these arrays, until one of them is collected."""
    key = _list_key(vals, sfs, ams, args)
    if key is None:
        return

    def drop(_ref, key=key):
        LONGLIVE_LISTS.pop(key, None)

    try:
        refs = [weakref.ref(a, drop) for a in chain(vals, sfs, ams)]
    except TypeError:  # an array type without weak references: no fast path
        return
    LONGLIVE_LISTS.put(key, (_current_device(), refs, launch))
