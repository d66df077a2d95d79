"""Arrays from other libraries come in through DLPack, zero copy, on both backends.

bfloat16 DLPack tensors on the CPU backend: NumPy's ``np.from_dlpack`` cannot import
bfloat16 (``kDLBfloat``), so ``fp4cache._arrays.from_dlpack_cpu`` reads the
``DLManagedTensor`` itself.  The producers here are built with ctypes, without PyTorch: a
capsule made with ``PyCapsule_New`` around a ``DLManagedTensor`` (or
``DLManagedTensorVersioned``) that points at a NumPy uint16 buffer, with a deleter that
counts its calls.  The capsules have no destructor (a Python one cannot run safely while
NumPy's import error is pending) and the producer keeps them: a capsule nobody consumed
keeps its name and its tensor is never deleted, which lets the tests tell that fp4cache
deleted exactly the tensor it consumed, once, and no other.

Last, the array helpers behind the ``out=`` overlap checks (``share_bytes``,
``ceil_div``).
"""

from __future__ import annotations

import ctypes
import gc
import itertools

import ml_dtypes
import numpy as np
import pytest
from conftest import DLPackProducer

import fp4cache
from fp4cache import PagedKVCache, _arrays
from fp4cache._arrays import ceil_div, from_dlpack_cpu, share_bytes, to_backend


def test_cpu_cache_takes_dlpack_producers():
    rng = np.random.default_rng(0)
    k = rng.standard_normal((20, 2, 64), dtype=np.float32)
    v = rng.standard_normal((20, 2, 64), dtype=np.float32)
    slots = rng.permutation(64)[:20].astype(np.int64)
    a = PagedKVCache(4, 16, 2, 64, device="cpu")
    b = PagedKVCache(4, 16, 2, 64, device="cpu")
    a.store(slots, k, v)
    b.store(DLPackProducer(slots), DLPackProducer(k), DLPackProducer(v))
    assert np.array_equal(a.buffer, b.buffer)
    data, scales = fp4cache.quantize(DLPackProducer(k))
    ref_data, ref_scales = fp4cache.quantize(k)
    assert np.array_equal(data, ref_data) and np.array_equal(scales, ref_scales)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_cache_takes_torch_tensors(dtype):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    import cupy

    rng = np.random.default_rng(1)
    n, H, D = 100, 8, 128
    x = rng.standard_normal((2, n, H, D), dtype=np.float32)
    np_dt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]
    slots = rng.permutation(32 * 16)[:n].astype(np.int64)
    tk = torch.from_numpy(x[0]).to("cuda", getattr(torch, dtype))
    tv = torch.from_numpy(x[1]).to("cuda", getattr(torch, dtype))
    ts = torch.from_numpy(slots).to("cuda")

    gpu = PagedKVCache(32, 16, H, D, scale_rule="4over6", device="cuda")
    cpu = PagedKVCache(32, 16, H, D, scale_rule="4over6", device="cpu")
    gpu.store(ts, tk, tv)  # PyTorch tensors in, through DLPack
    cpu.store(slots, x[0].astype(np_dt), x[1].astype(np_dt))
    torch.cuda.synchronize()
    assert np.array_equal(gpu.buffer.get(), cpu.buffer)

    # Outputs go back to PyTorch zero-copy, bf16 kept.
    k_out, _ = gpu.gather_dequant(cupy.arange(32, dtype=cupy.int32), dtype=dtype)
    back = torch.from_dlpack(k_out)
    assert back.dtype == getattr(torch, dtype) and back.device.type == "cuda"
    k_ref, _ = cpu.gather_dequant(np.arange(32), dtype=dtype)
    got = back.cpu().view(torch.int16 if dtype != "float32" else torch.int32).numpy()
    assert np.array_equal(got, k_ref.view(got.dtype))


# -- bfloat16 DLPack tensors on the CPU backend --------------------------------------------
BF16 = np.dtype(ml_dtypes.bfloat16)


# --- a DLPack producer made with ctypes ---------------------------------------------------
_NAMES = {False: ctypes.create_string_buffer(b"dltensor"),
          True: ctypes.create_string_buffer(b"dltensor_versioned")}


_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))


_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))


#: address of a live DLManagedTensor -> what must outlive it (struct, shape, strides, buffer)
_LIVE: dict[int, tuple] = {}


#: serial number of an export (its manager_ctx) -> how many times its deleter ran
DELETED: dict[int, int] = {}


#: addresses given to the deleter that were no live tensor (deleted twice, or never made)
BAD_DELETES: list[int] = []


_serials = itertools.count(1)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _deleter(addr):
    if addr not in _LIVE:
        BAD_DELETES.append(addr)
        return
    serial = _LIVE.pop(addr)[0].manager_ctx
    DELETED[serial] = DELETED.get(serial, 0) + 1


def capsule_name(capsule) -> str:
    for name in ("dltensor", "dltensor_versioned", "used_dltensor", "used_dltensor_versioned"):
        if _capsule_is_valid(capsule, name.encode()):
            return name
    raise AssertionError(f"not a DLPack capsule: {capsule!r}")


class Producer:
    """A host array that offers only ``__dlpack__``: ``buf`` (uint16 bits, or any NumPy
    array) exported with DLPack type ``code``/``bits``/``lanes``, ``buf``'s shape and
    strides, on device type ``device``.  ``versioned``: a DLPack 1.x producer (it takes
    ``max_version`` and gives a "dltensor_versioned" capsule, ``readonly`` flagged there, of
    major version ``major``); else a legacy one without ``max_version``.  ``exports`` lists
    the serial number (manager_ctx) of every DLManagedTensor it made."""

    def __init__(self, buf, *, code=4, bits=16, lanes=1, device=1, versioned=False,
                 readonly=False, major=1, contiguous_strides=False):
        self.buf, self.code, self.bits, self.lanes, self.device = buf, code, bits, lanes, device
        self.versioned, self.readonly, self.major = versioned, readonly, major
        self.null_strides = contiguous_strides and buf.flags.c_contiguous
        self.exports: list[int] = []
        self.capsules: list = []

    def __dlpack_device__(self):
        return (self.device, 0)

    def _export(self, versioned: bool):
        b = self.buf
        shape = np.array(b.shape, dtype=np.int64)
        strides = np.array([s // b.itemsize for s in b.strides], dtype=np.int64)
        m = (_arrays._DLManagedTensorVersioned if versioned else _arrays._DLManagedTensor)()
        t = m.dl_tensor
        # a data pointer at an offset, given through byte_offset as the spec allows
        t.data, t.byte_offset = b.ctypes.data - 2 * b.itemsize, 2 * b.itemsize
        t.device.device_type, t.device.device_id = self.device, 0
        t.ndim = b.ndim
        t.dtype.code, t.dtype.bits, t.dtype.lanes = self.code, self.bits, self.lanes
        t.shape = shape.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))
        if not self.null_strides:
            t.strides = strides.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))
        m.deleter = ctypes.cast(_deleter, ctypes.c_void_p).value
        if versioned:
            m.version.major, m.version.minor = self.major, 0
            m.flags = 1 if self.readonly else 0
        m.manager_ctx = serial = next(_serials)
        addr = ctypes.addressof(m)
        _LIVE[addr] = (m, shape, strides, b)
        self.exports.append(serial)
        cap = _capsule_new(addr, ctypes.addressof(_NAMES[versioned]), None)
        self.capsules.append(cap)
        return cap

    def __dlpack__(self, stream=None, **kwargs):
        if not self.versioned:
            if kwargs:
                raise TypeError(f"__dlpack__() got unexpected keyword arguments {kwargs}")
            return self._export(False)
        mv = kwargs.get("max_version")
        return self._export(mv is not None and tuple(mv) >= (1, 0))

    def consumed_once(self) -> bool:
        """The last export was consumed (its capsule renamed "used_...") and deleted once;
        every earlier one (offered to np.from_dlpack, which refused it) neither."""
        *refused, last = self.exports
        return (not BAD_DELETES and all(a not in DELETED for a in refused)
                and DELETED.get(last) == 1 and capsule_name(self.capsules[-1]).startswith("used_")
                and not any(capsule_name(c).startswith("used_") for c in self.capsules[:-1]))

    def none_consumed(self) -> bool:
        """fp4cache refused every capsule: none renamed, no tensor deleted (its producer
        frees it)."""
        return (not BAD_DELETES and bool(self.exports)
                and all(a not in DELETED for a in self.exports)
                and not any(capsule_name(c).startswith("used_") for c in self.capsules))


def _bits(shape, seed=0) -> np.ndarray:
    """bfloat16 bit patterns of normal values, as uint16."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape, dtype=np.float32).astype(BF16).view(np.uint16)


LAYOUTS = {
    "contiguous": lambda b: b,
    "transposed": lambda b: b.transpose(1, 0, 2),
    "sliced": lambda b: b[::2, :, 1::2],
    "reversed": lambda b: b[::-1],
}


# --- tests --------------------------------------------------------------------------------
@pytest.mark.gpu
def test_stream_view_is_dlpacks_array_without_the_export():
    """``stream_view`` (prepared launches on PyTorch's stream) gives the array DLPack's
    import gives: same address, shape, strides and dtype, for strided views too; what
    DLPack refuses still goes through ``to_backend`` and its errors."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    import cupy

    base = torch.randn(6, 40, 3, 128, device="cuda").to(torch.bfloat16)
    cases = [base, base[1:5, ::3, 1:, 64:], base.float().transpose(0, 1),
             base.half()[2], torch.arange(37, device="cuda", dtype=torch.int32)[5:],
             torch.arange(9, device="cuda")]
    for t in cases * 2:  # the second round: dtypes already seen
        got, want = _arrays.stream_view(t, "q"), cupy.from_dlpack(t)
        assert (got.data.ptr, got.shape, got.strides, got.dtype) == \
            (want.data.ptr, want.shape, want.strides, want.dtype)
        assert bool((got == want).all())
    with pytest.raises(TypeError, match="q is a tensor with requires_grad"):
        _arrays.stream_view(torch.zeros(4, device="cuda", requires_grad=True), "q")
    with pytest.raises(TypeError, match="k must be a CuPy"):
        _arrays.stream_view(torch.zeros(4, dtype=torch.bfloat16), "k")  # host memory


def test_struct_layout_is_dlpack_h():
    """Offsets and sizes of dlpack.h (DLPack 1.x) on a 64-bit platform."""
    T, M, V = _arrays._DLTensor, _arrays._DLManagedTensor, _arrays._DLManagedTensorVersioned
    assert [getattr(T, f).offset for f in ("data", "device", "ndim", "dtype", "shape",
                                           "strides", "byte_offset")] == [0, 8, 16, 20, 24, 32, 40]
    assert ctypes.sizeof(T) == 48 and ctypes.sizeof(_arrays._DLDataType) == 4
    assert (M.manager_ctx.offset, M.deleter.offset, ctypes.sizeof(M)) == (48, 56, 64)
    assert [getattr(V, f).offset for f in ("version", "manager_ctx", "deleter", "flags",
                                           "dl_tensor")] == [0, 8, 16, 24, 32]


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reader_agrees_with_numpys_own_capsules(versioned, layout):
    """NumPy is an independent producer of both capsule kinds: reading its capsules gives
    the same array, zero copy, with its strides."""
    base = np.arange(4 * 3 * 8, dtype=np.float32).reshape(4, 3, 8)
    x = LAYOUTS[layout](base)

    class NumPyProducer:
        def __dlpack__(self, stream=None, **kw):
            if not versioned and kw:
                raise TypeError("legacy producer")
            return x.__dlpack__(**kw)

    y = from_dlpack_cpu(NumPyProducer(), "x")
    assert y.dtype == x.dtype and y.shape == x.shape and y.strides == x.strides
    assert np.array_equal(y, x) and y.ctypes.data == x.ctypes.data and y.flags.writeable


def _numpy_exports_read_only() -> bool:
    """Whether this NumPy exports a read-only array through DLPack: only a versioned
    capsule can say read-only, and NumPy before 2.1 has none (it refuses the export with
    ``BufferError``: the floor, numpy 1.24, does)."""
    x = np.zeros(1)
    x.flags.writeable = False
    try:
        x.__dlpack__(max_version=(1, 0))
    except (TypeError, BufferError):
        return False
    return True


def test_reader_keeps_numpys_read_only_flag():
    x = np.arange(12, dtype=np.float16).reshape(3, 4)
    x.flags.writeable = False
    if not _numpy_exports_read_only():
        with pytest.raises(BufferError):  # NumPy's own refusal, passed on; nothing imported
            from_dlpack_cpu(x, "x")
        return
    y = from_dlpack_cpu(x, "x")  # only a versioned capsule can say read-only
    assert not y.flags.writeable and np.array_equal(y, x) and y.ctypes.data == x.ctypes.data


def test_reader_keeps_a_producers_read_only_flag():
    """The same through a versioned capsule that says read-only, on any NumPy."""
    bits = _bits((3, 16))
    y = from_dlpack_cpu(Producer(bits, versioned=True, readonly=True), "x")
    assert not y.flags.writeable and y.ctypes.data == bits.ctypes.data


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_producer_zero_copy_values_strides_deleter(versioned, layout):
    bits = LAYOUTS[layout](_bits((6, 4, 16)))
    p = Producer(bits, versioned=versioned)
    a = to_backend(p, "cpu", "k")
    want = bits.view(BF16)
    assert a.dtype == BF16 and a.shape == bits.shape and a.strides == bits.strides
    assert a.ctypes.data == bits.ctypes.data
    assert np.array_equal(a.view(np.uint16), bits) and np.array_equal(a, want)
    assert a.flags.writeable
    bits[1, 2, 3] = np.array(3.5, BF16).view(np.uint16)     # write through the producer
    assert a[1, 2, 3] == 3.5
    # np.from_dlpack tried first and refused its capsule; the one fp4cache imported lives
    # as long as the array.
    gc.collect()
    assert len(p.exports) == 2 and not DELETED.keys() & set(p.exports)
    view = a[1:]
    del a
    gc.collect()
    assert p.exports[-1] not in DELETED and view[0, 2, 3] == 3.5   # a view keeps it alive
    del view
    gc.collect()
    assert p.consumed_once()


def test_null_strides_are_c_contiguous():
    bits = _bits((5, 2, 16), seed=1)
    p = Producer(bits, contiguous_strides=True)
    a = to_backend(p, "cpu", "v")
    assert a.flags.c_contiguous and np.array_equal(a.view(np.uint16), bits)
    del a
    gc.collect()
    assert p.consumed_once()


def test_read_only_versioned_tensor_is_read_only():
    bits = _bits((3, 2, 16), seed=2)
    p = Producer(bits, versioned=True, readonly=True)
    a = to_backend(p, "cpu", "k")
    assert not a.flags.writeable and np.array_equal(a.view(np.uint16), bits)
    with pytest.raises(ValueError, match="read-only"):
        a[0, 0, 0] = 1.0
    del a
    gc.collect()
    assert p.consumed_once()


def test_empty_tensor():
    bits = np.zeros((0, 2, 16), np.uint16)
    p = Producer(bits, versioned=True)
    a = to_backend(p, "cpu", "k")
    assert a.shape == (0, 2, 16) and a.dtype == BF16
    gc.collect()
    assert p.consumed_once()


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
def test_store_takes_bf16_dlpack_as_ml_dtypes(versioned):
    """End to end: the page bytes equal those of the same bits as ml_dtypes arrays, for a
    C-contiguous K and a transposed (head-major buffer) V."""
    n, H, D = 40, 2, 64
    kb = _bits((n, H, D), seed=3)
    vb = _bits((H, n, D), seed=4).transpose(1, 0, 2)
    slots = np.random.default_rng(5).permutation(4 * 16)[:n].astype(np.int64)
    ref = PagedKVCache(4, 16, H, D, device="cpu")
    ref.store(slots, kb.view(BF16), vb.view(BF16))
    got = PagedKVCache(4, 16, H, D, device="cpu")
    pk, pv = Producer(kb, versioned=versioned), Producer(vb, versioned=versioned)
    got.store(slots, pk, pv)
    assert np.any(ref.buffer != 0)
    assert np.array_equal(got.buffer, ref.buffer)
    gc.collect()
    assert pk.consumed_once() and pv.consumed_once()


@pytest.mark.parametrize("code, bits, lanes, what", [
    (5, 32, 1, "code 5 (kDLComplex), 32 bits, 1 lane"),     # complex32: no NumPy type
    (4, 16, 2, "code 4 (kDLBfloat), 16 bits, 2 lane"),      # vector type
    (2, 8, 1, "code 2 (kDLFloat), 8 bits, 1 lane"),
])
def test_unsupported_dtype_names_the_parameter(code, bits, lanes, what):
    cache = PagedKVCache(4, 16, 2, 64, device="cpu")
    k = np.random.default_rng(6).standard_normal((3, 2, 64), dtype=np.float32)
    cache.store(np.array([0, 1, 2]), k, k)
    before = cache.buffer.copy()
    p = Producer(_bits((3, 2, 64)), code=code, bits=bits, lanes=lanes, versioned=True)
    with pytest.raises(TypeError, match=r"^v has DLPack dtype " + what.replace("(", r"\(")
                       .replace(")", r"\)")):
        cache.store(np.array([3, 4, 5]), k.astype(BF16), p)
    assert np.array_equal(cache.buffer, before)
    gc.collect()
    assert p.none_consumed()   # refused capsules are left to (and freed by) the producer


def test_gpu_memory_is_refused_by_name():
    """A device tensor reaching the CPU import (an index array, which may be converted)."""
    p = Producer(np.arange(4, dtype=np.int64), code=0, bits=64, device=2, versioned=True)
    with pytest.raises(TypeError, match=r"^slot_mapping is a DLPack tensor on device type 2 "
                                        r"\(kDLCUDA\)"):
        to_backend(p, "cpu", "slot_mapping", allow_convert=True)
    gc.collect()
    assert p.none_consumed()


def test_unknown_major_version_is_refused():
    p = Producer(_bits((2, 2, 16)), versioned=True, major=2)
    with pytest.raises(BufferError, match="k is a DLPack 2.0 tensor"):
        to_backend(p, "cpu", "k")
    gc.collect()
    assert p.none_consumed()


def test_torch_bf16_tensor():
    torch = pytest.importorskip("torch")
    n, H, D = 40, 2, 64
    k = torch.randn(n, H, D, dtype=torch.bfloat16)
    v = torch.randn(H, n, D, dtype=torch.bfloat16).transpose(0, 1)   # non-contiguous
    a = to_backend(k, "cpu", "k")
    assert a.dtype == BF16 and a.ctypes.data == k.data_ptr()
    assert np.array_equal(a.view(np.int16), k.view(torch.int16).numpy())
    k[0, 0, 0] = 2.0
    assert a[0, 0, 0] == 2.0
    slots = torch.randperm(4 * 16)[:n]
    ref = PagedKVCache(4, 16, H, D, device="cpu")
    ref.store(slots.numpy(), k.view(torch.int16).numpy().view(BF16),
              v.contiguous().view(torch.int16).numpy().view(BF16))
    got = PagedKVCache(4, 16, H, D, device="cpu")
    got.store(slots, k, v)
    assert np.array_equal(got.buffer, ref.buffer)


def test_jax_bf16_array():
    """JAX is another real bfloat16 producer (DLPack 1.x capsules)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    cpu = jax.devices("cpu")[0]  # a host array (JAX puts arrays on its GPU where it has one)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (40, 2, 64), dtype=jnp.bfloat16),
                       cpu)
    ref = np.asarray(x)                                      # JAX's own NumPy export
    assert ref.dtype == BF16
    a = to_backend(x, "cpu", "k")
    assert a.dtype == BF16 and np.array_equal(a.view(np.uint16), ref.view(np.uint16))
    slots = np.arange(40)
    c1, c2 = PagedKVCache(4, 16, 2, 64, device="cpu"), PagedKVCache(4, 16, 2, 64, device="cpu")
    c1.store(slots, x, x)
    c2.store(slots, ref, ref)
    assert np.array_equal(c1.buffer, c2.buffer)


# -- array helpers -------------------------------------------------------------------------
def test_share_bytes_and_ceil_div():
    buf = np.zeros(64, dtype=np.uint8)
    assert share_bytes(buf[:32], buf[31:40])
    assert not share_bytes(buf[:32], buf[32:40])  # adjacent: no common byte
    assert share_bytes(buf[8:16], buf)
    assert not share_bytes(buf[8:8], buf)  # empty arrays share nothing
    assert not share_bytes(buf, np.zeros(64, dtype=np.uint8))
    assert [ceil_div(a, 4) for a in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
