"""Prepared kernel launches through the CUDA driver's ``cuLaunchKernelEx``: programmatic
dependent launch (PDL; CuPy's ``RawKernel`` has no launch attributes), and ordinary
launches whose arguments are packed once (the decode-step store).

A kernel launched this way may start while the kernel before it on the stream is still
running, once every CTA of that kernel has executed ``griddepcontrol.launch_dependents``
(or exited); it must execute ``griddepcontrol.wait`` before it touches anything that
kernel writes.  The large store uses it so that the duplicate-slot claim pass overlaps
the store's K/V loads (``kernels/paged_kv.cu``).  Hopper (sm_90) and newer only; on
older devices, without the driver entry point, or while the stream is being captured
into a CUDA graph, :func:`launcher` returns ``None`` and the caller launches normally.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from functools import cache

import cupy

__all__ = ["launcher", "args_launcher", "capturing"]

_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_... (cuda.h)


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


assert ctypes.sizeof(_Attr) == 72 and ctypes.sizeof(_Config) == 56


@cache
def _driver_entry():
    """``cuLaunchKernelEx`` of the loaded driver, or ``None``."""
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        fn = ctypes.CDLL(name).cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return fn


def _error_text(err: int) -> str:
    """``CUDA_ERROR_...: description`` of a driver result code (the number if unknown)."""
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
        text, desc = ctypes.c_char_p(), ctypes.c_char_p()
        lib.cuGetErrorName(err, ctypes.byref(text))
        lib.cuGetErrorString(err, ctypes.byref(desc))
        if text.value:
            return f"{text.value.decode()}: {(desc.value or b'').decode()} (CUresult {err})"
    except (OSError, AttributeError):
        pass
    return f"CUresult {err}"


@cache
def _supported(device: int) -> bool:
    return int(cupy.cuda.Device(device).compute_capability) >= 90 and _driver_entry() is not None


class _Prepared:
    """A kernel launch whose argument buffers are set up once (``param_ptrs``: the address
    of each kernel argument's value); subclasses fill the values and call :meth:`_launch`
    while holding ``_lock`` (the buffers are shared by every call)."""

    def __init__(self, kernel, grid: int, block: int, param_ptrs, pdl: bool):
        self._fn = _driver_entry()
        self._func = ctypes.c_void_p(kernel.kernel.ptr)
        self._attr = _Attr(id=_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self._cfg = _Config(grid, 1, 1, block, 1, 1, 0, None,
                            ctypes.pointer(self._attr) if pdl else None, 1 if pdl else 0)
        self._params = (ctypes.c_void_p * len(param_ptrs))(*param_ptrs)
        self._lock = threading.Lock()

    def _launch(self, stream_ptr: int) -> None:
        self._cfg.hStream = stream_ptr or None
        err = self._fn(ctypes.byref(self._cfg), self._func, self._params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx failed: {_error_text(err)}")


def _addresses(values) -> list:
    return [ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values]


class _Launch(_Prepared):
    """A prepared (PDL) launch of one kernel with a fixed grid and block: pointer
    arguments, then one struct passed by value (a numpy 0-d structured array);
    ``__call__(stream_ptr, pointers, fields)`` sets the pointers and the struct's
    ``fields`` and launches (the driver copies the arguments at launch)."""

    def __init__(self, kernel, grid: int, block: int, struct, n_pointers: int,
                 pdl: bool = True):
        self._struct = struct
        self._ptrs = [ctypes.c_uint64(0) for _ in range(n_pointers)]
        super().__init__(kernel, grid, block,
                         _addresses(self._ptrs) + [ctypes.c_void_p(struct.ctypes.data)], pdl)

    def __call__(self, stream_ptr: int, pointers, fields: dict | None = None) -> None:
        with self._lock:
            for slot, value in zip(self._ptrs, pointers):
                slot.value = value
            if fields:
                for name, value in fields.items():
                    self._struct[name] = value
            self._launch(stream_ptr)


def launcher(kernel, grid: int, block: int, struct, n_pointers: int, pdl: bool = True):
    """A :class:`_Launch` for ``kernel(ptr_0, ..., ptr_{n-1}, struct)`` (``struct``: a
    numpy 0-d structured array, owned by the launch from then on), or ``None`` where it
    is not available: no driver entry point, or (``pdl``) a pre-Hopper device.  Without
    ``pdl`` it is an ordinary launch that costs less host time than a ``RawKernel`` call
    with a struct argument (the arguments are packed once, here)."""
    if _driver_entry() is None or (pdl and not _supported(cupy.cuda.runtime.getDevice())):
        return None
    return _Launch(kernel, grid, block, struct, n_pointers, pdl)


class _ArgsLaunch(_Prepared):
    """An ordinary launch of a kernel with scalar arguments, packed once: ``args`` are
    ctypes values matching the kernel's parameters one for one (``c_uint64`` for
    pointers).  ``__call__(stream_ptr, grid, values)`` sets the first ``len(values)``
    arguments and the grid, then launches (the driver copies the arguments)."""

    def __init__(self, kernel, block: int, args):
        self._args = list(args)
        super().__init__(kernel, 1, block, _addresses(self._args), pdl=False)

    def __call__(self, stream_ptr: int, grid: int, values=()) -> None:
        with self._lock:
            for slot, value in zip(self._args, values):
                slot.value = value
            self._cfg.gridDimX = grid
            self._launch(stream_ptr)


def args_launcher(kernel, block: int, args):
    """An :class:`_ArgsLaunch`, or ``None`` without the driver entry point."""
    if _driver_entry() is None:
        return None
    return _ArgsLaunch(kernel, block, args)


def capturing(stream) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph."""
    try:
        return bool(stream.is_capturing())
    except Exception:  # the legacy null stream cannot be captured
        return False
