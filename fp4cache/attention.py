"""Attention over the NVFP4 pages of a :class:`~fp4cache.PagedKVCache`.

The front ends of ``PagedKVCache.decode_attention`` (one query token per sequence) and
``PagedKVCache.attention`` (any number of query tokens per sequence, vLLM's flattened
layout): argument checks (the exceptions of ``docs/errors.md``; both methods share
them), the prepared launches of repeated argument signatures (:mod:`fp4cache._hotpath`)
and the call into the backend (:mod:`fp4cache._cpu`, or the CUDA kernels of
:mod:`fp4cache._cuda.decode` / :mod:`fp4cache._cuda.varlen`), which compute
``softmax(sm_scale * q K^T) V`` over the values ``gather_dequant`` returns.  Every
function takes the cache's :class:`~fp4cache._backend.Pool`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from . import _arrays, _hotpath
from ._abi import MAX_GROUP
from ._backend import Pool
from .formats import resolve_dtype
from .layout import PageGeometry
from .typing import Array, ArrayLike, IndexLike

__all__ = ["attention", "decode_attention", "workspace_hints"]

_FLAG = (bool, type(None))  # classes of an optional flag that need no check


class _Args(NamedTuple):
    q: Any
    block_tables: Any
    seq_lens: Any
    out: Any
    lse: Any
    sm_scale: float


def decode_attention(pool: Pool, q: ArrayLike, block_tables: IndexLike,
                     seq_lens: IndexLike, sm_scale: float | None = None, out: Array | None = None,
                     lse_out: Array | None = None, return_lse: bool = False,
                     validate: bool | None = None,
                     new_kv: tuple[ArrayLike, ArrayLike] | None = None
                     ) -> Array | tuple[Array, Array]:
    """The checked path of :meth:`PagedKVCache.decode_attention` (see its docstring), run
    with the cache's device current.  The backend keeps the launch of these arguments in
    the pool's plans under :func:`fp4cache._hotpath.decode_signature`: the method's hot
    path runs it for the next unvalidated call like this (never one given ``new_kv``)."""
    if validate.__class__ not in _FLAG or return_lse.__class__ is not bool:
        validate = _arrays.check_bool(validate, "validate", optional=True)
        return_lse = _arrays.check_bool(return_lse, "return_lse")
    check = pool.validate if validate is None else validate
    a = _check_args(pool, q, block_tables, seq_lens, sm_scale, out, lse_out, return_lse)
    nk = None if new_kv is None else check_new_kv(pool, new_kv, a.q)
    if check or pool.checks_are_free:
        _check_values(pool, a.block_tables, a.seq_lens, block_ids=check)
        if nk is not None:
            check_queries_cached(np.ones(a.q.shape[0], np.int64), _host(a.seq_lens),
                                 NEW_KV_LENGTHS)
    res = (a.out, a.lse) if return_lse else a.out
    if not a.q.shape[0]:
        return res
    key = _hotpath.decode_signature(a.q, a.block_tables, a.seq_lens, sm_scale,
                                    out if out is None else a.out,
                                    lse_out if lse_out is None else a.lse, return_lse)
    exact = {} if nk is None else {"exact_new": True}
    run = pool.backend.attention_runner(pool, a.q, None, a.block_tables, a.seq_lens,
                                        max_query_len=1, causal=False, sm_scale=a.sm_scale,
                                        key=key, **exact)
    if nk is None:
        run(a.q, None, a.block_tables, a.seq_lens, a.out, a.lse)
    else:
        run(a.q, None, a.block_tables, a.seq_lens, a.out, a.lse, new_kv=nk)
    return res


def attention(pool: Pool, q: ArrayLike, query_start_loc: IndexLike,
              block_tables: IndexLike, seq_lens: IndexLike, max_query_len: int | None,
              causal: bool, sm_scale: float | None, out: Array | None,
              lse_out: Array | None, return_lse: bool, validate: bool | None,
              new_kv: tuple[ArrayLike, ArrayLike] | None = None
              ) -> Array | tuple[Array, Array]:
    """Implementation of :meth:`PagedKVCache.attention` (see its docstring); the method
    passes every argument by position.  The backend keeps the launch under
    :func:`fp4cache._hotpath.varlen_signature` (when ``max_query_len`` is given)."""
    check = pool.validate if validate is None else bool(validate)
    return_lse = bool(return_lse)
    if causal is not True and causal is not False:
        causal = _check_flag(causal, "causal")
    bound = max_query_len
    if bound is not None and (type(bound) is not int or bound < 0):
        bound = _check_max_query_len(bound)
    q = _check_q(pool, q, "num_tokens")
    nk = None if new_kv is None else check_new_kv(pool, new_kv, q)
    qsl = _check_query_start_loc(pool, query_start_loc)
    bt, sl = _check_tables(pool, block_tables, seq_lens, qsl.shape[0] - 1, "query_start_loc")
    a = _finish_args(pool, q, bt, sl, sm_scale, out, lse_out, return_lse)
    _arrays.check_device({"query_start_loc": qsl}, pool.buffer)
    if check or pool.checks_are_free:
        sl = _host(a.seq_lens)
        _check_lengths(a.block_tables, sl, pool.block_size)
        n = _check_query_values(qsl, sl, a.q.shape[0], causal, bound)
        if nk is not None:
            check_queries_cached(n, sl, NEW_KV_LENGTHS)
        longest = int(n.max()) if n.size else 0
        bound = longest if bound is None else bound
        if check:
            # The ids a call reads: a sequence without query tokens reads no page, so its
            # row is not checked, as the unvalidated paths do not count it (the NumPy
            # backend's mask; the GPU kernels skip such a sequence before reading its
            # table: seq_rows in decode_attention.cu, find_work in varlen_attention.cu).
            _check_block_ids(pool, a.block_tables, sl, reads=n > 0)
    res = (a.out, a.lse) if return_lse else a.out
    if not a.q.shape[0] or qsl.shape[0] < 2:
        return res
    key = None
    if bound is None:
        # The one host synchronization of an unvalidated call without max_query_len.
        bound = int(pool.to_host((qsl[1:] - qsl[:-1]).max()))
    else:
        key = _hotpath.varlen_signature(a.q, qsl, a.block_tables, a.seq_lens, sm_scale,
                                        out if out is None else a.out,
                                        lse_out if lse_out is None else a.lse, return_lse,
                                        causal, bound)
    if bound <= 0:
        return res
    exact = {} if nk is None else {"exact_new": True}
    run = pool.backend.attention_runner(pool, a.q, qsl, a.block_tables, a.seq_lens,
                                        max_query_len=bound, causal=causal,
                                        sm_scale=a.sm_scale, key=key, **exact)
    if nk is None:
        run(a.q, qsl, a.block_tables, a.seq_lens, a.out, a.lse)
    else:
        run(a.q, qsl, a.block_tables, a.seq_lens, a.out, a.lse, new_kv=nk)
    return res


def workspace_hints(geom: PageGeometry, num_blocks: int, max_batch_size, max_seq_len,
                     num_query_heads) -> dict[str, int]:
    """The checked workspace hints of a cache (``PagedKVCache(max_batch_size=...,
    max_seq_len=..., num_query_heads=...)``) with their defaults: the pool's tokens and
    the largest GQA group; empty without ``max_batch_size``."""
    given = {"max_batch_size": max_batch_size, "max_seq_len": max_seq_len,
             "num_query_heads": num_query_heads}
    for name, val in given.items():
        if val is not None and (not isinstance(val, (int, np.integer))
                                or isinstance(val, bool) or val <= 0):
            raise ValueError(f"{name} must be a positive integer or None, got {val!r}")
    if max_batch_size is None:
        if max_seq_len is not None or num_query_heads is not None:
            raise ValueError("max_seq_len and num_query_heads size the decode-attention "
                             "workspace together with max_batch_size: pass it too")
        return {}
    H = geom.num_heads
    hq = H * MAX_GROUP if num_query_heads is None else int(num_query_heads)
    if hq % H or hq // H > MAX_GROUP:
        raise ValueError(f"num_query_heads must be a multiple of num_heads ({H}) of at most "
                         f"{MAX_GROUP} * num_heads, got {num_query_heads}")
    return {"max_batch_size": int(max_batch_size),
            "max_seq_len": int(num_blocks * geom.block_size if max_seq_len is None
                               else max_seq_len),
            "num_query_heads": hq}


# -- checks --------------------------------------------------------------------------------
def _check_args(pool: Pool, q, block_tables, seq_lens, sm_scale, out, lse_out,
                return_lse: bool) -> _Args:
    """Kinds, dtypes, shapes and devices of every argument of ``decode_attention``;
    touches no values."""
    q = _check_q(pool, q)
    bt, sl = _check_tables(pool, block_tables, seq_lens, q.shape[0], "q")
    return _finish_args(pool, q, bt, sl, sm_scale, out, lse_out, return_lse)


def _check_q(pool: Pool, q, rows: str = "B"):
    """``q``: on the cache's backend, bf16 / f16 / f32, ``(rows, Hq, head_dim)`` with a
    GQA group of 1..MAX_GROUP query heads per KV head (``rows`` names the first axis in
    messages)."""
    H, D = pool.geometry.num_heads, pool.geometry.head_dim
    q = _arrays.to_backend(q, pool.device, "q")
    try:
        resolve_dtype(q.dtype, name="q.dtype")
    except TypeError:
        raise TypeError(f"q must have dtype bfloat16, float16 or float32, got {q.dtype}") from None
    if q.ndim != 3:
        raise ValueError(f"q must be 3-D ({rows}, Hq, head_dim), got shape {tuple(q.shape)}")
    _, Hq, qd = q.shape
    if qd != D:
        raise ValueError(f"q.shape[2] must equal the cache's head_dim ({D}), got {qd}")
    if Hq % H or not 1 <= Hq // H <= MAX_GROUP:
        raise ValueError(
            f"q.shape[1] (Hq = {Hq}) must be a multiple of the cache's num_heads ({H}) "
            f"with Hq // num_heads between 1 and {MAX_GROUP} (query heads per KV head)"
        )
    return q


def _check_tables(pool: Pool, block_tables, seq_lens, B: int, source: str):
    """``block_tables (B, max_blocks)`` and ``seq_lens (B,)``, int32/int64, on the cache's
    backend (host arrays are converted), C-contiguous; ``source`` names where ``B`` came
    from."""
    be = pool.device
    bt = _arrays.to_backend(block_tables, be, "block_tables", allow_convert=True)
    _check_int_dtype(bt, "block_tables")
    if bt.ndim != 2:
        raise ValueError(
            f"block_tables must be 2-D (B, max_blocks), got shape {tuple(bt.shape)}"
        )
    if bt.shape[0] != B:
        raise ValueError(f"block_tables must have one row per sequence (B = {B}, from "
                         f"{source}), got {bt.shape[0]}")
    sl = _arrays.to_backend(seq_lens, be, "seq_lens", allow_convert=True)
    _check_int_dtype(sl, "seq_lens")
    if sl.ndim != 1:
        raise ValueError(f"seq_lens must be 1-D (B,), got shape {tuple(sl.shape)}")
    if sl.shape[0] != B:
        raise ValueError(f"seq_lens must have one entry per sequence (B = {B}, from "
                         f"{source}), got {sl.shape[0]}")
    xp = _arrays.array_module(be)
    bt = bt if bt.flags.c_contiguous else xp.ascontiguousarray(bt)
    sl = sl if sl.flags.c_contiguous else xp.ascontiguousarray(sl)
    return bt, sl


def _finish_args(pool: Pool, q, bt, sl, sm_scale, out, lse_out,
                 return_lse: bool) -> _Args:
    """The scale, ``q`` made C-contiguous, the outputs (checked or allocated: ``out`` like
    ``q``, ``lse`` ``q.shape[:2]`` float32) and the devices of all arrays."""
    be = pool.device
    scale = _arrays.check_scale(1.0 / math.sqrt(pool.geometry.head_dim) if sm_scale is None
                                else sm_scale, "sm_scale")
    xp = _arrays.array_module(be)
    # The backends read C-contiguous inputs (the copies are small: no K/V), q at its
    # alignment.
    q = _arrays.aligned(q, "q")
    q = q if q.flags.c_contiguous else xp.ascontiguousarray(q)
    if out is None:
        out = xp.empty(q.shape, dtype=q.dtype)
    else:
        out = _arrays.check_out(out, "out", q.shape, q.dtype, be)
        if _arrays.share_bytes(out, q):
            raise ValueError("out must not overlap q")
    if lse_out is not None and not return_lse:
        raise ValueError("lse_out is given but return_lse is False: pass return_lse=True")
    if not return_lse:
        lse = None
    elif lse_out is None:
        lse = xp.empty(q.shape[:2], dtype=np.float32)
    else:
        lse = _arrays.check_out(lse_out, "lse_out", q.shape[:2], np.dtype(np.float32), be)
        if _arrays.share_bytes(lse, q) or _arrays.share_bytes(lse, out):
            raise ValueError("lse_out must not overlap q or out")
    _arrays.check_device({"q": q, "block_tables": bt, "seq_lens": sl, "out": out,
                          "lse_out": lse}, pool.buffer)
    return _Args(q, bt, sl, out, lse, float(scale))


def _check_values(pool: Pool, block_tables, seq_lens, *,
                  block_ids: bool) -> None:
    """Lengths within each row's capacity and (``block_ids``) block ids inside the pool in
    the used part of each row (a host synchronization on the GPU).  The CPU always checks
    the lengths; its ``validate=False`` defers only the block ids, as the GPU does."""
    sl = _host(seq_lens)
    _check_lengths(block_tables, sl, pool.block_size)
    if block_ids:
        _check_block_ids(pool, block_tables, sl)


def _check_lengths(block_tables, sl: np.ndarray, T: int) -> None:
    """Host ``seq_lens`` ``sl`` within each row's capacity in ``block_tables``."""
    max_blocks = block_tables.shape[1]
    cap = max_blocks * T
    wrong = (sl < 0) | (sl > cap)
    if wrong.any():
        b = int(wrong.argmax())
        raise ValueError(
            f"seq_lens[{b}] = {int(sl[b])} is out of range: it must be in [0, {cap}], the "
            f"capacity of row {b} of block_tables (max_blocks {max_blocks} * block_size {T})"
        )


def _check_block_ids(pool: Pool, block_tables, sl: np.ndarray, *,
                     reads: np.ndarray | None = None) -> None:
    """Block ids inside the pool in the used part of each row (host ``seq_lens`` ``sl``;
    reading the table is a host synchronization on the GPU).  ``reads`` (host bools, one
    per sequence): only those rows are read by the call, so only their ids are checked
    (``attention``: the sequences with query tokens)."""
    T = pool.block_size
    nblk = -(-sl.astype(np.int64) // T)
    width = int(nblk.max()) if sl.size else 0
    if width == 0:
        return
    bt = block_tables[:, :width]
    bt = bt.get() if _arrays.is_cupy(bt) else np.asarray(bt)
    used = np.arange(width)[None, :] < nblk[:, None]
    if reads is not None:
        used &= reads[:, None]
    bad = used & ((bt < 0) | (bt >= pool.num_blocks))
    if bad.any():
        b, j = np.unravel_index(int(bad.argmax()), bad.shape)
        raise IndexError(
            f"block_tables[{b}, {j}] = {int(bt[b, j])} is out of range: block ids must be in "
            f"[0, {pool.num_blocks}) in the first ceil(seq_lens[b] / block_size) entries of "
            "each row" + (" of a sequence with query tokens" if reads is not None else "")
            + " (later entries are ignored); nothing was computed"
        )


def check_new_kv(pool: Pool, new_kv, q) -> tuple[Any, Any]:
    """``new_kv``: a ``(k, v)`` pair of bf16 / f16 / f32 arrays of one dtype on the cache's
    backend and device, each ``(q.shape[0], num_heads, head_dim)`` (``q`` checked);
    touches no values."""
    if not isinstance(new_kv, (tuple, list)) or len(new_kv) != 2:
        raise TypeError("new_kv must be a (k, v) pair of arrays (num_tokens, num_heads, "
                        f"head_dim) or None, got {type(new_kv).__name__}")
    g = pool.geometry
    shape = (q.shape[0], g.num_heads, g.head_dim)
    k = _arrays.to_backend(new_kv[0], pool.device, "new_kv[0]")
    v = _arrays.to_backend(new_kv[1], pool.device, "new_kv[1]")
    for name, a in (("new_kv[0]", k), ("new_kv[1]", v)):
        try:
            _arrays.check_values(a, name, shape)
        except ValueError as e:
            raise ValueError(f"{e} (one row per query token of q)") from None
    if k.dtype != v.dtype:
        raise TypeError(f"new_kv's k and v must have the same dtype, got {k.dtype} and "
                        f"{v.dtype}")
    _arrays.check_device({"new_kv[0]": k, "new_kv[1]": v}, pool.buffer)
    return k, v


def check_queries_cached(n: np.ndarray, sl, why: str) -> None:
    """Each sequence's ``n_b`` query tokens are among its ``seq_lens[b]`` cached ones
    (``n_b <= seq_lens[b]``): ``ValueError`` naming the first that is not, ending with
    ``why`` (what needs it)."""
    wrong = n > np.asarray(sl).astype(np.int64)
    if wrong.any():
        b = int(wrong.argmax())
        raise ValueError(f"sequence {b} has {int(n[b])} query tokens but seq_lens[{b}] = "
                         f"{int(np.asarray(sl)[b])}: {why}")


#: Why ``new_kv`` needs ``n_b <= seq_lens[b]``.
NEW_KV_LENGTHS = ("with new_kv the query tokens are the last n_b cached tokens (store them "
                  "first), so each sequence needs n_b <= seq_lens[b]")


def _check_query_start_loc(pool: Pool, query_start_loc):
    """``query_start_loc (B + 1,)`` int32/int64 on the cache's backend (host arrays are
    converted), C-contiguous; touches no values."""
    qsl = _arrays.to_backend(query_start_loc, pool.device, "query_start_loc",
                             allow_convert=True)
    _check_int_dtype(qsl, "query_start_loc")
    if qsl.ndim != 1 or qsl.shape[0] < 1:
        raise ValueError("query_start_loc must be 1-D (B + 1,) with at least one entry "
                         f"(0 for no sequence), got shape {tuple(qsl.shape)}")
    if not qsl.flags.c_contiguous:
        qsl = pool.xp.ascontiguousarray(qsl)
    return qsl


def _check_query_values(query_start_loc, seq_lens, num_tokens: int, causal: bool,
                        max_query_len: int | None) -> np.ndarray:
    """``query_start_loc`` non-decreasing from 0 to ``num_tokens``, each sequence's query
    count ``n_b`` at most ``max_query_len`` and (``causal``) at most ``seq_lens[b]`` (a
    host synchronization on the GPU).  Returns every ``n_b`` (host int64)."""
    qsl = _host(query_start_loc).astype(np.int64)
    if qsl[0] != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
    n = np.diff(qsl)
    if (n < 0).any():
        b = int((n < 0).argmax())
        raise ValueError(
            f"query_start_loc must be non-decreasing: query_start_loc[{b + 1}] = "
            f"{int(qsl[b + 1])} < query_start_loc[{b}] = {int(qsl[b])}")
    if qsl[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc[-1] must equal the number of query tokens (q.shape[0] = "
            f"{num_tokens}), got {int(qsl[-1])}")
    longest = int(n.max()) if n.size else 0
    if max_query_len is not None and longest > max_query_len:
        b = int(n.argmax())
        raise ValueError(
            f"max_query_len = {max_query_len} is smaller than the {longest} query tokens "
            f"of sequence {b} (query_start_loc[{b + 1}] - query_start_loc[{b}])")
    if causal:
        check_queries_cached(n, _host(seq_lens), "seq_lens counts the cached tokens "
                             "including this step's queries (store them first), so with "
                             "causal=True each sequence needs n_b <= seq_lens[b]")
    return n


def _check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _check_max_query_len(value) -> int:
    """A host integer >= 0 (a device array would need a synchronization to read)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError("max_query_len must be a Python or NumPy int (a host bound on the "
                        f"query tokens per sequence) or None, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"max_query_len must be >= 0, got {value}")
    return int(value)


def _host(a) -> np.ndarray:
    return a.get() if _arrays.is_cupy(a) else np.asarray(a)


def _check_int_dtype(a, name: str) -> None:
    if a.dtype not in (np.int32, np.int64):
        raise TypeError(f"{name} must have dtype int32 or int64, got {a.dtype}")
