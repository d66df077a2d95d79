"""``PagedKVCache``: a paged NVFP4 KV cache in vLLM's byte layout.

The class holds the public methods with their NumPy docstrings and examples; the work is
elsewhere: argument checks in ``_arrays``, attention in ``attention``, the pool and the
launches in the backends (``_cpu``, ``_cuda``), plans and workspace in ``_plans``.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np

from . import _abi, _arrays, _hotpath, attention, pages
from . import store as _store
from ._backend import Pool, backend
from ._device import DeviceGuard, array_device, parse_device
from .formats import check_rule, rotation_supported
from .layout import PageGeometry
from .typing import Array, ArrayLike, DeviceLike, DTypeLike, IndexLike, PageFormat, PathLike

__all__ = ["PagedKVCache"]

_STAT = _abi.STAT
#: Counters of badly scaled groups: K and V saturated, K and V underflowed.
_SCALE_STATS = [_STAT[f"{side}_{what}_groups"] for what in ("saturated", "underflow")
                for side in "kv"]
_NO_GUARD = contextlib.nullcontext()
_FLAG = (bool, type(None))  # classes of an optional flag that need no check
def _check_pool_fits(impl, num_blocks: int, geom: PageGeometry, index: int | None,
                     own_pages: bool = True) -> None:
    """``ValueError`` naming ``num_blocks``, the bytes the pool needs and the memory
    available (host ``MemAvailable``, or the GPU's free memory), before allocating."""
    from ._device import format_bytes

    need = impl.allocation_bytes(geom, num_blocks, own_pages)
    have, where = impl.memory_available(index)
    if have is not None and need > have:
        raise ValueError(
            f"num_blocks = {num_blocks} is too many for this machine: its page pool needs "
            f"{format_bytes(need)} ({need} bytes: num_blocks * {need // num_blocks} bytes a "
            f"page{impl.PAGE_EXTRAS}), but {where}; pass at most about num_blocks = "
            f"{max(0, have * num_blocks // need)}")


def _external_pages(buffer, geom: PageGeometry, num_blocks, kind: str, index):
    """The caller's page memory as the pool, ``(num_blocks, 2, side_bytes)`` uint8, a view
    (no copy): checked for its backend, device, dtype, contiguity, alignment and size."""
    page = 2 * geom.side_bytes
    buf = _arrays.to_backend(buffer, kind, "buffer")
    on = array_device(buf)
    if on != index:
        raise ValueError(f"buffer is on GPU {on}; device is cuda:{index}")
    if buf.dtype not in (np.uint8, np.int8):
        raise TypeError(f"buffer must hold bytes (uint8 or int8), got {buf.dtype}")
    if not buf.flags.c_contiguous:
        raise ValueError("buffer must be C-contiguous (its pages one after another, each "
                         "[K data | K scales | V data | V scales])")
    address = _arrays.address(buf)
    if address % 16:
        raise ValueError(f"buffer must start at a 16-byte aligned address, got {address:#x}")
    rows = int(buf.shape[0]) if buf.ndim > 1 else None
    n = num_blocks if num_blocks is not None else rows if rows is not None \
        else buf.size // page
    if (rows is not None and rows != n) or buf.size != n * page or n <= 0:
        raise ValueError(
            f"buffer must hold num_blocks pages of {page} bytes (2 * block_size * num_heads "
            f"* (head_dim / 2 + head_dim / 16)), its first axis the page index"
            f"{'' if num_blocks is None else f' (num_blocks = {num_blocks})'}; got shape "
            f"{tuple(buf.shape)} ({buf.size} bytes)")
    return buf.view(np.uint8).reshape(n, 2, geom.side_bytes)


def _check_window_options(geom: PageGeometry, rotation, window_pages,
                          window_slots) -> tuple[str, int, int]:
    """The checked ``rotation``, ``window_pages`` and ``window_slots`` of a cache."""
    if rotation not in ("none", "hadamard"):
        raise ValueError(f"rotation must be 'none' or 'hadamard', got {rotation!r}")
    d = geom.head_dim
    if rotation == "hadamard" and not rotation_supported(d):
        raise ValueError(f"rotation='hadamard' needs a power-of-two head_dim from 16 to 256, "
                         f"got head_dim = {d}")
    for name, value in (("window_pages", window_pages), ("window_slots", window_slots)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if (window_pages == 0) != (window_slots == 0):
        raise ValueError(f"window_pages and window_slots are both 0 (no window) or both "
                         f"positive, got {window_pages} and {window_slots}")
    if window_pages and geom.block_size % 16:
        raise ValueError(f"an exact window needs block_size % 16 == 0, got block_size = "
                         f"{geom.block_size}")
    if window_pages > 64:
        raise ValueError(f"window_pages must be at most 64, got {window_pages}")
    return rotation, int(window_pages), int(window_slots)


class PagedKVCache:
    """A paged KV cache that stores K and V in NVFP4, byte-compatible with vLLM.

    Parameters
    ----------
    num_blocks : int or None
        Pages in the pool (None with ``buffer``: its first axis).
    block_size : int
        Tokens per page (``T``).
    num_heads : int
        KV heads (``H``).
    head_dim : int
        ``D``; a multiple of 16 (of 64 when ``swizzle_v_scales``).
    layout : {"HND", "NHD"}
        Row order inside a page side: head-major (vLLM's default for NVFP4) or
        token-major.
    scale_rule : {"static6", "4over6"}
        Block-scale rule used by :meth:`store`.
    k_scale, v_scale : float
        Global dequantization multipliers (vLLM's ``k_scale``/``v_scale``), finite and
        positive.  Use ``fp4cache.calibrate_scale(x, scale_rule)`` with this cache's
        ``scale_rule`` (the one rule, stated there: ``amax / (6 * 448)`` for
        ``"static6"``, ``amax / (6 * 256)`` for ``"4over6"``, whose 4-candidate must stay
        below 448); with 1.0, data far from unit magnitude under- or overflows the E4M3
        block scales.
    swizzle_v_scales : bool
        Store V scales in trtllm-gen's swizzled order (what vLLM writes).  Needs
        ``block_size % 4 == 0`` and ``head_dim % 64 == 0``.
    device : None, "cpu", "cuda", "cuda:N", int or cupy.cuda.Device
        ``"cpu"``: NumPy backend; a GPU: CuPy kernels on that GPU (``"cuda"``: the
        current one at construction).  ``None``: the current GPU when one is usable,
        else the CPU.  The cache owns its device: every call runs there, on that
        device's current CuPy stream, whatever device is current, and leaves the
        current device unchanged.
    validate : bool, optional
        Check slot ids and block ids on the host before each call, raising
        ``IndexError`` before anything is written.  On the GPU the default is ``False``:
        no host synchronization on the hot path; out-of-range ids are skipped by the
        kernels (nothing outside the pool is read or written), counted on the device,
        and :meth:`check` raises for them.  The CPU backend always validates (it has no
        synchronization to save): ``validate=False`` here has no effect there and warns
        (``UserWarning``); a per-call ``validate=False`` of :meth:`store` or
        :meth:`gather_dequant` reproduces the GPU's deferred behaviour, for tests.
    max_batch_size, max_seq_len, num_query_heads : int, optional
        Workspace hints (GPU; kept but unused on the CPU): the largest batch ``B``, the
        longest sequence (block tables of up to ``ceil(max_seq_len / block_size)``
        columns; default ``num_blocks * block_size``) and the most query heads ``Hq``
        (default ``16 * num_heads``, the largest GQA group) of the
        :meth:`decode_attention` calls to come.  Given ``max_batch_size``, the cache
        reserves at construction the split-KV workspace that every such call needs, on
        any GPU, so those calls never allocate it (CUDA-graph capture, see below).
        Without hints the workspace grows to the largest call seen.
    rotation : {"none", "hadamard"}
        ``"hadamard"``: store K rotated by the normalized Hadamard transform along
        ``head_dim`` (a power of two) and rotate q in the attention kernels, so scores
        are unchanged and NVFP4's error on K shrinks; :meth:`gather_dequant` still
        returns K in the original basis (``docs/window.md``).  Calibrate ``k_scale`` on
        ``fp4cache.hadamard(k)``.
    window_pages, window_slots : int
        The exact window (``docs/window.md``): attention reads the newest
        ``window_pages`` pages of every sequence that are mapped to one of
        ``window_slots`` bf16 pages (:meth:`map_window`) from there, exactly, and the
        rest from the NVFP4 pages.  Both 0 (the default) or both positive; needs
        ``block_size % 16 == 0``.
    buffer : array, optional
        Page memory the caller owns and keeps alive (an engine's KV cache tensor, given
        as a CuPy or NumPy array or through DLPack / ``__cuda_array_interface__``, e.g. a
        PyTorch uint8 tensor): uint8 or int8, C-contiguous, 16-byte aligned, its first
        axis the page index and ``num_blocks * 2 * side_bytes`` bytes in all (vLLM's
        NVFP4 shape ``(num_blocks, 2, block_size, num_heads, head_dim // 2 +
        head_dim // 16)`` is one such).  The cache reads and writes it in place, with the
        same checks and guarantees as its own pool; its bytes are not cleared and not
        counted in :attr:`nbytes`.  ``device`` defaults to the buffer's.

    Attributes
    ----------
    device : {"cpu", "cuda"}
        The backend; ``device_id`` is the GPU index (``None`` on the CPU).
    buffer : ndarray, uint8, shape (num_blocks, 2, H*T*(D/2 + D/16))
        The page pool, zero-initialized.  ``buffer[b, 0]`` is page ``b``'s K side and
        ``buffer[b, 1]`` its V side, each ``[data | scales]`` as in vLLM.
    geometry : PageGeometry
        Sizes and offset formulas of one page.

    Notes
    -----
    Kernels run on CuPy's current stream; calls on one stream are ordered.  Use events
    to order a ``store`` on one stream before a ``gather_dequant`` on another.

    Memory and CUDA graphs (GPU).  Besides the pool the cache holds a few small tables,
    at most 256 prepared launches (host objects, least recently used dropped first) and
    one workspace for :meth:`decode_attention`'s split-KV partials and merge tickets,
    shared by every call: its size is what the hints ask for, or grows (at least
    doubling) to the largest call seen; :attr:`nbytes` and ``repr`` show it.  Nothing a
    captured graph may use is freed or moved while the cache lives: outgrown workspace
    buffers are kept (together at most the size of the current one) until
    :meth:`release_workspace`.  A call that needs more workspace than the cache holds
    while the current stream is capturing raises ``RuntimeError`` naming the hints to
    raise; run each shape once before capturing, or give the hints.  Calls of
    :meth:`decode_attention` on different streams share the workspace: order them
    (events), as with FlashInfer's workspace buffer.

    Examples
    --------
    >>> import numpy as np, fp4cache
    >>> k = np.linspace(-1, 1, 32 * 2 * 64, dtype=np.float32).reshape(32, 2, 64)
    >>> cache = fp4cache.PagedKVCache(4, 16, 2, 64, k_scale=fp4cache.calibrate_scale(k),
    ...                               v_scale=fp4cache.calibrate_scale(k), device="cpu")
    >>> cache.buffer.shape, cache.bytes_per_token, round(cache.compression_ratio, 2)
    ((4, 2, 1152), 144, 3.56)
    """

    def __init__(self, num_blocks: int, block_size: int, num_heads: int, head_dim: int, *,
                 layout: str = "HND", scale_rule: str = "static6", k_scale: float = 1.0,
                 v_scale: float = 1.0, swizzle_v_scales: bool = True,
                 device: DeviceLike | None = None,
                 validate: bool | None = None, max_batch_size: int | None = None,
                 max_seq_len: int | None = None, num_query_heads: int | None = None,
                 rotation: str = "none", window_pages: int = 0,
                 window_slots: int = 0, buffer: ArrayLike | None = None) -> None:
        swizzle_v_scales = _arrays.check_bool(swizzle_v_scales, "swizzle_v_scales")
        validate = _arrays.check_bool(validate, "validate", optional=True)
        geom = PageGeometry(num_heads, block_size, head_dim, layout, swizzle_v_scales)
        geom.check()
        if buffer is not None and device is None:
            device = "cpu" if _arrays.backend_of(buffer) == "cpu" else int(
                _arrays.to_backend(buffer, "cuda", "buffer").data.device_id)
        if (num_blocks is not None or buffer is None) and (
                not isinstance(num_blocks, (int, np.integer)) or isinstance(num_blocks, bool)
                or num_blocks <= 0):
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.scale_rule = check_rule(scale_rule)
        rotation, window_pages, window_slots = _check_window_options(
            geom, rotation, window_pages, window_slots)
        k_s = _arrays.check_scale(k_scale, "k_scale")
        v_s = _arrays.check_scale(v_scale, "v_scale")
        if device is None:
            device = "cuda" if _arrays.gpu_available() else "cpu"
        kind, index = parse_device(device)
        impl = backend(kind)
        pages = None
        if buffer is not None:
            with DeviceGuard(index):
                pages = _external_pages(buffer, geom, num_blocks, kind, index)
            num_blocks = pages.shape[0]
        _check_pool_fits(impl, int(num_blocks), geom, index, own_pages=pages is None)
        self._hints = attention.workspace_hints(geom, int(num_blocks), max_batch_size,
                                                max_seq_len, num_query_heads)
        # the backend makes and owns the pool: pages, counters, window, plans, workspace
        self._pool = impl.new_pool(geom, device_id=index, num_blocks=int(num_blocks),
                                   pages=pages, k_s=k_s, v_s=v_s, validate=bool(validate),
                                   scale_rule=self.scale_rule, rotation=rotation,
                                   window_pages=window_pages, window_slots=window_slots)
        if self._pool.checks_are_free and validate is False:
            warnings.warn(f"PagedKVCache(validate=False) has no effect on the {kind.upper()} "
                          "backend: it always checks slot and block ids on the host, before "
                          "writing", UserWarning, stacklevel=2)
        self.device = kind
        self.device_id = index
        self.geometry = geom
        self.num_blocks = self._pool.num_blocks
        self.buffer = self._pool.buffer
        self._reserve_workspace()
        self._scales_warned = False  # the store's warning about badly scaled groups

    @property
    def owns_pages(self) -> bool:
        """False for a cache over pages its caller owns (``PagedKVCache(buffer=...)``):
        :attr:`nbytes` does not count them."""
        return self._pool.owns_pages

    @property
    def pool(self) -> Pool:
        """The cache's pool as its backend made and owns it (:class:`fp4cache._backend.Pool`:
        pages, counters, global scales, exact window, prepared launches, workspace), which
        the library's front ends (:class:`fp4cache.AttentionPlan` among them) and the
        benchmarks take; integrations use this class's public methods instead.  The pages
        and counters are the cache's own (writing them changes the cache)."""
        return self._pool

    @property
    def validate(self) -> bool:
        """The default of every method's ``validate=None``: check ids and lengths on the
        host before any work (always True on the CPU)."""
        return self._pool.validate

    @validate.setter
    def validate(self, value: bool) -> None:
        value = _arrays.check_bool(value, "validate")
        self._pool.validate = value or self._pool.checks_are_free

    def _reserve_workspace(self) -> None:
        """The split-KV workspace every call within the hints needs (none without hints, or
        where the pool has no workspace)."""
        ws = self._pool.workspace
        if not self._hints or ws is None:
            return
        nbytes, tickets = self._pool.backend.workspace_bound(self.geometry, **self._hints)
        with self._guard():
            ws.reserve(nbytes, tickets, hint=", ".join(f"{k}={v}" for k, v in
                                                      self._hints.items()))

    def share_workspace(self, other: PagedKVCache) -> None:
        """Run this cache's attention with ``other``'s workspace from now on.

        For caches whose calls are ordered on one stream, such as the layers of one
        model: each call is done with the split-KV scratch before the next begins, so one
        workspace serves them all instead of one per layer.  This cache's own workspace is
        freed and its prepared launches dropped (run the calls before capturing them in a
        CUDA graph again); ``nbytes`` counts a share of the shared one in each cache.
        :meth:`release_workspace` on any of them leaves it to the others.  Nothing
        happens on the CPU (no workspace there).

        Examples
        --------
        >>> import fp4cache
        >>> layers = [fp4cache.PagedKVCache(8, 16, 2, 64, device="cpu") for _ in range(3)]
        >>> for layer in layers[1:]:
        ...     layer.share_workspace(layers[0])
        """
        if not isinstance(other, PagedKVCache):
            raise TypeError(f"other must be a PagedKVCache, got {type(other).__name__}")
        if (other._pool.device, other._pool.device_id) != (self._pool.device,
                                                           self._pool.device_id):
            raise ValueError("other is on another device than this cache: a workspace is "
                             "shared on one device")
        with self._guard():
            self._pool.share_workspace(other._pool)

    def release_workspace(self) -> None:
        """Free the decode-attention workspace and drop the prepared launches.

        Synchronizes the device first.  CUDA graphs captured before this call must not
        be replayed after it (their workspace is gone); the next calls prepare their
        launches again and take a new workspace as they need it (the hints' reservation
        is made again).  The only call that frees memory a graph may use; the CPU
        backend has nothing to free.
        """
        self._pool.release()
        self._reserve_workspace()

    @property
    def workspace_hints(self) -> dict[str, int]:
        """The workspace hints in force (``max_batch_size``, ``max_seq_len``,
        ``num_query_heads``), empty without ``max_batch_size``."""
        return dict(self._hints)

    # -- properties ---------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.geometry.block_size

    @property
    def num_heads(self) -> int:
        return self.geometry.num_heads

    @property
    def head_dim(self) -> int:
        return self.geometry.head_dim

    @property
    def layout(self) -> str:
        return self.geometry.layout

    @property
    def k_scale(self) -> float:
        return float(self._pool.k_s)

    @property
    def v_scale(self) -> float:
        return float(self._pool.v_s)

    @property
    def num_slots(self) -> int:
        """Token slots in the pool: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes per token for K and V over all heads."""
        return self.geometry.bytes_per_token

    @property
    def compression_ratio(self) -> float:
        """bf16 bytes per token over NVFP4 bytes per token (3.56 for D=128)."""
        return 2 * self.num_heads * self.head_dim * 2 / self.bytes_per_token

    @property
    def nbytes(self) -> int:
        """Memory the cache owns, in bytes: the page pool, plus on the GPU its counters,
        encode table, duplicate-slot claim table (4 bytes per slot) and the workspace of
        :meth:`decode_attention` and of page transfers through host memory
        (:attr:`workspace_nbytes`)."""
        return self._pool.nbytes

    @property
    def workspace_nbytes(self) -> int:
        """Device bytes of the decode-attention workspace: what the hints reserved or the
        largest call needed, plus outgrown buffers kept for graphs (0 on the CPU; the
        whole of a workspace shared with other caches, :meth:`share_workspace`)."""
        ws = self._pool.workspace
        return 0 if ws is None else ws.nbytes

    def _guard(self):
        return self._pool.guard()

    @property
    def stats(self) -> dict[str, int]:
        """Device-side counters (reads them back: synchronizes on the GPU).

        ``k/v_nonfinite_groups``: groups stored with a NaN/Inf (they decode to NaN);
        ``bad_slots``, ``bad_block_ids``: ids skipped by unvalidated GPU calls;
        ``k/v_saturated_groups``: groups whose block scale was clipped at E4M3's 448
        (it wanted more than 464, so it would have rounded above 448: values lost, the
        global scale is too small; a calibrated scale's top group wants 448.00003,
        which rounds to 448 and is not counted); ``k/v_underflow_groups``: nonzero
        groups whose block scale came out zero or subnormal (precision lost: the global
        scale is too large).  :func:`fp4cache.calibrate_scale` picks a scale that avoids
        both.
        """
        with self._guard():
            vals = self._pool.to_host(self._pool.stats)
        return {k: int(v) for k, v in zip(_abi.STAT_NAMES, vals)}

    @property
    def nonfinite_groups(self) -> tuple[int, int]:
        """Groups of 16 stored with a NaN/Inf so far, ``(k_groups, v_groups)``.

        Such groups decode to NaN (see ``docs/errors.md``).
        """
        st = self.stats
        return st["k_nonfinite_groups"], st["v_nonfinite_groups"]

    @property
    def saturated_groups(self) -> tuple[int, int]:
        """Groups whose block scale saturated at 448 so far, ``(k_groups, v_groups)``:
        the scale wanted more than 464 (see :attr:`stats`)."""
        st = self.stats
        return st["k_saturated_groups"], st["v_saturated_groups"]

    @property
    def underflow_groups(self) -> tuple[int, int]:
        """Nonzero groups whose block scale was zero or subnormal, ``(k_groups, v_groups)``."""
        st = self.stats
        return st["k_underflow_groups"], st["v_underflow_groups"]

    def check(self) -> None:
        """Raise ``IndexError`` if earlier calls met out-of-range slots or block ids.

        With ``validate=False`` on the GPU, kernels skip such ids and count them; this
        reads the counters (a host synchronization) and, if any is set, clears those two
        counters and raises.  The non-finite counters are kept (see
        :meth:`reset_counters`).

        Examples
        --------
        >>> import numpy as np, fp4cache
        >>> cache = fp4cache.PagedKVCache(2, 16, 1, 64, device="cpu")
        >>> k = np.ones((1, 1, 64), np.float32)
        >>> cache.store(np.array([40]), k, k, validate=False)   # skipped and counted
        >>> cache.check()
        Traceback (most recent call last):
        ...
        IndexError: 1 token(s) had a slot_mapping entry outside [0, num_slots = 32) other ...
        >>> cache.check()                                       # the counters were cleared
        """
        st = self.stats
        if st["bad_slots"] or st["bad_block_ids"]:
            with self._guard():
                self._pool.stats[_STAT["bad_slots"]] = 0
                self._pool.stats[_STAT["bad_block_ids"]] = 0
            raise IndexError(
                f"{st['bad_slots']} token(s) had a slot_mapping entry outside [0, "
                f"num_slots = {self.num_slots}) other than -1 and were not stored; "
                f"{st['bad_block_ids']} block id(s) were outside [0, {self.num_blocks}) "
                "(nothing outside the pool was read or written for them): a read "
                "(gather_dequant, decode_attention, attention, read_blocks) gave NaN for "
                "each, a copy_blocks pair or write_blocks row with one was skipped (its "
                "destination kept its bytes)"
            )

    def reset_counters(self) -> None:
        """Zero every device-side counter (see :attr:`stats`).

        Examples
        --------
        >>> import numpy as np, fp4cache
        >>> cache = fp4cache.PagedKVCache(2, 16, 1, 64, device="cpu")
        >>> k = np.full((1, 1, 64), np.nan, np.float32)
        >>> cache.store(np.array([0]), k, k)
        >>> cache.nonfinite_groups                  # 4 groups of 16 in K, 4 in V
        (4, 4)
        >>> cache.reset_counters()
        >>> cache.nonfinite_groups
        (0, 0)
        """
        with self._guard():
            self._pool.stats[...] = 0

    def __repr__(self) -> str:
        """Sizes and settings, plus the counters of groups stored badly so far (saturated
        or underflowed scales, NaN/Inf), where any is nonzero (reads the counters back:
        synchronizes on the GPU)."""
        g = self.geometry
        st = self.stats
        flagged = [f"{what} groups (k, v) = ({st['k_' + what + '_groups']}, "
                   f"{st['v_' + what + '_groups']})"
                   for what in ("saturated", "underflow", "nonfinite")
                   if st["k_" + what + "_groups"] or st["v_" + what + "_groups"]]
        ws = self.workspace_nbytes
        return (
            f"PagedKVCache(num_blocks={self.num_blocks}, block_size={g.block_size}, "
            f"num_heads={g.num_heads}, head_dim={g.head_dim}, layout={g.layout!r}, "
            f"scale_rule={self.scale_rule!r}, k_scale={self.k_scale:g}, "
            f"v_scale={self.v_scale:g}, swizzle_v_scales={g.swizzle_v_scales}, "
            f"device={self.device if self.device_id is None else f'cuda:{self.device_id}'!r}"
            + "".join(f", {k}={v}" for k, v in self._hints.items()) + ")"
            f"  # {self.bytes_per_token} B/token, "
            f"{self.compression_ratio:.2f}x vs bf16, pool {(self.nbytes - ws) / 2**20:.1f} MiB"
            + (f", workspace {ws / 2**20:.1f} MiB" if self._pool.workspace is not None else "")
            + "".join(f"; {f}" for f in flagged)
        )

    # -- store ---------------------------------------------------------------------------
    def store(self, slot_mapping: IndexLike, k: ArrayLike, v: ArrayLike, *,
              unique_slots: bool = True, validate: bool | None = None) -> None:
        """Quantize K and V and write them into their pages.

        Parameters
        ----------
        slot_mapping : array of int32 or int64, shape (N,)
            Slot of each token, ``block * block_size + offset``.  ``-1`` (vLLM's padding
            id) is skipped and not counted.  Any other negative entry, like one
            ``>= num_slots``, is a bad slot: ``IndexError`` when validating, else the
            token is skipped and counted in ``stats["bad_slots"]`` (:meth:`check` raises).
        k, v : array, shape (N, H, D), bfloat16, float16 or float32
            Keys and values, any token and head strides (same dtype for both).
        unique_slots : bool, default True
            ``True``: no slot repeats among the non-negative entries, as in every slot
            mapping a serving engine builds (vLLM's are unique by construction); when
            validating, a repeated slot raises ``ValueError``, otherwise such a slot
            holds an unspecified mix of its tokens' groups.  ``False``: slots may repeat
            and the last occurrence wins (the GPU adds a scan in the kernel for up to
            128 tokens, else a claim pass before the store and a clear pass after it).
        validate : bool, optional
            Override the cache's ``validate`` for this call.

        Raises
        ------
        TypeError, ValueError
            Wrong dtype, shape, strides, device or backend, or (when validating) a
            repeated slot with ``unique_slots=True``; the buffer is untouched.
        IndexError
            (when validating) a slot is ``>= num_slots`` or negative other than ``-1``;
            nothing is written.

        Warns
        -----
        UserWarning
            (CPU backend, once per cache) more than half of the call's nonzero groups of
            K or of V saturated or underflowed their block scale: ``k_scale`` /
            ``v_scale`` do not fit the data (:func:`fp4cache.calibrate_scale`).  On the
            GPU the counters are not read back (that would synchronize): :attr:`stats`,
            ``repr`` and :attr:`saturated_groups` / :attr:`underflow_groups` report them.

        Examples
        --------
        >>> import numpy as np, fp4cache
        >>> cache = fp4cache.PagedKVCache(4, 16, 1, 64, device="cpu")
        >>> k = np.full((3, 1, 64), 6.0, np.float32)     # exact in NVFP4 with scale 1.0
        >>> cache.store(np.array([17, -1, 18]), k, -k)   # page 1 rows 1 and 2; -1 skipped
        >>> kk, vv = cache.gather_dequant([1], dtype="float32")
        >>> kk[1:3, 0, :2].tolist(), vv[1, 0, 0].item(), bool(kk[0].any())
        ([[6.0, 6.0], [6.0, 6.0]], -6.0, False)
        """
        if unique_slots.__class__ is not bool or validate.__class__ not in _FLAG:
            unique_slots = _arrays.check_bool(unique_slots, "unique_slots")
            validate = _arrays.check_bool(validate, "validate", optional=True)
        check = self._pool.validate if validate is None else validate
        # Hot path of a decode step: arguments whose kind, shape, dtype, strides,
        # alignment and devices were checked before go straight to their launch.
        pool = self._pool
        if not check and _hotpath.run(
                pool, _hotpath.store_signature(slot_mapping, k, v, unique_slots), slot_mapping,
                k, v) is not _hotpath.MISS:
            return
        with self._guard():
            # counters the host reads for free: a badly scaled call is told at once
            before = None if self._scales_warned or not pool.checks_are_free \
                else pool.stats[_SCALE_STATS].copy()
            stored = _store.store(pool, slot_mapping, k, v, bool(unique_slots), check)
            if before is not None and stored is not None:
                self._warn_scales(pool.stats[_SCALE_STATS] - before, *stored)

    def _warn_scales(self, new: np.ndarray, slots, k, v) -> None:
        """``UserWarning``, once per cache, when the groups a CPU store just counted as
        saturated or underflowed (``new``: the counters' increase, ``_SCALE_STATS``) are
        more than half of the call's nonzero groups of K or of V."""
        if not new.any():
            return
        keep = np.asarray(slots) >= 0
        parts = []
        for i, (side, x) in enumerate((("k", k), ("v", v))):
            sat, under = int(new[i]), int(new[2 + i])
            if not sat + under:
                continue
            groups = np.asarray(x)[keep].reshape(-1, self.head_dim // 16, 16)
            if side == "k" and self._pool.rotated:  # stored rotated: a
                # nonzero row's groups are all nonzero
                groups = groups.reshape(groups.shape[0], 1, -1)
            nonzero = int((groups != 0).any(axis=-1).sum()) * (groups.shape[-1] // 16)
            if 2 * (sat + under) > nonzero:
                parts.append(f"{side.upper()}: {sat} saturated and {under} underflowed of "
                             f"{nonzero} nonzero groups ({side}_scale = "
                             f"{getattr(self, side + '_scale'):g})")
        if parts:
            self._scales_warned = True
            warnings.warn(
                f"PagedKVCache.store: most groups of this call lost their values to the "
                f"E4M3 block scales ({'; '.join(parts)}, scale_rule={self.scale_rule!r}): "
                "the global scale does not fit the data. Pass k_scale / v_scale = "
                "fp4cache.calibrate_scale(x, scale_rule) of representative K / V when "
                "making the cache. Warned once per cache; stats and repr keep counting.",
                UserWarning, stacklevel=4)

    # -- gather --------------------------------------------------------------------------
    def gather_dequant(self, blocks: IndexLike, dtype: DTypeLike | None = None, *,
                       out: tuple[Array, Array] | None = None,
                       validate: bool | None = None) -> tuple[Array, Array]:
        """Gather pages and decode them.

        Parameters
        ----------
        blocks : array of int32 or int64, shape (n,)
            Page ids, in output order; repeats allowed.
        dtype : {"bfloat16", "float16", "float32"}, optional
            Output dtype; default bfloat16, or the dtype of ``out``.
        out : tuple of two arrays, optional
            ``(k_out, v_out)``, each C-contiguous ``(n*block_size, H, D)``, aligned to
            their itemsize and not overlapping.
        validate : bool, optional
            Override the cache's ``validate`` for this call.

        Returns
        -------
        k, v : arrays, shape (n*block_size, H, D)
            Token ``i*block_size + t`` is row ``t`` of page ``blocks[i]``.

        On the GPU this neither allocates (given ``out``) nor synchronizes (unless
        validating), so it can be captured in a CUDA graph.

        Examples
        --------
        >>> import numpy as np, fp4cache
        >>> cache = fp4cache.PagedKVCache(4, 16, 2, 64, device="cpu")
        >>> cache.store(np.arange(16, 32), np.full((16, 2, 64), 6.0, np.float32),
        ...             np.zeros((16, 2, 64), np.float32))
        >>> k, v = cache.gather_dequant(np.array([1, 1, 0]))  # bfloat16, (3*16, 2, 64)
        >>> k.shape, str(k.dtype), float(k[:32].min()), float(k[32:].max())
        ((48, 2, 64), 'bfloat16', 6.0, 0.0)
        >>> cache.gather_dequant([])[0].shape                # an empty gather
        (0, 2, 64)
        """
        if validate.__class__ not in _FLAG:
            validate = _arrays.check_bool(validate, "validate", optional=True)
        check = self._pool.validate if validate is None else validate
        if not check:
            res = _hotpath.gather(self._pool, _hotpath.gather_signature(blocks, dtype, out),
                                  blocks, dtype, out)
            if res is not _hotpath.MISS:
                return res
        with self._guard():
            return _store.gather(self._pool, blocks, dtype, out, check)

    # -- attention -----------------------------------------------------------------------
    def decode_attention(self, q: ArrayLike, block_tables: IndexLike, seq_lens: IndexLike, *,
                         sm_scale: float | None = None, out: Array | None = None,
                         lse_out: Array | None = None, return_lse: bool = False,
                         validate: bool | None = None,
                         new_kv: tuple[ArrayLike, ArrayLike] | None = None
                         ) -> Array | tuple[Array, Array]:
        """Attention of one query token per sequence over its cached K/V pages.

        ``softmax(sm_scale * q K^T) V`` over the first ``seq_lens[b]`` tokens of sequence
        ``b``, where K and V are exactly the float32 values :meth:`gather_dequant` returns
        (global scales included), read from the pages without a bf16 copy.

        Parameters
        ----------
        q : array, shape (B, Hq, D), bfloat16, float16 or float32
            One query per sequence.  ``Hq`` is a multiple of ``num_heads`` with
            ``Hq // num_heads`` in 1..16 (GQA): query head ``h`` reads KV head
            ``h // (Hq // num_heads)``, as in vLLM and FlashInfer.
        block_tables : array of int32 or int64, shape (B, max_blocks)
            vLLM's block table: row ``b`` lists the pages of sequence ``b`` in order.
            Entries past ``ceil(seq_lens[b] / block_size)`` are ignored (they may be -1).
        seq_lens : array of int32 or int64, shape (B,)
            Tokens of each sequence, ``0 <= seq_lens[b] <= max_blocks * block_size``.
        sm_scale : float, optional
            Multiplier of the scores, finite and > 0; default ``1/sqrt(D)`` (used in
            float32).
        out : array, optional
            C-contiguous ``(B, Hq, D)`` array of ``q``'s dtype to write the result into.
        lse_out : array, optional
            C-contiguous ``(B, Hq)`` float32 array for the log-sum-exp (needs
            ``return_lse=True``).
        return_lse : bool, default False
            Also return ``lse``, the natural log of each softmax denominator.
        validate : bool, optional
            Override the cache's ``validate`` for this call.
        new_kv : (k, v) pair of arrays, shape (B, num_heads, D) each, optional
            The exact new tokens: each sequence's query token is its last cached token
            (at ``seq_lens[b] - 1``, stored first), and its key and value are read from
            row ``b`` of ``k`` / ``v`` (the values the model just computed, in their
            dtype: bfloat16, float16 or float32, one dtype for both) instead of the
            pages, as :meth:`attention` describes.

        Returns
        -------
        out : array, shape (B, Hq, D), ``q``'s dtype
            A sequence of length 0 gives zeros.
        lse : array of float32, shape (B, Hq)
            Only with ``return_lse``; ``-inf`` for a sequence of length 0.

        Raises
        ------
        TypeError, ValueError
            Wrong kind, dtype or shape of an argument, a bad ``sm_scale``, or (on the
            CPU, or when validating) a ``seq_lens`` entry outside ``[0, max_blocks *
            block_size]``.
        IndexError
            (when validating) a block id outside ``[0, num_blocks)`` in the used part of
            a row; nothing is computed.
        RuntimeError
            (GPU) the call needs more workspace than the cache holds while the current
            stream is capturing a CUDA graph (see the class notes); nothing is launched.

        Without validation (the GPU default) a bad block id is counted
        (``stats["bad_block_ids"]``, :meth:`check` raises) and the outputs of its
        sequence are NaN; nothing outside the pool is read.  A K group stored as NaN
        makes the outputs of the query heads that attend to it NaN (a V group: those 16
        channels).  On the GPU the call neither synchronizes (unless validating) nor,
        given ``out`` (and ``lse_out``), allocates, once a call of this signature has run
        (the first one may take workspace, see the class notes: under CUDA-graph capture
        it raises ``RuntimeError`` rather than allocate).
        """
        if validate.__class__ not in _FLAG or return_lse.__class__ is not bool:
            validate = _arrays.check_bool(validate, "validate", optional=True)
            return_lse = _arrays.check_bool(return_lse, "return_lse")
        pool = self._pool
        if new_kv is None and not (pool.validate if validate is None else validate):
            res = _hotpath.attention(pool, _hotpath.decode_signature(
                q, block_tables, seq_lens, sm_scale, out, lse_out, return_lse), return_lse,
                q, None, block_tables, seq_lens, out, lse_out)
            if res is not _hotpath.MISS:
                return res
        with self._guard():
            return attention.decode_attention(pool, q, block_tables, seq_lens, sm_scale, out,
                                              lse_out, return_lse, validate, new_kv)

    def attention(self, q: ArrayLike, query_start_loc: IndexLike, block_tables: IndexLike,
                  seq_lens: IndexLike, *, max_query_len: int | None = None,
                  causal: bool = True, sm_scale: float | None = None,
                  out: Array | None = None, lse_out: Array | None = None,
                  return_lse: bool = False, validate: bool | None = None,
                  new_kv: tuple[ArrayLike, ArrayLike] | None = None
                  ) -> Array | tuple[Array, Array]:
        """Attention of any number of query tokens per sequence over its cached K/V pages.

        Serves speculative-decoding verification (a few query tokens per sequence),
        chunked prefill and mixed batches (hundreds of tokens for some sequences, one for
        others) in one call, in vLLM's flattened layout: ``softmax(sm_scale * q K^T) V``
        where K and V are exactly the float32 values :meth:`gather_dequant` returns
        (global scales included), read from the pages without a bf16 copy.
        :meth:`decode_attention` is the case of one query token per sequence.

        Parameters
        ----------
        q : array, shape (num_tokens, Hq, D), bfloat16, float16 or float32
            The query tokens of all sequences concatenated in order.  ``Hq`` is a
            multiple of ``num_heads`` with ``Hq // num_heads`` in 1..16 (GQA): query head
            ``h`` reads KV head ``h // (Hq // num_heads)``.
        query_start_loc : array of int32 or int64, shape (B + 1,)
            Non-decreasing from 0 to ``num_tokens`` (vLLM's ``query_start_loc``,
            FlashInfer's ``qo_indptr``, FlashAttention's ``cu_seqlens_q``): sequence
            ``b`` owns the rows ``query_start_loc[b] : query_start_loc[b + 1]`` of ``q``,
            ``n_b`` of them (0 is allowed).
        block_tables : array of int32 or int64, shape (B, max_blocks)
            vLLM's block table, as in :meth:`decode_attention`.
        seq_lens : array of int32 or int64, shape (B,)
            Cached tokens of each sequence, *including* this step's ``n_b`` query tokens
            (store them first), ``0 <= seq_lens[b] <= max_blocks * block_size``.
        max_query_len : int, optional
            A host bound on every ``n_b`` (vLLM's and FlashAttention's
            ``max_query_len`` / ``max_seqlen_q``): with it, a GPU call neither
            synchronizes nor (given ``out`` and ``lse_out``) allocates, so it can be
            captured in a CUDA graph.  Omitted, it is computed from
            ``query_start_loc``, which on the GPU is one host synchronization (a
            device-to-host copy of one integer).  With ``max_query_len * group <= 16``
            (32 for bf16 / float16 q and ``head_dim`` 64 or 128) the call is one launch
            of the decode-attention kernel (each page decoded once for all of a
            sequence's rows); a larger bound adds a second launch for the sequences of
            more rows.
        causal : bool, default True
            Query ``i`` of sequence ``b`` (``0 <= i < n_b``) sees the keys ``0 ..
            seq_lens[b] - n_b + i``: the query tokens are the last ``n_b`` cached tokens
            (bottom-right alignment, as in FlashInfer and FlashAttention).  ``False``:
            every query sees all ``seq_lens[b]`` keys.
        sm_scale : float, optional
            Multiplier of the scores, finite and > 0; default ``1/sqrt(D)`` (used in
            float32).
        out : array, optional
            C-contiguous ``(num_tokens, Hq, D)`` array of ``q``'s dtype for the result.
        lse_out : array, optional
            C-contiguous ``(num_tokens, Hq)`` float32 array for the log-sum-exp (needs
            ``return_lse=True``).
        return_lse : bool, default False
            Also return ``lse``, the natural log of each softmax denominator.
        validate : bool, optional
            Override the cache's ``validate`` for this call.
        new_kv : (k, v) pair of arrays, shape (num_tokens, num_heads, D) each, optional
            The exact new tokens: the keys and values of this step's query tokens as the
            model computed them (bfloat16, float16 or float32, one dtype for both; row
            ``i`` belongs to query row ``i``), stored in the pages first as usual.  With
            ``L_b = seq_lens[b]``, sequence ``b`` reads its keys at positions ``p >= L_b -
            n_b`` from row ``query_start_loc[b] + p - (L_b - n_b)`` (their value in
            float64; with ``rotation="hadamard"`` that key is rotated too, as ``q`` is,
            which leaves the scores unchanged) and the earlier ones from the pages and the
            exact window as without it; masking as above, one softmax over both.  A
            one-pass prefill is then attention over the model's K/V.  Needs ``n_b <=
            seq_lens[b]`` (checked on the CPU or when validating).  The pages of those tokens are
            not read (a bad block id there is still counted, and does not make them
            NaN).  On the GPU the new values enter the kernels' f16 inputs as the
            window's do (times the global scale's inverse, saturated at f16's range; K
            rotated in float32), and a NaN in a new V row makes its group of 16 columns NaN
            for the rows that see that token (the pages' rule); the sm_90 wgmma kernel
            and the few-row decode kernel do not read new rows, so every sequence of such
            a call runs in the mma.sync any-length kernel.  Default None: every key is
            read through the pages.

        Returns
        -------
        out : array, shape (num_tokens, Hq, D), ``q``'s dtype
            A query that sees no key (a sequence of length 0 with ``causal=False``)
            gives zeros.
        lse : array of float32, shape (num_tokens, Hq)
            Only with ``return_lse``; ``-inf`` where a query sees no key.

        Raises
        ------
        TypeError, ValueError
            Wrong kind, dtype or shape of an argument, a bad ``sm_scale``, ``causal`` or
            ``max_query_len``; (on the CPU, or when validating) a ``seq_lens`` entry
            outside ``[0, max_blocks * block_size]``, a ``query_start_loc`` that does not
            rise from 0 to ``num_tokens``, an ``n_b`` above ``max_query_len`` or (with
            ``causal``) above ``seq_lens[b]``.
        IndexError
            (when validating) a block id outside ``[0, num_blocks)`` in the used part of
            a row; nothing is computed.

        Notes
        -----
        The rules of :meth:`decode_attention` hold row by row.  Without validation (the
        GPU default) a bad block id is counted (``stats["bad_block_ids"]``,
        :meth:`check` raises) and the rows that see a token of its page are NaN (other
        rows of that sequence are exact on the CPU; on the GPU they may be NaN too);
        nothing outside the pool is read.  A K group stored as NaN makes the outputs of
        the query heads whose rows see its token NaN (a V group: those 16 channels).  On
        the GPU without validation, ``n_b > seq_lens[b]`` is not checked: a row that sees
        no key gives zeros and ``lse = -inf``; ``query_start_loc`` must hold the values
        above and ``max_query_len`` must bound every ``n_b``, or the results are
        undefined (nothing outside the arguments and the pool is read or written).

        Examples
        --------
        Two sequences: one verifies 3 speculative tokens after 17 cached ones, the other
        decodes one token after 4.

        >>> import numpy as np, fp4cache
        >>> cache = fp4cache.PagedKVCache(8, 16, 2, 64, device="cpu")
        >>> rng = np.random.default_rng(0)
        >>> kv = rng.standard_normal((cache.num_slots, 2, 64), dtype=np.float32)
        >>> cache.store(np.arange(cache.num_slots), kv, kv)
        >>> q = rng.standard_normal((4, 8, 64), dtype=np.float32)     # 3 + 1 tokens, GQA 4
        >>> out = cache.attention(q, np.array([0, 3, 4]), np.array([[0, 1], [2, -1]]),
        ...                       np.array([20, 5]), max_query_len=3)
        >>> out.shape
        (4, 8, 64)
        >>> dec = cache.decode_attention(q[3:], np.array([[2, -1]]), np.array([5]))
        >>> bool(np.array_equal(out[3], dec[0]))                       # n_b = 1 is decode
        True
        """
        pool = self._pool
        if new_kv is None and max_query_len is not None and not (
                pool.validate if validate is None else validate):
            res = _hotpath.attention(pool, _hotpath.varlen_signature(
                q, query_start_loc, block_tables, seq_lens, sm_scale, out, lse_out, return_lse,
                causal, max_query_len), return_lse, q, query_start_loc, block_tables, seq_lens,
                out, lse_out)
            if res is not _hotpath.MISS:
                return res
        with self._guard():
            return attention.attention(pool, q, query_start_loc, block_tables, seq_lens,
                                       max_query_len, causal, sm_scale, out, lse_out,
                                       return_lse, validate, new_kv)

    # -- moving pages (fp4cache/pages.py) --------------------------------------------------
    def page_format(self) -> PageFormat:
        """What a receiver needs to read this cache's pages: a small JSON-able dict.

        Keys: ``format`` and ``version`` (of the byte layout), ``layout``, ``block_size``,
        ``num_heads``, ``head_dim``, ``page_bytes``, ``scale_rule``, ``swizzle_v_scales``
        and the global ``k_scale`` / ``v_scale`` (float32 values, exact as Python floats).
        :meth:`write_blocks` (``page_format=``), :meth:`load_pages` and :meth:`load`
        refuse pages whose format differs in any field, with a ``ValueError`` naming it.

        Examples
        --------
        >>> import fp4cache
        >>> fmt = fp4cache.PagedKVCache(4, 16, 2, 64, device="cpu").page_format()
        >>> fmt["layout"], fmt["page_bytes"], fmt["k_scale"], fmt["swizzle_v_scales"]
        ('HND', 2304, 1.0, True)
        """
        return pages.page_format(self._pool)

    def map_window(self, blocks: IndexLike, slots: IndexLike, *,
                   validate: bool | None = None) -> None:
        """Map pages to slots of the exact window (``docs/window.md``): attention reads a
        sequence's newest ``window_pages`` pages that are mapped from their slots, in
        bf16, instead of from NVFP4.

        ``window_map[blocks[i]] = slots[i]``; ``-1`` unmaps.  A newly mapped slot is
        filled from its page at once (its values dequantized, in bf16), so a window never
        holds stale tokens; from then on :meth:`store` writes the page's tokens to both.
        Map a page before its first token is stored to keep every token exact.  Engines
        keep a ring of ``window_pages`` slots per running sequence: when a sequence
        starts page ``p``, map it to slot ``base + p % P`` and unmap page ``p - P`` in the
        same call.  One launch on the GPU, no host synchronization unless validating, so
        it can be captured in a CUDA graph.

        Parameters
        ----------
        blocks : array of int32 or int64, shape (n,)
            Page ids, each at most once.
        slots : array of int32 or int64, shape (n,)
            Window slots in ``[0, window_slots)``, or -1.
        validate : bool, optional
            Override the cache's ``validate`` for this call: ids in range, and no slot
            held by two pages after the call.

        Raises
        ------
        ValueError
            The cache has no window, lengths differ, a block repeats, or (validating) a
            slot would hold two pages; nothing is written.
        IndexError
            (validating) a block or slot out of range; nothing is written.

        Examples
        --------
        >>> import numpy as np, fp4cache
        >>> cache = fp4cache.PagedKVCache(8, 16, 1, 64, window_pages=2, window_slots=2,
        ...                               device="cpu")
        >>> cache.map_window([5, 6], [0, 1])
        >>> cache.window_map[4:8].tolist()
        [-1, 0, 1, -1]
        """
        with self._guard():
            pages.map_window(self._pool, blocks, slots, validate)

    @property
    def window_map(self) -> Array | None:
        """The block -> window slot map, int32 ``(num_blocks,)`` (-1: none; the cache's
        own array, on its device), or None without a window."""
        return self._pool.window_map

    @property
    def window(self) -> Array | None:
        """The window slots, uint16 bfloat16 bits ``(window_slots, 2, block_size, H, D)``
        (``[s, 0]`` K, ``[s, 1]`` V; the cache's own array), or None without a window."""
        return self._pool.window

    @property
    def rotation(self) -> str:
        """``"none"`` or ``"hadamard"`` (K stored rotated)."""
        return self._pool.rotation

    @property
    def window_pages(self) -> int:
        """Pages per sequence read from the exact window (0: none)."""
        return self._pool.window_pages

    @property
    def window_slots(self) -> int:
        """Slots of the exact window (0: none)."""
        return self._pool.window_slots

    def copy_blocks(self, src: IndexLike, dst: IndexLike, *,
                    validate: bool | None = None) -> None:
        """Page ``dst[i]`` becomes a byte copy of page ``src[i]`` (K and V, data and scales).

        Every read of a page happens before any write of it, so ``src`` and ``dst`` may
        overlap as sets (``copy_blocks([1, 2], [2, 1])`` swaps two pages) and ``src`` may
        repeat (one page copied to several).  On the GPU: two kernel launches on the
        current stream (one counts each page's readers and writer, the other streams each
        source page into its destination, or through a staging row when the destination
        still has readers; see ``kernels/page_copy.cu``), no host synchronization (unless
        validating) and no allocation once the workspace fits (with int32/int64 device ids
        of one dtype), so it can be captured in a CUDA graph and replayed with new ids.
        Memory: the cache's workspace holds ``n * page_bytes`` bytes of staging rows
        (grown to the largest ``n`` copied) and ``2 * num_blocks`` uint32 counters that are
        zero between calls, taken at the first GPU call and kept (counted in
        :attr:`nbytes`); under CUDA-graph capture a call that needs more raises
        ``RuntimeError`` (run one of that size before capturing).

        Parameters
        ----------
        src, dst : array of int32 or int64, shape (n,)
            Page ids; ``dst`` must not repeat an id.
        validate : bool, optional
            Override the cache's ``validate`` for this call.

        Raises
        ------
        ValueError
            ``src`` and ``dst`` of different lengths, or ``dst`` repeats an id (checked
            whenever the ids are on the host, or when validating); nothing is written.
        IndexError
            (when validating) an id outside ``[0, num_blocks)``; nothing is written.
        RuntimeError
            (GPU) the call needs more workspace than the cache holds while the current
            stream is capturing a CUDA graph; nothing is written.

        Without validation (the GPU default) an id outside the pool is counted in
        ``stats["bad_block_ids"]`` (:meth:`check` raises) and its pair is skipped: nothing
        outside the pool is written.  A repeated ``dst`` among device ids that are not
        validated gets the bytes of one of its sources (which one is unspecified).

        Examples
        --------
        >>> import numpy as np, fp4cache
        >>> cache = fp4cache.PagedKVCache(4, 16, 1, 64, device="cpu")
        >>> cache.store(np.arange(16), np.ones((16, 1, 64), np.float32),
        ...             np.ones((16, 1, 64), np.float32))
        >>> cache.copy_blocks([0, 1], [1, 0])                 # swap pages 0 and 1
        >>> bool(cache.buffer[0].any()), bool(cache.buffer[1].any())
        (False, True)
        """
        with self._guard():
            pages.copy_blocks(self._pool, src, dst, validate)

    def read_blocks(self, blocks: IndexLike, out: Array | None = None, *,
                    validate: bool | None = None) -> Array:
        """The raw bytes of pages ``blocks``, as a ``(n, page_bytes)`` uint8 array.

        Parameters
        ----------
        blocks : array of int32 or int64, shape (n,)
            Page ids, in row order; repeats allowed.
        out : array, optional
            C-contiguous ``(n, page_bytes)`` uint8 array: on the cache's backend, or, for
            a GPU cache, a NumPy array in host memory (best pinned:
            :func:`fp4cache.pinned_empty`).  Without it, an array on the cache's backend.
        validate : bool, optional
            Override the cache's ``validate`` for this call.

        Returns
        -------
        out : array of uint8, shape (n, page_bytes)
            Row ``i`` is page ``blocks[i]``: K side then V side, as in :attr:`buffer`.

        Into host memory the copy is asynchronous on the current stream: one
        ``cudaMemcpyAsync`` for ids given on the host that are consecutive, else a gather
        into the cache's workspace (at most 64 MiB, counted in
        :attr:`nbytes`) and one copy per chunk.  **The host may read** ``out`` once the
        stream has passed the call: after ``cupy.cuda.get_current_stream().synchronize()``
        or an event recorded after it has completed (pageable ``out`` is written
        synchronously).  Without validation an id outside the pool is counted and its row
        is a page that decodes to NaN (data 0, scale bytes 0x7F).

        Examples
        --------
        >>> import numpy as np, fp4cache
        >>> cache = fp4cache.PagedKVCache(4, 16, 1, 64, device="cpu")
        >>> rows = cache.read_blocks(np.array([3, 0]))
        >>> rows.shape, rows.dtype == np.uint8, cache.geometry.page_bytes
        ((2, 1152), True, 1152)
        """
        with self._guard():
            return pages.read_blocks(self._pool, blocks, out, validate)

    def write_blocks(self, blocks: IndexLike, data: ArrayLike, *,
                     page_format: PageFormat | None = None,
                     validate: bool | None = None) -> None:
        """Write raw pages: page ``blocks[i]`` becomes ``data[i]`` (the inverse of
        :meth:`read_blocks`).

        Parameters
        ----------
        blocks : array of int32 or int64, shape (n,)
            Page ids, no repeats.
        data : array of uint8, shape (n, page_bytes), C-contiguous
            Host (NumPy, best pinned) or device (CuPy) memory.  From host memory the copy
            is asynchronous on the current stream (pinned ``data`` must stay unchanged
            until the stream has passed the call).
        page_format : dict, optional
            The :meth:`page_format` of the cache the pages come from: any field that
            differs from this cache's is a ``ValueError`` naming it.
        validate : bool, optional
            Override the cache's ``validate`` for this call.

        Raises
        ------
        TypeError, ValueError
            Wrong dtype, shape or kind of ``data``, a differing ``page_format`` field,
            or repeated ids (checked when the ids are on the host or when validating).
        IndexError
            (when validating) an id outside ``[0, num_blocks)``.

        In every case nothing is written.  Without validation an id outside the pool
        is counted (:meth:`check` raises) and its row skipped.

        Examples
        --------
        >>> import numpy as np, fp4cache
        >>> a = fp4cache.PagedKVCache(4, 16, 1, 64, device="cpu")
        >>> b = fp4cache.PagedKVCache(4, 16, 1, 64, device="cpu")
        >>> a.store(np.arange(16), np.ones((16, 1, 64), np.float32),
        ...         np.ones((16, 1, 64), np.float32))
        >>> b.write_blocks([2], a.read_blocks([0]), page_format=a.page_format())
        >>> bool((b.buffer[2] == a.buffer[0]).all())
        True
        """
        with self._guard():
            pages.write_blocks(self._pool, blocks, data, page_format, validate)

    def save(self, path: PathLike, blocks: IndexLike | None = None) -> None:
        """Save pages (default: all) with their ids and :meth:`page_format` to one
        ``safetensors`` file (tensors ``pages`` (n, page_bytes) uint8 and ``blocks``
        int64; the format in the metadata).  Needs ``safetensors`` (``pip install
        'fp4cache[io]'``).  Synchronizes with the current stream on the GPU.  The
        counters (:attr:`stats`) are not saved."""
        with self._guard():
            pages.save(self._pool, path, blocks)

    @classmethod
    def load(cls, path: PathLike, *, device: DeviceLike | None = None,
             validate: bool | None = None) -> PagedKVCache:
        """A new cache holding the pages of a file written by :meth:`save`, at their ids,
        with the saved geometry, rule and scales, on ``device`` (as in the constructor:
        a file saved from a GPU cache loads on the CPU and vice versa, byte for byte).

        Examples
        --------
        >>> import os, tempfile, numpy as np, fp4cache
        >>> cache = fp4cache.PagedKVCache(4, 16, 1, 64, k_scale=0.5, device="cpu")
        >>> cache.store(np.arange(20), np.ones((20, 1, 64), np.float32),
        ...             np.ones((20, 1, 64), np.float32))
        >>> path = os.path.join(tempfile.mkdtemp(), "prompt.safetensors")
        >>> cache.save(path, blocks=[0, 1])
        >>> back = fp4cache.PagedKVCache.load(path, device="cpu")
        >>> back.k_scale, bool((back.buffer[:2] == cache.buffer[:2]).all())
        (0.5, True)
        """
        return pages.load(cls, path, device, validate)

    def load_pages(self, path: PathLike, blocks: IndexLike | None = None) -> np.ndarray:
        """Write the pages of a file saved by :meth:`save` into this cache: at ``blocks``
        (one id per saved page, e.g. pages just allocated for the request) or at their
        saved ids.  The file's page format must equal this cache's (``ValueError``
        naming the first differing field; nothing is written).  Returns the ids written
        (NumPy int64).  Synchronizes with the current stream on the GPU."""
        with self._guard():
            return pages.load_pages(self._pool, path, blocks)
