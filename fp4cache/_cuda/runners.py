"""Prepared calls of the engine API (:class:`fp4cache.AttentionPlan`): the store and the
attention of one pool, for arrays like the ones given, as callables of one signature on
both backends (``fp4cache._cpu`` has the same two functions).

Each returned ``run`` launches on the current stream, allocates nothing and never
synchronizes the host, so a plan's ``run`` can be captured in a CUDA graph.  The launches
are kept in the pool's plan cache (``CacheState.plans``) under their backend keys.
"""

from __future__ import annotations

from .._hotpath import store_signature
from .decode import decode_runner
from .paged import store_plan
from .varlen import varlen_runner

__all__ = ["store_runner", "attention_runner"]


def store_runner(pool, slots, k, v, *, unique_slots: bool):
    """``run(slots, k, v)``: the store into ``pool`` (a :class:`~fp4cache._backend.Pool`)
    for arrays like these (slots C-contiguous, K/V rows of contiguous values), kept in the
    pool's plans under :func:`fp4cache._hotpath.store_signature` (where the cache's hot
    path finds it)."""
    sig = store_signature(slots, k, v, unique_slots)
    plans = pool.state.plans
    run = plans.get(sig) if sig is not None else None
    if run is None:
        run = store_plan(pool.state, slots, k, v, rule=pool.scale_rule,
                         unique_slots=unique_slots)
        if sig is not None:
            plans.put(sig, run)
    return run


def attention_runner(pool, q, query_start_loc, block_tables, seq_lens, *,
                     max_query_len: int, causal: bool, sm_scale):
    """``run(q, query_start_loc, block_tables, seq_lens, out, lse)``: attention over
    ``pool`` for arrays like these (``query_start_loc`` None: one query token per sequence,
    the decode launch)."""
    kw = {"geom": pool.geometry, "k_s": pool.k_s, "v_s": pool.v_s, "sm_scale": sm_scale,
          "stats": pool.stats, "scratch": pool.state, **pool.window_args}
    if query_start_loc is None:
        run = decode_runner(pool.buffer, q, block_tables, seq_lens, **kw)

        def run_decode(q, query_start_loc, block_tables, seq_lens, out, lse, _run=run):
            _run(q, block_tables, seq_lens, out, lse)

        return run_decode
    return varlen_runner(pool.buffer, q, query_start_loc, block_tables, seq_lens,
                         max_query_len=max_query_len, causal=causal, **kw)
