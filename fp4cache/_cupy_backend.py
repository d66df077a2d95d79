"""CuPy backend: the NVFP4 kernels of ``kernels/`` launched on CuPy's current stream.

Backend protocol (same names and signatures as :mod:`fp4cache._numpy_backend`; the
front end validates shapes, dtypes and ranges, computes the float32 scalars and
allocates outputs):

* ``quantize(x, s, g, rule, data_out, scales_out, stats=None)``
* ``dequantize(data, scales, s, out)``
* ``store(buffer, slot_mapping, k, v, *, geom, rule, k_s, k_g, v_s, v_g, stats)``
* ``gather_dequant(buffer, blocks, out_k, out_v, *, geom, k_s, v_s, stats)``
* ``store_launcher(...)`` / ``gather_launcher(...)``: prepared launches for the
  front end's hot path (GPU only; ``None`` where not available)
* ``abs_max(x)``: ``max |x|`` as a float32 host number (NaN for non-finite data)
* ``longlive_quantize(x, rule, values_out, sf_out, amax_out)``
* ``longlive_dequantize(value_ptrs, sf_ptrs, amax_ptrs, out, *, num_heads,
  block_token_size, inv_denom)`` (three device ``uint64`` pointer tables)

Every function enqueues work on the current stream and returns without a host
synchronization.  ``gather_dequant`` and ``longlive_dequantize`` allocate nothing,
so they can be captured in a CUDA graph.  ``store`` is one launch for up to
``FP4C_SCAN_MAX_TOKENS`` tokens; above that it adds a claim pre-pass over a claim table
allocated once per device and stream (calls outside graph capture number their claims
on the host; captured ones use a device epoch that the claim pass advances, so replays
stay correct; see ``kernels/paged_kv.cu``).  Non-contiguous K/V (any
token and head strides) are read in place; pointers or strides that are not
16-byte aligned select the ``_scalar`` kernel variants.  Launch arguments of
``store`` are cached per geometry/shape/stride/scale key, so a decode step costs
one dictionary lookup and one kernel launch of host time.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import cache, lru_cache
from typing import NamedTuple

import cupy
import numpy as np

from . import _kernels as K
from . import _pdl
from .layout import GROUP, PageGeometry

__all__ = [
    "quantize",
    "dequantize",
    "store",
    "gather_dequant",
    "abs_max",
    "longlive_quantize",
    "longlive_dequantize",
    "longlive_pointer_tables",
    "longlive_pool_launcher",
    "longlive_list_launcher",
]

_THREADS = 256
_BLOCK = (_THREADS,)


def _scan_max_tokens() -> int:
    """Up to this many tokens the store resolves duplicate slots by a scan in the kernel
    (one launch); above it, a claim pre-pass.  Read from the kernels' tuning, whose value
    also sizes the kernel's shared-memory arrays."""
    return K.tuning("FP4C_SCAN_MAX_TOKENS")

#: Launches are split so that a thread index always fits in 31 bits.
_MAX_THREADS = 2**31 - 1

_DT = {
    np.dtype(np.float32): "f32",
    np.dtype(np.float16): "f16",
}
try:  # CuPy arrays of ml_dtypes.bfloat16
    import ml_dtypes

    _DT[np.dtype(ml_dtypes.bfloat16)] = "bf16"
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    pass

_IX = {np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}
_U64 = np.uint64
_U32 = np.uint32
_I64 = np.int64
_F32 = np.float32
_NULL = np.uint64(0)


def _dtype_name(dtype, what: str) -> str:
    try:
        return _DT[dtype]
    except KeyError:
        raise TypeError(f"{what} must be bfloat16, float16 or float32, got {dtype}") from None


def _index_name(dtype, what: str) -> str:
    try:
        return _IX[dtype]
    except KeyError:
        raise TypeError(f"{what} must be int32 or int64, got {dtype}") from None


@cache
def fastdiv(d: int) -> tuple[np.uint32, np.uint32, np.uint32]:
    """``(d, m, s)`` of the device ``FastDiv`` for the divisor ``1 <= d < 2**31``."""
    if not 1 <= d < 2**31:
        raise ValueError(f"divisor must be in [1, 2**31), got {d}")
    s = (d - 1).bit_length()
    m = ((1 << 32) * ((1 << s) - d)) // d + 1
    return _U32(d), _U32(m & 0xFFFFFFFF), _U32(s)


_kernel_cache: dict = {}


def _kernel(spec: K.Spec):
    dev = cupy.cuda.runtime.getDevice()
    fn = _kernel_cache.get((dev, spec))
    if fn is None:
        fn = K.get_kernel(spec)
        _kernel_cache[(dev, spec)] = fn
    return fn


def clear_caches() -> None:
    """Forget compiled kernels and launch plans (after ``_kernels.set_defines``)."""
    _kernel_cache.clear()
    _store_plans.clear()


def _blocks(total: int) -> tuple[int]:
    return ((total + _THREADS - 1) // _THREADS,)


#: (input itemsize, rule) pairs whose store kernel gives each thread the same group of
#: two heads (h and h + H/2) of one token, where H is even (``kernels/paged_kv.cu``, NH):
#: bf16/f16 static6, measured faster on the H200 (bench/KERNEL_NOTES.md, v17); 4over6 and
#: float32 inputs would need too many registers.
STORE_PAIR: frozenset = frozenset({(2, "static6")})
#: Launch the store after a claim pass with programmatic dependent launch (sm_90+).
STORE_PDL = True
#: Prepared decode-step stores launch through cuLaunchKernelEx with arguments packed once.
STORE_DRIVER_LAUNCH = True


def _decode_blocks(chunks: int) -> tuple[int]:
    per = _THREADS * K.tuning("FP4C_DECODE_CHUNKS")
    return ((chunks + per - 1) // per,)


def _aligned(ptr: int, *strides: int, to: int = 16) -> bool:
    if ptr % to:
        return False
    return all(st % to == 0 for st in strides)


def _contig(a):
    return a if a.flags.c_contiguous else cupy.ascontiguousarray(a)


# -- flat codec ----------------------------------------------------------------------------
def quantize(x, s, g, rule, data_out, scales_out, stats=None) -> None:
    """Quantize ``x [N, D]`` into ``data_out [N, D/2]``, ``scales_out [N, D/16]``."""
    n, d = x.shape
    total = n * (d // GROUP)
    if total == 0:
        return
    x = _contig(x)
    vec = _aligned(x.data.ptr) and _aligned(data_out.data.ptr, to=8)
    fn = _kernel(K.quantize_spec(_dtype_name(x.dtype, "x"), rule, vec))
    st = _NULL if stats is None else stats
    fn(_blocks(total), (_THREADS,),
       (x, data_out, scales_out, st, _U64(total), _F32(s), _F32(g)))


def dequantize(data, scales, s, out) -> None:
    """Decode ``data [N, D/2]``, ``scales [N, D/16]`` into ``out [N, D]``."""
    n, half = data.shape
    total = n * (2 * half // GROUP)
    if total == 0:
        return
    chunk = 16 // out.itemsize  # values per thread (one 16-byte output piece)
    vec = _aligned(data.data.ptr, to=chunk // 2) and _aligned(out.data.ptr)
    fn = _kernel(K.dequantize_spec(_dtype_name(out.dtype, "out"), vec))
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
        "nhd": _U32(1 if geom.layout == "NHD" else 0),
        "swz": _U32(1 if geom.swizzle_v_scales else 0),
        # ceil(2^20 / (G/4)): the kernels divide by G/4 with one multiply and shift
        "swz_m": _U32(-(-(1 << 20) // max(1, G // 4))),
        "num_slots": _I64(num_blocks * T),
        "num_blocks": _I64(num_blocks),
        "side": _I64(geom.side_bytes),
        "data": _I64(geom.data_bytes),
        "side_ok": geom.side_bytes % 8 == 0,
        "side16": geom.side_bytes % 16 == 0,
    }


# Duplicate-slot claim state per (device, stream, captured): a zeroed uint64 table of at
# least num_slots entries, uint32 [epoch, finished-CTA count] and a host count of the
# calls that used it.  Calls outside graph capture key their claims with that count (the
# host epoch); captured calls, replayed with the same arguments, use their own table and
# the device epoch that the claim kernel advances.  Either epoch is re-zeroed, with its
# table, long before it could wrap.
_claim_tables: dict[tuple[int, int, bool], list] = {}
_EPOCH_LIMIT = 2**32 - 16


def _claim_state(num_slots: int, captured: bool):
    """(table, epoch array, host epoch) for this device and stream; the host epoch is 0
    for a call being captured into a CUDA graph (the device epoch is used)."""
    key = (cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr, captured)
    st = _claim_tables.get(key)
    if st is None or st[0].size < num_slots:
        st = [cupy.zeros(max(num_slots, 1024), dtype=np.uint64),
              cupy.zeros(2, dtype=np.uint32), 0]
        _claim_tables[key] = st
    st[2] += 1
    if st[2] >= _EPOCH_LIMIT:
        st[0].fill(0)
        st[1].fill(0)
        st[2] = 1
    return st[0], st[1], 0 if captured else st[2]


#: numpy twin of ``struct StoreParams`` in ``kernels/paged_kv.cu`` (same field order).
STORE_PARAMS_DTYPE = np.dtype(
    [(f, np.uint64) for f in ("buffer", "stats", "claim", "epoch")]
    + [(f, np.int64) for f in ("k_tok_stride", "k_head_stride", "v_tok_stride",
                             "v_head_stride", "num_slots", "side_bytes", "data_bytes")]
    + [("os_tab", np.uint64), ("k_pair_bytes", np.int64), ("v_pair_bytes", np.int64)]
    + [(f, np.uint32) for f in ("n_tokens", "total", "hg", "hg_m", "hg_s", "gd", "g_m", "g_s",
                                "td", "t_m", "t_s", "H", "nhd", "swizzle", "dedup", "swz_m",
                                "pair_rows", "epoch_host")]
    + [(f, np.float32) for f in ("k_s", "k_g", "v_s", "v_g")]
    + [("pk", np.uint32, (8,))],
    align=True,
)
#: EncodeAux::pk: multipliers that move a code from bits 22..24 to nibble 0..7.
_PACK_MULTIPLIERS = tuple(1 << (4 * j + 10) for j in range(6)) + (1 << 2, 1 << 6)


def _os_table_values(k_s: float, v_s: float) -> np.ndarray:
    """EncodeAux::os_tab for (k_s, v_s): os = min(fl(1/fl(f*s)), FLT_MAX), 0 for f = 0,
    for the 128 non-negative E4M3 scale bytes f, K's then V's (IEEE float32, numpy)."""
    f = np.arange(128, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    f[127] = 0  # 0x7F is NaN; never looked up (non-finite groups skip the table)
    out = []
    for s in (np.float32(k_s), np.float32(v_s)):
        with np.errstate(divide="ignore", over="ignore", under="ignore"):
            os_ = np.float32(1) / (f * s)
        os_ = np.minimum(os_, np.float32(np.finfo(np.float32).max))
        out.append(np.where(f == 0, np.float32(0), os_).astype(np.float32))
    return np.concatenate(out)


# Device os tables per (device, k_s, v_s), shared by every launch plan with those scales
# (a plan keeps its table alive; dropping the dict's reference frees nothing in use).
_os_tables: dict = {}


def _os_table(k_s, v_s):
    key = (cupy.cuda.runtime.getDevice(), float(k_s), float(v_s))
    tab = _os_tables.get(key)
    if tab is None:
        # Copied on a private stream, so that a plan made while the caller's stream is
        # being captured into a CUDA graph does not put a host copy into the graph.
        side = cupy.cuda.Stream(non_blocking=True)
        with side:
            tab = cupy.asarray(_os_table_values(key[1], key[2]))
        side.synchronize()
        if len(_os_tables) >= 64:
            _os_tables.clear()
        _os_tables[key] = tab
    return tab


class _StorePlan(NamedTuple):
    """What a store launch needs, cached per :func:`_store_key`."""

    fn: object  # the store kernel
    grid: tuple[int]
    params: np.ndarray  # 0-d StoreParams; per-call fields are set on a copy
    num_slots: np.int64
    os_tab: object  # kept alive: params holds its address
    claim: object  # claim pre-pass kernel (more than FP4C_SCAN_MAX_TOKENS tokens, no promise)
    after_claim: object  # PDL launch of the store after the claim pass, or None


# Store launch plans, keyed by everything they depend on, so that a decode step costs one
# dict lookup + one launch.
_store_plans: dict = {}


def _store_key(buffer, slots, k, v, geom, rule, k_s, k_g, v_s, v_g, unique_slots):
    return (geom, buffer.shape[0], buffer.data.ptr & 15, k.data.ptr & 15, v.data.ptr & 15,
            k.strides, v.strides, k.shape[0], k.dtype, slots.dtype, rule, float(k_s),
            float(k_g), float(v_s), float(v_g), cupy.cuda.runtime.getDevice(), unique_slots)


def _store_plan(key, buffer, slots, k, v, geom, rule, k_s, k_g, v_s, v_g, unique_slots=False):
    n = k.shape[0]
    pa = _page_args(geom, buffer.shape[0])
    es = k.itemsize
    kst, vst = k.strides, v.strides
    vec = (pa["side_ok"] and buffer.data.ptr % 8 == 0
           and _aligned(k.data.ptr, kst[0], kst[1]) and _aligned(v.data.ptr, vst[0], vst[1]))
    sl = _index_name(slots.dtype, "slot_mapping")
    G, H = geom.head_dim // GROUP, geom.num_heads
    pair = H % 2 == 0 and (k.itemsize, rule) in STORE_PAIR
    fn = _kernel(K.store_spec(_dtype_name(k.dtype, "k"), rule, sl, vec, pair))
    # threads cover (token, head, group), or (token, head pair, group) with heads h, h + H/2
    hg, fg, ft = (fastdiv(H // 2 * G) if pair else pa["HG"]), pa["fG"], pa["fT"]
    half = H // 2
    pair_rows = half if geom.layout == "NHD" else half * geom.block_size
    total = n * int(hg[0])
    # duplicate slots: none promised or possible (0), scan the later tokens (1) or claim
    # pass (2)
    dedup = 0 if unique_slots or n == 1 else 1 if n <= _scan_max_tokens() else 2
    os_tab = _os_table(k_s, v_s)
    params = np.array((0, 0, 0, 0, kst[0] // es, kst[1] // es, vst[0] // es,
                       vst[1] // es,
                       pa["num_slots"], pa["side"], pa["data"], os_tab.data.ptr,
                       half * kst[1], half * vst[1], n, total,
                       hg[0], hg[1], hg[2], fg[0], fg[1], fg[2], ft[0], ft[1], ft[2],
                       pa["H"], pa["nhd"], pa["swz"], dedup, pa["swz_m"], pair_rows, 0,
                       k_s, k_g, v_s, v_g,
                       _PACK_MULTIPLIERS),
                      dtype=STORE_PARAMS_DTYPE)
    per = _THREADS * (1 if pair else K.tuning("FP4C_STORE_ITEMS"))
    grid = (total + per - 1) // per
    claim = after_claim = None
    if dedup == 2:
        claim = _kernel(K.claim_spec(sl))
        # the store may start during the claim pass (its loads overlap it): sm_90+
        if STORE_PDL:
            after_claim = _pdl.launcher(fn, grid, _THREADS, params.copy(), 3)
    plan = _StorePlan(fn, (grid,), params, pa["num_slots"], os_tab, claim, after_claim)
    if len(_store_plans) > 4096:
        _store_plans.clear()
    _store_plans[key] = plan
    return plan


def store(buffer, slot_mapping, k, v, *, geom: PageGeometry, rule, k_s, k_g, v_s, v_g,
          stats, unique_slots: bool = False) -> None:
    """Quantize K/V ``[N, H, D]`` and scatter them into the page pool ``buffer``."""
    n = k.shape[0]
    if n == 0:
        return
    slots = slot_mapping if slot_mapping.flags.c_contiguous else \
        cupy.ascontiguousarray(slot_mapping)
    key = _store_key(buffer, slots, k, v, geom, rule, k_s, k_g, v_s, v_g, unique_slots)
    plan = _store_plans.get(key)
    if plan is None:
        pa = _page_args(geom, buffer.shape[0])
        max_tokens = _MAX_THREADS // int(pa["HG"][0])
        if n > max_tokens:  # later chunks overwrite earlier ones: the last occurrence wins
            for a in range(0, n, max_tokens):
                b = min(n, a + max_tokens)
                store(buffer, slots[a:b], k[a:b], v[a:b], geom=geom, rule=rule, k_s=k_s,
                      k_g=k_g, v_s=v_s, v_g=v_g, stats=stats, unique_slots=unique_slots)
            return
        plan = _store_plan(key, buffer, slots, k, v, geom, rule, k_s, k_g, v_s, v_g,
                           unique_slots)
    if plan.claim is None:
        p = plan.params.copy()
        p["buffer"] = buffer.data.ptr
        p["stats"] = stats.data.ptr
        plan.fn(plan.grid, _BLOCK, (slots, k, v, p[()]))
        return
    stream = cupy.cuda.get_current_stream()
    captured = _pdl.capturing(stream)
    table, epoch, e_host = _claim_state(int(plan.num_slots), captured)
    plan.claim(_blocks(n), _BLOCK, (slots, table, epoch, _U32(n), plan.num_slots,
                                    _U32(e_host)))
    if plan.after_claim is not None and not captured:
        plan.after_claim(stream.ptr, (slots.data.ptr, k.data.ptr, v.data.ptr),
                         {"buffer": buffer.data.ptr, "stats": stats.data.ptr,
                          "claim": table.data.ptr, "epoch": epoch.data.ptr,
                          "epoch_host": e_host})
        return
    p = plan.params.copy()
    p["buffer"] = buffer.data.ptr
    p["stats"] = stats.data.ptr
    p["claim"] = table.data.ptr
    p["epoch"] = epoch.data.ptr
    p["epoch_host"] = e_host
    plan.fn(plan.grid, _BLOCK, (slots, k, v, p[()]))


def store_launcher(buffer, slot_mapping, k, v, *, geom: PageGeometry, rule, k_s, k_g, v_s,
                   v_g, stats, unique_slots: bool = False):
    """A closure ``launch(slot_mapping, k, v)`` doing what :func:`store` does for arguments
    with the same shapes, strides, dtypes, pointer alignment and device, or ``None``.

    Only single-launch stores (up to ``FP4C_SCAN_MAX_TOKENS`` tokens: a decode step) get one;
    the caller keys it on those properties and then skips every per-call lookup.
    """
    n = k.shape[0]
    if n == 0 or n > _scan_max_tokens() or not slot_mapping.flags.c_contiguous:
        return None
    key = _store_key(buffer, slot_mapping, k, v, geom, rule, k_s, k_g, v_s, v_g, unique_slots)
    plan = _store_plans.get(key)
    if plan is None:
        plan = _store_plan(key, buffer, slot_mapping, k, v, geom, rule, k_s, k_g, v_s, v_g,
                           unique_slots)
    if plan.claim is not None:
        return None
    p = plan.params.copy()
    p["buffer"] = buffer.data.ptr
    p["stats"] = stats.data.ptr
    keep = (buffer, stats)  # the struct holds their addresses
    fn, grid = plan.fn, plan.grid
    drv = _pdl.launcher(fn, grid[0], _THREADS, p, 3, pdl=False) if STORE_DRIVER_LAUNCH else None
    if drv is not None:
        current = cupy.cuda.get_current_stream

        def launch(slots, kk, vv, _keep=keep):
            drv(current().ptr, (slots.data.ptr, kk.data.ptr, vv.data.ptr))

        return launch
    p = p[()]

    def launch(slots, kk, vv, _keep=keep):
        fn(grid, _BLOCK, (slots, kk, vv, p))

    return launch


class _GatherPlan(NamedTuple):
    """What a gather launch needs for one geometry, pool and output itemsize (the one
    place that derives the gather kernel's arguments)."""

    per_page: int  # threads per page: one 16-byte output piece each
    max_pages: int  # pages per launch (32-bit thread index)
    side_vec: bool  # the pool allows the vectorized kernel (outputs must be too)
    tail: tuple  # the kernel's arguments after ``total``, typed, without k_s and v_s


def _gather_plan(buffer, geom: PageGeometry, itemsize: int) -> _GatherPlan:
    pa = _page_args(geom, buffer.shape[0])
    per_group = itemsize  # 16-byte pieces per 16-value group: 16 // (16 // itemsize)
    chunk = 16 // itemsize  # values per piece
    per_page = geom.block_size * int(pa["HG"][0]) * per_group
    fc, fh, ft = fastdiv(pa["G"] * per_group), pa["fH"], pa["fT"]
    return _GatherPlan(
        per_page, _MAX_THREADS // per_page,
        geom.side_bytes % (chunk // 2) == 0 and buffer.data.ptr % (chunk // 2) == 0,
        (*fc, *fh, *ft, pa["nhd"], pa["swz"], pa["swz_m"], pa["num_blocks"], pa["side"],
         pa["data"]))


def _gather_vec(plan: _GatherPlan, out_k, out_v) -> bool:
    return plan.side_vec and out_k.data.ptr % 16 == 0 and out_v.data.ptr % 16 == 0


def gather_dequant(buffer, blocks, out_k, out_v, *, geom: PageGeometry, k_s, v_s,
                   stats) -> None:
    """Gather pages ``blocks`` and decode them into ``out_k``/``out_v`` ``[n*T, H, D]``."""
    n = blocks.shape[0]
    if n == 0:
        return
    plan = _gather_plan(buffer, geom, out_k.itemsize)
    if n > plan.max_pages:
        T, m = geom.block_size, plan.max_pages
        for a in range(0, n, m):
            b = min(n, a + m)
            gather_dequant(buffer, blocks[a:b], out_k[a * T:b * T], out_v[a * T:b * T],
                           geom=geom, k_s=k_s, v_s=v_s, stats=stats)
        return
    blocks = _contig(blocks)
    fn = _kernel(K.gather_spec(_dtype_name(out_k.dtype, "out_k"),
                               _index_name(blocks.dtype, "blocks"),
                               _gather_vec(plan, out_k, out_v)))
    total = n * plan.per_page
    fn(_decode_blocks(total), _BLOCK, (buffer, blocks, out_k, out_v, stats, _U32(total),
                                       *plan.tail, _F32(k_s), _F32(v_s)))


def gather_launcher(buffer, blocks, out_k, *, geom: PageGeometry, k_s, v_s, stats):
    """A closure ``launch(blocks, out_k, out_v)`` doing what :func:`gather_dequant` does
    for block-id arrays of ``blocks``' dtype and outputs of ``out_k``'s dtype, any length
    and alignment, with the arguments packed once per kernel variant (``None`` without the
    driver entry point).  The caller keys it on what it validated."""
    if not GATHER_DRIVER_LAUNCH:
        return None
    import ctypes

    plan = _gather_plan(buffer, geom, out_k.itemsize)
    dt = _dtype_name(out_k.dtype, "out_k")
    ix = _index_name(blocks.dtype, "blocks")
    as_ctype = {np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.int64): ctypes.c_int64}
    ptr = ctypes.c_uint64
    tail = [as_ctype[np.asarray(x).dtype](int(x)) for x in plan.tail]
    prepared = {}
    for vec in (True, False):
        args = [ptr(buffer.data.ptr), ptr(0), ptr(0), ptr(0), ptr(stats.data.ptr),
                ctypes.c_uint32(0), *tail, ctypes.c_float(float(_F32(k_s))),
                ctypes.c_float(float(_F32(v_s)))]
        prepared[vec] = _pdl.args_launcher(_kernel(K.gather_spec(dt, ix, vec)), _THREADS, args)
        if prepared[vec] is None:
            return None
    keep = (buffer, stats)  # the prepared arguments hold their addresses
    current = cupy.cuda.get_current_stream

    def launch(blocks, out_k, out_v, _keep=keep):
        n = blocks.shape[0]
        if n == 0:
            return
        if n > plan.max_pages or not blocks.flags.c_contiguous:
            gather_dequant(buffer, blocks, out_k, out_v, geom=geom, k_s=k_s, v_s=v_s,
                           stats=stats)
            return
        total = n * plan.per_page
        prepared[_gather_vec(plan, out_k, out_v)](
            current().ptr, _decode_blocks(total)[0],
            (buffer.data.ptr, blocks.data.ptr, out_k.data.ptr, out_v.data.ptr,
             stats.data.ptr, total))

    return launch


#: Prepared gathers launch through cuLaunchKernelEx with their arguments packed once.
GATHER_DRIVER_LAUNCH = True


# -- LongLive ------------------------------------------------------------------------------
def _num_sms() -> int:
    dev = cupy.cuda.runtime.getDevice()
    n = _SMS.get(dev)
    if n is None:
        n = int(cupy.cuda.Device(dev).attributes["MultiProcessorCount"])
        _SMS[dev] = n
    return n


_SMS: dict[int, int] = {}


def _amax_into(x, amax_out) -> bool:
    """Queue ``amax_out[0] = max |x|`` (NaN if ``x`` holds a NaN or an infinity) for a
    C-contiguous bf16/f16/f32 ``x``: a memset and one reduction kernel.  Returns whether
    the vector kernel variant was used (``x`` 16-byte aligned)."""
    dt = _dtype_name(x.dtype, "x")
    stream = cupy.cuda.get_current_stream()
    cupy.cuda.runtime.memsetAsync(amax_out.data.ptr, 0, 4, stream.ptr)
    n = x.size
    vec = _aligned(x.data.ptr)
    if n:
        chunks = max(1, n // 8)
        grid = min((chunks + _THREADS - 1) // _THREADS, 8 * _num_sms())
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
    dt = _dtype_name(x.dtype, "x")
    total = Rp * G
    if total >= _MAX_THREADS:  # checked before any work is queued
        raise ValueError(f"LongLive block too large: {Rp} rows x {G} groups")
    vec = _amax_into(x, amax_out)
    vec_q = vec and _aligned(values_out.data.ptr, to=8)
    fg = fastdiv(G)
    _kernel(K.ll_quantize_spec(dt, rule, vec_q))(_blocks(total), (_THREADS,), (
        x, amax_out, values_out, sf_out, _U32(total), _U32(R), fg[0], fg[1], fg[2]))


#: numpy twin of ``struct LLSource`` in ``kernels/longlive.cu`` (same field order).
LL_SOURCE_DTYPE = np.dtype(
    [(f, np.uint64) for f in ("value_ptrs", "sf_ptrs", "amax_ptrs", "ids", "vbase", "vstride",
                              "sbase", "sstride", "abase", "astride")]
    + [("n_pool", np.int64), ("ids64", np.uint32)],
    align=True,
)


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
                0, 0, 0, 0, 0, 0, 0, 0, 0)

    run = _ll_plan(source, tabs[0].shape[0], D, out_dtype, out_aligned, num_heads,
                   block_token_size, inv_denom, values_aligned)
    run.keep = tabs  # the structs hold the tables' addresses
    return run


# Device pointer tables of the list API, keyed by (device, the blocks' pointers): a
# decode loop that passes the same blocks again reuses them (no host-to-device copy).
# The key is the table's whole content, so a hit is always right.
_ll_tables: OrderedDict = OrderedDict()
_LL_TABLES_MAX = 64


def longlive_pointer_tables(vals, sfs, ams):
    """uint64 ``[3, n]`` device array of the blocks' pointers (cached by content)."""
    ptrs = tuple(tuple(a.data.ptr for a in group) for group in (vals, sfs, ams))
    key = (cupy.cuda.runtime.getDevice(), ptrs)
    tab = _ll_tables.get(key)
    if tab is None:
        tab = cupy.asarray(np.array(ptrs, dtype=np.uint64))
        _ll_tables[key] = tab
        if len(_ll_tables) > _LL_TABLES_MAX:
            _ll_tables.popitem(last=False)
    else:
        _ll_tables.move_to_end(key)
    return tab


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
                scale_factors.strides[0], am.data.ptr, am.strides[0], N, int(ids64))

    aligned = values.data.ptr % 16 == 0 and values.strides[0] % 16 == 0
    run = _ll_plan(source, ids.shape[0], D, out_dtype, out_aligned, num_heads,
                   block_token_size, inv_denom, aligned)
    if ids is not block_ids:
        run.keep = ids  # our contiguous copy: the struct holds its address
    return run


#: Use the wide LongLive decode kernel where it applies (bf16/f16 out, aligned blocks).
LL_WIDE = True


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
        dt = _dtype_name(out_dtype, "out")
        if LL_WIDE and aligned and itemsize == 2 and out_aligned and R * C < 2**31 - 8192:
            fn = _kernel(K.ll_decode_wide_spec(dt))
            per_cta = 1024 * K.tuning("FP4C_LL_WIDE_TILES")
            gx = (R * C + per_cta - 1) // per_cta
            for a in range(0, nb, 65535):  # grid y: one block each
                b = min(nb, a + 65535)
                src = np.array(source(a, b), dtype=LL_SOURCE_DTYPE)[()]
                launches.append((fn, (gx, b - a), src, a, b,
                                 (_U32(R * C), fc[0], fc[1], fc[2], _F32(inv_denom))))
        else:
            per = max(1, (_MAX_THREADS - 1) // (R * C))  # blocks per launch (32-bit ids)
            frc = fastdiv(R * C)
            fn = _kernel(K.ll_decode_spec(dt, out_aligned))
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
