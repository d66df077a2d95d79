"""What a cache keeps between calls: prepared launches (:class:`PlanCache`) and the device
workspace its kernels share (:class:`Workspace`).

Both are owned by the pool of one :class:`~fp4cache.PagedKVCache` and bounded:

* :class:`PlanCache` holds at most ``maxsize`` prepared launches (store, gather, decode
  attention; the LongLive module keeps two of its own), dropping the least recently used
  one first.  A plan holds host objects only (kernel, grid, packed arguments, addresses
  of memory its owner keeps), so dropping one frees nothing a captured CUDA graph uses.
* :class:`Workspace` holds the scratch memory of every launch (split-KV partials, merge
  tickets): one buffer that every plan takes views of, sized from the cache's hints at
  construction or grown to the largest request seen.  Memory is never freed or moved
  while a graph may use it: a grown buffer keeps its predecessors (at most as large
  together as itself: it at least doubles) until :meth:`Workspace.release`.

Nothing here imports CuPy at module level: the bound logic runs (and is tested) on the
CPU with NumPy stand-ins for the allocation and the capture test.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["PlanCache", "Workspace", "Scratch", "MAX_PLANS", "ALIGN"]

#: Prepared launches a cache keeps (per kind of call and argument signature).
MAX_PLANS = 256

#: Byte alignment of every view :meth:`Workspace.get` returns (cudaMalloc's, 16-byte
#: vector loads and more).
ALIGN = 256


class PlanCache:
    """A bounded map of prepared launches, least recently used dropped first.

    ``get`` is the hot path of every GPU method (one ordered-dict lookup and a move to
    the end); plans are immutable callables, so two threads may share a cache: a plan
    dropped by one thread while another looks it up is a miss, never a wrong launch.

    Examples
    --------
    >>> plans = PlanCache(2)
    >>> plans.put("a", 1); plans.put("b", 2)
    >>> plans.get("a")          # "a" is now the most recently used
    1
    >>> plans.put("c", 3)       # full: "b" goes
    >>> sorted(plans.keys()), len(plans)
    (['a', 'c'], 2)
    """

    __slots__ = ("_d", "maxsize")

    def __init__(self, maxsize: int = MAX_PLANS) -> None:
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 1:
            raise ValueError(f"maxsize must be a positive integer, got {maxsize!r}")
        self._d: OrderedDict = OrderedDict()
        self.maxsize = maxsize

    def get(self, key: Any) -> Any:
        """The plan stored under ``key`` (now the most recently used), else ``None``."""
        d = self._d
        plan = d.get(key)
        if plan is not None:
            try:
                d.move_to_end(key)
            except KeyError:  # dropped by another thread in between
                pass
        return plan

    def put(self, key: Any, plan: Any) -> None:
        """Store ``plan`` under ``key`` as the most recently used; drop the least recently
        used plans beyond ``maxsize``."""
        d = self._d
        d[key] = plan
        d.move_to_end(key)
        while len(d) > self.maxsize:
            try:
                d.popitem(last=False)
            except KeyError:  # emptied by another thread
                break

    def pop(self, key: Any, default: Any = None) -> Any:
        return self._d.pop(key, default)

    def clear(self) -> None:
        self._d.clear()

    def keys(self) -> list:
        return list(self._d)

    def values(self) -> list:
        return list(self._d.values())

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: Any) -> bool:
        return key in self._d

    def __repr__(self) -> str:
        return f"PlanCache({len(self._d)} of {self.maxsize} plans)"


def _cupy_alloc(nbytes: int, dtype: Any, zero: bool):
    import cupy

    return (cupy.zeros if zero else cupy.empty)(nbytes // np.dtype(dtype).itemsize,
                                                 dtype=dtype)


def _cupy_capturing() -> bool:
    import cupy

    try:
        return bool(cupy.cuda.get_current_stream().is_capturing())
    except cupy.cuda.runtime.CUDARuntimeError:  # the query itself is illegal: a capture
        return True                              # in global mode is going on elsewhere


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


Part = tuple[Any, Any]  # (shape or element count, dtype)


class Workspace:
    """Device scratch memory that every launch of one owner (a cache) shares.

    Two buffers on the owner's GPU:

    * ``scratch``: bytes without an invariant (split-KV partial outputs and the like),
      handed out by :meth:`get` as views that start at offset 0, each part
      :data:`ALIGN`-byte aligned;
    * ``tickets``: uint32 merge counters, zero between launches: a kernel that takes
      tickets must leave them zero (the decode attention's last CTA resets its ticket).

    A request that does not fit grows the buffer it needs (to at least twice its size:
    few growths, and what a graph may still use stays bounded) and keeps the old buffer
    alive (plans and captured graphs that hold its address stay valid) until
    :meth:`release`; :attr:`nbytes` counts both.  While the current stream is capturing
    a CUDA graph a request that does not fit raises ``RuntimeError`` instead: allocating
    there would hand the graph memory that nothing orders against its replays.

    Calls on different streams share these buffers: order them (events), as with any
    library workspace (FlashInfer's, cuBLAS').

    Parameters
    ----------
    device : int
        The GPU the buffers live on.
    alloc : callable, optional
        ``alloc(nbytes, dtype, zero)`` returning a 1-D array of ``nbytes`` bytes (zeroed
        when ``zero``); CuPy's on ``device`` by default (tests pass NumPy's).
    capturing : callable, optional
        ``capturing() -> bool``: whether the current stream is capturing; CuPy's
        ``get_current_stream().is_capturing()`` by default.

    Examples
    --------
    >>> import numpy as np
    >>> ws = Workspace(0, alloc=lambda n, dt, zero: np.zeros(n // np.dtype(dt).itemsize, dt),
    ...                capturing=lambda: False)
    >>> o, ml, t = ws.get([((4, 8), np.float32), (10, np.float32)], tickets=3)
    >>> o.shape, ml.shape, t.dtype.name, ws.scratch_bytes, ws.tickets
    ((4, 8), (10,), 'uint32', 512, 3)
    >>> ws.layout([((4, 8), np.float32), (10, np.float32)])   # offsets and total bytes
    ([0, 256], 512)
    """

    def __init__(self, device: int | None, *,
                 alloc: Callable[[int, Any, bool], Any] | None = None,
                 capturing: Callable[[], bool] | None = None) -> None:
        self.device = device
        self._alloc = alloc
        self._capturing = _cupy_capturing if capturing is None else capturing
        self._scratch: Any = None
        self._tickets: Any = None
        self._retired: list = []  # outgrown buffers: plans and graphs may hold them
        self._users = 1  # owners using it (share / leave)
        #: What the caller of :meth:`reserve` said (shown by errors and ``repr``).
        self.reserved_for = ""

    # -- sizes -------------------------------------------------------------------------
    @staticmethod
    def layout(parts: Sequence[Part]) -> tuple[list[int], int]:
        """``(offsets, total_bytes)`` of ``parts`` (``(shape or count, dtype)`` each) laid
        out one after another, each at an :data:`ALIGN`-byte boundary."""
        offsets, end = [], 0
        for shape, dtype in parts:
            offsets.append(end)
            end += _aligned(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
        return offsets, end

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the current scratch buffer (what one request may use)."""
        return 0 if self._scratch is None else int(self._scratch.nbytes)

    @property
    def tickets(self) -> int:
        """Tickets of the current ticket buffer."""
        return 0 if self._tickets is None else int(self._tickets.size)

    @property
    def users(self) -> int:
        """Owners using this workspace (1 unless :meth:`share` added some)."""
        return self._users

    @property
    def nbytes(self) -> int:
        """Device bytes held: the current buffers and the outgrown ones kept for plans and
        graphs that may use them (at most as many again)."""
        return sum(int(a.nbytes) for a in (self._scratch, self._tickets, *self._retired)
                   if a is not None)

    # -- requests ------------------------------------------------------------------------
    def get(self, parts: Sequence[Part], *, tickets: int = 0, hint: str = "") -> tuple:
        """Views of the workspace for one launch plan.

        Parameters
        ----------
        parts : sequence of (shape or int, dtype)
            Arrays the launch needs, laid out one after another in the scratch buffer
            (each at an :data:`ALIGN`-byte boundary, see :meth:`layout`).  Their
            contents are undefined (and shared with every other plan).
        tickets : int
            uint32 merge counters the launch needs, appended to the result as one 1-D
            view (all zero; the kernel must leave them zero).
        hint : str
            What to raise if this does not fit during a CUDA-graph capture (e.g. the
            cache's workspace hints: ``"max_batch_size >= 64"``).

        Returns
        -------
        tuple of arrays
            One view per part, then the tickets view (when ``tickets``).  A plan takes
            their addresses; the memory stays valid until :meth:`release`.

        Raises
        ------
        RuntimeError
            The request does not fit while the current stream is capturing.
        """
        offsets, total = self.layout(parts)
        self._fit(max(total, ALIGN if parts else 0), tickets, hint, "this call")
        out = []
        for (shape, dtype), off in zip(parts, offsets):
            dt = np.dtype(dtype)
            shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            out.append(self._scratch[off:off + n].view(dt).reshape(shape))
        if tickets:
            out.append(self._tickets[:tickets])
        return tuple(out)

    def reserve(self, scratch_bytes: int, tickets: int = 0, *, hint: str = "") -> None:
        """Make the buffers hold at least ``scratch_bytes`` bytes and ``tickets`` tickets
        (what the cache's hints ask for at construction; ``hint`` says which, for
        ``repr`` and errors).  Raises ``RuntimeError`` instead of growing while the
        current stream is capturing."""
        self._fit(scratch_bytes, tickets, hint, "the reservation")
        if hint:
            self.reserved_for = hint

    def _fit(self, scratch_bytes: int, tickets: int, hint: str, what: str) -> None:
        grow_s = scratch_bytes > self.scratch_bytes
        grow_t = tickets > self.tickets
        if not (grow_s or grow_t):
            return
        if self._capturing():
            raise RuntimeError(
                f"{what} needs {scratch_bytes} bytes of workspace and {tickets} merge "
                f"tickets, but the cache holds {self.scratch_bytes} bytes and "
                f"{self.tickets} tickets, and the current stream is capturing a CUDA graph: "
                "growing now would allocate inside the capture. "
                + (f"Raise the cache's workspace hints ({hint}) or run" if hint else "Run")
                + " a call of this shape once before capturing.")
        if grow_s:
            size = max(_aligned(scratch_bytes), 2 * self.scratch_bytes)
            self._scratch = self._grow(self._scratch, size, np.uint8, zero=False)
        if grow_t:
            count = max(tickets, 2 * self.tickets)
            self._tickets = self._grow(self._tickets, count * 4, np.uint32, zero=True)

    def _grow(self, old, nbytes: int, dtype, *, zero: bool):
        if self._alloc is not None:
            new = self._alloc(nbytes, dtype, zero)
        else:
            import cupy

            with cupy.cuda.Device(self.device):
                new = _cupy_alloc(nbytes, dtype, zero)
        if old is not None:
            self._retired.append(old)
        return new

    def share(self) -> Workspace:
        """One more owner uses this workspace; returns it.  Owners whose launches are
        ordered on one stream (the layers of one model) need one workspace between them,
        not one each: each launch finishes with its scratch before the next begins, and
        leaves the tickets zero."""
        self._users += 1
        return self

    def leave(self) -> Workspace:
        """An owner of a shared workspace stops using it: the others keep the buffers
        (and the launches prepared over them stay valid); returns a new, empty workspace
        for the leaving owner."""
        if self._users < 2:
            raise RuntimeError("leave() is for a shared workspace; release() frees one")
        self._users -= 1
        return Workspace(self.device, alloc=self._alloc, capturing=self._capturing)

    def release(self) -> None:
        """Free every buffer (synchronizes the device first, so no launch in flight uses
        them).  Plans and CUDA graphs that took views of them must not run again: the
        owner drops its plans with them (``PagedKVCache.release_workspace``).  A shared
        workspace is freed by its last owner: the others :meth:`leave` it."""
        if self._users > 1:
            raise RuntimeError(f"this workspace has {self._users} owners: leave() it")
        if self._alloc is None and self.nbytes:
            import cupy

            cupy.cuda.Device(self.device).synchronize()
        self._scratch = self._tickets = None
        self._retired = []
        self.reserved_for = ""

    def __repr__(self) -> str:
        retired = sum(int(a.nbytes) for a in self._retired)
        return (f"Workspace({self.scratch_bytes / 2**20:.1f} MiB scratch, {self.tickets} "
                f"tickets" + (f", {retired / 2**20:.1f} MiB outgrown" if retired else "")
                + (f"; reserved for {self.reserved_for}" if self.reserved_for else "") + ")")


class Scratch(NamedTuple):
    """What the backends' prepared launches take from their owner: its plan cache and its
    workspace (a :class:`~fp4cache.PagedKVCache` passes its pool, which has
    both; tests and benchmarks make their own)."""

    plans: PlanCache
    workspace: Workspace
