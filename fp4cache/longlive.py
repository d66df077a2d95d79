"""LongLive / fouroversix interop: per-block amax NVFP4 in cuBLAS' blocked scale layout.

One cache block of ``Tb`` tokens and ``H`` heads is a ``[Rp, D/2]`` matrix of packed
E2M1 values (row ``r = t*H + h``, ``Rp`` = ``Tb*H`` rounded up to 128, padding rows
zero), ``Rp*D/16`` E4M3 scale bytes in the 128x4 tile order of
:func:`fp4cache.layout.blocked_scale_offset`, and one float32 ``amax``.  This is what
LongLive's ``dequantize_kv_cache_fp4`` reads; :func:`dequantize` has the same arguments
and result, for any ``D`` that is a multiple of 64.

Which maximum belongs to which rule: a block quantized with ``"4over6"`` (the default
here, LongLive's own convention) is read with ``e4m3_max=256``, LongLive's reader
default; a ``"static6"`` block with ``e4m3_max=448``.  Read with the wrong one, every
value is off by 448/256 (relative RMSE about 0.76) and nothing in the arrays says so:
:func:`quantize_block` therefore returns a :class:`LongLiveBlock`, which unpacks like the
three arrays but remembers its rule and its ``(Tb, H)``, and :func:`dequantize` takes a
list of such blocks and picks (or checks) ``e4m3_max``, ``num_heads`` and
``block_token_size`` itself.  Raw arrays carry neither: :func:`dequantize` and
:func:`dequantize_pool` then need the rule said (``scale_rule=`` or ``e4m3_max=``; no
default), and only the product ``Tb*H`` (padded to 128) can be checked against them.

The module is LongLive's API surface: the block type, the quantizer, the list and pool
decoders with their prepared launches; the arithmetic is in the backends.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from . import _arrays, _backend, _hotpath
from ._device import on_input_device
from .formats import RULE_E4M3_MAX, check_rule, resolve_dtype
from .layout import GROUP, longlive_padded_rows
from .typing import Array, ArrayLike, DTypeLike, IndexLike

__all__ = ["LongLiveBlock", "quantize_block", "dequantize", "dequantize_pool",
           "inverse_global_denominator"]

#: LongLive's reader defaults: ``e2m1_max = 6`` and ``e4m3_max = 256`` (the 4over6 rule).
LONGLIVE_E2M1_MAX = 6.0
LONGLIVE_E4M3_MAX = RULE_E4M3_MAX["4over6"]

#: Largest block: the GPU kernels number groups with 32-bit thread ids.
_MAX_GROUPS = 2**31 - 1


def inverse_global_denominator(e2m1_max: float = LONGLIVE_E2M1_MAX,
                               e4m3_max: float = LONGLIVE_E4M3_MAX) -> np.float32:
    """``fl(1 / fl(e2m1_max * e4m3_max))`` in float32 (LongLive's global-scale divisor).

    The defaults (6, 256) are LongLive's, those of blocks quantized with ``"4over6"``;
    ``"static6"`` blocks use ``e4m3_max=448``.

    Examples
    --------
    >>> from fp4cache import longlive
    >>> float(longlive.inverse_global_denominator()) == float(np.float32(1 / 1536))
    True
    >>> float(longlive.inverse_global_denominator(e4m3_max=448.0)) * 2688
    1.0000000...
    """
    for name, val in (("e2m1_max", e2m1_max), ("e4m3_max", e4m3_max)):
        _arrays.check_scale(val, name)
    return np.float32(1.0) / (np.float32(e2m1_max) * np.float32(e4m3_max))


def _check_head_dim(d: int, name: str) -> None:
    if d <= 0 or d % 64:
        raise ValueError(f"{name} must be a positive multiple of 64 for the LongLive layout, "
                         f"got {d}")


class _BlockArrays(NamedTuple):
    values: Array
    scale_factors: Array
    amax: Array


class LongLiveBlock(_BlockArrays):
    """One quantized LongLive block: ``(values, scale_factors, amax)`` plus its rule.

    A tuple of the three arrays (``values, sf, amax = block`` works, and so does
    ``zip(*blocks)``), with the attributes ``scale_rule``, ``e4m3_max`` (256 for
    ``"4over6"``, 448 for ``"static6"``), the maximum :func:`dequantize` must use, and
    ``block_token_size``, ``num_heads`` (``Tb``, ``H`` of the quantized block; ``None``
    when not known).  Pass the blocks themselves to :func:`dequantize` and neither the
    rule nor the row order can be lost; once split into plain arrays, the caller must
    state the rule (``scale_rule=`` or ``e4m3_max=``).

    Examples
    --------
    >>> import numpy as np
    >>> from fp4cache import longlive
    >>> block = longlive.quantize_block(np.ones((2, 1, 64), np.float32), "static6")
    >>> block.scale_rule, block.e4m3_max, len(block), (block.block_token_size, block.num_heads)
    ('static6', 448.0, 3, (2, 1))
    >>> values, scale_factors, amax = block
    >>> values.shape, scale_factors.shape, amax.tolist()
    ((128, 32), (512,), [1.0])
    """

    def __new__(cls, values: Array, scale_factors: Array, amax: Array, scale_rule: str,
                block_token_size: int | None = None,
                num_heads: int | None = None) -> LongLiveBlock:
        self = super().__new__(cls, values, scale_factors, amax)
        self.scale_rule = check_rule(scale_rule)
        self.block_token_size = block_token_size
        self.num_heads = num_heads
        return self

    def __getnewargs__(self) -> tuple:
        return (*self, self.scale_rule, self.block_token_size, self.num_heads)

    @property
    def e4m3_max(self) -> float:
        """The ``e4m3_max`` to read this block with (256 for 4over6, 448 for static6)."""
        return RULE_E4M3_MAX[self.scale_rule]

    def __repr__(self) -> str:
        v = self.values
        return (f"LongLiveBlock(values={type(v).__module__.split('.')[0]} "
                f"{v.dtype}{tuple(v.shape)}, scale_rule={self.scale_rule!r}, "
                f"e4m3_max={self.e4m3_max:g})")


@on_input_device
def quantize_block(x: ArrayLike, scale_rule: str = "4over6") -> LongLiveBlock:
    """Quantize one cache block ``x [Tb, H, D]`` with a per-block amax.

    Parameters
    ----------
    x : ndarray, shape (Tb, H, D), bfloat16, float16 or float32
        NumPy or CuPy array (or any DLPack producer); ``D`` a multiple of 64.
    scale_rule : {"4over6", "static6"}, default "4over6"
        ``"4over6"`` (the default, because it is LongLive's own convention: its writer
        uses it and its reader defaults to ``e4m3_max=256``) uses ``M = 256``;
        ``"static6"`` uses ``M = 448`` and must be read back with ``e4m3_max=448``.
        (:func:`fp4cache.quantize` and :class:`fp4cache.PagedKVCache` default to
        ``"static6"``, vLLM's rule.)

    Returns
    -------
    LongLiveBlock
        The tuple ``(values, scale_factors, amax)`` with ``scale_rule`` and
        ``e4m3_max`` attributes:

        * values : uint8, shape (Rp, D/2)
        * scale_factors : uint8, shape (Rp*D/16,), E4M3 bytes in the 128x4 blocked order
        * amax : float32, shape (1,), ``max |x|`` over the block (NaN if the block holds a
          NaN or an infinity, in which case every scale is NaN and the block decodes to
          NaN)

    Every argument is checked before any GPU work is queued.  On the GPU the result
    stays on the device (the amax is computed there; no host synchronization).

    Examples
    --------
    >>> import numpy as np
    >>> from fp4cache import longlive
    >>> x = np.linspace(-3, 3, 4 * 2 * 64, dtype=np.float32).reshape(4, 2, 64)
    >>> block = longlive.quantize_block(x)          # 4over6, read with e4m3_max=256
    >>> block.values.shape, block.amax.tolist(), block.e4m3_max
    ((128, 32), [3.0], 256.0)
    >>> y = longlive.dequantize([block], num_heads=2, block_token_size=4, dtype="float32")
    >>> y.shape, bool(np.abs(y[0] - x).max() <= 0.25)
    ((1, 4, 2, 64), True)
    """
    check_rule(scale_rule)
    backend = _arrays.backend_of(x)
    x = _arrays.to_backend(x, backend, "x")
    _arrays.check_values(x, "x", (None, None, None))
    Tb, H, D = x.shape
    if Tb == 0 or H == 0:
        raise ValueError(f"x must have at least one token and one head, got shape {x.shape}")
    _check_head_dim(D, "x.shape[2] (head_dim)")
    Rp = longlive_padded_rows(Tb, H)
    if Rp * (D // GROUP) >= _MAX_GROUPS:
        raise ValueError(f"x is too large for one LongLive block: {Rp} padded rows x "
                         f"{D // GROUP} groups must stay below 2**31 - 1")
    impl = _backend.backend(backend)
    xp = _arrays.array_module(backend)
    values = xp.empty((Rp, D // 2), dtype=np.uint8)
    sf = xp.empty((Rp * (D // GROUP),), dtype=np.uint8)
    amax = xp.empty((1,), dtype=np.float32)
    impl.longlive_quantize(xp.ascontiguousarray(x), scale_rule, values, sf, amax)
    return LongLiveBlock(values, sf, amax, scale_rule, Tb, H)


def _resolve_e4m3_max(e4m3_max, scale_rule, rules: set | None) -> float:
    """``e4m3_max`` of a call: the blocks' rule's (``rules``: the LongLiveBlock rules,
    ``None`` for raw arrays, which must name theirs), checked against explicit ones."""
    if scale_rule is not None:
        check_rule(scale_rule)
    if rules is not None and len(rules) > 1:
        raise ValueError("the blocks were quantized with different scale rules "
                         f"({', '.join(sorted(rules))}); decode each rule's blocks in its "
                         "own call")
    if rules:
        rule = next(iter(rules))
        if scale_rule is not None and scale_rule != rule:
            raise ValueError(f"scale_rule={scale_rule!r} does not match the blocks: they were "
                             f"quantized with scale_rule={rule!r} (leave it out to use it)")
        src = "the blocks"
    elif scale_rule is not None:
        rule, src = scale_rule, f"scale_rule={scale_rule!r}"
    elif e4m3_max is None:
        raise TypeError(
            "raw LongLive arrays do not say which scale rule quantized them: pass "
            "scale_rule='4over6' (e4m3_max=256, LongLive's own) or scale_rule='static6' "
            "(e4m3_max=448), or e4m3_max=..., or the LongLiveBlock list that "
            "quantize_block returns (read with the wrong rule, every value is off by "
            "448/256)")
    else:
        return e4m3_max
    want = RULE_E4M3_MAX[rule]
    if e4m3_max is not None and _arrays.check_real(e4m3_max, "e4m3_max") != want:
        raise ValueError(f"e4m3_max={e4m3_max!r} does not match {src}: scale_rule={rule!r} "
                         f"is read with e4m3_max={want:g} (leave e4m3_max out to use it)")
    return want


def _check_block_shapes(blocks, num_heads, block_token_size):
    """``(num_heads, block_token_size)`` of a LongLiveBlock list: what the blocks recorded
    when quantized, checked against the arguments given (a swap of the two, whose
    product is the same, is caught here)."""
    shapes = set(map(attrgetter("block_token_size", "num_heads"), blocks))
    shapes.discard((None, None))
    if len(shapes) > 1:
        raise ValueError("the blocks have different shapes (block_token_size, num_heads) "
                         f"{sorted(shapes)}: decode each shape's blocks in its own call")
    if not shapes:
        return num_heads, block_token_size
    tb, h = next(iter(shapes))
    for name, got, want in (("num_heads", num_heads, h),
                            ("block_token_size", block_token_size, tb)):
        if got is not None and (isinstance(got, bool) or got != want):
            raise ValueError(
                f"{name}={got!r} does not match the blocks: they were quantized with "
                f"num_heads={h} and block_token_size={tb} (x of shape ({tb}, {h}, D)); "
                "leave both out to use them")
    return h, tb


@on_input_device
def dequantize(values: Sequence[ArrayLike] | Sequence[LongLiveBlock],
               scale_factors: Sequence[ArrayLike] | None = None,
               amax: Sequence[ArrayLike] | None = None, num_heads: int | None = None,
               block_token_size: int | None = None, dtype: DTypeLike = "bfloat16",
               e2m1_max: float = LONGLIVE_E2M1_MAX, e4m3_max: float | None = None, *,
               scale_rule: str | None = None) -> Array:
    """Decode LongLive cache blocks, like LongLive's ``dequantize_kv_cache_fp4``.

    Two forms: LongLive's, ``dequantize(values, scale_factors, amax, num_heads,
    block_token_size, ...)`` with three lists of per-block arrays, and
    ``dequantize(blocks, num_heads=..., block_token_size=...)`` with a list of the
    :class:`LongLiveBlock` that :func:`quantize_block` returns, which also carry their
    rule.

    Parameters
    ----------
    values : sequence of uint8 arrays, each (Rp, D/2); or a sequence of LongLiveBlock
    scale_factors : sequence of uint8/float8_e4m3fn arrays, each with Rp*D/16 bytes
        Omitted (None) when ``values`` holds LongLiveBlock.
    amax : sequence of float32 arrays, each (1,)
        Omitted (None) when ``values`` holds LongLiveBlock.
    num_heads, block_token_size : int
        ``H`` and ``Tb``.  LongLiveBlock input: optional, the blocks' own (a value that
        contradicts them, such as the two swapped, is a ``ValueError``).  Raw arrays:
        required, and only their product can be checked (``Rp`` must be ``Tb*H``
        rounded up to 128, else ``ValueError``): 8 heads x 32 tokens and 32 heads x 8
        tokens have the same rows, so a swap decodes scrambled rows.
    dtype : {"bfloat16", "float16", "float32"}
    e2m1_max : float, default 6.0
    e4m3_max : float, optional
        The global scale is ``amax * fl(1/fl(e2m1_max*e4m3_max))``: 256 for blocks
        quantized with ``"4over6"`` (LongLive's default), 448 for ``"static6"``.
        LongLiveBlock input: the blocks' own.  Raw arrays: no default (they do not say
        their rule): pass this or ``scale_rule``, else ``TypeError``.  A value that
        contradicts the blocks or ``scale_rule`` is a ``ValueError``.
    scale_rule : {"4over6", "static6"}, optional
        The rule that quantized raw arrays (sets ``e4m3_max``); checked against
        LongLiveBlock input.

    Returns
    -------
    ndarray, shape (1, len(values)*Tb, H, D)
        ``x = fl(fl(e2m1 * sf) * fl(amax * inv))`` rounded to ``dtype``.

    Notes
    -----
    On the GPU the per-block pointers go through one small host-to-device copy, made
    once per distinct list of blocks; then the call is one kernel launch.  A call with
    the same block arrays (the same objects, in the same order) and arguments as an
    earlier checked call skips the checks and reuses its launch and pointer tables,
    which live as long as those arrays: its cost no longer grows with the per-array
    checks (an in-place ``a.shape = ...`` of a block array is not seen then; it cannot
    change the bytes read).  :func:`dequantize_pool` needs no pointer tables at all.

    Examples
    --------
    >>> import numpy as np
    >>> from fp4cache import longlive
    >>> rng = np.random.default_rng(0)
    >>> blocks = [longlive.quantize_block(rng.standard_normal((32, 8, 64)).astype(np.float32),
    ...                                   "static6") for _ in range(3)]
    >>> longlive.dequantize(blocks, num_heads=8, block_token_size=32).shape  # e4m3_max 448
    (1, 96, 8, 64)
    >>> longlive.dequantize(blocks, num_heads=32, block_token_size=8)  # swapped
    Traceback (most recent call last):
    ...
    ValueError: num_heads=32 does not match the blocks: ...
    >>> vals, sfs, ams = zip(*blocks)                  # LongLive's form: say the rule
    >>> y = longlive.dequantize(vals, sfs, ams, 8, 32, scale_rule="static6")
    >>> y = longlive.dequantize(vals, sfs, ams, 8, 32, e4m3_max=448.0)  # the same
    >>> longlive.dequantize(vals, sfs, ams, 8, 32)
    Traceback (most recent call last):
    ...
    TypeError: raw LongLive arrays do not say which scale rule quantized them: ...
    >>> longlive.dequantize(vals, sfs, ams, num_heads=4, block_token_size=32,
    ...                     scale_rule="static6")
    Traceback (most recent call last):
    ...
    ValueError: num_heads=4 and block_token_size=32 do not match the blocks: ...
    """
    if scale_factors is None and amax is None and _all_blocks(values):
        vals, sfs, ams = zip(*values)
        e4m3_max = _resolve_e4m3_max(e4m3_max, scale_rule, set(map(_RULE_OF, values)))
        num_heads, block_token_size = _check_block_shapes(values, num_heads,
                                                          block_token_size)
    elif scale_factors is None or amax is None:
        if scale_factors is None and amax is None:
            raise TypeError("values must be a non-empty list of LongLiveBlock (what "
                            "quantize_block returns) when scale_factors and amax are omitted")
        raise TypeError("pass both scale_factors and amax, or neither (with a list of "
                        "LongLiveBlock as values)")
    else:
        vals, sfs, ams = values, scale_factors, amax
        e4m3_max = _resolve_e4m3_max(e4m3_max, scale_rule, None)
    args = (num_heads, block_token_size, dtype, e2m1_max, e4m3_max)
    hit = _hotpath.longlive_list_hit(vals, sfs, ams, args)
    if hit is not None:  # the same arrays as a checked earlier call: launch at once
        run, shape, dt, xp = hit
        out = xp.empty(shape, dtype=dt)
        run(out)
        return out
    if not isinstance(vals, (list, tuple)) or not vals:
        raise ValueError("values must be a non-empty list of per-block arrays")
    if not isinstance(sfs, (list, tuple)) or not isinstance(ams, (list, tuple)):
        raise TypeError("scale_factors and amax must be lists of per-block arrays, got "
                        f"{type(sfs).__name__} and {type(ams).__name__}")
    if not (len(vals) == len(sfs) == len(ams)):
        raise ValueError(
            "values, scale_factors and amax must have the same length, got "
            f"{len(vals)}, {len(sfs)}, {len(ams)}"
        )
    if num_heads is None or block_token_size is None:
        raise TypeError("dequantize needs num_heads and block_token_size")
    H, Tb = _check_counts(num_heads, block_token_size)
    dt = resolve_dtype(dtype)
    inv = inverse_global_denominator(e2m1_max, e4m3_max)
    backend = _arrays.backend_of(vals[0])
    checked, plain = _intake(vals, sfs, ams, backend)
    Rp, D = _check_block_arrays(*checked, H, Tb)
    xp = _arrays.array_module(backend)
    impl = _backend.backend(backend)
    if backend == "cuda":  # everything is checked before the GPU sees any work
        _check_gpu_blocks(*checked)
    out = xp.empty((1, len(vals) * Tb, H, D), dtype=dt)
    if backend == "cpu":
        impl.longlive_dequantize(*checked, out, num_heads=H, block_token_size=Tb,
                                 inv_denom=inv)
        return out
    # The three pointer tables: one small host-to-device copy, owned by the launch (kept
    # below, for as long as the block arrays live).
    run = impl.longlive_list_launcher(*checked, D, out.dtype, True, num_heads=H,
                                      block_token_size=Tb, inv_denom=inv)
    run(out)
    if plain:  # the checked arrays are the caller's own objects
        _hotpath.longlive_list_remember(vals, sfs, ams, args, (run, out.shape, out.dtype, xp))
    return out


def _all_blocks(values) -> bool:
    return type(values) in _SEQ and bool(values) and set(map(type, values)) == {LongLiveBlock}


_SEQ = (list, tuple)
_RULE_OF = attrgetter("scale_rule")


_U8 = np.dtype(np.uint8)
_F32 = np.dtype(np.float32)


def _intake(vals, sfs, ams, backend):
    """``((vals, sfs, ams), plain)``: the per-block arrays as arrays of ``backend``, scale
    bytes as uint8; ``plain`` when they are the caller's own objects (every one already a
    plain array of that backend, the scale bytes uint8)."""
    nd = _arrays.array_module(backend).ndarray
    if all(type(a) is nd for a in chain(vals, sfs, ams)) and \
            set(map(attrgetter("dtype"), sfs)) == {_U8}:
        return (list(vals), list(sfs), list(ams)), True
    vals = [_arrays.to_backend(a, backend, f"values[{i}]") for i, a in enumerate(vals)]
    sfs = [_arrays.as_scale_bytes(_arrays.to_backend(a, backend, f"scale_factors[{i}]"),
                                  f"scale_factors[{i}]") for i, a in enumerate(sfs)]
    ams = [_arrays.to_backend(a, backend, f"amax[{i}]") for i, a in enumerate(ams)]
    return (vals, sfs, ams), False


def _first(group, bad) -> int:
    return next(i for i, a in enumerate(group) if bad(a))


def _check_gpu_blocks(vals, sfs, ams) -> None:
    """One GPU for every block, and C-contiguous values and scale bytes."""
    dev = vals[0].data.device_id
    for name, group in (("values", vals), ("scale_factors", sfs), ("amax", ams)):
        if set(map(attrgetter("data.device_id"), group)) != {dev}:
            i = _first(group, lambda a: a.data.device_id != dev)
            raise ValueError(f"{name}[{i}] is on GPU {group[i].data.device_id} but "
                             f"values[0] is on GPU {dev}: all blocks must be on one GPU")
    for name, group in (("values", vals), ("scale_factors", sfs)):
        if not all(map(attrgetter("flags.c_contiguous"), group)):
            i = _first(group, lambda a: not a.flags.c_contiguous)
            raise ValueError(f"{name}[{i}] must be C-contiguous")



@on_input_device
def dequantize_pool(values: ArrayLike, scale_factors: ArrayLike, amax: ArrayLike,
                    block_ids: IndexLike, num_heads: int, block_token_size: int,
                    dtype: DTypeLike = "bfloat16", e2m1_max: float = LONGLIVE_E2M1_MAX,
                    e4m3_max: float | None = None, *, scale_rule: str | None = None,
                    out: Array | None = None) -> Array:
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
    num_heads, block_token_size : int
        ``H`` and ``Tb``; ``Tb*H`` rounded up to 128 must be ``Rp`` (``ValueError``).
        Only the product can be checked: a swap of the two decodes scrambled rows.
    dtype : {"bfloat16", "float16", "float32"}
        Ignored when ``out`` is given.
    e2m1_max : float, default 6.0
    e4m3_max : float, optional
        256 (LongLive's default) for blocks quantized with ``"4over6"``, 448 for
        ``"static6"``.  A stacked pool no longer knows its rule: pass this or
        ``scale_rule`` (no default: ``TypeError`` when both are missing).
    scale_rule : {"4over6", "static6"}, optional
        The rule that quantized the pool (sets ``e4m3_max``).
    out : ndarray, optional
        ``(1, n*Tb, H, D)`` output.

    On the GPU this is one kernel launch: no host synchronization, and with ``out`` no
    allocation, so it can be captured in a CUDA graph.

    Examples
    --------
    >>> import numpy as np
    >>> from fp4cache import longlive
    >>> rng = np.random.default_rng(1)
    >>> blocks = [longlive.quantize_block(rng.standard_normal((8, 2, 64)).astype(np.float32))
    ...           for _ in range(4)]                       # 4over6: e4m3_max=256
    >>> values, scale_factors, amax = (np.stack(a) for a in zip(*blocks))
    >>> values.shape, scale_factors.shape, amax.shape
    ((4, 128, 32), (4, 512), (4, 1))
    >>> y = longlive.dequantize_pool(values, scale_factors, amax, np.array([3, 0]), 2, 8,
    ...                              scale_rule="4over6")
    >>> y.shape
    (1, 16, 2, 64)
    >>> bool((y[0, :8] == longlive.dequantize([blocks[3]])[0]).all())
    True
    """
    key = _hotpath.longlive_signature("pool", (values, scale_factors, amax, block_ids),
                                      num_heads, block_token_size, dtype, e2m1_max, e4m3_max,
                                      out, scale_rule)
    hit = _hotpath.LONGLIVE_POOL.get(key) if key is not None else None
    if hit is not None:  # same arrays as a validated earlier call: launch straight away
        run, shape, dt = hit
        if out is None:
            out = _arrays.array_module("cuda").empty(shape, dtype=dt)
        run(out)
        return out
    H, Tb = _check_counts(num_heads, block_token_size)
    e4m3_max = _resolve_e4m3_max(e4m3_max, scale_rule, None)
    backend = _arrays.backend_of(values)
    values = _arrays.to_backend(values, backend, "values")
    scale_factors = _arrays.as_scale_bytes(
        _arrays.to_backend(scale_factors, backend, "scale_factors"), "scale_factors")
    amax = _arrays.to_backend(amax, backend, "amax")
    if values.ndim != 3:
        raise ValueError(f"values must be 3-D (N, Rp, D/2), got shape {values.shape}")
    N = values.shape[0]
    if scale_factors.ndim != 2 or scale_factors.shape[0] != N:
        raise ValueError(f"scale_factors must be 2-D (N={N}, Rp*D/16), got {scale_factors.shape}")
    if amax.dtype != np.float32 or amax.size != N:
        raise ValueError(f"amax must be float32 with N={N} entries, got {amax.dtype} {amax.shape}")
    if N == 0:
        raise ValueError("values must hold at least one block (N >= 1), got shape "
                         f"{tuple(values.shape)}")
    Rp, D = _check_block_arrays([values[0]], [scale_factors[0]], [amax.reshape(N, 1)[0]], H, Tb)
    inv = inverse_global_denominator(e2m1_max, e4m3_max)
    dt = resolve_dtype(dtype) if out is None else resolve_dtype(out.dtype, name="out.dtype")
    if backend == "cuda":
        for name, a in (("values", values), ("scale_factors", scale_factors), ("amax", amax)):
            if not a.flags.c_contiguous:
                raise ValueError(f"{name} must be C-contiguous")
    # Checked last because a list or NumPy ids array is copied to the GPU here.
    ids = _arrays.to_backend(block_ids, backend, "block_ids", allow_convert=True)
    _arrays.check_index_array(ids, "block_ids")
    n = ids.shape[0]
    shape = (1, n * Tb, H, D)
    xp = _arrays.array_module(backend)
    if out is None:
        out = xp.empty(shape, dtype=dt)
    else:
        out = _arrays.check_out(out, "out", shape, dt, backend)
    if n == 0:
        return out
    impl = _backend.backend(backend)
    if backend == "cpu":
        if int(ids.min()) < 0 or int(ids.max()) >= N:
            raise IndexError(f"block_ids must be in [0, {N}), got min {int(ids.min())} "
                             f"max {int(ids.max())}")
        idl = [int(i) for i in ids]
        impl.longlive_dequantize([values[i] for i in idl], [scale_factors[i] for i in idl],
                                 [amax.reshape(N, 1)[i] for i in idl], out, num_heads=H,
                                 block_token_size=Tb, inv_denom=inv)
        return out
    run = impl.longlive_pool_launcher(values, scale_factors, amax, ids, D, out.dtype,
                                      out.data.ptr % 16 == 0, num_heads=H,
                                      block_token_size=Tb, inv_denom=inv)
    run(out)
    if ids is block_ids and ids.flags.c_contiguous:  # the launch reads block_ids itself
        if key is not None:
            _hotpath.LONGLIVE_POOL.put(key, (run, out.shape, out.dtype))
    return out



def _check_counts(num_heads, block_token_size):
    for name, val in (("num_heads", num_heads), ("block_token_size", block_token_size)):
        if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val <= 0:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    return int(num_heads), int(block_token_size)


def _check_block_arrays(vals, sfs, ams, H, Tb):
    """``(Rp, D)`` of equally shaped blocks whose rows match ``Tb*H`` (padded to 128)."""
    v0 = vals[0]
    if v0.ndim != 2:
        raise ValueError(f"values[0] must be 2-D (Rp, D/2), got shape {tuple(v0.shape)}")
    Rp, half = v0.shape
    D = 2 * half
    _check_head_dim(D, "head_dim (2*values[0].shape[1])")
    want = longlive_padded_rows(Tb, H)
    if Rp != want:
        raise ValueError(
            f"num_heads={H} and block_token_size={Tb} do not match the blocks: "
            f"values[0] has Rp = {Rp} rows, but block_token_size*num_heads = {Tb * H} rows "
            f"pad to {want} (Rp is Tb*H rounded up to a multiple of 128)"
        )
    S = D // GROUP
    checks = (
        ("values", vals, "dtype", {_U8}, TypeError, "must have dtype uint8"),
        ("values", vals, "shape", {(Rp, half)}, ValueError, f"must have shape {(Rp, half)}"),
        ("scale_factors", sfs, "size", {Rp * S}, ValueError,
         f"must hold Rp*D/16 = {Rp * S} bytes"),
        ("amax", ams, "dtype", {_F32}, TypeError, "must be a float32 array with one element"),
    )
    for name, group, attr, ok, exc, what in checks:
        if not set(map(attrgetter(attr), group)) <= ok:
            i = _first(group, lambda a, attr=attr, ok=ok: getattr(a, attr) not in ok)
            got = group[i]
            raise exc(f"{name}[{i}] {what}, got {got.dtype} {tuple(got.shape)}")
    if min(map(attrgetter("size"), ams)) < 1:
        i = _first(ams, lambda a: a.size < 1)
        raise ValueError(f"amax[{i}] must be a float32 array with one element, got an empty "
                         f"array of shape {tuple(ams[i].shape)}")
    return Rp, D
