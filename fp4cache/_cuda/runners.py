"""The CUDA backend's runners: the prepared store, gather and attention of one pool, kept
in the pool's plan cache (``pool.plans``), the backend's one level of prepared launches.

A runner returns the launch kept under ``key`` (the front end's signature of the
arguments, :mod:`fp4cache._hotpath`, under which the front end's hot path finds it again;
without one, a key of the backend's own), preparing and keeping it on a miss.  Each launch
runs on the current stream, allocates nothing and never synchronizes the host, so it can
be captured in a CUDA graph.  ``fp4cache._cpu`` has the same three functions.
"""

from __future__ import annotations

import cupy
import numpy as np

from .._hotpath import store_signature
from .decode import decode_plan_key, make_decode_run
from .paged import gather_plan, store_plan
from .state import DevicePool
from .varlen import make_varlen_run, varlen_plan_key

__all__ = ["store_runner", "gather_runner", "attention_runner"]


def store_runner(pool: DevicePool, slots, k, v, *, unique_slots: bool, key=None):
    """``run(slots, k, v)``: the store into ``pool`` for arrays like these (slots
    C-contiguous, K/V rows of contiguous values); ``key`` defaults to
    :func:`fp4cache._hotpath.store_signature` of the arrays."""
    if key is None:
        key = store_signature(slots, k, v, unique_slots)
    run = pool.plans.get(key) if key is not None else None
    if run is None:
        run = store_plan(pool, slots, k, v, rule=pool.scale_rule, unique_slots=unique_slots)
        if key is not None:
            pool.plans.put(key, run)
    return run


def gather_runner(pool: DevicePool, blocks, out_k, out_v, *, key=None):
    """``run(blocks, out_k, out_v)``: the gather of ``pool``'s pages (``blocks``
    C-contiguous) into outputs of ``out_k``'s dtype and alignment, any number of pages."""
    if key is None:
        key = ("gather", blocks.dtype, out_k.dtype,
               out_k.data.ptr % 16 == 0 and out_v.data.ptr % 16 == 0)
    run = pool.plans.get(key)
    if run is None:
        run = gather_plan(pool, blocks, out_k, out_v)
        pool.plans.put(key, run)
    return run


def attention_runner(pool: DevicePool, q, query_start_loc, block_tables, seq_lens, *,
                     max_query_len: int, causal: bool, sm_scale, exact_new: bool = False,
                     key=None):
    """``run(q, query_start_loc, block_tables, seq_lens, out, lse)``: attention over
    ``pool`` for arrays like these (``query_start_loc`` None: one query token per
    sequence, the decode launch).  ``exact_new``: the run also takes ``new_kv=(k, v)``,
    the exact new tokens, read by the any-length kernel (a decode's too)."""
    kw = {"geom": pool.geometry, "k_s": pool.k_s, "v_s": pool.v_s, "sm_scale": sm_scale,
          "stats": pool.stats, "scratch": pool, **pool.window_args}
    if exact_new:
        return _exact_new_runner(pool, q, query_start_loc, block_tables, seq_lens,
                                 max_query_len, causal, key, kw)
    if query_start_loc is None:
        if key is None:
            key = decode_plan_key(pool.buffer, q, block_tables, seq_lens, pool.geometry,
                                  pool.k_s, pool.v_s, sm_scale, pool.stats,
                                  **pool.window_args)
        run = pool.plans.get(key)
        if run is None:
            run = make_decode_run(pool.buffer, q, block_tables, seq_lens, **kw)
            pool.plans.put(key, run)
        return run
    if key is None:
        key = varlen_plan_key(pool.buffer, q, query_start_loc, block_tables, seq_lens,
                              pool.geometry, max_query_len, causal, pool.k_s, pool.v_s,
                              sm_scale, pool.stats, **pool.window_args)
    run = pool.plans.get(key)
    if run is None:
        run = make_varlen_run(pool.buffer, q, query_start_loc, block_tables, seq_lens,
                              max_query_len=max_query_len, causal=causal, **kw)
        pool.plans.put(key, run)
    return run


def _exact_new_runner(pool: DevicePool, q, query_start_loc, block_tables, seq_lens,
                      max_query_len: int, causal: bool, key, kw):
    """The any-length kernel's run with the exact new tokens; a decode (no
    ``query_start_loc``) runs it with one token per sequence (its own ``arange``)."""
    decode = query_start_loc is None
    if key is None:
        key = ("decode" if decode else "varlen", id(pool), q.shape, q.dtype,
               None if decode else (query_start_loc.shape, query_start_loc.dtype),
               block_tables.shape[1], block_tables.dtype, seq_lens.dtype, int(max_query_len),
               bool(causal), float(kw["sm_scale"]))
    key = ("exact_new", key)
    run = pool.plans.get(key)
    if run is not None:
        return run
    if decode:
        qsl = cupy.arange(q.shape[0] + 1, dtype=np.int32)
        inner = make_varlen_run(pool.buffer, q, qsl, block_tables, seq_lens, max_query_len=1,
                                causal=False, exact_new=True, **kw)

        def run(q, query_start_loc, block_tables, seq_lens, out, lse, new_kv=None):
            inner(q, qsl, block_tables, seq_lens, out, lse, new_kv=new_kv)
    else:
        run = make_varlen_run(pool.buffer, q, query_start_loc, block_tables, seq_lens,
                              max_query_len=max_query_len, causal=causal, exact_new=True,
                              **kw)
    pool.plans.put(key, run)
    return run
