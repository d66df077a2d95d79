"""Array plumbing: which backend an array lives on, DLPack intake, argument checks.

The checks here raise the exceptions described in ``docs/errors.md``: ``TypeError`` for a
wrong kind of array or dtype, ``ValueError`` for a wrong shape or value, ``IndexError``
for slots or block ids outside the pool.  Each message names the parameter, what was
expected and what was given.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from typing import Any

import ml_dtypes
import numpy as np

from .formats import resolve_dtype

__all__ = [
    "gpu_available",
    "gpu_unavailable_reason",
    "is_cupy",
    "backend_of",
    "to_backend",
    "from_dlpack_cpu",
    "array_module",
    "as_scale_bytes",
    "check_index_array",
    "check_values",
    "check_scale",
    "check_real",
    "check_bool",
    "check_out",
    "check_device",
    "check_strides",
    "aligned",
    "share_bytes",
    "ceil_div",
]


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    return gpu_unavailable_reason() is None


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


@functools.lru_cache(maxsize=1)
def gpu_unavailable_reason() -> str | None:
    """``None`` when a GPU is usable, else what is missing, in words: CuPy (then the extra
    to install), the NVIDIA driver, a driver new enough for CuPy's CUDA, or a GPU the
    driver sees.  Memoized: the answer of the first call holds for the process."""
    try:
        import cupy
    except ImportError:
        return ("CuPy is not installed: pip install 'fp4cache[cuda12]' (CUDA 12) or "
                "'fp4cache[cuda13]' (CUDA 13)")
    except Exception as e:  # noqa: BLE001 - a broken install: say what it raised
        return f"CuPy is installed but fails to import ({type(e).__name__}: {e})"
    runtime = cupy.cuda.runtime
    try:
        if runtime.getDeviceCount() > 0:
            return None
        err = "0 devices"
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError: why is said below
        err = str(e)
    try:
        drv = int(runtime.driverGetVersion())
    except Exception:  # noqa: BLE001 - no libcuda at all
        drv = 0
    have = f"CuPy {cupy.__version__} is installed"
    if drv == 0:
        return (f"{have}, but no NVIDIA driver was found (the CUDA runtime says: {err}): "
                "install the NVIDIA driver "
                "on a machine with an NVIDIA GPU (the CUDA extra cannot provide it)")
    if "InsufficientDriver" in err:
        try:
            rt = _cuda_version(int(runtime.runtimeGetVersion()))
        except Exception:  # noqa: BLE001
            rt = "a newer CUDA"
        return (f"{have}, built for CUDA {rt}, but the NVIDIA driver supports CUDA up to "
                f"{_cuda_version(drv)} ({err}): update the driver, or install the CuPy of "
                "an older CUDA (fp4cache[cuda12])")
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"{have} and the NVIDIA driver (CUDA {_cuda_version(drv)}) is loaded, but it "
            f"sees no GPU ({err}"
            + (f"; CUDA_VISIBLE_DEVICES={vis!r}" if vis is not None else "") + ")")


def is_cupy(a: Any) -> bool:
    """True for a ``cupy.ndarray`` (checked without importing CuPy)."""
    return type(a).__module__.split(".")[0] == "cupy"


def backend_of(a: Any) -> str:
    """``"cuda"`` for CuPy arrays, GPU DLPack producers and ``__cuda_array_interface__``
    objects, else ``"cpu"``."""
    if is_cupy(a):
        return "cuda"
    if isinstance(a, np.ndarray):
        return "cpu"
    dev = getattr(a, "__dlpack_device__", None)
    if dev is not None:
        try:
            return "cpu" if int(dev()[0]) == 1 else "cuda"
        except Exception:
            return "cpu"
    return "cuda" if hasattr(a, "__cuda_array_interface__") else "cpu"


def to_backend(a: Any, backend: str, name: str, *, allow_convert: bool = False):
    """Return ``a`` as an array of ``backend`` (``"cpu"`` NumPy or ``"cuda"`` CuPy).

    Arrays from other libraries come in through DLPack (zero copy): ``np.from_dlpack`` on
    the CPU, and, for what it refuses (a bfloat16 tensor), :func:`from_dlpack_cpu`, which
    gives an ``ml_dtypes.bfloat16`` view or a ``TypeError`` naming ``name``.  An array on the
    other backend is refused with ``TypeError`` unless ``allow_convert`` is set (the
    small index arrays are converted; K/V and outputs never are, so that no hidden
    host-device copy lands on a hot path).  With ``allow_convert`` an empty list, tuple or range
    is an empty int64 index array, as ``np.asarray([], dtype=int)`` would be.
    """
    if isinstance(a, (list, tuple, range)):
        a = _from_sequence(a, name, allow_convert)
    where = backend_of(a)
    if where != backend and not (allow_convert or isinstance(a, (list, tuple, range))):
        raise TypeError(
            f"{name} must be a {'CuPy (GPU)' if backend == 'cuda' else 'NumPy (CPU)'} array "
            f"for a cache on device={backend!r}, got {type(a).__module__}.{type(a).__name__} "
            f"on {where!r}"
            + (" (convert it with cupy.asarray)" if backend == "cuda" else " (use .get())")
        )
    if backend == "cpu":
        if isinstance(a, np.ndarray):
            return _native_ints(a)
        if is_cupy(a):
            return a.get()
        if hasattr(a, "__dlpack__") and not isinstance(a, (list, tuple)):
            _check_grad(a, name)
            try:
                return np.from_dlpack(a)
            except (BufferError, RuntimeError, TypeError):
                pass  # bfloat16, which NumPy cannot import: read the DLTensor below
            return from_dlpack_cpu(a, name)
        return _native_ints(np.asarray(a))
    import cupy

    if is_cupy(a):
        return a
    if hasattr(a, "__dlpack__") and backend_of(a) == "cuda":
        _check_grad(a, name)
        return cupy.from_dlpack(a)
    if hasattr(a, "__cuda_array_interface__"):  # zero copy (Numba, older libraries)
        return cupy.asarray(a)
    return cupy.asarray(_native_ints(np.asarray(a)))


#: (tensor type, dtype) -> CuPy dtype, for the tensors :func:`stream_view` has seen come in
#: through DLPack (PyTorch CUDA tensors, learned at their first import)
_STREAM_VIEWABLE: dict[tuple[type, Any], np.dtype] = {}


def stream_view(a: Any, name: str):
    """``a`` on the GPU as a CuPy array, for a caller already on the stream of the tensor's
    library (a prepared launch on PyTorch's current stream): a view of the same memory,
    made without DLPack's export (which orders the producer's stream against the
    consumer's, a synchronization the shared stream does not need, and costs tens of
    microseconds).  What it has not seen come in through DLPack, and tensors DLPack
    would refuse (``requires_grad``, host memory), go through :func:`to_backend`."""
    dtype = _STREAM_VIEWABLE.get((type(a), getattr(a, "dtype", None)))
    if dtype is None or not a.is_cuda or a.requires_grad or a.numel() == 0:
        got = to_backend(a, "cuda", name)
        if type(a).__module__.split(".")[0] == "torch" and a.is_cuda and a.numel():
            _STREAM_VIEWABLE[(type(a), a.dtype)] = got.dtype
        return got
    import cupy

    size = dtype.itemsize
    shape, strides = tuple(a.shape), a.stride()
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
    mem = cupy.cuda.UnownedMemory(a.data_ptr(), extent * size, a, a.get_device())
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0),
                        tuple(st * size for st in strides))


def _native_ints(a: np.ndarray) -> np.ndarray:
    """An integer array in non-native byte order (``>i8`` on x86: index arrays read from a
    file) as a native copy, as K/V of non-native order are converted; other arrays as is
    (an output must stay the caller's array)."""
    if a.dtype.kind in "iu" and not a.dtype.isnative:
        return a.astype(a.dtype.newbyteorder("="))
    return a


def _check_grad(a: Any, name: str) -> None:
    """A PyTorch tensor that requires grad refuses DLPack export (torch's own
    ``BufferError``, naming no argument): say which argument and what to pass."""
    if getattr(a, "requires_grad", False) is True:
        raise TypeError(f"{name} is a tensor with requires_grad=True, which DLPack cannot "
                        f"export (autograd would not see what fp4cache does with it): pass "
                        f"{name}.detach()")


# --- DLPack intake on the host, for what np.from_dlpack cannot import (bfloat16) ----------
# The structs of dlpack.h (DLPack 1.x; the legacy DLManagedTensor and the versioned one).


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", _DLTensor)]


_DLPACK_FLAG_READ_ONLY = 1
_DL_CPU, _DL_CUDA_HOST = 1, 3           # host memory: kDLCPU, kDLCUDAHost (pinned)
_DL_DEVICES = {2: "kDLCUDA", 4: "kDLOpenCL", 7: "kDLVulkan", 8: "kDLMetal", 10: "kDLROCM",
               11: "kDLROCMHost", 13: "kDLCUDAManaged", 14: "kDLOneAPI"}
_DL_CODES = {0: "kDLInt", 1: "kDLUInt", 2: "kDLFloat", 3: "kDLOpaqueHandle", 4: "kDLBfloat",
             5: "kDLComplex", 6: "kDLBool"}
#: (DLPack type code, bits) -> the NumPy dtype of a lanes=1 element.
_DL_DTYPES = {
    (0, 8): np.dtype(np.int8), (0, 16): np.dtype(np.int16), (0, 32): np.dtype(np.int32),
    (0, 64): np.dtype(np.int64), (1, 8): np.dtype(np.uint8), (1, 16): np.dtype(np.uint16),
    (1, 32): np.dtype(np.uint32), (1, 64): np.dtype(np.uint64),
    (2, 16): np.dtype(np.float16), (2, 32): np.dtype(np.float32), (2, 64): np.dtype(np.float64),
    (4, 16): np.dtype(ml_dtypes.bfloat16),
    (5, 64): np.dtype(np.complex64), (5, 128): np.dtype(np.complex128),
    (6, 8): np.dtype(np.bool_),
}

# Capsule names; PyCapsule_SetName keeps the pointer, so the "used" names live as long as
# this module (the buffers below).
_NAME = {False: b"dltensor", True: b"dltensor_versioned"}
_USED = {False: ctypes.create_string_buffer(b"used_dltensor"),
         True: ctypes.create_string_buffer(b"used_dltensor_versioned")}
# Prototypes of our own (rather than argtypes set on the shared ctypes.pythonapi functions).
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_capsule_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_capsule_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p)(
    ("PyCapsule_SetName", ctypes.pythonapi))
_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLPackOwner:
    """The base of an array imported from a DLPack capsule: it exposes the tensor's memory
    through ``__array_interface__`` and, when the last array on it is gone, calls the
    producer's deleter, once."""

    __slots__ = ("__array_interface__", "_managed", "_deleter")

    def __init__(self, managed: int, deleter: int | None):
        self._managed = managed
        self._deleter = deleter

    def release(self) -> None:
        deleter, self._deleter = self._deleter, None
        if deleter:
            _Deleter(deleter)(self._managed)

    def __del__(self):
        self.release()


def from_dlpack_cpu(a: Any, name: str) -> np.ndarray:
    """Import a host DLPack tensor into NumPy by reading its ``DLManagedTensor`` (or, from
    producers of DLPack 1.x, ``DLManagedTensorVersioned``) with ctypes: zero copy, the
    producer's strides and byte offset kept, read-only when the producer says so.  This is
    how a bfloat16 tensor (``kDLBfloat``, 16 bits), which ``np.from_dlpack`` refuses, comes in
    as an ``ml_dtypes.bfloat16`` array.  The producer's deleter runs once, when the last
    array on the memory is garbage collected.

    A dtype NumPy has no type for (or with ``lanes != 1``) is a ``TypeError``, and memory
    the CPU cannot read (a GPU tensor) a ``TypeError`` naming ``name``; a DLPack major
    version other than 1 is a ``BufferError``.  In every refusal the capsule is left
    unconsumed, so that its producer frees it.
    """
    try:
        capsule = a.__dlpack__(max_version=(1, 0))
    except TypeError:  # a producer older than DLPack 1.0: no max_version
        capsule = a.__dlpack__()
    for versioned in (True, False):
        if _capsule_is_valid(capsule, _NAME[versioned]):
            break
    else:
        raise TypeError(f"{name}.__dlpack__() returned {capsule!r}, not an unconsumed DLPack "
                        "capsule (named 'dltensor' or 'dltensor_versioned')")
    ptr = _capsule_get_pointer(capsule, _NAME[versioned])
    if versioned:
        managed = _DLManagedTensorVersioned.from_address(ptr)
        if managed.version.major != 1:
            raise BufferError(f"{name} is a DLPack {managed.version.major}."
                              f"{managed.version.minor} tensor; fp4cache reads DLPack 1.x")
        readonly = bool(managed.flags & _DLPACK_FLAG_READ_ONLY)
    else:
        managed = _DLManagedTensor.from_address(ptr)
        readonly = False
    t = managed.dl_tensor
    dev = t.device.device_type
    if dev not in (_DL_CPU, _DL_CUDA_HOST):
        raise TypeError(f"{name} is a DLPack tensor on device type {dev} "
                        f"({_DL_DEVICES.get(dev, 'not host memory')}), which the CPU backend "
                        "cannot read: copy it to the host first (e.g. tensor.cpu())")
    code, bits, lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
    dtype = _DL_DTYPES.get((code, bits)) if lanes == 1 else None
    if dtype is None:
        raise TypeError(f"{name} has DLPack dtype code {code} "
                        f"({_DL_CODES.get(code, 'unknown')}), {bits} bits, {lanes} lane(s), "
                        "which has no NumPy dtype: the cache takes bfloat16, float16 or "
                        "float32 values and int32/int64 indices")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = (None if not t.strides else
               tuple(t.strides[i] * dtype.itemsize for i in range(t.ndim)))
    if _capsule_set_name(capsule, ctypes.addressof(_USED[versioned])):
        raise RuntimeError("PyCapsule_SetName failed")  # pragma: no cover - cannot fail
    # Consumed from here on: the owner calls the deleter when the array is gone.
    owner = _DLPackOwner(ptr, managed.deleter)
    if math.prod(shape) == 0:
        owner.release()
        return np.empty(shape, dtype)
    owner.__array_interface__ = {
        "version": 3, "shape": shape, "typestr": f"|V{dtype.itemsize}", "strides": strides,
        "data": ((t.data or 0) + t.byte_offset, readonly),
    }
    return np.asarray(owner).view(dtype)


def _from_sequence(a, name: str, allow_convert: bool) -> np.ndarray:
    """A Python list, tuple or range as a NumPy array: index arrays only (``allow_convert``;
    an empty one is int64, as ``np.asarray([], dtype=int)`` would be).  Values (K, V, q,
    outputs) are refused with a ``TypeError`` naming ``name``: NumPy would read a list as
    float64, which no kernel takes; a ragged list is a ``ValueError`` naming ``name``."""
    if not allow_convert:
        raise TypeError(f"{name} must be an array (NumPy, CuPy or a DLPack producer such as "
                        f"a torch tensor), got a Python {type(a).__name__}: make it one with "
                        f"the dtype you mean, e.g. numpy.asarray({name}, dtype=numpy.float32)")
    if len(a) == 0:
        return np.zeros(0, dtype=np.int64)
    try:
        return np.asarray(a)
    except ValueError:
        lens = sorted({len(r) for r in a if hasattr(r, "__len__")})
        raise ValueError(f"{name} must be a rectangular array: its rows have different "
                         f"lengths {lens} (pad the shorter rows, as vLLM pads block tables "
                         "with -1)") from None


def array_module(backend: str):
    """``numpy`` for ``"cpu"``, ``cupy`` for ``"cuda"``."""
    if backend == "cpu":
        return np
    import cupy

    return cupy


def as_scale_bytes(a, name: str):
    """E4M3 scale bytes as uint8: uint8 as is, ``float8_e4m3fn`` viewed as uint8."""
    if a.dtype == np.uint8:
        return a
    if a.dtype.itemsize == 1 and "float8_e4m3fn" in str(a.dtype):
        return a.view(np.uint8)
    raise TypeError(f"{name} must have dtype uint8 or float8_e4m3fn, got {a.dtype}")


def check_index_array(a, name: str, *, length: int | None = None):
    """Check a 1-D int32/int64 index array (slot_mapping, blocks); :func:`to_backend`
    has already made one of non-native byte order native."""
    if a.dtype not in (np.int32, np.int64):
        raise TypeError(f"{name} must have dtype int32 or int64, got {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(a.shape)}")
    if length is not None and a.shape[0] != length:
        raise ValueError(
            f"{name} must have one entry per token ({length}), got {a.shape[0]}"
        )
    return a


def check_values(a, name: str, shape: tuple[int | None, ...]):
    """Check a bf16/f16/f32 array against ``shape`` (``None`` = any size)."""
    try:
        resolve_dtype(a.dtype, name=f"{name}.dtype")
    except TypeError:
        raise TypeError(
            f"{name} must have dtype bfloat16, float16 or float32, got {a.dtype}"
        ) from None
    if a.ndim != len(shape):
        raise ValueError(
            f"{name} must be {len(shape)}-D {_shape_str(shape)}, got shape {tuple(a.shape)}"
        )
    for got, want in zip(a.shape, shape):
        if want is not None and got != want:
            raise ValueError(f"{name} must have shape {_shape_str(shape)}, got {tuple(a.shape)}")
    return a


def check_real(value, name: str, what: str = "a real number") -> float:
    """``value`` as a Python float when it is a real number (Python or NumPy int or
    float, a 0-d array); a string (``"0.01"``), bytes, a bool or anything else
    without ``__float__`` is a ``TypeError`` naming ``name``."""
    if (isinstance(value, (str, bytes, bool, np.bool_))
            or not hasattr(type(value), "__float__")
            or getattr(value, "dtype", np.dtype(float)).kind not in "iuf"):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} "
                        f"{value!r}") from None


def check_bool(value, name: str, *, optional: bool = False) -> bool | None:
    """``value`` as a bool when it is a ``bool`` or NumPy ``bool_`` (or ``None`` when
    ``optional``); anything else (``"no"``, 0, 1) is a ``TypeError`` naming ``name``: a
    string would otherwise read as True.  A plain bool costs one type comparison (hot
    paths call this)."""
    if value.__class__ is bool or (optional and value is None):
        return value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False{' (or None)' if optional else ''}, got "
                    f"{type(value).__name__} {value!r}")


def check_scale(value, name: str) -> np.float32:
    """A positive, finite float32 scale (its float32 rounding too); a string or a bool
    is a ``TypeError``."""
    f = check_real(value, name, "a positive finite number")
    with np.errstate(over="ignore"):
        f32 = np.float32(f)
    if not math.isfinite(f) or f <= 0 or not f32 > 0 or not np.isfinite(f32):
        raise ValueError(f"{name} must be a positive finite float32 number, got {value!r}")
    return np.float32(f)


def check_out(out, name: str, shape: tuple[int, ...], dtype, backend: str):
    """Check a caller-supplied output array: backend, shape, dtype, C-contiguity."""
    out = to_backend(out, backend, name)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {out.dtype}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if is_cupy(out) and out.data.ptr % out.itemsize:
        raise ValueError(f"{name} must be aligned to its itemsize ({out.itemsize} bytes), got "
                         f"address {out.data.ptr:#x} (a view at an odd byte offset)")
    return out


def aligned(a, name: str):
    """A CuPy array whose address is a multiple of its itemsize: ``a`` itself, or (a
    C-contiguous view at an odd byte offset of another buffer) a copy made byte by byte,
    so that no kernel, CuPy's copy included, makes a misaligned load.  Other misaligned
    views are refused with ``ValueError``."""
    if not is_cupy(a) or a.data.ptr % a.itemsize == 0:
        return a
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be aligned to its itemsize ({a.itemsize} bytes) or "
                         f"C-contiguous, got address {a.data.ptr:#x} and strides "
                         f"{tuple(a.strides)}")
    import cupy

    raw = cupy.ndarray((a.nbytes,), dtype=np.uint8, memptr=a.data)
    return raw.copy().view(a.dtype).reshape(a.shape)


def check_strides(a, name: str):
    """Byte strides must be whole elements (a view of another dtype's buffer can have
    strides that are not: refused rather than read wrong)."""
    for st in a.strides:
        if st % a.itemsize:
            raise ValueError(f"{name} must have strides that are multiples of its itemsize "
                             f"({a.itemsize} bytes), got strides {tuple(a.strides)}")
    return a


def check_device(arrays: dict[str, Any], ref) -> None:
    """CuPy arrays must live on the same GPU as ``ref`` (the cache's buffer): a
    ``ValueError`` names the argument and both devices."""
    if not is_cupy(ref):
        return
    want = ref.data.device_id
    for name, a in arrays.items():
        if is_cupy(a) and a.data.device_id != want:
            raise ValueError(
                f"{name} is on GPU {a.data.device_id} (cuda:{a.data.device_id}) but the cache "
                f"lives on GPU {want} (cuda:{want}); move it with cupy.asarray under "
                f"cupy.cuda.Device({want})"
            )


def _shape_str(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def address(a) -> int:
    """The address of a NumPy or CuPy array's first element."""
    return a.data.ptr if is_cupy(a) else a.__array_interface__["data"][0]


def share_bytes(a, b) -> bool:
    """Whether two C-contiguous arrays of one backend share any byte (their address
    ranges intersect; an empty array shares none)."""
    if a.nbytes == 0 or b.nbytes == 0:
        return False
    pa, pb = address(a), address(b)
    return pa < pb + b.nbytes and pb < pa + a.nbytes


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` of integers (``b > 0``)."""
    return -(-a // b)
