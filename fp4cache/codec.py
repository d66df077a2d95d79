"""Functional NVFP4 codec: ``quantize`` and ``dequantize`` on NumPy or CuPy arrays."""

from __future__ import annotations

import numpy as np

from . import _arrays, _backend
from ._device import on_input_device
from .formats import check_rule, reciprocal_clamped, resolve_dtype
from .layout import GROUP
from .typing import Array, ArrayLike, DTypeLike

__all__ = ["quantize", "dequantize"]


def quantize(x: ArrayLike, scale: float = 1.0, scale_rule: str = "static6", *,
             out: tuple[Array, Array] | None = None) -> tuple[Array, Array]:
    """Quantize ``x`` to NVFP4: packed E2M1 values and one E4M3 scale per 16 values.

    Parameters
    ----------
    x : ndarray, shape (..., D), bfloat16, float16 or float32
        NumPy or CuPy array (or any DLPack producer); ``D`` must be a multiple of 16.
        The groups are 16 consecutive elements of the last axis.
    scale : float, default 1.0
        The global *dequantization* multiplier ``s`` (vLLM's ``k_scale``); values are
        encoded with ``g = 1/s``.  Must be finite and positive.
    scale_rule : {"static6", "4over6"}
        ``"static6"`` maps each group's max to 6; ``"4over6"`` also tries 4 and keeps
        the candidate with the smaller squared error (ties keep 6).
    out : tuple of two arrays, optional
        ``(data, scales)`` to write into: C-contiguous, on the same backend as ``x``,
        ``data`` uint8 of shape ``(..., D/2)``, ``scales`` uint8 (or ``float8_e4m3fn``)
        of shape ``(..., D/16)``.  Checked before anything is written; returned.

    Returns
    -------
    data : ndarray, uint8, shape (..., D/2)
        Two E2M1 codes per byte, element ``2i`` in the low nibble.
    scales : ndarray, uint8, shape (..., D/16)
        E4M3 block-scale bytes (``scales.view(ml_dtypes.float8_e4m3fn)`` on NumPy).
        A group with a NaN or infinity gets scale 0x7F (NaN) and zero data.

    Runs on the GPU (CuPy's current stream) when ``x`` is a CuPy array.  With
    ``k_scale = 1.0`` data of very small or very large magnitude under- or overflows the
    E4M3 block scales: pass ``scale=fp4cache.calibrate_scale(x)``.

    Examples
    --------
    >>> import numpy as np, fp4cache
    >>> x = np.array([[0.0, 1.0, -2.0, 3.0] * 4], np.float32)    # one group of 16
    >>> data, scales = fp4cache.quantize(x, scale=0.25)
    >>> data.shape, scales.shape, data.dtype
    ((1, 8), (1, 1), dtype('uint8'))
    >>> fp4cache.dequantize(data, scales, scale=0.25, dtype="float32").tolist()[0][:4]
    [0.0, 1.0, -2.0, 3.0]
    >>> buf = (np.empty((1, 8), np.uint8), np.empty((1, 1), np.uint8))
    >>> fp4cache.quantize(x, scale=0.25, out=buf)[0] is buf[0]
    True
    """
    backend = _arrays.backend_of(x)
    x = _arrays.to_backend(x, backend, "x")
    if x.ndim == 0:
        raise ValueError("x must have at least one axis (..., D), got a scalar")
    _arrays.check_values(x, "x", (None,) * x.ndim)
    d = x.shape[-1]
    if d % GROUP or d == 0:
        raise ValueError(f"x.shape[-1] (D) must be a positive multiple of 16, got {d}")
    s = _arrays.check_scale(scale, "scale")
    check_rule(scale_rule)
    xp = _arrays.array_module(backend)
    lead = tuple(x.shape[:-1])
    if out is None:
        data = xp.empty(lead + (d // 2,), dtype=np.uint8)
        scales = xp.empty(lead + (d // GROUP,), dtype=np.uint8)
        result = data, scales
    else:
        data, scales, result = _check_quantize_out(out, lead, d, backend)
    rows = xp.ascontiguousarray(x).reshape(-1, d)
    if rows.shape[0]:
        _backend.backend(backend).quantize(
            rows, s, reciprocal_clamped(s), scale_rule,
            data.reshape(-1, d // 2), scales.reshape(-1, d // GROUP),
        )
    return result


def _check_quantize_out(out, lead: tuple, d: int, backend: str):
    """``(data, scales as uint8, the caller's pair)`` of a checked ``quantize`` ``out``."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out must be a tuple (data, scales), got {type(out).__name__}")
    data = _arrays.check_out(out[0], "out[0]", lead + (d // 2,), np.dtype(np.uint8), backend)
    sc = _arrays.to_backend(out[1], backend, "out[1]")
    scales = _arrays.as_scale_bytes(sc, "out[1]")
    scales = _arrays.check_out(scales, "out[1]", lead + (d // GROUP,), np.dtype(np.uint8),
                               backend)
    return data, scales, (out[0], out[1])


@on_input_device
def dequantize(data: ArrayLike, scales: ArrayLike, scale: float = 1.0,
               dtype: DTypeLike = "bfloat16", *, out: Array | None = None) -> Array:
    """Decode NVFP4 ``data``/``scales`` to ``dtype``: ``fl(fl(e2m1 * sf) * scale)``.

    Parameters
    ----------
    data : ndarray, uint8, shape (..., D/2)
    scales : ndarray, uint8 or float8_e4m3fn, shape (..., D/16)
    scale : float, default 1.0
        The global dequantization multiplier used at quantization.
    dtype : {"bfloat16", "float16", "float32"} or a matching dtype object
        Output dtype (float32 results are rounded to nearest even).  Ignored when
        ``out`` is given, whose dtype is used.
    out : ndarray, optional
        C-contiguous output of shape (..., D) on the same backend.

    Returns
    -------
    ndarray, shape (..., D)

    Examples
    --------
    >>> import numpy as np, fp4cache
    >>> data, scales = fp4cache.quantize(np.array([[6.0, -0.5] * 8], np.float32))
    >>> fp4cache.dequantize(data, scales, dtype="float32")[0, :4].tolist()
    [6.0, -0.5, 6.0, -0.5]
    >>> out = np.empty((1, 16), np.float16)
    >>> fp4cache.dequantize(data, scales, out=out) is out    # out's dtype is used
    True
    """
    backend = _arrays.backend_of(data)
    data = _arrays.to_backend(data, backend, "data")
    scales = _arrays.to_backend(scales, backend, "scales")
    if data.dtype != np.uint8:
        raise TypeError(f"data must have dtype uint8 (packed E2M1), got {data.dtype}")
    scales = _arrays.as_scale_bytes(scales, "scales")
    if data.ndim == 0 or scales.ndim != data.ndim:
        raise ValueError(
            f"data and scales must have the same rank >= 1, got {data.shape} and {scales.shape}"
        )
    half = data.shape[-1]
    if half % (GROUP // 2) or tuple(scales.shape) != tuple(data.shape[:-1]) + (half // 8,):
        raise ValueError(
            "scales must have shape data.shape[:-1] + (data.shape[-1]/8,) and "
            f"data.shape[-1] must be a multiple of 8, got {data.shape} and {scales.shape}"
        )
    s = _arrays.check_scale(scale, "scale")
    shape = tuple(data.shape[:-1]) + (2 * half,)
    xp = _arrays.array_module(backend)
    if out is None:
        dt = resolve_dtype(dtype)
        out = xp.empty(shape, dtype=dt)
    else:
        out = _arrays.check_out(out, "out", shape, resolve_dtype(out.dtype, name="out.dtype"),
                                backend)
    n = int(np.prod(shape[:-1], dtype=np.int64))
    if n:
        _backend.backend(backend).dequantize(
            xp.ascontiguousarray(data).reshape(n, half),
            xp.ascontiguousarray(scales).reshape(n, half // 8), s, out.reshape(n, 2 * half),
        )
    return out
