"""CuPy backend of ``PagedKVCache.attention``: paged attention over NVFP4 pages for any number
of query tokens per sequence (``kernels/varlen_attention.cu``), on CuPy's current stream.

The front end validates the arguments and calls :func:`attention` (or keeps the run of
:func:`attention_runner` for its hot path). A launch has ``B * H * slots`` work items,
``slots = query tiles x splits`` sized from ``max_query_len`` and the shapes only (never
from device values); its CTAs (at most ``GRID_WAVES`` waves of resident ones) loop over the
items and find their work on the device (``find_work`` in the kernel): a sequence whose rows
(tokens x query heads per KV head) fit one CTA cuts its keys into up to ``min(slots,
max_splits)`` splits merged through the workspace, a longer one takes one item per query
tile, and items past a sequence's work are skipped. With ``max_query_len * group`` at most
32 (bf16 / f16 q, head_dim 64 / 128; else 16: ``_kernels.attn_max_rows``; decode,
speculative verification) a call is one launch of the few-row kernel,
``kernels/decode_attention.cu`` with ``query_start_loc`` (a sequence's tokens x heads packed
as the MMA rows, each page byte decoded once per (sequence, KV head), the decode attention's
split plan, one, two or four n8 tiles of rows); otherwise, whatever the batch, the few-row
kernel for the sequences of at most 16 rows (two launches when ``group <= 8``: its
one-n8-tile form for those of at most 8 rows, a mixed batch's decodes, and its two-tile form
for 9 to 16) and the smallest varlen kernel that holds the longest sequence (32 to 128 rows
per CTA, 16 where shared memory is short; on sm_90 the wgmma kernel in place of the 128-row
one) for the others.  A call with the exact new tokens (``exact_new``: the keys of each
sequence's query tokens read from the caller's K/V rows) is one launch of the varlen
kernel's ``_win`` variant for every sequence, neither of the others reading such rows.
Everything that does not change from call to call (kernel, grid, packed ``VarlenParams`` /
``AttnParams``, workspace and merge tickets) is prepared once per signature in the owner's
plan cache (``scratch.plans``); the split partials and merge tickets are views of the
owner's one workspace (``scratch.workspace``, :class:`fp4cache._plans.Workspace`, shared
with decode attention): a warm call is one to three launches, no allocation and no
synchronization (CUDA-graph safe).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cupy
import numpy as np

from .. import _abi
from .. import _kernels as K
from .._arrays import ceil_div
from .._device import by_value, resident_ctas
from ..layout import PageGeometry
from .decode import (
    NULL,
    RowsSpec,
    attention_scales,
    check_attention_args,
    fill_shared_params,
    make_decode_plan,
    split_plan,
    window_key,
    window_params,
)

__all__ = ["attention", "varlen_runner", "make_varlen_run", "varlen_plan_key", "plan_shape",
           "row_warps_for", "wgmma_applies", "GRID_WAVES",
           "VARLEN_PARAMS_DTYPE", "WORKSPACE_WAVES"]

#: numpy twin of ``struct VarlenParams`` (generated from :mod:`fp4cache._abi`).
VARLEN_PARAMS_DTYPE = _abi.struct_dtype("VarlenParams")
#: The workspace holds partials for at most this many waves of resident CTAs (splits per
#: (sequence, KV head) = ceil(WORKSPACE_WAVES * resident / (B * H)), at most
#: ``_abi.VARLEN_MAX_SPLITS``): the split merge's memory stays bounded for any batch.
WORKSPACE_WAVES = 4
#: A launch has at most this many waves of resident CTAs; each CTA loops over the work
#: items ``blockIdx.x, + gridDim.x, ...`` (B * H * slots of them, most of them empty for
#: a mixed batch: an empty item costs a loop turn instead of a CTA launch).
GRID_WAVES = 16
_STATIC_SMEM_MAX = 48 * 1024


class PlanShape(NamedTuple):
    row_warps: int   # query rows per CTA: _abi.MMA_ROWS * row_warps
    qtiles: int      # query tiles of the longest sequence
    nsplit: int      # splits per query tile (1 unless every sequence fits one tile)
    slots: int       # CTAs per (sequence, KV head)
    max_splits: int  # splits per (sequence, KV head) the workspace holds


def row_warps_for(rows: int) -> int:
    """The smallest kernel (row warps) whose CTA holds ``rows`` rows, else the largest."""
    for mw in _abi.VARLEN_ROW_WARPS:
        if rows <= _abi.MMA_ROWS * mw:
            return mw
    return max(_abi.VARLEN_ROW_WARPS)


def plan_shape(batch: int, kv_heads: int, row_warps: int, rows: int, capacity: int,
               resident: int) -> PlanShape:
    """Grid shape of one launch whose longest sequence has ``rows`` rows: query tiles, and
    (when that fits one CTA) the decode attention's split plan over the block-table
    capacity; the workspace holds at most WORKSPACE_WAVES waves of partials."""
    rows_cta = _abi.MMA_ROWS * row_warps
    qtiles = ceil_div(max(1, rows), rows_cta)
    nsplit = 1
    if qtiles == 1:
        nsplit = min(split_plan(batch, kv_heads, capacity, resident).nsplit,
                     _abi.VARLEN_MAX_SPLITS)
    slots = qtiles * nsplit
    bh = max(1, batch * kv_heads)
    max_splits = max(1, min(_abi.VARLEN_MAX_SPLITS, slots,
                            ceil_div(WORKSPACE_WAVES * resident, bh)))
    return PlanShape(row_warps, qtiles, nsplit, slots, max_splits)


class _VarlenPlan(NamedTuple):
    fn: Any
    grid: int
    smem: int
    params: Any  # a VARLEN_PARAMS_DTYPE (or AttnParams: a few-row launch) struct, by_value
    keep: tuple  # the workspace, what the params point to, and the PlanShape last
    block: int = 32 * _abi.VARLEN_WARPS
    name: str = ""  # the kernel's name
    raw: Any = None  # the mma.sync varlen kernel's params as filled (it takes new_k, new_v)


class _VarlenCall(NamedTuple):
    launches: tuple  # _VarlenPlan: the few-row kernel's (sequences of <= 8, <= 16 rows),
    #                  then the others'


def _make_launch(buffer, q, query_start_loc, block_tables, seq_lens, geom: PageGeometry,
                 row_warps: int, rows: int, rows_lo: int, rows_hi: int, causal: bool, k_s,
                 v_s, sm_scale, stats, workspace, window=None,
                 rotate: bool = False, wgmma: bool = False,
                 exact_new: bool = False) -> _VarlenPlan:
    """One launch for the sequences of ``rows_lo < rows <= rows_hi`` rows, the longest
    ``rows``; with a window, the rotation or the exact new tokens the kernel variant that
    has them (``decode.window_params``; q rotated in the kernel, its 1/sqrt(head_dim)
    included; the new rows' kind and strides are set per call, :func:`new_params`);
    ``wgmma``: the sm_90a kernel in place of the 128-row one (:func:`wgmma_applies`)."""
    _, Hq, D = q.shape
    B = int(query_start_loc.shape[0]) - 1
    H, T = geom.num_heads, geom.block_size
    group = Hq // H
    max_blocks = int(block_tables.shape[1])
    extras = window is not None or bool(rotate) or exact_new
    dtype = K.value_type(q.dtype, "q.dtype")
    if wgmma:
        spec = K.varlen_wgmma_spec(dtype, D)
        smem = _abi.varlen_wg_smem_bytes(D)
    else:
        spec = K.varlen_attention_spec(dtype, D, row_warps, extras)
        smem = _abi.varlen_smem_bytes(D, row_warps, np.dtype(q.dtype).itemsize == 4)
    fn = K.get_kernel(spec)
    if smem > _STATIC_SMEM_MAX:
        fn.max_dynamic_shared_size_bytes = smem
    threads = 32 * (_abi.VARLEN_WG_ROW_WARPS + _abi.VARLEN_WG_DECODE_WARPS if wgmma
                    else _abi.varlen_warps(row_warps))
    resident = resident_ctas(fn, threads, smem)
    ps = plan_shape(B, H, row_warps, rows, max_blocks * T, resident)
    # (the plan depends on shapes only; items past a sequence's work are skipped on the
    # device)
    items = B * H * ps.slots
    if q.shape[0] >= 2**32:
        raise ValueError(f"q must have fewer than 2**32 tokens, got {q.shape[0]}")
    if items >= 2**32:
        raise ValueError(f"the launch has {items} work items (batch x num_heads x query "
                         "tiles): more than 2**32 - 1")
    grid = max(1, min(items, GRID_WAVES * resident))
    # workspace: (m, l) and O partials of the splits, B*H merge tickets (zero at rest)
    bh = max(1, B * H)
    n_part = bh * ps.max_splits * _abi.MMA_ROWS * row_warps if ps.max_splits > 1 else 0
    ws_ml, ws_o, counters = (a.data.ptr for a in workspace.get(
        [(n_part * 2, np.float32), (n_part * D, np.float32)], tickets=bh,
        hint=f"attention of {B} sequences x {max_blocks * T} tokens x {Hq} query heads"))
    p = np.zeros((), dtype=VARLEN_PARAMS_DTYPE)
    fill_shared_params(p, buffer, geom, stats, (ws_o, ws_ml, counters), group, block_tables,
                       seq_lens, query_start_loc.dtype.itemsize == 8, causal, rows_lo, rows_hi,
                       q.shape[0], attention_scales(sm_scale, k_s, v_s))
    for name, value in window_params(window, geom, int(buffer.shape[0]), k_s, v_s,
                                     exact_new).items():
        p[name] = value
    p["rotate"] = 1 if rotate else 0
    for name, value in (("slots", ps.slots), ("max_splits", ps.max_splits), ("smem", smem),
                        ("items", items)):
        p[name] = value
    return _VarlenPlan(fn, grid, smem, by_value(p), (buffer, stats, geom, window, ps), threads,
                       spec.name, None if wgmma else p)


def wgmma_applies(q, row_warps: int, extras: bool, smem_max: int, route: str = "auto") -> bool:
    """Whether the launch of ``row_warps`` (the 128-row kernel's) takes the wgmma kernel:
    ``route`` "auto" (``_kernels.PREFILL_ROUTES``), an sm_90 device, bf16 / f16 q, head_dim
    in ``_abi.VARLEN_WG_HEAD_DIMS``, neither window nor rotation (``extras``), and its
    shared memory on this device."""
    D = int(q.shape[2])
    return (route == "auto" and row_warps == _abi.VARLEN_WG_ROW_WARPS and not extras
            and K.DTYPE_NAMES.get(np.dtype(q.dtype)) in K.VARLEN_WG_DTYPES
            and D in _abi.VARLEN_WG_HEAD_DIMS
            and cupy.cuda.Device().compute_capability == "90"
            and _abi.varlen_wg_smem_bytes(D) <= smem_max)


def make_varlen_plan(buffer, q, query_start_loc, block_tables, seq_lens, geom: PageGeometry,
               max_query_len: int, causal: bool, k_s, v_s, sm_scale, stats,
               workspace, window=None, rotate: bool = False,
               route: str = "auto", exact_new: bool = False) -> _VarlenCall:
    if route not in K.PREFILL_ROUTES:
        raise ValueError(f"route must be one of {K.PREFILL_ROUTES}, got {route!r}")
    _, Hq, D = q.shape
    group = check_attention_args("attention", buffer, q, geom, query_start_loc=query_start_loc,
                                 block_tables=block_tables, seq_lens=seq_lens)
    rows = max(1, int(max_query_len)) * group
    args = (buffer, q, query_start_loc, block_tables, seq_lens, geom)
    small = _abi.MMA_ROWS
    if exact_new:
        # the exact new tokens: every sequence in the mma.sync kernel's variant that reads
        # them (neither the few-row nor the wgmma kernel does)
        return _VarlenCall((_make_launch(
            *args, _fitting_row_warps(q, rows), rows, 0, 0xFFFFFFFF, causal, k_s, v_s,
            sm_scale, stats, workspace, window, rotate, exact_new=True),))
    if rows <= K.attn_max_rows(K.value_type(q.dtype, "q.dtype"), D):
        # decode / speculative verification: one launch of the few-row kernel
        return _VarlenCall((_few_rows_launch(*args, 0, 0xFFFFFFFF, max_query_len, causal, k_s,
                                             v_s, sm_scale, stats, workspace, window,
                                             rotate),))
    # mixed: sequences of <= 16 rows in the few-row kernel, the others in the smallest
    # varlen kernel that holds the longest (and whose shared memory this device has)
    big = _fitting_row_warps(q, rows)
    wgmma = wgmma_applies(q, big, window is not None or bool(rotate), _smem_max(), route)
    # the few-row kernel in two launches where a one-token sequence fits its one-n8-tile
    # form (the decodes of a mixed batch: the two-tile form costs them 1.5x)
    half = small // 2
    bounds = ((0, half), (half, small)) if group <= half else ((0, small),)
    few = tuple(_few_rows_launch(*args, lo, hi, hi // group, causal, k_s, v_s, sm_scale,
                                 stats, workspace, window, rotate) for lo, hi in bounds)
    return _VarlenCall(few + (
        _make_launch(*args, big, rows, small, 0xFFFFFFFF, causal, k_s, v_s, sm_scale,
                     stats, workspace, window, rotate, wgmma),))


def _smem_max() -> int:
    """Shared memory per CTA this device offers a kernel (less the static part's bound)."""
    return int(cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]) - 4096


def _fitting_row_warps(q, rows: int) -> int:
    """Row warps of the smallest varlen kernel that holds ``rows`` and whose shared memory
    this device has (``ValueError`` when not even the 16-row one fits)."""
    D = q.shape[2]
    split_q = np.dtype(q.dtype).itemsize == 4
    smem_max = _smem_max()
    big = row_warps_for(rows)
    while big > 1 and _abi.varlen_smem_bytes(D, big, split_q) > smem_max:
        big //= 2  # e.g. head_dim 256 with float32 q on sm_80 (163 KB per CTA)
    if _abi.varlen_smem_bytes(D, 1, split_q) > smem_max:
        raise ValueError(f"head_dim {D} with {q.dtype} q needs more shared memory per CTA "
                         f"than this device has ({smem_max + 4096} bytes)")
    return big


def _few_rows_launch(buffer, q, query_start_loc, block_tables, seq_lens, geom: PageGeometry,
                     rows_lo: int, rows_hi: int, max_q: int, causal: bool, k_s, v_s,
                     sm_scale, stats, workspace, window=None,
                     rotate: bool = False) -> _VarlenPlan:
    """One launch of the decode-attention kernel (``kernels/decode_attention.cu``) for the
    sequences of ``rows_lo < n_b * group <= rows_hi`` rows, at most ``max_q`` tokens each:
    their rows packed next to the group's heads, each page byte decoded once per
    (sequence, KV head); ``window``, ``rotate``: the exact window and the rotation
    (``decode.window_params``; part of the caller's plan key)."""
    rows = RowsSpec(int(query_start_loc.shape[0]) - 1, True,
                    query_start_loc.dtype.itemsize == 8, bool(causal), rows_lo, rows_hi,
                    max(1, int(max_q)))
    plan = make_decode_plan(buffer, q, block_tables, seq_lens, geom, k_s, v_s, sm_scale, stats,
                            workspace, rows=rows, window=window, rotate=rotate)
    nsplit, H, B = plan.grid
    return _VarlenPlan(plan.fn, nsplit * H * B, 0, plan.params, (plan,), plan.block[0],
                       plan.spec.name)


def varlen_plan_key(buffer, q, query_start_loc, block_tables, seq_lens, geom, max_query_len, causal,
              k_s, v_s, sm_scale, stats, window=None, rotate: bool = False,
              route: str = "auto") -> tuple:
    # id(geom): the plan keeps geom alive, so the id is not reused while the key exists.
    # No stream: the workspace is the owner's, shared by every stream (calls on different
    # streams are ordered by the caller, see Workspace).
    return ("varlen", buffer.data.device_id, buffer.data.ptr, buffer.shape[0],
            id(geom), q.shape, q.dtype, query_start_loc.shape[0], query_start_loc.dtype,
            block_tables.shape[1], block_tables.dtype, seq_lens.dtype, int(max_query_len),
            bool(causal), float(k_s), float(v_s), float(sm_scale), stats.data.ptr,
            window_key(window, rotate), route)


def make_varlen_run(buffer, q, query_start_loc, block_tables, seq_lens, *,
                    max_query_len: int, causal: bool, geom: PageGeometry, k_s, v_s, sm_scale,
                    stats, scratch, window=None, rotate: bool = False, route: str = "auto",
                    exact_new: bool = False):
    """``run(q, query_start_loc, block_tables, seq_lens, out, lse, new_kv=None)``:
    :func:`attention` for arrays like these on the current stream, prepared now (one to
    three launches per call).  ``window = (slots, map, pages)``: the cache's exact window
    (keys from the window start on read from the bf16 slots, ``docs/window.md``);
    ``rotate``: K is stored rotated, q is rotated in the kernels; ``route``:
    ``_kernels.PREFILL_ROUTES``; ``exact_new``: the run takes ``new_kv = (k, v)``, the
    exact new tokens (the keys ``[seq_lens[b] - n_b, seq_lens[b])`` read from their rows
    ``query_start_loc[b] ..``, :func:`new_params`).  ``run.plan`` is the plan."""
    plan = make_varlen_plan(buffer, q, query_start_loc, block_tables, seq_lens, geom,
                            max_query_len, causal, k_s, v_s, sm_scale, stats,
                            scratch.workspace, window, rotate, route, exact_new)
    zero = NULL
    launches = tuple((lp.fn, (lp.grid,), (lp.block,), lp.smem, lp.params, lp.raw is not None)
                     for lp in plan.launches)
    by_rows: dict = {}  # (dtype, token strides) of new_kv -> the launch's params

    def run(q, query_start_loc, block_tables, seq_lens, out, lse, new_kv=None, _keep=plan):
        # (q, query_start_loc, block_tables, seq_lens, out, lse), then new_k, new_v for the
        # mma.sync varlen kernel, then the params
        head = (q, query_start_loc, block_tables, seq_lens, out, zero if lse is None else lse)
        tail = (zero, zero)
        if new_kv is not None:
            if not exact_new:
                raise ValueError("new_kv given to a run prepared without exact_new")
            k, v = (_new_rows(a) for a in new_kv)
            sig = (k.dtype, k.strides[0], v.strides[0])
            params = by_rows.get(sig)
            if params is None:
                params = by_rows[sig] = new_params(plan.launches[0].raw, k, v)
            (fn, grid, block, smem, _, _), = launches
            fn(grid, block, head + (k, v, params), shared_mem=smem)
            return
        for fn, grid, block, smem, params, takes_new in launches:
            fn(grid, block, head + (tail if takes_new else ()) + (params,), shared_mem=smem)

    run.plan = plan  # type: ignore[attr-defined]
    return run


def _new_rows(a):
    """An exact-new-tokens array as the kernel reads it: rows ``(N, H, D)`` whose heads and
    values are contiguous and whose start and token stride are 16-byte aligned (any other
    is copied)."""
    e = a.dtype.itemsize
    if (a.strides[1:] == (a.shape[2] * e, e) and a.data.ptr % 16 == 0
            and a.strides[0] % 16 == 0 and a.strides[0] >= 0):
        return a
    return cupy.ascontiguousarray(a)


def new_params(raw, k, v):
    """The launch's params (``raw``, as :func:`_make_launch` filled them) for the exact new
    rows ``k``, ``v`` (:func:`_new_rows`): their kind and token strides."""
    p = raw.copy()
    p["new_kind"] = _abi.NEW_KV_KINDS[K.value_type(k.dtype, "new_kv dtype")]
    p["new_k_ld"] = k.strides[0] // k.dtype.itemsize
    p["new_v_ld"] = v.strides[0] // v.dtype.itemsize
    return by_value(p)


def varlen_runner(buffer, q, query_start_loc, block_tables, seq_lens, *, max_query_len: int,
                  causal: bool, geom: PageGeometry, k_s, v_s, sm_scale, stats,
                  scratch, window=None, rotate: bool = False, route: str = "auto"):
    """:func:`make_varlen_run`, prepared once and kept in ``scratch.plans`` under
    :func:`varlen_plan_key` (the functional API; a cache's pool goes through
    ``runners.attention_runner``)."""
    key = varlen_plan_key(buffer, q, query_start_loc, block_tables, seq_lens, geom,
                          max_query_len, causal, k_s, v_s, sm_scale, stats, window, rotate,
                          route)
    run = scratch.plans.get(key)
    if run is None:
        run = make_varlen_run(buffer, q, query_start_loc, block_tables, seq_lens,
                              max_query_len=max_query_len, causal=causal, geom=geom, k_s=k_s,
                              v_s=v_s, sm_scale=sm_scale, stats=stats, scratch=scratch,
                              window=window, rotate=rotate, route=route)
        scratch.plans.put(key, run)
    return run


def attention(buffer, q, query_start_loc, block_tables, seq_lens, out, lse, *,
              max_query_len: int, causal: bool, geom: PageGeometry, k_s, v_s,
              sm_scale: float, stats, scratch, window=None, rotate: bool = False,
              route: str = "auto") -> None:
    """Paged attention over the NVFP4 page pool ``buffer`` for any query length per
    sequence (see the module doc).

    Parameters
    ----------
    buffer : cupy.ndarray, uint8, (num_blocks, 2, geom.side_bytes)
        The page pool.
    q : cupy.ndarray, (N, Hq, D), bfloat16 / float16 / float32, C-contiguous
        The query tokens of all sequences, concatenated in order (vLLM's flattened
        layout); ``Hq = group * num_heads``, ``group`` in 1..16.
    query_start_loc : cupy.ndarray, int32 or int64, (B + 1,)
        Sequence ``b`` owns query tokens ``query_start_loc[b] : query_start_loc[b+1]``.
    block_tables : cupy.ndarray, int32 or int64, (B, max_blocks), C-contiguous
    seq_lens : cupy.ndarray, int32 or int64, (B,)
        Cached tokens of each sequence including its ``n_b`` query tokens; clamped to
        ``[0, max_blocks * block_size]`` on the device.
    out : cupy.ndarray, (N, Hq, D), q's dtype, C-contiguous (written)
    lse : cupy.ndarray, float32, (N, Hq), or None
        Natural log of the softmax denominator (``-inf`` for a row that sees no key).
    max_query_len : int
        A bound on every ``n_b`` (rows of a sequence beyond it are not computed).
    causal : bool
        Bottom-right causal mask: token ``i`` of sequence ``b`` sees keys ``0 ..
        seq_lens[b] - n_b + i``; else every key.
    geom, k_s, v_s, sm_scale, stats
        Page geometry, global K/V scales, score scale, the cache's counters (index 3
        counts bad block ids among the entries a query row uses, once per entry and call).
    scratch : CacheState or Scratch
        The owner's ``plans`` (prepared launches, by signature) and ``workspace`` (split
        partials and merge tickets).
    window, rotate
        The cache's exact window ``(slots, map, pages)`` or None, and whether K is stored
        rotated (:func:`varlen_runner`, ``docs/window.md``).
    route : str
        ``_kernels.PREFILL_ROUTES``: "auto" takes the wgmma kernel for sequences of more
        than 64 rows where it applies (:func:`wgmma_applies`), "mma" the mma.sync kernels.

    Raises
    ------
    RuntimeError
        The launch needs more workspace than the owner holds while the current stream
        is capturing a CUDA graph (nothing is allocated during a capture).
    """
    if q.shape[0] == 0 or query_start_loc.shape[0] < 2 or int(max_query_len) <= 0:
        return
    varlen_runner(buffer, q, query_start_loc, block_tables, seq_lens,
                     max_query_len=max_query_len, causal=causal, geom=geom, k_s=k_s, v_s=v_s,
                     sm_scale=sm_scale, stats=stats, scratch=scratch, window=window,
                     rotate=rotate, route=route)(q, query_start_loc, block_tables, seq_lens,
                                                 out, lse)
