"""The engine-facing API: an :class:`AttentionPlan` built once per batch step and run by
every layer of it.

An engine step (decode, speculative verification, a chunked prefill, or a batch that mixes
them) is described once, in vLLM's flattened form: ``query_start_loc`` (where each
sequence's query tokens start in the step's token axis), ``seq_lens`` (each sequence's
length after the step), ``block_tables`` (each sequence's pages, in order) and
``slot_mapping`` (where each new token's K/V go).  :meth:`AttentionPlan.plan` copies them
into the plan's own device buffers, whose addresses never change; then
:meth:`AttentionPlan.run` stores one layer's new K/V by slot and attends over that layer's
:class:`~fp4cache.PagedKVCache`, once per layer.  Every launch a ``run`` makes reads the
metadata from those buffers, so a step captured in a CUDA graph (``torch.cuda.graph`` or
CuPy's stream capture) replays correctly after the next :meth:`~AttentionPlan.plan`, as
FlashInfer's plan / run wrappers do.

``run`` allocates nothing on the device when ``out`` is given (or when the inputs are
PyTorch tensors: ``out`` then comes from PyTorch's allocator, which graph capture
handles), and never synchronizes the host; the checks and the kernel choice happen at the
first ``run`` of each (layer, argument shapes) pair, so run every shape once before
capturing it.  Arrays of a framework with its own current stream (PyTorch) run on that
stream; others on CuPy's current stream.

:class:`WindowRing` is the exact window's ring policy (``docs/window.md``): which pages of
each sequence to map to, or unmap from, the window slots after a step.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import numpy as np

from . import _arrays, attention
from . import store as _store
from ._device import DeviceGuard, external_stream, parse_device
from ._plans import PlanCache
from .typing import Array, ArrayLike, DeviceLike, IndexLike

__all__ = ["AttentionPlan", "WindowRing"]

_NO_GUARD = contextlib.nullcontext()
#: Prepared (layer, signature) launches a plan keeps, least recently used dropped first.
MAX_RUNS = 1024


def _positive(value, name: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _torch_stream(a) -> int | None:
    """The handle of PyTorch's current stream on ``a``'s device for a PyTorch CUDA tensor
    (the stream PyTorch's own kernels, and a ``torch.cuda.graph`` capture, use), else
    None.  PyTorch is not imported here: a tensor means it already is."""
    if type(a).__module__.split(".")[0] != "torch" or not a.is_cuda:
        return None
    return sys.modules["torch"].cuda.current_stream(a.device).cuda_stream


#: The signature of an argument of a kind the plan keeps no launch for (checked each call).
_UNCACHED = object()


def _signature(a) -> Any:
    """What a prepared launch depends on of array ``a``: kind, shape, dtype, strides,
    pointer alignment and device (never the values or the address); :data:`_UNCACHED`
    for other kinds of argument."""
    if a is None:
        return None
    t = type(a)
    if t is np.ndarray:
        return (t, a.shape, a.dtype, a.strides, _arrays.address(a) & 15)
    if _arrays.is_cupy(a):
        return (t, a.shape, a.dtype, a.strides, a.data.ptr & 15, a.data.device_id)
    if hasattr(a, "data_ptr") and hasattr(a, "stride"):  # a PyTorch tensor
        return (t, tuple(a.shape), a.dtype, a.stride(), a.data_ptr() & 15, a.device,
                a.requires_grad)
    return _UNCACHED


class _Run:
    """A prepared ``run`` of one layer: its store and attention launches (``exact``: the
    attention reads the stored ``k`` / ``v`` as given, ``new_kv``)."""

    __slots__ = ("pool", "store", "attend", "alloc", "stream", "exact")

    def __init__(self, pool, store, attend, alloc, stream, exact=False) -> None:
        self.pool, self.store, self.attend = pool, store, attend
        self.alloc, self.stream, self.exact = alloc, stream, exact


class AttentionPlan:
    """One batch step's attention metadata, planned once and run by every layer.

    Parameters
    ----------
    max_batch_size : int
        Most sequences of a step.
    max_num_tokens : int
        Most new (query) tokens of a step, all sequences together.
    max_blocks_per_seq : int
        Columns of the block table: the most pages of one sequence.  Every planned table
        is kept at this width (columns past a sequence's pages are never read).
    device : None, "cpu", "cuda", "cuda:N" or int
        Where the plan's buffers live: the device of the caches it runs (``None``: the
        current GPU when one is usable, else the CPU).

    Notes
    -----
    Memory: ``(max_batch_size + 1) * 4 + max_batch_size * 4 * (1 + max_blocks_per_seq) +
    max_num_tokens * 8`` bytes of metadata (:attr:`nbytes`), plus at most ``MAX_RUNS``
    prepared launches (host objects).  The layers' workspaces stay with their caches.

    Examples
    --------
    A step of two sequences: one decodes a token after 20 cached ones, the other
    prefills 3 tokens; both layers run from one plan.

    >>> import numpy as np, fp4cache
    >>> layers = [fp4cache.PagedKVCache(8, 16, 2, 64, device="cpu") for _ in range(2)]
    >>> plan = fp4cache.AttentionPlan(max_batch_size=4, max_num_tokens=64,
    ...                               max_blocks_per_seq=4, device="cpu")
    >>> _ = plan.plan(query_start_loc=[0, 1, 4], seq_lens=[21, 3],
    ...               block_tables=[[0, 1], [2, -1]], slot_mapping=[20, 32, 33, 34])
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((4, 8, 64), dtype=np.float32)
    >>> k = rng.standard_normal((4, 2, 64), dtype=np.float32)
    >>> outs = [plan.run(layer, q, k, k) for layer in layers]
    >>> outs[0].shape, bool(np.array_equal(outs[0], outs[1]))
    ((4, 8, 64), True)
    """

    def __init__(self, max_batch_size: int, max_num_tokens: int, max_blocks_per_seq: int, *,
                 device: DeviceLike | None = None) -> None:
        self.max_batch_size = _positive(max_batch_size, "max_batch_size")
        self.max_num_tokens = _positive(max_num_tokens, "max_num_tokens")
        self.max_blocks_per_seq = _positive(max_blocks_per_seq, "max_blocks_per_seq")
        if device is None:
            device = "cuda" if _arrays.gpu_available() else "cpu"
        self.device, self.device_id = parse_device(device)
        xp = _arrays.array_module(self.device)
        with self._guard():
            self._qsl = xp.zeros(self.max_batch_size + 1, dtype=np.int32)
            self._seq_lens = xp.zeros(self.max_batch_size, dtype=np.int32)
            self._tables = xp.zeros((self.max_batch_size, self.max_blocks_per_seq),
                                    dtype=np.int32)
            self._slots = xp.full(self.max_num_tokens, -1, dtype=np.int64)
        self._runs = PlanCache(MAX_RUNS)
        self._streams: dict[tuple[int, int], Any] = {}
        self._step: tuple | None = None  # (B, N, max_query_len, causal, decode)
        self._views: tuple = ()
        self._host: tuple | None = None  # host copies of the metadata, for value checks
        self._checked: set[tuple[int, int]] = set()  # (block_size, num_blocks) checked

    def _guard(self):
        return DeviceGuard(self.device_id)

    @property
    def nbytes(self) -> int:
        """Bytes of the plan's metadata buffers (on its device)."""
        return int(sum(a.nbytes for a in (self._qsl, self._seq_lens, self._tables,
                                          self._slots)))

    @property
    def batch_size(self) -> int:
        """Sequences of the planned step (0 before :meth:`plan`)."""
        return 0 if self._step is None else self._step[0]

    @property
    def max_query_len(self) -> int:
        """Most query tokens of one sequence in the planned step."""
        return 0 if self._step is None else self._step[2]

    # -- plan -------------------------------------------------------------------------------
    def plan(self, query_start_loc: IndexLike, seq_lens: IndexLike, block_tables: IndexLike,
             slot_mapping: IndexLike | None = None, *, max_query_len: int | None = None,
             causal: bool = True) -> AttentionPlan:
        """Describe the next step: copy its metadata into the plan's buffers.

        Parameters
        ----------
        query_start_loc : array of int, shape (B + 1,)
            ``query_start_loc[b]:query_start_loc[b + 1]`` are sequence ``b``'s query
            tokens, in the step's token axis (``[0, N]``, non-decreasing).
        seq_lens : array of int, shape (B,)
            Each sequence's length including the step's tokens.
        block_tables : array of int, shape (B, n), ``n <= max_blocks_per_seq``
            Each sequence's pages in order.
        slot_mapping : array of int, shape (N,), optional
            Each new token's slot (``block * block_size + offset``; -1: not stored), for
            :meth:`run` with ``k`` / ``v``.
        max_query_len : int, optional
            ``max(query_start_loc[b + 1] - query_start_loc[b])``; computed when omitted
            (one host synchronization for device arrays).
        causal : bool
            Query token ``i`` of a sequence of ``n`` new tokens sees the keys up to
            position ``seq_len - n + i``.

        Host arrays (NumPy, lists) are checked here (lengths, order, sizes); device arrays
        are copied on the device as given (the kernels skip and count out-of-range ids).
        The copies are asynchronous, in order on the current stream (PyTorch's for
        PyTorch tensors, else CuPy's): plan on the stream the runs use, so that a step's
        launches still queued read their own metadata.  Call it outside a CUDA-graph
        capture; the next :meth:`run` calls, captured or not, read what it copied.
        Returns the plan.
        """
        causal = _arrays.check_bool(causal, "causal")
        if max_query_len is not None:
            max_query_len = attention._check_max_query_len(max_query_len)
        qsl = self._intake(query_start_loc, "query_start_loc", 1)
        sl = self._intake(seq_lens, "seq_lens", 1)
        bt = self._intake(block_tables, "block_tables", 2)
        sm = None if slot_mapping is None else self._intake(slot_mapping, "slot_mapping", 1)
        B = int(sl.shape[0])
        if B > self.max_batch_size:
            raise ValueError(f"seq_lens holds {B} sequences; this plan holds "
                             f"max_batch_size = {self.max_batch_size}")
        if qsl.shape[0] != B + 1:
            raise ValueError(f"query_start_loc must have B + 1 = {B + 1} entries (B from "
                             f"seq_lens), got {qsl.shape[0]}")
        if bt.shape[0] != B or bt.shape[1] > self.max_blocks_per_seq:
            raise ValueError(f"block_tables must be (B = {B}, n <= max_blocks_per_seq = "
                             f"{self.max_blocks_per_seq}), got shape {tuple(bt.shape)}")
        if sm is not None and sm.shape[0] > self.max_num_tokens:
            raise ValueError(f"slot_mapping holds {sm.shape[0]} tokens; this plan holds "
                             f"max_num_tokens = {self.max_num_tokens}")
        host = all(isinstance(a, np.ndarray) for a in (qsl, sl, bt))
        if host:
            n = attention._check_query_values(qsl, sl, int(qsl[-1]), causal, max_query_len)
            if int(qsl[-1]) > self.max_num_tokens:
                raise ValueError(f"query_start_loc[-1] = {int(qsl[-1])} tokens; this plan "
                                 f"holds max_num_tokens = {self.max_num_tokens}")
            if sm is not None and isinstance(sm, np.ndarray) and sm.shape[0] != int(qsl[-1]):
                raise ValueError(f"slot_mapping must have one entry per query token "
                                 f"(query_start_loc[-1] = {int(qsl[-1])}), got {sm.shape[0]}")
            longest = int(n.max()) if n.size else 0
            max_query_len = longest if max_query_len is None else max_query_len
            self._host = (sl.astype(np.int64), np.array(bt), n)
        else:
            if max_query_len is None:  # the one host synchronization
                d = qsl[1:] - qsl[:-1]
                max_query_len = int(d.max().get() if _arrays.is_cupy(d) else d.max()) \
                    if B else 0
            self._host = None
        torch_in = next((a for a in (query_start_loc, seq_lens, block_tables, slot_mapping)
                         if _torch_stream(a) is not None), None)
        with self._guard(), self._stream_of(torch_in) if torch_in is not None else _NO_GUARD:
            self._copy(self._qsl[:B + 1], qsl)
            self._copy(self._seq_lens[:B], sl)
            if isinstance(bt, np.ndarray) and bt.shape[1] < self.max_blocks_per_seq:
                # whole rows: one contiguous copy (the columns past a sequence's pages
                # are never read)
                wide = np.zeros((B, self.max_blocks_per_seq), np.int32)
                wide[:, :bt.shape[1]] = bt
                bt = wide
            self._copy(self._tables[:B, :bt.shape[1]], bt)
            if sm is not None:
                self._copy(self._slots[:sm.shape[0]], sm)
        N = None if sm is None else int(sm.shape[0])
        self._step = (B, N, int(max_query_len), causal)
        self._views = (self._qsl[:B + 1], self._seq_lens[:B], self._tables[:B],
                       None if N is None else self._slots[:N])
        self._checked = set()
        return self

    def _intake(self, a, name: str, ndim: int):
        """Metadata as given (host, or device on a GPU plan), an int array of ``ndim``."""
        given = _arrays.backend_of(a)
        where = given if given == self.device else "cpu"
        a = _arrays.to_backend(a, where, name, allow_convert=True)
        attention._check_int_dtype(a, name)
        if a.ndim != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(a.shape)}")
        return a

    def _copy(self, dst, src) -> None:
        if dst.size == 0:
            return
        if isinstance(src, np.ndarray) and not isinstance(dst, np.ndarray):
            # host to device; the destination is contiguous (whole rows)
            dst.set(np.ascontiguousarray(src, dtype=dst.dtype))
        else:
            _arrays.check_device({"metadata": src}, dst)
            dst[...] = src  # on a GPU: an asynchronous copy (and cast) on the current stream

    # -- run --------------------------------------------------------------------------------
    def run(self, cache, q: ArrayLike, k: ArrayLike | None = None, v: ArrayLike | None = None,
            *, out: Array | None = None, sm_scale: float | None = None,
            unique_slots: bool = True, exact_new: bool = False) -> Array:
        """One layer of the planned step: store ``k`` / ``v`` at the planned slots (when
        given) and attend over ``cache``'s pages.

        Parameters
        ----------
        cache : PagedKVCache
            The layer's pages (on the plan's device).
        q : array, shape (N, Hq, D), bfloat16 / float16 / float32
            The step's query tokens, sequence after sequence.
        k, v : arrays, shape (N, H, D), optional
            The step's new keys and values (needs ``slot_mapping`` in :meth:`plan`).
        out : array, shape (N, Hq, D), q's dtype, optional
            Written and returned; default a new array of ``q``'s kind.
        sm_scale : float, optional
            Score scale (default ``1 / sqrt(D)``).
        unique_slots : bool
            As in :meth:`PagedKVCache.store`.
        exact_new : bool, default False
            Attend with the exact new tokens: ``k`` / ``v`` (needed) are stored as
            always, and the step's queries read them as given
            (:meth:`PagedKVCache.attention`'s ``new_kv``) and the earlier tokens through
            the pages.

        Returns
        -------
        out : array, shape (N, Hq, D)
        """
        step = self._step
        if step is None:
            raise RuntimeError("AttentionPlan.run before plan(): describe the step first")
        key = (id(cache), step, _signature(q), _signature(k), _signature(v),
               _signature(out), sm_scale, unique_slots, exact_new)
        try:
            if _UNCACHED in key:
                key = None
        except TypeError:  # an unhashable or uncomparable sm_scale
            key = None
        prep = self._runs.get(key) if key is not None else None
        if prep is None or prep.pool is not getattr(cache, "pool", None):
            prep = self._prepare(cache, q, k, v, out, sm_scale, unique_slots, exact_new)
            if key is not None:
                self._runs.put(key, prep)
        elif self._host is not None and (cache.block_size, cache.num_blocks) not in \
                self._checked:
            self._check_ids(cache)
        return self._launch(prep, q, k, v, out)

    def _launch(self, prep: _Run, q, k, v, out):
        qsl, sl, bt, slots = self._views
        be = self.device
        if out is None:
            out = prep.alloc(q)
        # the stream first: a DLPack import names the consumer's current stream, and
        # PyTorch's own needs no ordering against itself (nothing recorded in a capture)
        if prep.stream:  # on PyTorch's current stream: its tensors are viewed in place
            view = _arrays.stream_view
        else:
            def view(a, name):
                return _arrays.to_backend(a, be, name)
        with self._stream_of(q) if prep.stream else _NO_GUARD:
            qa, oa = view(q, "q"), view(out, "out")
            if prep.store is not None:
                ka, va = view(k, "k"), view(v, "v")
                prep.store(slots, ka, va)
            if prep.attend is not None:
                if prep.exact:
                    prep.attend(qa, qsl, bt, sl, oa, None, new_kv=(ka, va))
                else:
                    prep.attend(qa, qsl, bt, sl, oa, None)
        return out

    def _stream_of(self, a):
        """PyTorch's current stream on ``a``'s device as a CuPy stream (kept per handle)."""
        handle = _torch_stream(a)
        ctx = self._streams.get((handle, self.device_id))
        if ctx is None:

            ctx = self._streams[(handle, self.device_id)] = external_stream(
                handle, self.device_id)
        return ctx

    def _prepare(self, cache, q, k, v, out, sm_scale, unique_slots, exact_new) -> _Run:
        """The checked path: every argument checked against the cache and the plan, the
        launches prepared (kernels compiled, workspace taken) for arrays like these."""
        from .cache import PagedKVCache

        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        pool = cache.pool
        if (pool.device, pool.device_id) != (self.device, self.device_id):
            raise ValueError(f"cache is on {_where(pool.device, pool.device_id)}; this plan "
                             f"on {_where(self.device, self.device_id)}")
        unique_slots = _arrays.check_bool(unique_slots, "unique_slots")
        exact_new = _arrays.check_bool(exact_new, "exact_new")
        if exact_new and (k is None or v is None):
            raise ValueError("exact_new=True attends with the step's new tokens: pass k and v")
        B, N, max_q, causal = self._step
        qsl, sl, bt, slots = self._views
        torch_stream = _torch_stream(q) is not None
        with self._guard(), self._stream_of(q) if torch_stream else _NO_GUARD:
            qa = attention._check_q(pool, q, "num_tokens")
            if not qa.flags.c_contiguous or _arrays.address(qa) % qa.itemsize:
                raise ValueError("q must be C-contiguous (num_tokens, Hq, head_dim) and "
                                 "aligned to its itemsize (the kernels read it in place)")
            _arrays.check_device({"q": qa}, pool.buffer)
            tokens = qa.shape[0]
            if self._host is not None and tokens != int(self._host[2].sum()):
                raise ValueError(f"q holds {tokens} tokens; the plan's query_start_loc[-1] "
                                 f"is {int(self._host[2].sum())}")
            scale = _arrays.check_scale(1.0 / np.sqrt(pool.geometry.head_dim)
                                        if sm_scale is None else sm_scale, "sm_scale")
            alloc = _allocator(q)
            if out is not None:  # an allocated one is q's like by construction
                oa = _arrays.check_out(_arrays.to_backend(out, self.device, "out"), "out",
                                       qa.shape, qa.dtype, self.device)
                if _arrays.share_bytes(oa, qa):
                    raise ValueError("out must not overlap q")
                _arrays.check_device({"out": oa}, pool.buffer)
            store = None
            if k is not None or v is not None:
                store = self._prepare_store(pool, k, v, tokens, unique_slots)
            if self._host is not None:
                self._check_ids(cache)
                if exact_new:
                    attention.check_queries_cached(self._host[2], self._host[0],
                                                   attention.NEW_KV_LENGTHS)
            attend = None
            if tokens and B and max_q > 0:
                decode = max_q == 1 and tokens == B
                exact = {"exact_new": True} if exact_new else {}
                attend = pool.backend.attention_runner(
                    pool, qa, None if decode else qsl, bt, sl, max_query_len=max_q,
                    causal=causal, sm_scale=scale, **exact)
        return _Run(pool, store, attend, alloc, torch_stream, exact_new)

    def _prepare_store(self, pool, k, v, tokens: int, unique_slots: bool):
        slots = self._views[3]
        if k is None or v is None:
            raise ValueError("k and v are given together, or neither")
        if slots is None:
            raise ValueError("run(cache, q, k, v) stores at the planned slot_mapping: pass "
                             "slot_mapping to plan()")
        if slots.shape[0] != tokens:
            raise ValueError(f"q holds {tokens} tokens; the plan's slot_mapping "
                             f"{slots.shape[0]}")
        s, ka, va = _store.check_args(pool, slots, k, v)
        for name, arg in (("k", k), ("v", v)):
            given = _arrays.to_backend(arg, self.device, name)
            if given.strides[-1] != given.itemsize or _arrays.address(given) % given.itemsize:
                raise ValueError(f"{name} must have contiguous values along head_dim at its "
                                 "dtype's alignment (the store reads it in place)")
        if self._host is not None:
            _store.check_slots(pool, s, unique_slots)
        return pool.backend.store_runner(pool, s, ka, va, unique_slots=unique_slots)

    def _check_ids(self, cache) -> None:
        """The planned lengths fit the cache's pages, and the pages a step reads are in
        its pool (host metadata only)."""
        sl, bt, n = self._host
        T = cache.block_size
        attention._check_lengths(bt, sl, T)
        attention._check_block_ids(cache.pool, bt, sl, reads=n > 0)
        self._checked.add((T, cache.num_blocks))

    def __repr__(self) -> str:
        return (f"AttentionPlan(max_batch_size={self.max_batch_size}, max_num_tokens="
                f"{self.max_num_tokens}, max_blocks_per_seq={self.max_blocks_per_seq}, "
                f"device={self.device!r}, batch_size={self.batch_size}, "
                f"max_query_len={self.max_query_len})")


def _where(kind: str, index: int | None) -> str:
    return kind if index is None else f"{kind}:{index}"


def _allocator(q):
    """``alloc(q)``: an uninitialized array like ``q`` of ``q``'s own kind (a PyTorch tensor
    from PyTorch's allocator, which CUDA-graph capture handles)."""
    if isinstance(q, np.ndarray):
        return lambda q: np.empty(q.shape, dtype=q.dtype)
    if _arrays.is_cupy(q):
        import cupy

        return lambda q: cupy.empty(q.shape, dtype=q.dtype)
    if hasattr(q, "new_empty"):
        return lambda q: q.new_empty(q.shape)
    raise TypeError(f"q of type {type(q).__name__}: pass out= (an array of q's shape and "
                    "dtype on the cache's device)")


class WindowRing:
    """The exact window's ring policy (``docs/window.md``): each sequence owns a ring of
    ``window_pages`` window slots, and its page at position ``p`` (0 for its first page)
    maps to slot ``ring * window_pages + p % window_pages``; after a step the newest
    ``window_pages`` pages of every sequence that grew are mapped, older ones unmapped.

    Parameters
    ----------
    window_pages : int
        ``P``: the cache's ``window_pages`` (the newest pages read exact).
    num_blocks : int
        Pages in the pool (the ring remembers which are mapped).

    The moves :meth:`step` returns are the same for every layer of a step: apply them to
    each layer's cache with :meth:`PagedKVCache.map_window` before its store.
    """

    def __init__(self, window_pages: int, num_blocks: int) -> None:
        if not isinstance(window_pages, (int, np.integer)) or isinstance(window_pages, bool) \
                or window_pages < 0:
            raise ValueError(f"window_pages must be a non-negative integer, got "
                             f"{window_pages!r}")
        self.window_pages = int(window_pages)
        self.num_blocks = _positive(num_blocks, "num_blocks")
        self._mapped = np.zeros(self.num_blocks, dtype=bool)

    def slots(self, rings: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The slot of the page at ``positions`` of the sequences owning ``rings``."""
        return (np.asarray(rings, np.int64) * self.window_pages
                + np.asarray(positions, np.int64) % self.window_pages)

    def step(self, block_tables: np.ndarray, rings: np.ndarray, lens_before: np.ndarray,
             lens_after: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``(blocks, slots)`` (int64, slot -1: unmap) that keep the newest
        ``window_pages`` pages of each sequence mapped after a step from ``lens_before``
        to ``lens_after`` tokens, or None when nothing moves.  ``block_tables`` (host,
        one row per sequence) holds each sequence's pages in order, ``rings`` its ring."""
        if not self.window_pages:
            return None
        P = self.window_pages
        lens_before = np.asarray(lens_before, np.int64)
        lens_after = np.asarray(lens_after, np.int64)
        rows = np.flatnonzero(lens_after > lens_before)
        tab = np.asarray(block_tables)[rows]
        n = -(-lens_after[rows] // block_size)[:, None]  # pages in use after the step
        col = np.arange(tab.shape[1])
        want = (col >= n - P) & (col < n)
        inside = (tab >= 0) & (tab < self.num_blocks)
        mapped = np.zeros(tab.shape, dtype=bool)
        mapped[inside] = self._mapped[tab[inside]]
        drop = np.sort(tab[mapped & ~want])
        add_at = np.nonzero(want & ~mapped & inside)
        add = tab[add_at]
        if not (drop.size or add.size):
            return None
        order = np.argsort(add, kind="stable")
        add_slots = self.slots(np.asarray(rings)[rows][add_at[0]], add_at[1])[order]
        add = add[order]
        self._mapped[drop] = False
        self._mapped[add] = True
        return (np.concatenate([drop, add]).astype(np.int64),
                np.concatenate([np.full(drop.size, -1, np.int64), add_slots]))

    def unmap_all(self) -> np.ndarray:
        """The blocks mapped now (to unmap: slot -1 each), forgotten by the ring."""
        blocks = np.flatnonzero(self._mapped).astype(np.int64)
        self._mapped[:] = False
        return blocks

    @property
    def mapped(self) -> np.ndarray:
        """The blocks mapped now (a copy)."""
        return np.flatnonzero(self._mapped)
