"""CuPy backend: the NVFP4 kernels of ``kernels/`` launched on CuPy's current stream.

Backend protocol shared with :mod:`fp4cache._numpy_backend` (the front end validates
shapes, dtypes and ranges, computes the float32 scalars, allocates outputs and makes the
arrays' device current, see :mod:`fp4cache._device`):

* ``quantize(x, s, g, rule, data_out, scales_out)``, ``dequantize(data, scales, s, out)``
* ``longlive_quantize(...)``, ``longlive_dequantize(...)`` (see their docstrings)
* ``decode_attention(buffer, q, block_tables, seq_lens, out, lse, *, geom, k_s, v_s,
  sm_scale, stats, scratch)`` (:mod:`fp4cache._cupy_attention`)
* ``abs_max(x)``: ``max |x|`` as a float32 host number (NaN for non-finite data)

The paged cache keeps its GPU resources in a :class:`CacheState` (page pool, counters,
encode table, duplicate-slot claim table and its launch plans), created by and owned by
the cache.  :func:`store_plan` and :func:`gather_plan` prepare one launch sequence from
everything it depends on (shapes, strides, dtypes, pointer alignment, the state's device
and buffers): a plan is an immutable callable, so a decode step costs one dictionary
lookup and one kernel launch of host time, and two threads may share plans and a stream.
Plans hold no device memory of their own: what a kernel needs between calls lives in the
state (the decode attention's split-KV workspace in ``CacheState.workspace``).
Nothing here synchronizes with the host or allocates once a plan exists, so calls can
be captured in CUDA graphs.  Non-contiguous K/V (any token and head strides) are read
in place; pointers or strides that are not 16-byte aligned select the ``_scalar``
kernel variants.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import cupy
import ml_dtypes
import numpy as np

from . import _abi
from . import _kernels as K
from ._cupy_attention import attention_runner, decode_attention
from ._device import by_value, num_sms
from ._plans import PlanCache, Workspace
from .formats import reciprocal_clamped
from .layout import GROUP, PageGeometry

__all__ = [
    "CacheState",
    "store_plan",
    "gather_plan",
    "store",
    "gather_dequant",
    "decode_attention",
    "attention_runner",
    "quantize",
    "dequantize",
    "abs_max",
    "longlive_quantize",
    "longlive_dequantize",
    "longlive_pointer_tables",
    "longlive_pool_launcher",
    "longlive_list_launcher",
]

_THREADS = 256
_BLOCK = (_THREADS,)

#: Launches are split so that a thread index always fits in 31 bits.
_MAX_THREADS = 2**31 - 1

_IX = {np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}
_U64 = np.uint64
_U32 = np.uint32
_I64 = np.int64
_F32 = np.float32


def _index_name(dtype, what: str) -> str:
    try:
        return _IX[dtype]
    except KeyError:
        raise TypeError(f"{what} must be int32 or int64, got {dtype}") from None


fastdiv = _abi.fastdiv


def _kernel(spec: K.Spec):
    return K.get_kernel(spec)


def _blocks(total: int) -> tuple[int]:
    return ((total + _THREADS - 1) // _THREADS,)


def _decode_blocks(chunks: int) -> tuple[int]:
    per = _THREADS * _abi.DECODE_CHUNKS
    return ((chunks + per - 1) // per,)


def _aligned(ptr: int, *strides: int, to: int = 16) -> bool:
    if ptr % to:
        return False
    return all(st % to == 0 for st in strides)


def _contig(a):
    return a if a.flags.c_contiguous else cupy.ascontiguousarray(a)


# -- flat codec ----------------------------------------------------------------------------
def quantize(x, s, g, rule, data_out, scales_out) -> None:
    """Quantize ``x [N, D]`` into ``data_out [N, D/2]``, ``scales_out [N, D/16]``."""
    n, d = x.shape
    total = n * (d // GROUP)
    if total == 0:
        return
    x = _contig(x)
    vec = _aligned(x.data.ptr) and _aligned(data_out.data.ptr, to=8)
    fn = _kernel(K.quantize_spec(K.value_type(x.dtype, "x"), rule, vec))
    fn(_blocks(total), _BLOCK, (x, data_out, scales_out, _U64(total), _F32(s), _F32(g)))


def dequantize(data, scales, s, out) -> None:
    """Decode ``data [N, D/2]``, ``scales [N, D/16]`` into ``out [N, D]``."""
    n, half = data.shape
    total = n * (2 * half // GROUP)
    if total == 0:
        return
    chunk = 16 // out.itemsize  # values per thread (one 16-byte output piece)
    vec = _aligned(data.data.ptr, to=chunk // 2) and _aligned(out.data.ptr)
    spec = K.dequantize_spec(K.value_type(out.dtype, "out"), vec)
    fn = _kernel(spec)
    threads = total * (16 // chunk)
    fn(_decode_blocks(threads), _BLOCK,
       (_contig(data), _contig(scales), out, _U64(threads), _F32(s)))


# -- paged cache ---------------------------------------------------------------------------
@lru_cache(maxsize=256)
def _page_args(geom: PageGeometry, num_blocks: int):
    """Kernel arguments that depend only on the geometry and pool size."""
    H, T, D = geom.num_heads, geom.block_size, geom.head_dim
    G = D // GROUP
    if geom.swizzle_v_scales and G // 4 >= 512:
        raise ValueError(f"head_dim must be < 32768 with swizzle_v_scales=True, got {D}")
    return {
        "G": G,
        "HG": fastdiv(H * G),
        "fG": fastdiv(G),
        "fH": fastdiv(H),
        "fT": fastdiv(T),
        "H": _U32(H),
        "nhd": _U32(_abi.LAYOUTS[geom.layout]),
        "swz": _U32(1 if geom.swizzle_v_scales else 0),
        # ceil(2^20 / (G/4)): the kernels divide by G/4 with one multiply and shift
        "swz_m": _U32(-(-(1 << 20) // max(1, G // 4))),
        "num_slots": _I64(num_blocks * T),
        "num_blocks": _I64(num_blocks),
        "side": _I64(geom.side_bytes),
        "data": _I64(geom.data_bytes),
        "side_ok": geom.side_bytes % 8 == 0,
    }


STORE_PARAMS_DTYPE = _abi.struct_dtype("StoreParams")
GATHER_PARAMS_DTYPE = _abi.struct_dtype("GatherParams")
#: EncodeAux::pk: multipliers that move a code from bits 22..24 to nibble 0..7.
_PACK_MULTIPLIERS = tuple(1 << (4 * j + 10) for j in range(6)) + (1 << 2, 1 << 6)


def _os_table_values(k_s: float, v_s: float) -> np.ndarray:
    """EncodeAux::os_tab for (k_s, v_s): os = min(fl(1/fl(f*s)), FLT_MAX), 0 for f = 0,
    for the 128 non-negative E4M3 scale bytes f, K's then V's (IEEE float32, numpy)."""
    f = np.arange(128, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    f[127] = 0  # 0x7F is NaN; never looked up (non-finite groups skip the table)
    out = []
    for s in (np.float32(k_s), np.float32(v_s)):
        with np.errstate(under="ignore"):
            fs = f * s
        out.append(np.where(f == 0, np.float32(0), reciprocal_clamped(fs)).astype(np.float32))
    return np.concatenate(out)


class CacheState:
    """The GPU resources one :class:`~fp4cache.PagedKVCache` owns, all on ``device``: the
    page pool, the uint64 counters, the encode table of its scales, the uint32
    duplicate-slot claim table (one entry per slot, zero between calls), its launch
    plans (:class:`~fp4cache._plans.PlanCache`, bounded) and the workspace its kernels
    share (:class:`~fp4cache._plans.Workspace`).  Freed with the cache.  It is also the
    ``scratch`` of :func:`decode_attention` (it has ``plans`` and ``workspace``)."""

    def __init__(self, device: int, geom: PageGeometry, num_blocks: int, k_s, k_g, v_s,
                 v_g, *, buffer=None, stats=None, tables: bool = True) -> None:
        self.device = device
        self.geom = geom
        self.num_blocks = num_blocks
        self.scalars = (_F32(k_s), _F32(k_g), _F32(v_s), _F32(v_g))
        with cupy.cuda.Device(device):
            self.buffer = (cupy.zeros((num_blocks, 2, geom.side_bytes), dtype=np.uint8)
                           if buffer is None else buffer)
            self.stats = (cupy.zeros(len(_abi.STAT_NAMES), dtype=np.uint64)
                          if stats is None else stats)
            # the store's tables (a gather-only state has none)
            self.os_tab = cupy.asarray(_os_table_values(k_s, v_s)) if tables else None
            self.claim = (cupy.zeros(num_blocks * geom.block_size, dtype=np.uint32)
                          if tables else None)
        self.plans = PlanCache()
        self.workspace = Workspace(device)

    @property
    def nbytes(self) -> int:
        """Device bytes held: pool, counters, encode table, claim table and workspace."""
        return self.workspace.nbytes + sum(
            a.nbytes for a in (self.buffer, self.stats, self.os_tab, self.claim)
            if a is not None)


def _noop(*args) -> None:
    return None


def store_plan(st: CacheState, slots, k, v, *, rule: str, unique_slots: bool) -> Callable:
    """``run(slots, k, v)``: store K/V ``[N, H, D]`` of arrays like these (same shapes,
    strides, dtypes, pointer alignment; ``slots`` C-contiguous) into ``st``'s pool.

    ``unique_slots``: no slot repeats (no duplicate pass); otherwise the last occurrence
    of a slot wins: a scan inside the kernel for up to ``_abi.SCAN_MAX_TOKENS`` tokens,
    else a claim pass before the store and a clear pass after it (three launches).
    """
    n = k.shape[0]
    if n == 0:
        return _noop
    geom = st.geom
    pa = _page_args(geom, st.num_blocks)
    G, H = geom.head_dim // GROUP, geom.num_heads
    dt = K.value_type(k.dtype, "k")
    pair = H % 2 == 0 and (dt, rule) in K.STORE_PAIR
    hg = fastdiv(H // 2 * G) if pair else pa["HG"]
    max_tokens = _MAX_THREADS // int(hg[0])
    if n > max_tokens:  # later chunks overwrite earlier ones: the last occurrence wins
        parts = [(a, min(n, a + max_tokens)) for a in range(0, n, max_tokens)]
        runs = [store_plan(st, slots[a:b], k[a:b], v[a:b], rule=rule,
                           unique_slots=unique_slots) for a, b in parts]

        def run_chunks(slots, k, v):
            for (a, b), r in zip(parts, runs):
                r(slots[a:b], k[a:b], v[a:b])

        return run_chunks
    es = k.itemsize
    kst, vst = k.strides, v.strides
    vec = (pa["side_ok"] and st.buffer.data.ptr % 8 == 0
           and _aligned(k.data.ptr, kst[0], kst[1]) and _aligned(v.data.ptr, vst[0], vst[1]))
    sl = _index_name(slots.dtype, "slot_mapping")
    spec = K.store_spec(dt, rule, sl, vec, pair)
    fn = _kernel(spec)
    half = H // 2
    total = n * int(hg[0])
    # duplicate slots: none promised or possible (0), scan the later tokens (1), claim (2)
    dedup = 0 if unique_slots or n == 1 else 1 if n <= _abi.SCAN_MAX_TOKENS else 2
    fg, ft = pa["fG"], pa["fT"]
    k_s, k_g, v_s, v_g = st.scalars
    p = np.zeros((), dtype=STORE_PARAMS_DTYPE)
    for name, value in (
            ("buffer", st.buffer.data.ptr), ("stats", st.stats.data.ptr),
            ("claim", st.claim.data.ptr), ("os_tab", st.os_tab.data.ptr),
            ("k_tok_stride", kst[0] // es), ("k_head_stride", kst[1] // es),
            ("v_tok_stride", vst[0] // es), ("v_head_stride", vst[1] // es),
            ("num_slots", pa["num_slots"]), ("side_bytes", pa["side"]),
            ("data_bytes", pa["data"]), ("k_pair_bytes", half * kst[1]),
            ("v_pair_bytes", half * vst[1]), ("n_tokens", n), ("total", total),
            ("hg", hg), ("g", fg), ("t", ft), ("H", pa["H"]),
            ("nhd", pa["nhd"]), ("swizzle", pa["swz"]), ("dedup", dedup),
            ("swz_m", pa["swz_m"]),
            ("pair_rows", half if geom.layout == "NHD" else half * geom.block_size),
            ("k_s", k_s), ("k_g", k_g), ("v_s", v_s), ("v_g", v_g),
            ("pk", _PACK_MULTIPLIERS)):
        p[name] = value
    params = by_value(p)
    grid = _blocks(total)  # one item per thread
    keep = st  # the struct holds the state's addresses

    if dedup != 2:
        def run(slots, k, v, _keep=keep):
            fn(grid, _BLOCK, (slots, k, v, params))

        return run
    claim = _kernel(K.claim_spec(sl))
    clear = _kernel(K.clear_spec(sl))
    cgrid, table, nt, ns = _blocks(n), st.claim, _U32(n), pa["num_slots"]

    def run_claimed(slots, k, v, _keep=keep):
        claim(cgrid, _BLOCK, (slots, table, nt, ns))
        fn(grid, _BLOCK, (slots, k, v, params))
        clear(cgrid, _BLOCK, (slots, table, nt, ns))

    return run_claimed


def store(buffer, slot_mapping, k, v, *, geom: PageGeometry, rule, k_s, k_g, v_s, v_g, stats,
          unique_slots: bool = False) -> None:
    """The functional form of the protocol (as in the NumPy backend; tests, benchmarks):
    store into ``buffer``/``stats`` through a :class:`CacheState` made for this call (it
    allocates and uploads tables: not for CUDA-graph capture, which needs the owner's
    state, :class:`~fp4cache.PagedKVCache`)."""
    st = CacheState(buffer.data.device_id, geom, buffer.shape[0], k_s, k_g, v_s, v_g,
                    buffer=buffer, stats=stats)
    slots = _contig(slot_mapping)
    store_plan(st, slots, k, v, rule=rule, unique_slots=unique_slots)(slots, k, v)


def gather_dequant(buffer, blocks, out_k, out_v, *, geom: PageGeometry, k_s, v_s,
                   stats) -> None:
    """The functional form of the gather (as in the NumPy backend; tests, benchmarks)."""
    st = CacheState(buffer.data.device_id, geom, buffer.shape[0], k_s, 1.0, v_s, 1.0,
                    buffer=buffer, stats=stats, tables=False)
    blocks = _contig(blocks)
    gather_plan(st, blocks, out_k, out_v)(blocks, out_k, out_v)


def gather_plan(st: CacheState, blocks, out_k, out_v) -> Callable:
    """``run(blocks, out_k, out_v)``: gather and decode pages ``blocks`` (C-contiguous,
    any length, of ``blocks``' dtype) into C-contiguous outputs ``[n*T, H, D]`` of
    ``out_k``'s dtype, 16-byte aligned if both of these are."""
    geom = st.geom
    pa = _page_args(geom, st.num_blocks)
    itemsize = out_k.itemsize
    chunk = 16 // itemsize  # values per 16-byte output piece; itemsize pieces per group
    per_page = geom.block_size * int(pa["HG"][0]) * itemsize
    max_pages = _MAX_THREADS // per_page
    vec = (geom.side_bytes % (chunk // 2) == 0 and st.buffer.data.ptr % (chunk // 2) == 0
           and out_k.data.ptr % 16 == 0 and out_v.data.ptr % 16 == 0)
    spec = K.gather_spec(K.value_type(out_k.dtype, "out_k"), _index_name(blocks.dtype, "blocks"),
                         vec)
    fn = _kernel(spec)
    fc, fh, ft = fastdiv(pa["G"] * itemsize), pa["fH"], pa["fT"]
    p = np.zeros((), dtype=GATHER_PARAMS_DTYPE)
    for name, value in (
            ("buffer", st.buffer.data.ptr), ("stats", st.stats.data.ptr),
            ("num_blocks", pa["num_blocks"]), ("side_bytes", pa["side"]),
            ("data_bytes", pa["data"]), ("c", fc), ("h", fh), ("t", ft),
            ("nhd", pa["nhd"]), ("swizzle", pa["swz"]),
            ("swz_m", pa["swz_m"]), ("k_s", st.scalars[0]), ("v_s", st.scalars[2])):
        p[name] = value
    params = by_value(p)
    T = geom.block_size
    per_cta = _THREADS * _abi.DECODE_CHUNKS

    def run(blocks, out_k, out_v, _keep=st):
        n = blocks.shape[0]
        if n <= max_pages:
            total = n * per_page
            if total:
                fn(((total + per_cta - 1) // per_cta,), _BLOCK,
                   (blocks, out_k, out_v, _U32(total), params))
            return
        for a in range(0, n, max_pages):
            run(blocks[a:a + max_pages], out_k[a * T:(a + max_pages) * T],
                out_v[a * T:(a + max_pages) * T])

    return run


# -- LongLive ------------------------------------------------------------------------------
def _amax_into(x, amax_out) -> bool:
    """Queue ``amax_out[0] = max |x|`` (NaN if ``x`` holds a NaN or an infinity) for a
    C-contiguous bf16/f16/f32 ``x``: a memset and one reduction kernel.  Returns whether
    the vector kernel variant was used (``x`` 16-byte aligned)."""
    dt = K.value_type(x.dtype, "x")
    stream = cupy.cuda.get_current_stream()
    cupy.cuda.runtime.memsetAsync(amax_out.data.ptr, 0, 4, stream.ptr)
    n = x.size
    vec = _aligned(x.data.ptr)
    if n:
        chunks = max(1, n // 8)
        grid = min((chunks + _THREADS - 1) // _THREADS, 8 * num_sms())
        _kernel(K.ll_amax_spec(dt, vec))((grid,), (_THREADS,), (x, amax_out, _U64(n)))
    return vec


def abs_max(x) -> np.float32:
    """``max |x|`` in float32 (NaN if ``x`` holds a NaN or an infinity; 0 if empty).

    One reduction kernel on the current stream, then a 4-byte device-to-host copy: this
    synchronizes with the stream (the result is a host number)."""
    amax = cupy.empty((1,), dtype=np.float32)
    _amax_into(_contig(x), amax)
    return np.float32(amax.get()[0])


def longlive_quantize(x, rule, values_out, sf_out, amax_out) -> None:
    """Quantize one block ``x [Tb, H, D]`` into the blocked layout (amax on the device)."""
    Tb, H, D = x.shape
    x = _contig(x)
    G = D // GROUP
    R = Tb * H
    Rp = values_out.shape[0]
    dt = K.value_type(x.dtype, "x")
    total = Rp * G
    if total >= _MAX_THREADS:  # checked before any work is queued
        raise ValueError(f"LongLive block too large: {Rp} rows x {G} groups")
    vec = _amax_into(x, amax_out)
    vec_q = vec and _aligned(values_out.data.ptr, to=8)
    fg = fastdiv(G)
    _kernel(K.ll_quantize_spec(dt, rule, vec_q))(_blocks(total), (_THREADS,), (
        x, amax_out, values_out, sf_out, _U32(total), _U32(R), fg[0], fg[1], fg[2]))


#: numpy twin of ``struct LLSource`` (generated from :mod:`fp4cache._abi`).
LL_SOURCE_DTYPE = _abi.struct_dtype("LLSource")


def longlive_dequantize(value_ptrs, sf_ptrs, amax_ptrs, out, *, num_heads, block_token_size,
                        inv_denom, values_aligned: bool = False) -> None:
    """Decode LongLive blocks given by device pointer tables into ``out [1, n*Tb, H, D]``.

    ``values_aligned``: the caller knows every values pointer is 16-byte aligned
    (enables the wide kernel)."""
    _table_plan(value_ptrs, sf_ptrs, amax_ptrs, out.shape[-1], out.dtype,
                out.data.ptr % 16 == 0, num_heads, block_token_size, inv_denom,
                values_aligned)(out)


def _table_plan(value_ptrs, sf_ptrs, amax_ptrs, D, out_dtype, out_aligned, num_heads,
                block_token_size, inv_denom, values_aligned):
    tabs = [_contig(a) for a in (value_ptrs, sf_ptrs, amax_ptrs)]

    def source(a, b):
        return (tabs[0][a:b].data.ptr, tabs[1][a:b].data.ptr, tabs[2][a:b].data.ptr,
                0, 0, 0, 0, 0, 0, 0, 0, 0, 0)

    run = _ll_plan(source, tabs[0].shape[0], D, out_dtype, out_aligned, num_heads,
                   block_token_size, inv_denom, values_aligned)
    run.keep = tabs  # the structs hold the tables' addresses
    return run


def longlive_pointer_tables(vals, sfs, ams):
    """uint64 ``[3, n]`` device array of the blocks' pointers (one small host-to-device
    copy; the plan that uses it owns it, see :func:`longlive_list_launcher`)."""
    ptrs = [[a.data.ptr for a in group] for group in (vals, sfs, ams)]
    return cupy.asarray(np.array(ptrs, dtype=np.uint64))


def longlive_list_launcher(vals, sfs, ams, D, out_dtype, out_aligned, *, num_heads,
                           block_token_size, inv_denom):
    """``run(out)`` decoding these blocks (the list API, prepared once per signature)."""
    tab = longlive_pointer_tables(vals, sfs, ams)
    return _table_plan(tab[0], tab[1], tab[2], D, out_dtype, out_aligned, num_heads,
                       block_token_size, inv_denom, all(a.data.ptr % 16 == 0 for a in vals))


def longlive_pool_launcher(values, scale_factors, amax, block_ids, D, out_dtype, out_aligned,
                           *, num_heads, block_token_size, inv_denom):
    """``run(out)`` decoding blocks ``block_ids`` of a pool (``values [N, Rp, D/2]``,
    ``scale_factors [N, Rp*D/16]``, ``amax`` with N float32) in one launch: the kernel
    turns each id into the block's addresses; an id outside ``[0, N)`` gives NaN rows."""
    ids = _contig(block_ids)
    N = values.shape[0]
    ids64 = ids.dtype.itemsize == 8
    am = amax.reshape(N)

    def source(a, b):
        return (0, 0, 0, ids[a:b].data.ptr if b > a else ids.data.ptr,
                values.data.ptr, values.strides[0], scale_factors.data.ptr,
                scale_factors.strides[0], am.data.ptr, am.strides[0], N, int(ids64), 0)

    aligned = values.data.ptr % 16 == 0 and values.strides[0] % 16 == 0
    run = _ll_plan(source, ids.shape[0], D, out_dtype, out_aligned, num_heads,
                   block_token_size, inv_denom, aligned)
    if ids is not block_ids:
        run.keep = ids  # our contiguous copy: the struct holds its address
    return run


def _ll_plan(source, nb, D, out_dtype, out_aligned, num_heads, block_token_size, inv_denom,
             aligned):
    """The launches of one LongLive decode, prepared: ``run(out)`` issues them."""
    out_dtype = np.dtype(out_dtype)
    itemsize = out_dtype.itemsize
    G = D // GROUP
    R = int(num_heads) * int(block_token_size)
    Tb = int(block_token_size)
    launches = []  # (kernel, grid, args before out, first block, end block, args after out)
    if nb * R * G > 0:
        C = D // (16 // itemsize)  # 16-byte output chunks per row, one per thread
        fc = fastdiv(C)
        dt = K.value_type(out_dtype, "out")
        # the wide kernel where it applies: bf16/f16 out, aligned blocks
        if aligned and itemsize == 2 and out_aligned and R * C < 2**31 - 8192:
            spec = K.ll_decode_wide_spec(dt)
            fn = _kernel(spec)
            per_cta = 1024 * _abi.LL_WIDE_TILES
            gx = (R * C + per_cta - 1) // per_cta
            for a in range(0, nb, 65535):  # grid y: one block each
                b = min(nb, a + 65535)
                src = np.array(source(a, b), dtype=LL_SOURCE_DTYPE)[()]
                launches.append((fn, (gx, b - a), src, a, b,
                                 (_U32(R * C), fc[0], fc[1], fc[2], _F32(inv_denom))))
        else:
            per = max(1, (_MAX_THREADS - 1) // (R * C))  # blocks per launch (32-bit ids)
            frc = fastdiv(R * C)
            spec = K.ll_decode_spec(dt, out_aligned)
            fn = _kernel(spec)
            for a in range(0, nb, per):
                b = min(nb, a + per)
                threads = (b - a) * R * C
                src = np.array(source(a, b), dtype=LL_SOURCE_DTYPE)[()]
                launches.append((fn, _decode_blocks(threads), src, a, b,
                                 (_U32(threads), frc[0], frc[1], frc[2], fc[0], fc[1], fc[2],
                                  _F32(inv_denom))))

    if len(launches) == 1:
        fn, grid, src, _, _, rest = launches[0]

        def run(out):
            fn(grid, _BLOCK, (src, out) + rest)
    else:
        def run(out):
            for fn, grid, src, a, b, rest in launches:
                fn(grid, _BLOCK, (src, out[:, a * Tb:b * Tb]) + rest)
    return run
