"""LongLive / fouroversix interop: per-block amax NVFP4 in cuBLAS' blocked scale layout.

One cache block of ``Tb`` tokens and ``H`` heads is a ``[Rp, D/2]`` matrix of packed
E2M1 values (row ``r = t*H + h``, ``Rp`` = ``Tb*H`` rounded up to 128, padding rows
zero), ``Rp*D/16`` E4M3 scale bytes in the 128x4 tile order of
:func:`fp4cache.layout.blocked_scale_offset`, and one float32 ``amax``.  This is what
LongLive's ``dequantize_kv_cache_fp4`` reads; :func:`dequantize` has the same arguments
and result, for any ``D`` that is a multiple of 64.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _arrays
from .codec import backend_module, check_rule
from .formats import resolve_dtype
from .layout import GROUP, longlive_padded_rows

__all__ = ["quantize_block", "dequantize", "dequantize_pool", "inverse_global_denominator"]


def inverse_global_denominator(e2m1_max: float = 6.0, e4m3_max: float = 256.0) -> np.float32:
    """``fl(1 / fl(e2m1_max * e4m3_max))`` in float32 (LongLive's global-scale divisor)."""
    for name, val in (("e2m1_max", e2m1_max), ("e4m3_max", e4m3_max)):
        _arrays.check_scale(val, name)
    return np.float32(1.0) / (np.float32(e2m1_max) * np.float32(e4m3_max))


def _check_head_dim(d: int, name: str) -> None:
    if d <= 0 or d % 64:
        raise ValueError(f"{name} must be a positive multiple of 64 for the LongLive layout, "
                         f"got {d}")


def quantize_block(x: Any, scale_rule: str = "4over6"):
    """Quantize one cache block ``x [Tb, H, D]`` with a per-block amax.

    Parameters
    ----------
    x : ndarray, shape (Tb, H, D), bfloat16, float16 or float32
        NumPy or CuPy array; ``D`` a multiple of 64.
    scale_rule : {"4over6", "static6"}
        ``"4over6"`` uses ``e4m3_max = 256`` (read back with the default
        ``e4m3_max=256.0``); ``"static6"`` uses 448 (read back with ``e4m3_max=448.0``).

    Returns
    -------
    values : uint8, shape (Rp, D/2)
    scale_factors : uint8, shape (Rp*D/16,)
        E4M3 bytes in the 128x4 blocked order.
    amax : float32, shape (1,)
        ``max |x|`` over the block (NaN if the block holds a NaN or infinity, in which
        case every scale is NaN and the block decodes to NaN).
    """
    backend = _arrays.backend_of(x)
    x = _arrays.to_backend(x, backend, "x")
    _arrays.check_values(x, "x", (None, None, None))
    Tb, H, D = x.shape
    if Tb == 0 or H == 0:
        raise ValueError(f"x must have at least one token and one head, got shape {x.shape}")
    _check_head_dim(D, "x.shape[2] (head_dim)")
    check_rule(scale_rule)
    xp = _arrays.array_module(backend)
    Rp = longlive_padded_rows(Tb, H)
    values = xp.empty((Rp, D // 2), dtype=np.uint8)
    sf = xp.empty((Rp * (D // GROUP),), dtype=np.uint8)
    amax = xp.empty((1,), dtype=np.float32)
    backend_module(backend).longlive_quantize(xp.ascontiguousarray(x), scale_rule, values, sf,
                                              amax)
    return values, sf, amax


def dequantize(values: Sequence[Any], scale_factors: Sequence[Any], amax: Sequence[Any],
               num_heads: int, block_token_size: int, dtype: Any = "bfloat16",
               e2m1_max: float = 6.0, e4m3_max: float = 256.0):
    """Decode LongLive cache blocks, like LongLive's ``dequantize_kv_cache_fp4``.

    Parameters
    ----------
    values : sequence of uint8 arrays, each (Rp, D/2)
    scale_factors : sequence of uint8/float8_e4m3fn arrays, each with Rp*D/16 bytes
    amax : sequence of float32 arrays, each (1,)
    num_heads, block_token_size : int
        ``H`` and ``Tb``.
    dtype : {"bfloat16", "float16", "float32"}
    e2m1_max, e4m3_max : float
        The global scale is ``amax * fl(1/fl(e2m1_max*e4m3_max))``.

    Returns
    -------
    ndarray, shape (1, len(values)*Tb, H, D)
        ``x = fl(fl(e2m1 * sf) * fl(amax * inv))`` rounded to ``dtype``.

    On the GPU the per-block pointers go through one small host-to-device copy, made
    once per distinct list of blocks (the device tables are cached by content);
    :func:`dequantize_pool` needs none.
    """
    key = None
    if all(isinstance(x, (list, tuple)) for x in (values, scale_factors, amax)):
        key = _signature("list", (*values, *scale_factors, *amax), num_heads,
                         block_token_size, dtype, e2m1_max, e4m3_max, None, len(values),
                         len(scale_factors))
    hit = _FAST.get(key) if key is not None else None
    if hit is not None:  # same arrays as a validated earlier call: launch straight away
        run, shape, dt = hit
        out = _arrays.array_module("cuda").empty(shape, dtype=dt)
        run(out)
        return out
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError("values must be a non-empty list of per-block arrays")
    if not (len(values) == len(scale_factors) == len(amax)):
        raise ValueError(
            "values, scale_factors and amax must have the same length, got "
            f"{len(values)}, {len(scale_factors)}, {len(amax)}"
        )
    H, Tb = _check_counts(num_heads, block_token_size)
    dt = resolve_dtype(dtype)
    inv = inverse_global_denominator(e2m1_max, e4m3_max)
    backend = _arrays.backend_of(values[0])
    vals = [_arrays.to_backend(a, backend, f"values[{i}]") for i, a in enumerate(values)]
    sfs = [_arrays.as_scale_bytes(_arrays.to_backend(a, backend, name), name)
           for name, a in ((f"scale_factors[{i}]", a) for i, a in enumerate(scale_factors))]
    ams = [_arrays.to_backend(a, backend, f"amax[{i}]") for i, a in enumerate(amax)]
    Rp, D = _check_block_arrays(vals, sfs, ams, H, Tb)
    xp = _arrays.array_module(backend)
    out = xp.empty((1, len(vals) * Tb, H, D), dtype=dt)
    impl = backend_module(backend)
    if backend == "cpu":
        impl.longlive_dequantize(vals, sfs, ams, out, num_heads=H, block_token_size=Tb,
                                 inv_denom=inv)
    else:
        for name, group in (("values", vals), ("scale_factors", sfs), ("amax", ams)):
            for i, a in enumerate(group):
                if not a.flags.c_contiguous:
                    raise ValueError(f"{name}[{i}] must be C-contiguous")
        # The three pointer tables: one small host-to-device copy, skipped when the same
        # blocks were decoded recently (the device tables are cached by content).
        run = impl.longlive_list_launcher(vals, sfs, ams, D, out.dtype, True, num_heads=H,
                                          block_token_size=Tb, inv_denom=inv)
        run(out)
        _remember(key, (run, out.shape, out.dtype))
    return out


def dequantize_pool(values: Any, scale_factors: Any, amax: Any, block_ids: Any,
                    num_heads: int, block_token_size: int, dtype: Any = "bfloat16",
                    e2m1_max: float = 6.0, e4m3_max: float = 256.0, *, out: Any = None):
    """Decode blocks ``block_ids`` of a pool of LongLive blocks.

    Parameters
    ----------
    values : uint8, shape (N, Rp, D/2)
    scale_factors : uint8 or float8_e4m3fn, shape (N, Rp*D/16)
    amax : float32, shape (N,) or (N, 1)
    block_ids : int32/int64, shape (n,)
        Blocks to decode, in output order, in ``[0, N)``.  The CPU raises
        ``IndexError`` for an id outside it; the GPU reads nothing for such an id and
        writes NaN for its tokens (no host synchronization).
    out : ndarray, optional
        ``(1, n*Tb, H, D)`` output.

    On the GPU this is one kernel launch: no host synchronization, and with ``out`` no
    allocation, so it can be captured in a CUDA graph.
    """
    key = _signature("pool", (values, scale_factors, amax, block_ids), num_heads,
                     block_token_size, dtype, e2m1_max, e4m3_max, out)
    hit = _FAST.get(key) if key is not None else None
    if hit is not None:  # same arrays as a validated earlier call: launch straight away
        run, shape, dt = hit
        if out is None:
            out = _arrays.array_module("cuda").empty(shape, dtype=dt)
        run(out)
        return out
    H, Tb = _check_counts(num_heads, block_token_size)
    backend = _arrays.backend_of(values)
    values = _arrays.to_backend(values, backend, "values")
    scale_factors = _arrays.as_scale_bytes(
        _arrays.to_backend(scale_factors, backend, "scale_factors"), "scale_factors")
    amax = _arrays.to_backend(amax, backend, "amax")
    ids = _arrays.to_backend(block_ids, backend, "block_ids", allow_convert=True)
    _arrays.check_index_array(ids, "block_ids")
    if values.ndim != 3:
        raise ValueError(f"values must be 3-D (N, Rp, D/2), got shape {values.shape}")
    N = values.shape[0]
    if scale_factors.ndim != 2 or scale_factors.shape[0] != N:
        raise ValueError(f"scale_factors must be 2-D (N={N}, Rp*D/16), got {scale_factors.shape}")
    if amax.dtype != np.float32 or amax.size != N:
        raise ValueError(f"amax must be float32 with N={N} entries, got {amax.dtype} {amax.shape}")
    Rp, D = _check_block_arrays([values[0]], [scale_factors[0]], [amax.reshape(N, 1)[0]], H, Tb)
    inv = inverse_global_denominator(e2m1_max, e4m3_max)
    n = ids.shape[0]
    shape = (1, n * Tb, H, D)
    xp = _arrays.array_module(backend)
    if out is None:
        out = xp.empty(shape, dtype=resolve_dtype(dtype))
    else:
        out = _arrays.check_out(out, "out", shape, resolve_dtype(out.dtype, name="out.dtype"),
                                backend)
    if n == 0:
        return out
    impl = backend_module(backend)
    if backend == "cpu":
        if int(ids.min()) < 0 or int(ids.max()) >= N:
            raise IndexError(f"block_ids must be in [0, {N}), got min {int(ids.min())} "
                             f"max {int(ids.max())}")
        idl = [int(i) for i in ids]
        impl.longlive_dequantize([values[i] for i in idl], [scale_factors[i] for i in idl],
                                 [amax.reshape(N, 1)[i] for i in idl], out, num_heads=H,
                                 block_token_size=Tb, inv_denom=inv)
        return out
    for name, a in (("values", values), ("scale_factors", scale_factors), ("amax", amax)):
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
    run = impl.longlive_pool_launcher(values, scale_factors, amax, ids, D, out.dtype,
                                      out.data.ptr % 16 == 0, num_heads=H,
                                      block_token_size=Tb, inv_denom=inv)
    run(out)
    if ids is block_ids and ids.flags.c_contiguous:  # the launch reads block_ids itself
        _remember(key, (run, out.shape, out.dtype))
    return out


# Prepared GPU launches of dequantize / dequantize_pool, keyed by everything the checks
# and the launch depend on: the type, address, shape, strides and dtype of every array,
# the counts (with their types), the dtype and maxima, and the device.  A call with the
# same signature as an earlier validated one skips the checks and launches at once
# (the kernels read the arrays' current contents, so new data is decoded).  Entries
# hold addresses, not the arrays: they are only used for live arrays at those addresses.
_FAST: dict = {}
_FAST_MAX = 256


def _signature(api, arrays, num_heads, block_token_size, dtype, e2m1_max, e4m3_max, out,
               *extra):
    """Hashable signature of a GPU call, or None (CPU arrays, unhashable arguments)."""
    try:
        if not arrays or not _arrays.is_cupy(arrays[0]):
            return None
        parts = [api, type(num_heads), num_heads, type(block_token_size), block_token_size,
                 type(e2m1_max), e2m1_max, type(e4m3_max), e4m3_max, extra,
                 _arrays.array_module("cuda").cuda.runtime.getDevice()]
        for a in arrays:
            parts.append((type(a), a.data.ptr, a.shape, a.strides, a.dtype))
        if out is None:
            parts.append(("new", type(dtype), dtype))
        else:
            parts.append((type(out), out.data.ptr, out.shape, out.strides, out.dtype))
        key = tuple(parts)
        hash(key)
        return key
    except (AttributeError, TypeError):
        return None


def _remember(key, entry) -> None:
    if key is None:
        return
    if len(_FAST) >= _FAST_MAX:
        _FAST.clear()
    _FAST[key] = entry


def _check_counts(num_heads, block_token_size):
    for name, val in (("num_heads", num_heads), ("block_token_size", block_token_size)):
        if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val <= 0:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    return int(num_heads), int(block_token_size)


def _check_block_arrays(vals, sfs, ams, H, Tb):
    v0 = vals[0]
    if v0.ndim != 2:
        raise ValueError(f"values[0] must be 2-D (Rp, D/2), got shape {v0.shape}")
    Rp, half = v0.shape
    D = 2 * half
    _check_head_dim(D, "head_dim (2*values[0].shape[1])")
    if Rp % 128 or Rp < Tb * H:
        raise ValueError(
            f"values rows must be a multiple of 128 and >= block_token_size*num_heads "
            f"({Tb * H}), got {Rp}"
        )
    S = D // GROUP
    for i, (v, sf, am) in enumerate(zip(vals, sfs, ams)):
        if v.dtype != np.uint8:
            raise TypeError(f"values[{i}] must have dtype uint8, got {v.dtype}")
        if tuple(v.shape) != (Rp, half):
            raise ValueError(f"values[{i}] must have shape {(Rp, half)}, got {tuple(v.shape)}")
        if sf.size != Rp * S:
            raise ValueError(f"scale_factors[{i}] must hold Rp*D/16 = {Rp * S} bytes, "
                             f"got {sf.size}")
        if am.dtype != np.float32 or am.size < 1:
            raise TypeError(f"amax[{i}] must be a float32 array with one element, got "
                            f"{am.dtype} {tuple(am.shape)}")
    return Rp, D
