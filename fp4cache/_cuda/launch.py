"""Launch helpers of the CuPy backend: block and grid sizes, index dtypes, alignment."""

from __future__ import annotations

import cupy
import numpy as np

from .. import _abi

__all__ = ["THREADS", "BLOCK", "MAX_THREADS", "index_name", "grid_of", "decode_grid",
           "aligned", "contig"]

#: Threads of the store, gather, codec and LongLive launches.
THREADS = 256
BLOCK = (THREADS,)

#: Launches are split so that a thread index always fits in 31 bits.
MAX_THREADS = 2**31 - 1

_IX = {np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}


def index_name(dtype, what: str) -> str:
    """The kernel name part of an index dtype (``"i32"``, ``"i64"``)."""
    try:
        return _IX[dtype]
    except KeyError:
        raise TypeError(f"{what} must be int32 or int64, got {dtype}") from None


def grid_of(total: int) -> tuple[int]:
    """The grid of ``total`` items, one per thread."""
    return ((total + THREADS - 1) // THREADS,)


def decode_grid(chunks: int) -> tuple[int]:
    """The grid of ``chunks`` decode items, ``_abi.DECODE_CHUNKS`` per thread."""
    per = THREADS * _abi.DECODE_CHUNKS
    return ((chunks + per - 1) // per,)


def aligned(ptr: int, *strides: int, to: int = 16) -> bool:
    """Whether a pointer and strides are all multiples of ``to`` bytes."""
    if ptr % to:
        return False
    return all(st % to == 0 for st in strides)


def contig(a):
    """``a``, or a C-contiguous copy of it."""
    return a if a.flags.c_contiguous else cupy.ascontiguousarray(a)
