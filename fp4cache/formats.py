"""Element formats: E2M1 (FP4) codes, E4M3 (FP8) block scales, and the float32 rules.

These are the scalar building blocks of the contract in ``docs/format.md``, written
with NumPy so that every function works element-wise on arrays.  They are the
reference the CUDA kernels are tested against.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import _abi

__all__ = [
    "E2M1_VALUES",
    "E4M3_NAN",
    "E4M3_MAX",
    "FLT_MAX",
    "C6",
    "C4",
    "SCALE_RULES",
    "check_rule",
    "e2m1_encode",
    "e2m1_decode",
    "e4m3_encode",
    "e4m3_decode",
    "pack_nibbles",
    "unpack_nibbles",
    "float32_to",
    "hadamard",
    "rotation_supported",
    "bf16_bits",
    "resolve_dtype",
    "reciprocal_clamped",
]

#: Values of the 16 E2M1 codes; bit 3 is the sign.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
#: The E4M3 byte that encodes NaN (the scale of a non-finite group).
E4M3_NAN = 0x7F
#: Largest finite E4M3 value.
E4M3_MAX = np.float32(448.0)
FLT_MAX = np.float32(np.finfo(np.float32).max)
#: ``fl(1/6)`` and ``1/4``: the multipliers that turn a group's max into a block scale.
C6 = np.float32(1.0) / np.float32(6.0)
C4 = np.float32(0.25)
#: ``static6`` always scales the group max to 6; ``4over6`` also tries 4 and keeps the better.
SCALE_RULES: tuple[str, ...] = tuple(_abi.RULES)


def check_rule(scale_rule: str) -> str:
    """Validate ``scale_rule`` (``"static6"`` or ``"4over6"``)."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be 'static6' or '4over6', got {scale_rule!r}")
    return scale_rule


#: ``M`` of each rule (spec section 3): the largest block scale a calibrated global scale
#: aims at, ``6 * M`` the largest value.  4over6 uses 256 so that its 4-candidate (1.5x
#: the 6-candidate) stays below 448; it is also LongLive's ``e4m3_max`` default.
RULE_E4M3_MAX: dict[str, float] = {"static6": 448.0, "4over6": 256.0}

_F32 = np.float32


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """Round float32 ``x`` to E2M1 codes (nearest, ties to even, saturating to +-6).

    The rounding thresholds are: ``|x| <= .25 -> 0``, ``< .75 -> .5``, ``<= 1.25 -> 1``,
    ``< 1.75 -> 1.5``, ``<= 2.5 -> 2``, ``< 3.5 -> 3``, ``<= 5 -> 4``, else 6.  The sign
    bit is kept, so negative values that round to zero give code 8.  NaN is not
    representable; callers never pass it (non-finite groups are handled before
    encoding).  Implemented as a saturating cast to ``ml_dtypes.float4_e2m1fn``, which
    follows exactly these rules on every finite float32.
    """
    x = np.clip(np.asarray(x, dtype=_F32), _F32(-6.0), _F32(6.0))
    return x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & np.uint8(0xF)


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """float32 value of each E2M1 code (only the low 4 bits are read)."""
    return E2M1_VALUES[np.asarray(codes) & 0xF]


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """E4M3 byte of float32 ``x``: clip to +-448, then round to nearest even (satfinite)."""
    x = np.clip(np.asarray(x, dtype=_F32), -E4M3_MAX, E4M3_MAX)
    return x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_decode(b: np.ndarray) -> np.ndarray:
    """float32 value of E4M3 bytes (0x7F and 0xFF are NaN)."""
    return np.asarray(b, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(_F32)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pack codes ``[..., 2n]`` into bytes ``[..., n]``: element 2i low nibble, 2i+1 high."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(data: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_nibbles`: bytes ``[..., n]`` to codes ``[..., 2n]``."""
    data = np.asarray(data, dtype=np.uint8)
    out = np.empty(data.shape[:-1] + (2 * data.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = data & 0xF
    out[..., 1::2] = data >> 4
    return out


def reciprocal_clamped(x) -> np.float32:
    """``min(fl(1/x), FLT_MAX)`` in float32 (the spec's clamp against 0*inf)."""
    with np.errstate(divide="ignore", over="ignore"):
        r = _F32(1.0) / _F32(x)
    return np.minimum(r, FLT_MAX)


_DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
}
#: Names of the accepted input and output value dtypes.
VALUE_DTYPES: tuple[str, ...] = tuple(_DTYPES)


def resolve_dtype(dtype, *, name: str = "dtype") -> np.dtype:
    """Normalize a value dtype (``"bfloat16"``, ``ml_dtypes.bfloat16``, ``np.float16``...).

    Raises ``TypeError`` naming ``name`` when the dtype is not bfloat16, float16 or
    float32.
    """
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is not None:
        for ok in _DTYPES.values():
            if dt == ok:
                return ok
    # CuPy/torch dtypes and strings such as "bf16" are matched by name.
    label = getattr(dtype, "name", None) or str(dtype)
    label = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
             "float": "float32"}.get(label.replace("torch.", ""), label.replace("torch.", ""))
    if label in _DTYPES:
        return _DTYPES[label]
    raise TypeError(
        f"{name} must be bfloat16, float16 or float32, got {dtype!r}"
    )


def float32_to(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round float32 ``x`` to ``dtype`` (bfloat16/float16/float32), nearest even."""
    # beyond the target's range rounds to +-inf, below it to subnormals or zero: intended
    with np.errstate(over="ignore", under="ignore"):
        return np.asarray(x, dtype=_F32).astype(dtype)


def rotation_supported(head_dim: int) -> bool:
    """Whether K of ``head_dim`` can be stored rotated (``rotation="hadamard"``): a power
    of two from 16 to 256, the sizes the attention kernels rotate q for."""
    d = int(head_dim)
    return d & (d - 1) == 0 and 16 <= d <= 256


def hadamard(x, *, xp=None):
    """The normalized Hadamard transform along the last axis, in float32: the rotation of
    ``PagedKVCache(rotation="hadamard")`` bit for bit (``docs/window.md``).

    Butterfly stages of strides 1, 2, ..., D/2 in that order (``(a, b) -> (a + b, a - b)``,
    float32), then a multiply by ``fl32(1 / sqrt(D))``.  The transform is its own
    inverse up to rounding.  ``x``: a NumPy or CuPy array (any float dtype, converted
    to float32 exactly) whose last axis ``D`` is a power of two.

    >>> import numpy as np
    >>> hadamard(np.array([1.0, 1.0, 1.0, 1.0]))
    array([2., 0., 0., 0.], dtype=float32)
    """
    if xp is None:
        xp = np
        if type(x).__module__.startswith("cupy"):
            import cupy as xp
    y = xp.asarray(x).astype(np.float32, copy=True)
    d = y.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard needs a power-of-two last axis, got {d}")
    lead = y.shape[:-1]
    s = 1
    while s < d:
        z = y.reshape(*lead, d // (2 * s), 2, s)
        a, b = z[..., 0, :], z[..., 1, :]
        y = xp.stack([a + b, a - b], axis=-2).reshape(*lead, d)
        s *= 2
    return y * np.float32(1.0 / np.sqrt(d))


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even; NaN -> ``0x7FC0``: what
    the store writes to an exact window (``docs/window.md``)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    r = r.astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), r).astype(np.uint16)
