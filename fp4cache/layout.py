"""Byte layouts of the NVFP4 KV cache: the one place where every offset formula lives.

Two layouts are described here (see ``docs/format.md`` for the prose version):

* the **vLLM paged layout** written by ``reshape_and_cache_nvfp4``: one page of
  ``block_size`` tokens is ``[K side | V side]``, each side ``[data | scales]``;
  data is ``H*T*D/2`` packed E2M1 bytes, scales ``H*T*D/16`` E4M3 bytes.  Inside a
  side the rows are ordered head-major (``"HND"``) or token-major (``"NHD"``).  The
  V-side scales may be swizzled per head for trtllm-gen attention kernels.
* the **LongLive blocked layout** read by ``dequantize_kv_cache_fp4``: one block of
  ``Tb`` tokens is a ``[Rp, D/2]`` value matrix (row ``r = t*H + h``, rows padded to a
  multiple of 128) and ``Rp*D/16`` scale bytes in cuBLAS' 128x4 tile order.

All functions accept NumPy integer arrays (or Python ints) and broadcast
(:func:`slot_mapping` CuPy ones too).  The CUDA kernels implement the same formulas; the
tests check both against independent forms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from . import _abi, _arrays
from .typing import IntArray, IntArrayLike

__all__ = [
    "GROUP",
    "slot_mapping",
    "Layout",
    "PageGeometry",
    "swizzle_scale_index",
    "blocked_scale_offset",
    "longlive_padded_rows",
]

#: Number of values that share one E4M3 block scale.
GROUP = 16

#: Page row orders, from :data:`fp4cache._abi.LAYOUTS` (which gives the kernels' values);
#: ``Layout`` spells them for type checkers (a test keeps the two equal).
LAYOUTS: tuple[str, ...] = tuple(_abi.LAYOUTS)
Layout = Literal["HND", "NHD"]


def swizzle_scale_index(t: IntArrayLike, s: IntArrayLike,
                        scales_per_row: int) -> tuple[IntArray, IntArray]:
    """Return the swizzled ``(t', s')`` position of scale ``(t, s)`` inside one head's tile.

    The head's ``[T, S]`` scale tile is viewed as ``[T/4, 4, 4, S/4]`` and permuted
    ``(0, 2, 3, 1)`` (trtllm-gen's order); element ``(t, s)`` of the logical tile is
    stored at the linear position of ``(t', s')``:
    ``t' = (t//4)*4 + s//(S/4)`` and ``s' = (s % (S/4))*4 + t%4``.
    """
    q = scales_per_row // 4
    t = np.asarray(t)
    s = np.asarray(s)
    return (t // 4) * 4 + s // q, (s % q) * 4 + t % 4


@dataclass(frozen=True)
class PageGeometry:
    """Sizes and byte offsets of one vLLM-layout NVFP4 page.

    Parameters
    ----------
    num_heads, block_size, head_dim : int
        ``H``, ``T`` (tokens per page) and ``D``.
    layout : {"HND", "NHD"}
        Row order inside a side: head-major or token-major.
    swizzle_v_scales : bool
        Whether the V side's scales use trtllm-gen's swizzled order.
    """

    num_heads: int
    block_size: int
    head_dim: int
    layout: str = "HND"
    swizzle_v_scales: bool = True

    # -- sizes ---------------------------------------------------------------------
    @property
    def row_data_bytes(self) -> int:
        """Packed E2M1 bytes of one (token, head) row: ``D/2``."""
        return self.head_dim // 2

    @property
    def scales_per_row(self) -> int:
        """E4M3 scales of one (token, head) row: ``S = D/16``."""
        return self.head_dim // GROUP

    @property
    def bytes_per_row(self) -> int:
        """Bytes of one (token, head) row of K (or of V): ``D/2 + D/16``."""
        return self.row_data_bytes + self.scales_per_row

    @property
    def data_bytes(self) -> int:
        """Bytes of the data region of one side: ``H*T*D/2``."""
        return self.num_heads * self.block_size * self.row_data_bytes

    @property
    def scale_bytes(self) -> int:
        """Bytes of the scale region of one side: ``H*T*D/16``."""
        return self.num_heads * self.block_size * self.scales_per_row

    @property
    def side_bytes(self) -> int:
        """Bytes of one side (K or V) of a page."""
        return self.data_bytes + self.scale_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page, K side and V side."""
        return 2 * self.side_bytes

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes per token, K and V, all heads: ``2*H*(D/2 + D/16)``."""
        return 2 * self.num_heads * self.bytes_per_row

    # -- offsets (bytes, relative to the start of one side) ---------------------------
    def _row_index(self, t, h):
        t = np.asarray(t)
        h = np.asarray(h)
        if self.layout == "HND":
            return h * self.block_size + t
        return t * self.num_heads + h

    def data_offset(self, t: IntArrayLike, h: IntArrayLike, j: IntArrayLike = 0) -> IntArray:
        """Byte offset of packed data byte ``j`` (``0 <= j < D/2``) of row (t, h)."""
        return self._row_index(t, h) * self.row_data_bytes + np.asarray(j)

    def scale_offset(self, t: IntArrayLike, h: IntArrayLike, s: IntArrayLike, *,
                     side: int = 0) -> IntArray:
        """Byte offset of block scale ``s`` of row (t, h) on ``side`` (0 = K, 1 = V).

        The V side is swizzled per head when ``swizzle_v_scales`` is set; the K side
        never is.  The offset includes the data region that precedes the scales.
        """
        S = self.scales_per_row
        t = np.asarray(t)
        h = np.asarray(h)
        s = np.asarray(s)
        if side == 1 and self.swizzle_v_scales:
            t, s = swizzle_scale_index(t, s, S)
        return self.data_bytes + self._row_index(t, h) * S + s

    def check(self) -> None:
        """Raise ``ValueError`` if the geometry cannot be laid out (``TypeError`` for a
        ``swizzle_v_scales`` that is not a bool)."""
        if not isinstance(self.swizzle_v_scales, (bool, np.bool_)):
            raise TypeError("swizzle_v_scales must be True or False, got "
                            f"{type(self.swizzle_v_scales).__name__} {self.swizzle_v_scales!r}")
        for name in ("num_heads", "block_size", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.head_dim % GROUP:
            raise ValueError(f"head_dim must be a multiple of 16, got {self.head_dim}")
        if self.swizzle_v_scales:
            if self.head_dim % 64:
                raise ValueError(
                    "head_dim must be a multiple of 64 with swizzle_v_scales=True "
                    f"(D/16 scales per row must divide into 4), got {self.head_dim}"
                )
            if self.block_size % 4:
                raise ValueError(
                    "block_size must be a multiple of 4 with swizzle_v_scales=True, "
                    f"got {self.block_size}"
                )


# -- LongLive blocked layout ------------------------------------------------------------
def longlive_padded_rows(block_token_size: int, num_heads: int) -> int:
    """``Rp``: the ``Tb*H`` rows of one LongLive block rounded up to a multiple of 128."""
    rows = block_token_size * num_heads
    return -(-rows // 128) * 128


def blocked_scale_offset(r: IntArrayLike, s: IntArrayLike, scales_per_row: int) -> IntArray:
    """Offset of scale ``(r, s)`` in cuBLAS' 128x4 blocked order (``to_blocked``).

    ``((r//128)*(S/4) + s//4)*512 + (r%32)*16 + ((r%128)//32)*4 + s%4``
    """
    r = np.asarray(r)
    s = np.asarray(s)
    tile = (r // 128) * (scales_per_row // 4) + s // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + s % 4


# -- vLLM's slot mapping ---------------------------------------------------------------------
def slot_mapping(block_tables, positions, *, block_size: int, validate: bool = True):
    """vLLM's slot of every token position: ``block_tables[b, p // block_size] *
    block_size + p % block_size``, and -1 where ``p`` is -1 (padding).

    Parameters
    ----------
    block_tables : array of int32 or int64, shape (B, max_blocks)
        Row ``b`` lists the pages of sequence ``b`` in order (vLLM's block table).
    positions : array of int32 or int64, shape (B, n)
        Token positions of each sequence, -1 for padding.  NumPy or CuPy, the same
        backend as ``block_tables``.
    block_size : int
        Tokens per page (the cache's ``block_size``).
    validate : bool, default True
        Check the values: a position below -1 or a used table entry below 0 is a
        ``ValueError``, a position past the table (``p >= max_blocks * block_size``) an
        ``IndexError``.  On CuPy arrays the checks read a result back (a host sync);
        with ``validate=False`` such positions give slot -1 (the store skips them).

    Returns
    -------
    slots : array of int64, shape (B, n), on the inputs' backend
        Flatten it (``slots.reshape(-1)``) to get the ``slot_mapping`` of
        :meth:`PagedKVCache.store` for the tokens in row-major order.

    Examples
    --------
    >>> import numpy as np, fp4cache
    >>> tables = np.array([[7, 2], [5, -1]])
    >>> fp4cache.slot_mapping(tables, np.array([[0, 17, 18], [3, -1, -1]]), block_size=16)
    array([[112,  33,  34],
           [ 83,  -1,  -1]])
    """
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    T = int(block_size)
    on_gpu = _arrays.is_cupy(block_tables) or _arrays.is_cupy(positions)
    be = "cuda" if on_gpu else "cpu"
    tables = _arrays.to_backend(block_tables, be, "block_tables",
                                allow_convert=isinstance(block_tables, (list, tuple)))
    pos = _arrays.to_backend(positions, be, "positions",
                             allow_convert=isinstance(positions, (list, tuple)))
    for name, a in (("block_tables", tables), ("positions", pos)):
        if a.dtype not in (np.int32, np.int64):
            raise TypeError(f"{name} must have dtype int32 or int64, got {a.dtype}")
        if a.ndim != 2:
            raise ValueError(f"{name} must be 2-D (sequences, ...), got shape {tuple(a.shape)}")
    if pos.shape[0] != tables.shape[0]:
        raise ValueError(f"positions must have one row per block_tables row "
                         f"({tables.shape[0]}), got {pos.shape[0]}")
    xp = _arrays.array_module(be)
    max_blocks = tables.shape[1]
    limit = max_blocks * T
    pos = pos.astype(np.int64)
    pad = pos < 0
    past = pos >= limit
    col = xp.where(pad | past, 0, pos // T)
    if max_blocks == 0:
        blk = xp.full(pos.shape, -1, np.int64)
    else:
        blk = xp.take_along_axis(tables, col, axis=1).astype(np.int64)
    if _arrays.check_bool(validate, "validate"):
        for bad, exc, what in (
                (pos < -1, ValueError, "is below -1 (only -1 marks padding)"),
                (past, IndexError, f"is past the block table ({max_blocks} pages of "
                                   f"{T} tokens: positions must be < {limit})"),
                (~pad & ~past & (blk < 0), ValueError,
                 "falls in a block table entry below 0 (no page)")):
            if bool(bad.any()):
                b, j = (int(x) for x in np.unravel_index(int(bad.argmax()), bad.shape))
                raise exc(f"positions[{b}, {j}] = {int(pos[b, j])} {what}")
    slots = blk * T + pos % T
    return xp.where(pad | past | (blk < 0), -1, slots)
