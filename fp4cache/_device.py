"""Which device a cache or an array lives on, running GPU work there, and pinned host
memory for transfers (:func:`pinned_empty`).

Every GPU entry point runs on the device its data lives on, whatever device is current
(like a PyTorch device guard), on that device's current CuPy stream, and leaves the
current device as it found it.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import numpy as np

__all__ = ["parse_device", "host_memory", "format_bytes", "device_name", "array_device",
           "DeviceGuard", "on_input_device", "num_sms", "resident_ctas", "by_value",
           "pinned_empty"]

_CUDA = re.compile(r"^cuda(?::(\d+))?$")


def parse_device(device: Any) -> tuple[str, int | None]:
    """``("cpu", None)`` or ``("cuda", index)`` for a ``device=`` argument.

    Accepts ``"cpu"``, ``"cuda"`` (the current device), ``"cuda:N"``, an ``int`` N and a
    ``cupy.cuda.Device``.  ``None`` is resolved by the caller (GPU when usable).
    Raises ``ValueError`` naming the accepted forms; a GPU index is checked against the
    devices CuPy sees.
    """
    if isinstance(device, str):
        if device == "cpu":
            return "cpu", None
        m = _CUDA.match(device)
        if m is None:
            raise ValueError(
                f"device must be 'cpu', 'cuda', 'cuda:N', an int or a cupy.cuda.Device, "
                f"got {device!r}")
        index = None if m.group(1) is None else int(m.group(1))
    elif isinstance(device, bool):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N', an int or a "
                         f"cupy.cuda.Device, got {device!r}")
    elif isinstance(device, int):
        if device < 0:
            raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N', an int N >= 0 (a GPU "
                             f"index) or a cupy.cuda.Device, got {device!r}: a GPU index "
                             "cannot be negative")
        index = device
    elif type(device).__module__.startswith("cupy") and hasattr(device, "id"):
        index = int(device.id)
    else:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N', an int or a "
                         f"cupy.cuda.Device, got {device!r}")
    from ._arrays import gpu_unavailable_reason

    why = gpu_unavailable_reason()
    if why is not None:
        raise RuntimeError(f"device={device!r} needs CuPy and a CUDA GPU: {why}")
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if index is None:
        index = cupy.cuda.runtime.getDevice()
    if not 0 <= index < count:
        raise ValueError(f"device {device!r}: CuPy sees {count} GPU(s), indices 0..{count - 1}")
    return "cuda", index


def host_memory() -> int | None:
    """Bytes of host memory available now (``MemAvailable``), else the machine's total,
    else ``None`` (unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units (``2.05 PiB``)."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if x < 1024 or unit == "PiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def device_name(kind: str, index: int | None) -> str:
    """``"cpu"`` or ``"cuda:N"``."""
    return "cpu" if kind == "cpu" else f"cuda:{index}"


def array_device(a: Any) -> int | None:
    """GPU index of a CuPy array, ``None`` for anything else."""
    dev = getattr(a, "device", None)
    return None if dev is None or not hasattr(dev, "id") else int(dev.id)


@functools.cache
def _sm_count(index: int) -> int:
    import cupy

    return int(cupy.cuda.Device(index).attributes["MultiProcessorCount"])


def num_sms() -> int:
    """Streaming multiprocessors of the current GPU (a device fact, memoized per device)."""
    import cupy

    return _sm_count(cupy.cuda.runtime.getDevice())


def resident_ctas(fn: Any, threads: int, dynamic_smem: int = 0) -> int:
    """CTAs of the kernel ``fn`` (a ``cupy.RawKernel`` of the current device) with
    ``threads`` threads and ``dynamic_smem`` dynamic shared-memory bytes that fit on the
    whole GPU at once: CUDA's occupancy calculator (the kernel's registers and shared
    memory against this device's limits, which differ between sm_80 and sm_90)."""
    from cupy_backends.cuda.api import driver

    kernel = getattr(fn, "kernel", fn)  # RawKernel -> its cupy.cuda.Function
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, threads,
                                                              dynamic_smem)
    return num_sms() * max(1, int(per_sm))


class DeviceGuard:
    """``with DeviceGuard(n):`` makes GPU ``n`` current inside the block (only switching
    when another one is current) and restores the previous device after it;
    ``DeviceGuard(None)`` (the CPU) does nothing."""

    __slots__ = ("index", "prev", "_runtime")

    def __init__(self, index: int | None) -> None:
        self.index = index
        self.prev = index
        if index is None:
            self._runtime = None
            return
        import cupy

        self._runtime = cupy.cuda.runtime

    def __enter__(self) -> DeviceGuard:
        if self._runtime is not None:
            self.prev = self._runtime.getDevice()
            if self.prev != self.index:
                self._runtime.setDevice(self.index)
        return self

    def __exit__(self, *exc) -> None:
        if self.prev != self.index:
            self._runtime.setDevice(self.prev)


def on_input_device(fn):
    """Decorator of a function whose first argument is its data (an array, or a list of
    arrays or of tuples of arrays, whose first one is looked at): a CuPy array there makes
    that array's GPU current for the call (and the previous one current again after)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        a = args[0] if args else None
        while isinstance(a, (list, tuple)) and a:
            a = a[0]
        dev = array_device(a) if type(a).__module__.startswith("cupy") else None
        if dev is None:
            return fn(*args, **kwargs)
        with DeviceGuard(dev):
            return fn(*args, **kwargs)

    return wrapper


def by_value(value: Any) -> Any:
    """A kernel argument passed by value, converted for CuPy once instead of at every launch.

    ``value`` is a zero-dimensional NumPy array (a parameter struct of
    :mod:`fp4cache._abi`, or a scalar); the result is what CuPy's ``RawKernel`` makes of a
    size-one NumPy array (``cupy.cuda.function.CNumpyArray``, which points at the array's
    bytes and keeps the array alive), so a prepared launch pays nothing for it: CuPy
    converts a NumPy scalar or a structured scalar anew on every call (about 3 us for the
    attention parameters on a server CPU, ``docs/kernels.md``).  The
    array is copied first (later changes to ``value`` do not reach the kernel).  Where
    CuPy does not offer that class, the copy itself is returned (CuPy then converts it
    at each launch, as before).
    """
    arr = np.array(value, copy=True)
    if arr.size != 1:
        raise ValueError(f"a kernel argument by value must hold one element, got shape "
                         f"{arr.shape}")
    try:
        from cupy.cuda.function import CNumpyArray
    except ImportError:  # pragma: no cover - another CuPy
        return arr
    return CNumpyArray(arr)


def external_stream(handle: int, device: int):
    """CuPy's view of a CUDA stream another library made (PyTorch's current stream, say),
    ``with``-able to make it CuPy's current stream.  ``cupy.cuda.ExternalStream`` (CuPy
    14 marks it deprecated in favour of the stream protocol, which takes an object, not a
    handle; the class still works) is made once per stream by the callers."""
    import warnings

    import cupy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, device)


def pinned_empty(shape, dtype=np.uint8) -> np.ndarray:
    """An uninitialized NumPy array in page-locked (pinned) host memory.

    Transfers between pinned memory and the GPU run asynchronously at full bus speed
    (:meth:`PagedKVCache.read_blocks` / ``write_blocks`` with a host array).  Made with
    ``cupyx.empty_pinned`` (CuPy's pinned memory pool keeps the memory for reuse); without
    a usable GPU this is plain ``numpy.empty`` (nothing to pin for).

    Examples
    --------
    >>> import fp4cache
    >>> a = fp4cache.pinned_empty((2, 3), "uint8")
    >>> a.shape, str(a.dtype)
    ((2, 3), 'uint8')
    """
    from ._arrays import gpu_available

    if gpu_available():
        import cupyx

        return cupyx.empty_pinned(shape, dtype=dtype)
    return np.empty(shape, dtype=dtype)


