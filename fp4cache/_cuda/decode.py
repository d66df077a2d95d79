"""CuPy backend of ``PagedKVCache.decode_attention``: the fused NVFP4 paged decode-attention
kernel of ``kernels/decode_attention.cu``, launched on CuPy's current stream.

The front end validates the arguments and calls :func:`decode_attention`.  Everything a
launch needs that does not change from call to call (the kernel, the grid, the packed
``AttnParams`` struct) is prepared once per signature and kept in the owner's plan cache
(``scratch.plans``, bounded); the split-KV partials and merge tickets are views of the
owner's one workspace (``scratch.workspace``, :class:`fp4cache._plans.Workspace`), shared
by every plan, so a plan owns no device memory.  A call with a known signature is one
lookup and one ``RawKernel`` launch, no allocation and no synchronization, so it can be
captured in a CUDA graph.

Split-KV: each (sequence, KV head) is cut into ``nsplit`` splits of ``split_len`` tokens,
chosen on the host from the shapes only (batch, KV heads, block-table capacity), never
from the sequence lengths (no device-to-host copy): :func:`split_plan`.  The workspace a
launch takes is :func:`workspace_parts`; :func:`workspace_bound` is the most that any call
within a cache's hints can take (what the cache reserves at construction).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import cupy
import numpy as np

from .. import _abi
from .. import _kernels as K
from .._abi import MAX_GROUP
from .._arrays import ceil_div
from .._device import by_value, num_sms, resident_ctas
from .._plans import PlanCache, Scratch, Workspace
from ..layout import PageGeometry

__all__ = ["decode_attention", "decode_runner", "make_decode_run", "attention_plans",
           "new_scratch", "decode_plan_key",
           "split_plan", "max_splits", "workspace_parts", "workspace_bound",
           "make_decode_plan", "window_params", "window_key", "check_attention_args",
           "fill_shared_params", "RowsSpec", "NULL",
           "bytes_read", "attention_scales", "ATTN_PARAMS_DTYPE", "SPLIT_TOKENS",
           "MIN_SPLIT_TOKENS", "CTA_TOKENS", "MERGE_TOKENS", "SPLIT_FIXED_TOKENS", "splits_of"]

_U32, _I64, _F32 = np.uint32, np.int64, np.float32
_LOG2E = 1.4426950408889634

#: a null pointer argument (``query_start_loc`` of decode, ``lse`` when not asked for)
NULL = by_value(np.uint64(0))
#: numpy twin of ``struct AttnParams`` (generated from :mod:`fp4cache._abi`).
ATTN_PARAMS_DTYPE = _abi.struct_dtype("AttnParams")

#: The split plan's constants (:func:`split_plan`; measured on the H200, docs/kernels.md,
#: "Decode attention", in CTA-tokens: the time one CTA alone on its SM takes per key, about
#: 10 ns at head_dim 128): the longest and the shortest split; a wave's fixed cost (q, the
#: first chunk's loads, the warp merge, the write: about 3 us); merging at all (partial
#: write, ticket, the merge pass: about 2 us) and per split merged; and SM_SHARE, how much
#: CTAs that share an SM slow each other: k of them on one SM take (k + SM_SHARE) / (1 +
#: SM_SHARE) times as long as one alone (measured: about 1.5x for 2, 2.5x for 4).
SPLIT_TOKENS = 4096
MIN_SPLIT_TOKENS = 128
CTA_TOKENS = 300
SPLIT_FIXED_TOKENS = 250
MERGE_TOKENS = 4
SM_SHARE = 1.0

def attention_scales(sm_scale, k_s, v_s) -> tuple[np.float32, np.float32]:
    """``(qk_scale, out_scale)`` of the attention kernels' params: the kernels' decoded
    values are e2m1 * sf * 2^-PAIR_SCALE_SHIFT (``_abi``), so the score scale takes
    sm_scale * k_scale * 2^PAIR_SCALE_SHIFT * log2(e) (scores in the log2 domain) and the
    output v_scale * 2^PAIR_SCALE_SHIFT."""
    unscale = 2.0 ** _abi.PAIR_SCALE_SHIFT
    return (np.float32(float(sm_scale) * float(np.float32(k_s)) * unscale * _LOG2E),
            np.float32(float(np.float32(v_s)) * unscale))


class SplitPlan(NamedTuple):
    nsplit: int
    split_len: int


def _split_step(spec: K.Spec | None) -> int:
    """Split lengths are multiples of this: one chunk per warp of the CTA (at least two
    16-token tiles, ``_abi.ATTN_CHUNK_TILES`` of the spec's head_dim)."""
    tiles = 2 if spec is None else max(2, _abi.ATTN_CHUNK_TILES[K.attention_head_dim(spec)])
    return 16 * tiles * _abi.ATTN_WARPS


def splits_of(n: int, capacity: int, spec: K.Spec | None = None) -> SplitPlan:
    """``capacity`` tokens cut into (at most) ``n`` splits: ``split_len`` is
    ``ceil(capacity / n)`` rounded up to one chunk per warp of the CTA (:func:`_split_step`;
    without a spec, 32-token chunks)."""
    cap = max(int(capacity), 1)
    step = _split_step(spec)
    length = ceil_div(ceil_div(cap, n), step) * step
    return SplitPlan(ceil_div(cap, length), length)


def split_plan(batch: int, kv_heads: int, capacity: int, resident_ctas: int,
               spec: K.Spec | None = None, per_sm: int = 4) -> SplitPlan:
    """Splits per (sequence, KV head) for ``capacity = max_blocks * block_size`` tokens.

    The plan takes the number of splits ``n`` whose modelled time is least (ties to
    fewer splits), in CTA-tokens (the module's constants)::

        waves * (CTA_TOKENS + split_len * (k + SM_SHARE) / (1 + SM_SHARE))
            + (SPLIT_FIXED_TOKENS + n * MERGE_TOKENS if n > 1 else 0)

    with ``split_len`` = :func:`splits_of` ``n``, ``C = B * H * n`` CTAs on ``SMs =
    resident_ctas / per_sm`` SMs, ``waves = ceil(C / resident_ctas)`` and ``k`` the CTAs
    one SM holds at once (``ceil(C / SMs)``, at most ``per_sm``): a short sequence alone
    on the GPU is split until its CTAs fill the SMs, a batch that fills them already is
    not.  Splits are at least :data:`MIN_SPLIT_TOKENS` long (unless one split) and at
    most :data:`SPLIT_TOKENS` times ``max(1, 4 // per_sm)`` (so that unequal sequence
    lengths still spread over the GPU: about 16K tokens per SM and wave, whether 4 CTAs
    share an SM or, for a kernel of more registers, ``per_sm`` = 2), and at most
    ``_abi.ATTN_MAX_SPLITS``.
    """
    per_sm = max(1, int(per_sm))
    resident = max(1, int(resident_ctas))
    sms = max(1, resident // per_sm)
    longest = SPLIT_TOKENS * max(1, 4 // per_sm)
    bh = max(1, batch * kv_heads)
    best: tuple[float, SplitPlan] | None = None
    for n in range(1, _abi.ATTN_MAX_SPLITS + 1):
        plan = splits_of(n, capacity, spec)
        if plan.nsplit != n:  # the same split length as a smaller n
            continue
        if n > 1 and plan.split_len < MIN_SPLIT_TOKENS:
            break
        if plan.split_len > longest:
            continue
        ctas = bh * n
        waves = ceil_div(ctas, resident)
        k = min(per_sm, ceil_div(ctas, sms))
        cost = waves * (CTA_TOKENS + plan.split_len * (k + SM_SHARE) / (1 + SM_SHARE))
        if n > 1:
            cost += SPLIT_FIXED_TOKENS + n * MERGE_TOKENS
        if best is None or cost < best[0]:
            best = (cost, plan)
    if best is None:  # only with MIN_SPLIT_TOKENS > SPLIT_TOKENS or huge capacities
        cap = max(int(capacity), 1)
        return splits_of(min(ceil_div(cap, longest), _abi.ATTN_MAX_SPLITS),
                         capacity, spec)
    return best[1]


def max_splits(capacity: int, spec: K.Spec | None = None) -> int:
    """The most splits :func:`split_plan` can choose for ``capacity`` tokens on any GPU:
    ``_abi.ATTN_MAX_SPLITS``, and (more than one split being at least
    :data:`MIN_SPLIT_TOKENS` long) ``ceil(capacity / MIN_SPLIT_TOKENS)``."""
    return max(1, min(_abi.ATTN_MAX_SPLITS, ceil_div(int(capacity), MIN_SPLIT_TOKENS)))


def workspace_parts(batch: int, kv_heads: int, nsplit: int, rows: int,
                    head_dim: int) -> tuple[tuple, int]:
    """``(parts, tickets)`` of one launch for :meth:`~fp4cache._plans.Workspace.get`:
    with more than one split, the float32 partial outputs ``[B*H*nsplit, rows*D]``, the
    partial ``(m, l)`` ``[B*H*nsplit, rows, 2]`` (``rows``: query rows per (sequence, KV
    head), the group for decode) and one merge ticket per (sequence, KV head); nothing with
    one split (the kernel then touches none of them)."""
    if nsplit <= 1:
        return (), 0
    n = batch * kv_heads * nsplit
    return (((n, rows * head_dim), np.float32), ((n, rows, 2), np.float32)), \
        batch * kv_heads


def workspace_bound(geom: PageGeometry, max_batch_size: int, max_seq_len: int,
                    num_query_heads: int) -> tuple[int, int]:
    """``(scratch_bytes, tickets)`` that cover every call with ``B <= max_batch_size``,
    block tables of at most ``ceil(max_seq_len / block_size)`` columns and
    ``Hq <= num_query_heads`` (on any GPU: :func:`max_splits`)."""
    T, H = geom.block_size, geom.num_heads
    nsplit = max_splits(ceil_div(max_seq_len, T) * T)
    # (decode's rows; attention with several query tokens per sequence grows it)
    parts, tickets = workspace_parts(max_batch_size, H, nsplit, max(1, num_query_heads // H),
                                     geom.head_dim)
    return Workspace.layout(parts)[1], tickets


class _AttnPlan(NamedTuple):
    fn: Any
    grid: tuple[int, int, int]  # (nsplit, H, B); launched as one dimension, split fastest
    block: tuple[int]
    params: Any  # an ATTN_PARAMS_DTYPE struct, prepared by _device.by_value
    keep: tuple  # the owner's arrays the params point to (pool, counters, geometry)
    spec: K.Spec  # the kernel's specialization


def check_attention_args(what: str, buffer, q, geom: PageGeometry, **index_arrays) -> int:
    """The checks of both attention kernels' arguments (``what`` names the function): q's
    head_dim and heads against ``geom``, the block tables' row capacity, the pool's
    alignment and the index arrays' dtypes.  Returns the query heads per KV head."""
    _, Hq, D = q.shape
    H, T = geom.num_heads, geom.block_size
    if D != geom.head_dim:
        raise ValueError(f"q.shape[2] must be head_dim={geom.head_dim}, got {D}")
    if D not in K.ATTN_HEAD_DIMS:
        raise ValueError(f"{what} supports head_dim in {K.ATTN_HEAD_DIMS}, got {D}")
    if Hq % H:
        raise ValueError(f"q.shape[1] = {Hq} must be a multiple of num_heads = {H}")
    group = Hq // H
    if not 1 <= group <= MAX_GROUP:
        raise ValueError(f"query heads per KV head must be 1..{MAX_GROUP}, got {group}")
    capacity = int(index_arrays["block_tables"].shape[1]) * T
    if capacity >= 2**31:
        raise ValueError(f"block_tables row capacity {capacity} tokens must be < 2**31")
    if buffer.data.ptr % 16:
        raise ValueError("the page pool must be 16-byte aligned")
    for name, a in index_arrays.items():
        if np.dtype(a.dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise ValueError(f"{name}.dtype must be int32 or int64, got {np.dtype(a.dtype)}")
    return group


class RowsSpec(NamedTuple):
    """Where a launch's CTAs take their query rows: decode (``qsl=False``: token ``b`` of
    sequence ``b``, the group's heads) or ``query_start_loc`` (the sequences of ``rows_lo <
    n_b * group <= rows_hi``, at most ``max_q`` tokens each, ``causal`` bottom-right)."""
    batch: int
    qsl: bool = False
    ql64: bool = False
    causal: bool = False
    rows_lo: int = 0
    rows_hi: int = 0xFFFFFFFF
    max_q: int = 1


def fill_shared_params(p, buffer, geom: PageGeometry, stats, workspace: tuple[int, int, int],
                       group: int, block_tables, seq_lens, ql64: bool, causal: bool,
                       rows_lo: int, rows_hi: int, num_tokens: int,
                       scales: tuple[np.float32, np.float32]) -> None:
    """Fill the fields both attention kernels' parameter structs share (``AttnParams`` and
    ``VarlenParams``, ``kernels/attn_seq.cuh``): the pool and its geometry, the counters,
    the workspace ``(ws_o, ws_ml, counters)`` addresses, the index dtypes, the row range
    and mask, and the ``(qk_scale, out_scale)`` of :func:`attention_scales`."""
    H, T = geom.num_heads, geom.block_size
    hnd = geom.layout == "HND"
    ws_o, ws_ml, counters = workspace
    for name, value in (
            ("buffer", buffer.data.ptr), ("ws_o", ws_o), ("ws_ml", ws_ml),
            ("counters", counters), ("stats", stats.data.ptr),
            ("num_blocks", buffer.shape[0]), ("side_bytes", geom.side_bytes),
            ("data_bytes", geom.data_bytes), ("H", H), ("group", group),
            ("t", _abi.fastdiv(T)), ("max_blocks", int(block_tables.shape[1])),
            ("row_h", T if hnd else 1), ("row_t", 1 if hnd else H),
            ("swizzle", 1 if geom.swizzle_v_scales else 0),
            ("bt64", 1 if np.dtype(block_tables.dtype).itemsize == 8 else 0),
            ("sl64", 1 if np.dtype(seq_lens.dtype).itemsize == 8 else 0),
            ("ql64", 1 if ql64 else 0), ("causal", 1 if causal else 0),
            ("rows_lo", rows_lo), ("rows_hi", rows_hi), ("num_tokens", num_tokens),
            ("qk_scale", scales[0]), ("out_scale", scales[1])):
        p[name] = value


def window_params(window, geom: PageGeometry, num_blocks: int, k_s, v_s,
                  exact_new: bool = False) -> dict:
    """The ``AttnParams`` fields of the exact window (``docs/window.md``): ``window = (win,
    win_map, pages)`` (cupy uint16 ``(S, 2, T, H, D)`` bf16 bits, int32 ``(num_blocks,)``
    block -> slot, pages per sequence) or None (no window: ``win_pages = 0``).
    ``win_k_mul`` / ``win_v_mul`` turn an exact K / V value (the window's, or with
    ``exact_new`` the new tokens') into the units of the kernel's decoded NVFP4 values
    (e2m1 * sf * 2^-PAIR_SCALE_SHIFT, :func:`attention_scales`):
    ``2^-PAIR_SCALE_SHIFT / k_scale`` (``v_scale``), so that the score and output scales
    apply to both (the kernel multiplies in its decode route's power of two)."""
    unscale = 2.0 ** -_abi.PAIR_SCALE_SHIFT
    big = float(np.finfo(np.float32).max)
    muls = {"win_k_mul": _F32(min(unscale / float(np.float32(k_s)), big)),
            "win_v_mul": _F32(min(unscale / float(np.float32(v_s)), big))}
    if window is None:
        return {"win": 0, "win_map": 0, "win_pages": 0, "win_slots": 0,
                **(muls if exact_new else {"win_k_mul": _F32(0), "win_v_mul": _F32(0)})}
    win, win_map, pages = window
    T, H, D = geom.block_size, geom.num_heads, geom.head_dim
    if T % 16:
        raise ValueError(f"the exact window needs block_size % 16 == 0, got {T}")
    if (win.ndim != 5 or tuple(win.shape[1:]) != (2, T, H, D)
            or np.dtype(win.dtype) != np.dtype(np.uint16) or not win.flags.c_contiguous):
        raise ValueError(f"window slots must be C-contiguous uint16 (S, 2, {T}, {H}, {D}), "
                         f"got {win.dtype} {tuple(win.shape)}")
    if (tuple(win_map.shape) != (num_blocks,) or np.dtype(win_map.dtype) != np.dtype(np.int32)
            or not win_map.flags.c_contiguous):
        raise ValueError(f"window_map must be C-contiguous int32 ({num_blocks},), got "
                         f"{win_map.dtype} {tuple(win_map.shape)}")
    if win.data.ptr % 16:
        raise ValueError("the window slots must be 16-byte aligned")
    return {"win": win.data.ptr, "win_map": win_map.data.ptr,
            "win_pages": max(0, min(int(pages), 0xFFFFFFFF)), "win_slots": int(win.shape[0]),
            **muls}


def make_decode_plan(buffer, q, block_tables, seq_lens, geom: PageGeometry, k_s, v_s, sm_scale,
               stats, workspace: Workspace, decode_route: str = "auto",
               kernel_file: str | None = None, rows: RowsSpec | None = None,
               window=None, rotate: bool = False) -> _AttnPlan:
    """The prepared launch of :func:`decode_runner` (and of the few-row launch of
    ``varlen``); ``window``, ``rotate``: :func:`window_params`, q rotated by the normalized
    Hadamard transform in the kernel (its 1/sqrt(head_dim) is folded into qk_scale)."""
    num_tokens, Hq, D = q.shape
    H, T = geom.num_heads, geom.block_size
    if rows is None:
        rows = RowsSpec(num_tokens)
    B = rows.batch
    what = "attention" if rows.qsl else "decode_attention"
    group = check_attention_args(what, buffer, q, geom, block_tables=block_tables,
                                 seq_lens=seq_lens)
    if num_tokens >= 2**32:
        raise ValueError(f"q must have fewer than 2**32 tokens, got {num_tokens}")
    rows_max = rows.max_q * group
    dtype = K.value_type(q.dtype, "q.dtype")
    most = K.attn_max_rows(dtype, D)
    if rows_max > most:
        raise ValueError(f"{rows.max_q} query tokens x {group} heads exceed the {most} rows "
                         f"of the attention kernel's CTA ({dtype} q, head_dim {D})")
    max_blocks = int(block_tables.shape[1])
    if buffer.shape[0] >= 2**32 - 1:  # the kernel's 32-bit page index (FP4C_BAD_PAGE)
        raise ValueError(f"the page pool must hold fewer than 2**32 - 1 pages, got "
                         f"{buffer.shape[0]}")
    spec = K.decode_attention_spec(dtype, D, K.attn_row_tiles(rows_max), T % 16 == 0,
                                   decode_route)
    if kernel_file is not None:
        spec = dataclasses.replace(spec, file=kernel_file)
    fn = K.get_kernel(spec)
    resident = resident_ctas(fn, 32 * _abi.ATTN_WARPS)
    sp = split_plan(B, H, max_blocks * T, resident, spec, per_sm=resident // num_sms())
    nsplit, split_len = sp
    if nsplit * H * B >= 2**31:  # one-dimensional grid
        raise ValueError(f"{B} sequences x {H} KV heads x {nsplit} splits exceed the 2**31 - 1 "
                         "CTAs of a launch")
    parts, tickets = workspace_parts(B, H, nsplit, rows_max, D)
    views = workspace.get(parts, tickets=tickets, hint=(
        f"max_batch_size >= {B}, max_seq_len >= {max_blocks * T}, num_query_heads >= {Hq}"))
    ws_o, ws_ml, counters = (a.data.ptr for a in views) if views else (0, 0, 0)
    win = window_params(window, geom, int(buffer.shape[0]), k_s, v_s)
    qk_scale, out_scale = attention_scales(sm_scale, k_s, v_s)
    if rotate:
        qk_scale = _F32(qk_scale * _F32(1.0 / math.sqrt(D)))
    p = np.zeros((), dtype=ATTN_PARAMS_DTYPE)
    fill_shared_params(p, buffer, geom, stats, (ws_o, ws_ml, counters), group, block_tables,
                       seq_lens, rows.ql64, rows.causal, rows.rows_lo, rows.rows_hi,
                       num_tokens, (qk_scale, out_scale))
    for name, value in (("split_len", split_len), ("nsplit", nsplit), ("max_q", rows.max_q),
                        ("rows_max", rows_max), ("rotate", 1 if rotate else 0),
                        *win.items()):
        p[name] = value
    threads = 32 * _abi.ATTN_WARPS
    keep = (buffer, stats, geom) + (() if window is None else tuple(window[:2]))
    return _AttnPlan(fn, (nsplit, H, B), (threads,), by_value(p), keep, spec)


def window_key(window, rotate: bool) -> tuple:
    """The part of a plan key that names the window (its arrays and pages) and the
    rotation."""
    if window is None:
        return (None, bool(rotate))
    win, win_map, pages = window
    return (win.data.ptr, tuple(win.shape), win_map.data.ptr, int(win_map.shape[0]),
            int(pages), bool(rotate))


def decode_plan_key(buffer, q, block_tables, seq_lens, geom, k_s, v_s, sm_scale, stats,
                    decode_route="auto", kernel_file=None, window=None,
                    rotate: bool = False) -> tuple:
    # id(geom): the plan keeps geom alive, so the id is not reused while the key exists.
    # No stream: the workspace is the owner's, shared by every stream (calls on different
    # streams are ordered by the caller, see Workspace).
    return ("attention-plan", buffer.data.device_id, buffer.data.ptr, buffer.shape[0],
            id(geom), q.shape, q.dtype, block_tables.shape[1], block_tables.dtype,
            seq_lens.dtype, float(k_s), float(v_s), float(sm_scale), stats.data.ptr,
            decode_route, kernel_file) + window_key(window, rotate)


def decode_attention(buffer, q, block_tables, seq_lens, out, lse, *, geom: PageGeometry, k_s,
                     v_s, sm_scale, stats, scratch, decode_route: str = "auto",
                     kernel_file: str | None = None, window=None,
                     rotate: bool = False) -> None:
    """Paged decode attention over the NVFP4 page pool ``buffer`` (see the module doc).

    Parameters
    ----------
    buffer : cupy.ndarray, uint8, (num_blocks, 2, geom.side_bytes)
        The page pool.
    q : cupy.ndarray, (B, Hq, D), bfloat16 / float16 / float32, C-contiguous
        Queries; ``Hq = group * num_heads``, ``group`` in 1..16; query head ``h`` reads
        KV head ``h // group``.
    block_tables : cupy.ndarray, int32 or int64, (B, max_blocks), C-contiguous
    seq_lens : cupy.ndarray, int32 or int64, (B,)
        Clamped to ``[0, max_blocks * block_size]`` on the device.
    out : cupy.ndarray, (B, Hq, D), q's dtype, C-contiguous (written)
    lse : cupy.ndarray, float32, (B, Hq), or None
        Natural log of the softmax denominator (``-inf`` for an empty sequence).
    geom, k_s, v_s, sm_scale, stats
        Page geometry, global K/V scales, score scale, the cache's counters (index 3
        counts bad block ids among the used entries, once per entry and call).
    scratch : CacheState or Scratch
        The owner's ``plans`` (prepared launches, by signature) and ``workspace``
        (split-KV partials and merge tickets, see :func:`workspace_parts`).
    decode_route : str
        ``_kernels.DECODE_ROUTES``: "bitmove" takes the sm_80 decode route on any GPU
        (tests); the library uses "auto".
    kernel_file : str, optional
        A replacement of ``decode_attention.cu`` in the kernel folder, same kernel names
        and arguments (``bench/attn_kernel.py``'s experiments).
    window : (win, win_map, pages) or None
        The cache's exact window (``docs/window.md``, :func:`window_params`): keys from
        the sequence's window start on are read from the bf16 slots.
    rotate : bool
        K is stored rotated by the normalized Hadamard transform: q is rotated the same
        way in the kernel.

    Raises
    ------
    RuntimeError
        The launch needs more workspace than the owner holds while the current stream
        is capturing a CUDA graph.
    """
    if q.shape[0] == 0:
        return
    decode_runner(buffer, q, block_tables, seq_lens, geom=geom, k_s=k_s, v_s=v_s,
                     sm_scale=sm_scale, stats=stats, scratch=scratch,
                     decode_route=decode_route, kernel_file=kernel_file, window=window,
                     rotate=rotate)(
        q, block_tables, seq_lens, out, lse)


def make_decode_run(buffer, q, block_tables, seq_lens, *, geom: PageGeometry, k_s, v_s,
                    sm_scale, stats, scratch, decode_route: str = "auto",
                    kernel_file: str | None = None, window=None, rotate: bool = False):
    """``run(q, query_start_loc, block_tables, seq_lens, out, lse)``: the decode launch for
    arrays like these (shapes, dtypes) on the current stream, prepared now (its split-KV
    partials taken from ``scratch.workspace``); ``query_start_loc`` is not read (one query
    token per sequence).  ``run.plan`` is the :class:`_AttnPlan`."""
    plan = make_decode_plan(buffer, q, block_tables, seq_lens, geom, k_s, v_s, sm_scale, stats,
                            scratch.workspace, decode_route, kernel_file, window=window,
                            rotate=rotate)
    nsplit, H, B = plan.grid
    fn, grid, block, params, zero = plan.fn, (nsplit * H * B,), plan.block, plan.params, \
        NULL

    def run(q, query_start_loc, block_tables, seq_lens, out, lse, _keep=plan):
        fn(grid, block, (q, zero, block_tables, seq_lens, out, zero if lse is None else lse,
                         params))

    run.plan = plan  # type: ignore[attr-defined]
    return run


def decode_runner(buffer, q, block_tables, seq_lens, *, geom: PageGeometry, k_s, v_s,
                  sm_scale, stats, scratch, decode_route: str = "auto",
                  kernel_file: str | None = None, window=None, rotate: bool = False):
    """``run(q, block_tables, seq_lens, out, lse)``: :func:`decode_attention` for arrays
    like these, prepared once and kept in ``scratch.plans`` under
    :func:`decode_plan_key` (the functional API; a cache's pool goes through
    ``runners.attention_runner``)."""
    key = decode_plan_key(buffer, q, block_tables, seq_lens, geom, k_s, v_s, sm_scale, stats,
                          decode_route, kernel_file, window, rotate)
    run = scratch.plans.get(key)
    if run is None:
        run = make_decode_run(buffer, q, block_tables, seq_lens, geom=geom, k_s=k_s, v_s=v_s,
                              sm_scale=sm_scale, stats=stats, scratch=scratch,
                              decode_route=decode_route, kernel_file=kernel_file,
                              window=window, rotate=rotate)
        scratch.plans.put(key, run)

    def run_decode(q, block_tables, seq_lens, out, lse, _run=run):
        _run(q, None, block_tables, seq_lens, out, lse)

    return run_decode


def attention_plans(scratch) -> list[_AttnPlan]:
    """The prepared decode-attention launches in ``scratch.plans``, least recently used
    first (tests and benchmarks read their grids)."""
    plans = (getattr(run, "plan", None) for run in scratch.plans.values())
    return [p for p in plans if isinstance(p, _AttnPlan)]


def new_scratch(device: int | None = None) -> Scratch:
    """A plan cache and a workspace of their own on ``device`` (default: the current one),
    for calling :func:`decode_attention` outside a cache (tests, benchmarks)."""
    return Scratch(PlanCache(), Workspace(cupy.cuda.runtime.getDevice() if device is None
                                          else device))


def bytes_read(geom: PageGeometry, seq_lens) -> int:
    """NVFP4 page bytes the kernel reads for ``seq_lens`` (K and V of every used token and
    KV head; the benchmark's byte count)."""
    n = int(np.sum(np.asarray(seq_lens, dtype=np.int64)))
    return n * geom.bytes_per_token

