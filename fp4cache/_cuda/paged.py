"""The store, the gather and the flat codec of the CuPy backend.

:func:`store_plan` and :func:`gather_plan` prepare one launch sequence from everything it
depends on (shapes, strides, dtypes, pointer alignment, the state's device and buffers):
a plan is an immutable callable, so a decode step costs one dictionary lookup and one
kernel launch of host time, and two threads may share plans and a stream.  Plans hold no
device memory of their own: what a kernel needs between calls lives in the
:class:`~fp4cache._cuda.state.DevicePool`.  Nothing here synchronizes with the host or
allocates once a plan exists, so calls can be captured in CUDA graphs.  Non-contiguous
K/V (any token and head strides) are read in place; pointers or strides that are not
16-byte aligned select the ``_scalar`` kernel variants.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import lru_cache

import numpy as np

from .. import _abi
from .. import _kernels as K
from .._device import by_value
from ..layout import GROUP, PageGeometry
from .launch import BLOCK, MAX_THREADS, THREADS, aligned, contig, decode_grid, grid_of, index_name
from .state import DevicePool

__all__ = ["quantize", "dequantize", "store_plan", "store", "gather_plan", "gather_dequant",
           "STORE_PARAMS_DTYPE", "GATHER_PARAMS_DTYPE"]

_U64 = np.uint64
_U32 = np.uint32
_I64 = np.int64
_F32 = np.float32
fastdiv = _abi.fastdiv


# -- flat codec ----------------------------------------------------------------------------
def quantize(x, s, g, rule, data_out, scales_out) -> None:
    """Quantize ``x [N, D]`` into ``data_out [N, D/2]``, ``scales_out [N, D/16]``."""
    n, d = x.shape
    total = n * (d // GROUP)
    if total == 0:
        return
    x = contig(x)
    vec = aligned(x.data.ptr) and aligned(data_out.data.ptr, to=8)
    fn = K.get_kernel(K.quantize_spec(K.value_type(x.dtype, "x"), rule, vec))
    fn(grid_of(total), BLOCK, (x, data_out, scales_out, _U64(total), _F32(s), _F32(g)))


def dequantize(data, scales, s, out) -> None:
    """Decode ``data [N, D/2]``, ``scales [N, D/16]`` into ``out [N, D]``."""
    n, half = data.shape
    total = n * (2 * half // GROUP)
    if total == 0:
        return
    chunk = 16 // out.itemsize  # values per thread (one 16-byte output piece)
    vec = aligned(data.data.ptr, to=chunk // 2) and aligned(out.data.ptr)
    spec = K.dequantize_spec(K.value_type(out.dtype, "out"), vec)
    fn = K.get_kernel(spec)
    threads = total * (16 // chunk)
    fn(decode_grid(threads), BLOCK,
       (contig(data), contig(scales), out, _U64(threads), _F32(s)))


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


#: A store with rotation or window gives a thread two heads (``K.STORE_PAIR``) from this
#: many groups (``N * H * G``) on: the H200 measured, bf16 H=8 D=128 static6, 3.9 us one head
#: against 5.2 us two heads per thread at 64 tokens, 40.1 against 39.0 us at 16384 tokens.
PAIR_MIN_ITEMS = 1 << 19


def _noop(*args) -> None:
    return None


def rotation_scale(head_dim: int) -> np.float32:
    """``fl32(1 / sqrt(D))``, the last step of the rotation (as
    :func:`fp4cache.formats.hadamard`)."""
    return _F32(1.0 / np.sqrt(head_dim))


def store_plan(st: DevicePool, slots, k, v, *, rule: str, unique_slots: bool) -> Callable:
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
    rot = st.rotated
    # two heads per thread where they pay: a rotating or windowed store of few tokens is
    # latency-bound and runs faster with one head per thread (bench/window_store.py)
    pair = (H % 2 == 0 and (dt, rule) in K.STORE_PAIR
            and (not (rot or st.window is not None) or n * H * G >= PAIR_MIN_ITEMS))
    hg = fastdiv(H // 2 * G) if pair else pa["HG"]
    max_tokens = MAX_THREADS // int(hg[0])
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
           and aligned(k.data.ptr, kst[0], kst[1]) and aligned(v.data.ptr, vst[0], vst[1]))
    sl = index_name(slots.dtype, "slot_mapping")
    win = st.window
    spec = K.store_spec(dt, rule, sl, vec, pair, rot=rot, win=win is not None)
    fn = K.get_kernel(spec)
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
            ("pk", _PACK_MULTIPLIERS), ("rot_scale", rotation_scale(geom.head_dim))):
        p[name] = value
    if win is not None:  # the exact window (store_window in kernels/paged_kv.cu)
        p["win"], p["win_map"] = win.data.ptr, st.window_map.data.ptr
        p["win_slots"] = win.shape[0]
    params = by_value(p)
    grid = grid_of(total)  # one item per thread
    keep = st  # the struct holds the state's addresses

    if dedup != 2:
        def run(slots, k, v, _keep=keep):
            fn(grid, BLOCK, (slots, k, v, params))

        return run
    claim = K.get_kernel(K.claim_spec(sl))
    clear = K.get_kernel(K.clear_spec(sl))
    cgrid, table, nt, ns = grid_of(n), st.claim, _U32(n), pa["num_slots"]

    def run_claimed(slots, k, v, _keep=keep):
        claim(cgrid, BLOCK, (slots, table, nt, ns))
        fn(grid, BLOCK, (slots, k, v, params))
        clear(cgrid, BLOCK, (slots, table, nt, ns))

    return run_claimed


def _pool_over(buffer, geom: PageGeometry, k_s, v_s, stats, rotate: bool, **kw) -> DevicePool:
    """A pool over ``buffer`` and ``stats`` for one functional call."""
    return DevicePool(sys.modules[__package__], buffer.data.device_id, geom, k_s, v_s,
                      pages=buffer, stats=stats, rotation="hadamard" if rotate else "none",
                      **kw)


def store(buffer, slot_mapping, k, v, *, geom: PageGeometry, rule, k_s, k_g, v_s, v_g, stats,
          unique_slots: bool = False, rotate: bool = False, window=None) -> None:
    """The functional form of the protocol (as in the NumPy backend; tests, benchmarks):
    store into ``buffer``/``stats`` through a :class:`DevicePool` made for this call (it
    allocates and uploads tables: not for CUDA-graph capture, which needs the owner's
    state, :class:`~fp4cache.PagedKVCache`).  ``rotate``: K rotated first; ``window``:
    ``(slots, map)`` of an exact window (cupy uint16 ``(S, 2, T, H, D)``, int32
    ``(num_blocks,)``)."""
    st = _pool_over(buffer, geom, k_s, v_s, stats, rotate, k_g=k_g, v_g=v_g)
    if window is not None:
        st.window, st.window_map = window
    slots = contig(slot_mapping)
    store_plan(st, slots, k, v, rule=rule, unique_slots=unique_slots)(slots, k, v)


def gather_dequant(buffer, blocks, out_k, out_v, *, geom: PageGeometry, k_s, v_s,
                   stats, rotate: bool = False) -> None:
    """The functional form of the gather (as in the NumPy backend; tests, benchmarks;
    ``rotate``: K turned back to the original basis)."""
    st = _pool_over(buffer, geom, k_s, v_s, stats, rotate, tables=False)
    blocks = contig(blocks)
    gather_plan(st, blocks, out_k, out_v)(blocks, out_k, out_v)


def gather_plan(st: DevicePool, blocks, out_k, out_v) -> Callable:
    """``run(blocks, out_k, out_v)``: gather and decode pages ``blocks`` (C-contiguous,
    any length, of ``blocks``' dtype) into C-contiguous outputs ``[n*T, H, D]`` of
    ``out_k``'s dtype, 16-byte aligned if both of these are.  A rotating cache's K comes
    back in the original basis (the ``_rot`` kernel: one thread per group)."""
    geom = st.geom
    pa = _page_args(geom, st.num_blocks)
    itemsize = out_k.itemsize
    rot = st.rotated
    chunk = 16 // itemsize  # values per 16-byte output piece; itemsize pieces per group
    per_page = geom.block_size * int(pa["HG"][0]) * itemsize
    max_pages = MAX_THREADS // per_page
    if rot:  # 8-byte code loads, 16-byte stores of the 32 or 64 output bytes of a group
        vec = (geom.side_bytes % 8 == 0 and st.buffer.data.ptr % 8 == 0
               and out_k.data.ptr % 16 == 0 and out_v.data.ptr % 16 == 0)
    else:
        vec = (geom.side_bytes % (chunk // 2) == 0 and st.buffer.data.ptr % (chunk // 2) == 0
               and out_k.data.ptr % 16 == 0 and out_v.data.ptr % 16 == 0)
    spec = K.gather_spec(K.value_type(out_k.dtype, "out_k"), index_name(blocks.dtype, "blocks"),
                         vec, rot=rot)
    fn = K.get_kernel(spec)
    fc = pa["fG"] if rot else fastdiv(pa["G"] * itemsize)
    fh, ft = pa["fH"], pa["fT"]
    p = np.zeros((), dtype=GATHER_PARAMS_DTYPE)
    for name, value in (
            ("buffer", st.buffer.data.ptr), ("stats", st.stats.data.ptr),
            ("num_blocks", pa["num_blocks"]), ("side_bytes", pa["side"]),
            ("data_bytes", pa["data"]), ("c", fc), ("h", fh), ("t", ft),
            ("nhd", pa["nhd"]), ("swizzle", pa["swz"]),
            ("swz_m", pa["swz_m"]), ("k_s", st.scalars[0]), ("v_s", st.scalars[2]),
            ("rot_scale", rotation_scale(geom.head_dim))):
        p[name] = value
    params = by_value(p)
    T = geom.block_size
    if rot:  # one group per thread
        per_page = geom.block_size * int(pa["HG"][0])
        per_cta = THREADS
    else:
        per_cta = THREADS * _abi.DECODE_CHUNKS

    def run(blocks, out_k, out_v, _keep=st):
        n = blocks.shape[0]
        if n <= max_pages:
            total = n * per_page
            if total:
                fn(((total + per_cta - 1) // per_cta,), BLOCK,
                   (blocks, out_k, out_v, _U32(total), params))
            return
        for a in range(0, n, max_pages):
            run(blocks[a:a + max_pages], out_k[a * T:(a + max_pages) * T],
                out_v[a * T:(a + max_pages) * T])

    return run
