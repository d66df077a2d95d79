"""Calibrating the global scale of a static-scale NVFP4 tensor (``k_scale``/``v_scale``)."""

from __future__ import annotations

import numpy as np

from . import _arrays, _backend
from ._device import on_input_device
from .formats import RULE_E4M3_MAX, check_rule
from .typing import ArrayLike

__all__ = ["calibrate_scale"]


@on_input_device
def calibrate_scale(x: ArrayLike, scale_rule: str = "static6") -> float:
    """The global scale that puts the largest block scale of ``x`` at the top of E4M3.

    ``amax / (6 * M)`` in float32 (one exact division, ``fl(amax / fl(6 * M))``), where
    ``amax = max |x|`` and ``M = 448`` for ``"static6"`` (E4M3's largest value) or
    ``M = 256`` for ``"4over6"`` (so that the 4-candidate, 1.5x the 6-candidate, stays
    below 448: the same ``M`` as LongLive's per-block rule).  This is the library's one
    scale rule: every cache, codec call, notebook and document uses it (``M`` from
    ``fp4cache.formats.RULE_E4M3_MAX``), and for static6 it is what vLLM's exporters
    compute for ``k_scale``: with the default ``k_scale = 1.0`` data of small
    magnitude underflows the E4M3 block scales (std 1e-4: every scale 0, the cache holds
    zeros) and large data saturates them.

    Parameters
    ----------
    x : ndarray, bfloat16, float16 or float32, any shape
        Representative data (for example the keys of a calibration prompt), as a NumPy
        or CuPy array or any DLPack producer.
    scale_rule : {"static6", "4over6"}, default "static6"
        The rule of the cache or :func:`fp4cache.quantize` call that will use the scale.

    Returns
    -------
    float
        A finite positive float32 value as a Python float, ready for
        ``PagedKVCache(k_scale=...)`` or ``quantize(x, scale=...)``.

    Raises
    ------
    ValueError
        ``x`` is empty, holds a NaN or an infinity, is all zeros (no scale can be derived
        from it: calibrate on data of the real magnitude, or keep the default 1.0), or is
        so small that ``amax / (6 * M)`` underflows float32 to zero.
    TypeError
        ``x`` is not bfloat16, float16 or float32.

    Notes
    -----
    On the GPU this is one reduction kernel on CuPy's current stream (a non-contiguous
    ``x`` is copied first) followed by a 4-byte copy to the host, so it synchronizes with
    that stream: call it once, at calibration time, not per decode step.

    There is no ``k_scale="auto"`` on :class:`fp4cache.PagedKVCache`: a cache's scale
    must be fixed before its first store (every stored byte depends on it), so "auto"
    could only mean "calibrate on whatever the first store holds", which ties the whole
    cache to one batch (a one-token prompt, say) and puts a host synchronization inside
    that store.  Calibrate explicitly on representative data instead.

    Examples
    --------
    >>> import numpy as np, fp4cache
    >>> x = np.array([[0.5, -2688.0] + [0.0] * 14], np.float32)
    >>> fp4cache.calibrate_scale(x)                # 2688 / (6 * 448)
    1.0
    >>> fp4cache.calibrate_scale(x, "4over6")      # 2688 / (6 * 256)
    1.75
    >>> k = np.full((4, 2, 16), 1e-4, np.float32)  # small data: the default 1.0 loses it
    >>> data, scales = fp4cache.quantize(k)
    >>> int(scales.max())                          # every block scale underflowed to 0
    0
    >>> data, scales = fp4cache.quantize(k, scale=fp4cache.calibrate_scale(k))
    >>> float(fp4cache.formats.e4m3_decode(scales).max())  # at E4M3's largest value
    448.0
    """
    check_rule(scale_rule)
    backend = _arrays.backend_of(x)
    x = _arrays.to_backend(x, backend, "x")
    _arrays.check_values(x, "x", (None,) * x.ndim)
    if x.size == 0:
        raise ValueError("x must hold at least one value to calibrate a scale, got an empty "
                         f"array of shape {tuple(x.shape)}")
    amax = np.float32(_backend.backend(backend).abs_max(x))
    if not np.isfinite(amax):
        raise ValueError("x holds a NaN or an infinity: calibrate on finite data (such "
                         "values are stored as NaN groups whatever the scale)")
    if amax == 0:
        raise ValueError("x is all zeros: no scale can be calibrated from it (calibrate on "
                         "data of the real magnitude, or keep the default scale 1.0)")
    six_m = np.float32(6.0) * np.float32(RULE_E4M3_MAX[scale_rule])
    scale = amax / six_m
    if not scale > 0:
        raise ValueError(f"max |x| = {float(amax):g} is too small: amax / {float(six_m):g} "
                         "underflows float32 to zero")
    return float(scale)
