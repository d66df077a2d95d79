"""LongLive's NVFP4 blocks on the GPU: the absolute maximum, the block quantize and the
decode of block lists and pools (one launch per call, prepared once per signature)."""

from __future__ import annotations

import cupy
import numpy as np

from .. import _abi
from .. import _kernels as K
from .._device import num_sms
from ..layout import GROUP
from .launch import BLOCK, MAX_THREADS, THREADS, aligned, contig, decode_grid, grid_of

__all__ = ["abs_max", "longlive_quantize", "longlive_dequantize", "longlive_pointer_tables",
           "longlive_list_launcher", "longlive_pool_launcher", "LL_SOURCE_DTYPE"]

_U64 = np.uint64
_U32 = np.uint32
_F32 = np.float32
fastdiv = _abi.fastdiv


def _amax_into(x, amax_out) -> bool:
    """Queue ``amax_out[0] = max |x|`` (NaN if ``x`` holds a NaN or an infinity) for a
    C-contiguous bf16/f16/f32 ``x``: a memset and one reduction kernel.  Returns whether
    the vector kernel variant was used (``x`` 16-byte aligned)."""
    dt = K.value_type(x.dtype, "x")
    stream = cupy.cuda.get_current_stream()
    cupy.cuda.runtime.memsetAsync(amax_out.data.ptr, 0, 4, stream.ptr)
    n = x.size
    vec = aligned(x.data.ptr)
    if n:
        chunks = max(1, n // 8)
        grid = min((chunks + THREADS - 1) // THREADS, 8 * num_sms())
        K.get_kernel(K.ll_amax_spec(dt, vec))((grid,), (THREADS,), (x, amax_out, _U64(n)))
    return vec


def abs_max(x) -> np.float32:
    """``max |x|`` in float32 (NaN if ``x`` holds a NaN or an infinity; 0 if empty).

    One reduction kernel on the current stream, then a 4-byte device-to-host copy: this
    synchronizes with the stream (the result is a host number)."""
    amax = cupy.empty((1,), dtype=np.float32)
    _amax_into(contig(x), amax)
    return np.float32(amax.get()[0])


def longlive_quantize(x, rule, values_out, sf_out, amax_out) -> None:
    """Quantize one block ``x [Tb, H, D]`` into the blocked layout (amax on the device)."""
    Tb, H, D = x.shape
    x = contig(x)
    G = D // GROUP
    R = Tb * H
    Rp = values_out.shape[0]
    dt = K.value_type(x.dtype, "x")
    total = Rp * G
    if total >= MAX_THREADS:  # checked before any work is queued
        raise ValueError(f"LongLive block too large: {Rp} rows x {G} groups")
    vec = _amax_into(x, amax_out)
    vec_q = vec and aligned(values_out.data.ptr, to=8)
    fg = fastdiv(G)
    K.get_kernel(K.ll_quantize_spec(dt, rule, vec_q))(grid_of(total), (THREADS,), (
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
    tabs = [contig(a) for a in (value_ptrs, sf_ptrs, amax_ptrs)]

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
    ids = contig(block_ids)
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
            fn = K.get_kernel(spec)
            per_cta = 1024 * _abi.LL_WIDE_TILES
            gx = (R * C + per_cta - 1) // per_cta
            for a in range(0, nb, 65535):  # grid y: one block each
                b = min(nb, a + 65535)
                src = np.array(source(a, b), dtype=LL_SOURCE_DTYPE)[()]
                launches.append((fn, (gx, b - a), src, a, b,
                                 (_U32(R * C), fc[0], fc[1], fc[2], _F32(inv_denom))))
        else:
            per = max(1, (MAX_THREADS - 1) // (R * C))  # blocks per launch (32-bit ids)
            frc = fastdiv(R * C)
            spec = K.ll_decode_spec(dt, out_aligned)
            fn = K.get_kernel(spec)
            for a in range(0, nb, per):
                b = min(nb, a + per)
                threads = (b - a) * R * C
                src = np.array(source(a, b), dtype=LL_SOURCE_DTYPE)[()]
                launches.append((fn, decode_grid(threads), src, a, b,
                                 (_U32(threads), frc[0], frc[1], frc[2], fc[0], fc[1], fc[2],
                                  _F32(inv_denom))))

    if len(launches) == 1:
        fn, grid, src, _, _, rest = launches[0]

        def run(out):
            fn(grid, BLOCK, (src, out) + rest)
    else:
        def run(out):
            for fn, grid, src, a, b, rest in launches:
                fn(grid, BLOCK, (src, out[:, a * Tb:b * Tb]) + rest)
    return run
