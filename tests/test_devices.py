"""Each cache owns its device: the ``device=`` forms, the guard around every GPU call,
arrays from another GPU, and CuPy's streams.  The multi-GPU tests run only where two GPUs
are visible.

Streams: kernels run on CuPy's current stream; events order them.
"""

from __future__ import annotations

import re
import threading

import ml_dtypes
import numpy as np
import pytest
from helpers import capture_stream

import fp4cache._backend
from fp4cache import PagedKVCache, gpu_available
from fp4cache._device import DeviceGuard, array_device, by_value, parse_device

BF16 = np.dtype(ml_dtypes.bfloat16)


# -- on any machine ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["tpu", "cuda:", "cuda:x", "cuda:-1", "CUDA", "cuda0", 1.5,
                                 True, [0]])
def test_device_forms_refused_with_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="'cpu', 'cuda', 'cuda:N', an int or a cupy"):
        parse_device(bad)


def test_cpu_device_forms():
    assert parse_device("cpu") == ("cpu", None)
    c = PagedKVCache(4, 16, 2, 64, device="cpu")
    assert c.device == "cpu" and c.device_id is None
    assert "device='cpu'" in repr(c)


def test_by_value_takes_one_element_and_copies_it():
    with pytest.raises(ValueError, match="one element, got shape \\(2,\\)"):
        by_value(np.zeros(2, np.uint32))
    dt = np.dtype([("a", "<u4"), ("b", "<f4")], align=True)
    p = np.zeros((), dt)
    arg = by_value(p)
    p["a"] = 7  # later changes do not reach the prepared argument
    try:
        from cupy.cuda.function import CPointer
    except ImportError:
        assert isinstance(arg, np.ndarray) and arg.shape == () and int(arg["a"]) == 0
    else:
        assert isinstance(arg, CPointer)


@pytest.mark.gpu
def test_by_value_struct_reaches_the_kernel():
    import cupy

    dt = np.dtype([("a", "<u4"), ("b", "<f4"), ("c", "<u8")], align=True)
    k = cupy.RawKernel(r"""
        struct P { unsigned int a; float b; unsigned long long c; };
        extern "C" __global__ void k(unsigned long long* out, P p) {
          out[0] = p.a; out[1] = __float_as_uint(p.b); out[2] = p.c; }""", "k")
    p = np.zeros((), dt)
    p["a"], p["b"], p["c"] = 3, 1.5, 2**40 + 5
    arg = by_value(p)
    p["a"] = 99
    out = cupy.zeros(3, np.uint64)
    for _ in range(2):  # the same prepared argument, launched twice
        k((1,), (1,), (out, arg))
        assert out.get().tolist() == [3, int(np.float32(1.5).view(np.uint32)), 2**40 + 5]
        out.fill(0)


@pytest.mark.skipif(gpu_available(), reason="checks the no-GPU error")
@pytest.mark.parametrize("form", ["cuda", "cuda:0", 0, 3])
def test_gpu_forms_without_a_gpu_say_so(form):
    with pytest.raises(RuntimeError, match="needs CuPy and a CUDA GPU"):
        PagedKVCache(4, 16, 2, 64, device=form)


def test_foreign_device_error_names_argument_and_both_devices():
    """check_device on stand-ins for CuPy arrays (no GPU needed): a k on GPU 1 given to a
    cache on GPU 0."""
    from fp4cache import _arrays

    class Mem:
        def __init__(self, dev):
            self.device_id = dev

    class FakeCupy:  # is_cupy() looks at the type's module
        __module__ = "cupy._core.core"

        def __init__(self, dev):
            self.data = Mem(dev)

    FakeCupy.__module__ = "cupy._core.core"
    with pytest.raises(ValueError, match=r"k is on GPU 1 \(cuda:1\) but the cache lives on "
                                         r"GPU 0 \(cuda:0\)"):
        _arrays.check_device({"slot_mapping": FakeCupy(0), "k": FakeCupy(1)}, FakeCupy(0))


# -- one GPU -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("form", ["cuda", "cuda:0", 0, "device"])
def test_gpu_device_forms(form):
    import cupy

    if form == "device":
        form = cupy.cuda.Device(0)
    with cupy.cuda.Device(0):
        c = PagedKVCache(4, 16, 2, 64, device=form)
    assert c.device == "cuda" and c.device_id == 0
    assert array_device(c.buffer) == 0
    assert "device='cuda:0'" in repr(c)
    with pytest.raises(ValueError, match="CuPy sees"):
        PagedKVCache(4, 16, 2, 64, device=cupy.cuda.runtime.getDeviceCount())


@pytest.mark.gpu
def test_guard_switches_to_the_cache_device_and_back(monkeypatch):
    """With another device 'current' (getDevice patched to say 1), every public call
    switches to the cache's device 0 for its work and restores 1 afterwards; results stay
    right.  What one GPU can show of the multi-GPU guard."""
    import cupy

    rt = cupy.cuda.runtime
    real_get, real_set = rt.getDevice, rt.setDevice
    c = PagedKVCache(8, 16, 2, 64, device="cuda:0")
    ref = PagedKVCache(8, 16, 2, 64, device="cpu")
    k = np.random.default_rng(0).standard_normal((20, 2, 64)).astype(BF16)
    kd, sd = cupy.asarray(k), cupy.arange(20, dtype=cupy.int64)
    ref.store(np.arange(20), k, k)
    state = {"cur": 1}
    calls = []

    def fake_get():
        return state["cur"]

    def fake_set(d):
        calls.append(d)
        state["cur"] = d
        real_set(0)  # there is one GPU: the real work always runs on 0

    monkeypatch.setattr(rt, "getDevice", fake_get)
    monkeypatch.setattr(rt, "setDevice", fake_set)
    from fp4cache import _device, _hotpath

    _hotpath._get_device.cache_clear()
    try:
        for step in range(3):  # checked path first, then the prepared hot path
            calls.clear()
            c.store(sd, kd, kd)
            assert calls == [0, 1] and state["cur"] == 1, (step, calls)
            calls.clear()
            out = c.gather_dequant(cupy.arange(3, dtype=cupy.int32))
            assert calls == [0, 1] and state["cur"] == 1, (step, calls)
        calls.clear()
        assert c.stats["bad_slots"] == 0
        c.check()
        c.reset_counters()
        assert calls == [0, 1, 0, 1, 0, 1] and state["cur"] == 1
        with DeviceGuard(0):
            assert state["cur"] == 0
        assert state["cur"] == 1
    finally:
        monkeypatch.undo()
        _hotpath._get_device.cache_clear()
        real_set(real_get())
    assert _device is not None
    rk, _ = ref.gather_dequant(np.arange(3))
    assert np.array_equal(out[0].get().view(np.uint16), rk.view(np.uint16))


@pytest.mark.gpu
def test_bad_strides_odd_addresses_and_aliased_outputs():
    """Byte strides that are not whole elements are refused; a bf16 view at an odd byte
    address is stored correctly (copied, never a misaligned 2-byte load); out=(a, a) and
    outputs at odd addresses are refused; the buffer is untouched by every refusal."""
    import cupy

    c = PagedKVCache(8, 16, 2, 64, device="cuda")
    ref = PagedKVCache(8, 16, 2, 64, device="cpu")
    rng = np.random.default_rng(3)
    k = rng.standard_normal((5, 2, 64)).astype(BF16)
    c.store(cupy.arange(5), cupy.asarray(k), cupy.asarray(k))
    ref.store(np.arange(5), k, k)
    before = c.buffer.copy()
    raw = cupy.zeros(16 * 2 * 64 * 2 + 1, cupy.uint8)
    odd_all = raw[1:].view(BF16).reshape(16, 2, 64)  # address % 2 == 1
    odd = odd_all[:5]
    with pytest.raises(ValueError, match="out\\[0\\] and out\\[1\\] must not overlap"):
        a = cupy.empty((16, 2, 64), BF16)
        c.gather_dequant(cupy.arange(1), out=(a, a))
    with pytest.raises(ValueError, match="aligned to its itemsize"):
        c.gather_dequant(cupy.arange(1), out=(odd_all, cupy.empty((16, 2, 64), BF16)))
    assert cupy.array_equal(before, c.buffer)
    # odd address: stored through an aligned copy (the bytes are written through the
    # uint8 buffer: CuPy's own kernels would fault on the odd bf16 view too)
    k2 = rng.standard_normal((5, 2, 64)).astype(BF16)
    raw[1:1 + k2.nbytes] = cupy.asarray(k2.view(np.uint8).reshape(-1))
    c.store(cupy.arange(5, 10), odd, odd)
    ref.store(np.arange(5, 10), k2, k2)
    assert np.array_equal(c.buffer.get(), ref.buffer)
    # strides that are not whole elements (a uint8 view reinterpreted)
    wide = cupy.zeros((5, 2, 64 * 2 + 1), cupy.uint8)
    bad = cupy.ndarray((5, 2, 64), BF16, wide.data, strides=(wide.strides[0], 129, 2))
    before = c.buffer.copy()
    with pytest.raises(ValueError, match="strides that are multiples of its itemsize"):
        c.store(cupy.arange(5), bad, bad)
    assert cupy.array_equal(before, c.buffer)


@pytest.mark.gpu
def test_two_threads_share_one_stream():
    """Two threads storing into one cache (disjoint slots) and gathering on one shared
    stream: the shared plans and bookkeeping stay right."""
    import cupy

    nb, T, H, D = 64, 16, 2, 64
    c = PagedKVCache(nb, T, H, D, device="cuda")
    ref = PagedKVCache(nb, T, H, D, device="cpu")
    rng = np.random.default_rng(5)
    work = []
    for t in range(2):
        for step in range(20):
            slots = np.arange(t * 512 + step * 16, t * 512 + step * 16 + 16)
            k = rng.standard_normal((16, H, D)).astype(BF16)
            work.append((t, slots, k))
            ref.store(slots, k, k)
    stream = capture_stream()
    errors = []

    def worker(t):
        try:
            with cupy.cuda.Device(0), stream:
                for tt, slots, k in work:
                    if tt == t:
                        kd = cupy.asarray(k)
                        c.store(cupy.asarray(slots), kd, kd)
                        c.gather_dequant(cupy.arange(4, dtype=cupy.int32))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stream.synchronize()
    assert not errors, errors
    assert np.array_equal(c.buffer.get(), ref.buffer)


# -- two GPUs ------------------------------------------------------------------------------
def _rand(rng, n, H, D):
    return rng.standard_normal((n, H, D)).astype(BF16)


@pytest.mark.gpu(2)
def test_every_call_with_the_other_gpu_current():
    """A cache on GPU 0 used while GPU 1 is current (and the reverse): right results, the
    current device unchanged afterwards, no error."""
    import cupy

    from fp4cache import dequantize, quantize

    rng = np.random.default_rng(1)
    for home, other in ((0, 1), (1, 0)):
        with cupy.cuda.Device(home):
            c = PagedKVCache(32, 16, 2, 64, device=f"cuda:{home}")
            k = cupy.asarray(_rand(rng, 40, 2, 64))
            slots = cupy.arange(40, dtype=cupy.int64)
            blocks = cupy.arange(3, dtype=cupy.int32)
        ref = PagedKVCache(32, 16, 2, 64, device="cpu")
        ref.store(np.arange(40), k.get(), k.get())
        with cupy.cuda.Device(other):
            for _ in range(3):  # checked, then prepared
                c.store(slots, k, k)
                out = c.gather_dequant(blocks)
                assert cupy.cuda.runtime.getDevice() == other
            c.check()
            assert c.stats["bad_slots"] == 0
            data, scales = quantize(k)  # the codec runs where its input lives
            back = dequantize(data, scales)
            assert array_device(data) == home and array_device(back) == home
            assert cupy.cuda.runtime.getDevice() == other
        rk, rv = ref.gather_dequant(np.arange(3))
        assert np.array_equal(out[0].get().view(np.uint16), rk.view(np.uint16))
        assert np.array_equal(c.buffer.get(), ref.buffer)


@pytest.mark.gpu(2)
def test_foreign_arrays_refused_and_cache_still_works():
    import cupy

    with cupy.cuda.Device(0):
        c = PagedKVCache(8, 16, 2, 64, device="cuda:0")
        k0 = cupy.ones((4, 2, 64), BF16)
        c.store(cupy.arange(4), k0, k0)
        before = c.buffer.copy()
    with cupy.cuda.Device(1):
        k1 = cupy.ones((4, 2, 64), BF16)
        s1 = cupy.arange(4)
    with pytest.raises(ValueError, match=r"k is on GPU 1 \(cuda:1\) but the cache lives on "
                                         r"GPU 0"):
        c.store(cupy.arange(4, device=None) if False else s1.get(), k1, k0)
    with pytest.raises(ValueError, match="on GPU 1"):
        c.gather_dequant(cupy.arange(2, dtype=cupy.int32).get(),
                         out=(cupy.empty((32, 2, 64), BF16), k1.reshape(-1)))
    assert cupy.array_equal(before, c.buffer)
    c.store(cupy.arange(4, 8), k0, k0)  # still works
    assert c.stats["bad_slots"] == 0


@pytest.mark.gpu(2)
def test_one_cache_per_gpu_from_two_threads():
    """One cache per GPU, each used from its own thread, stores and gathers interleaved,
    against the CPU backend."""
    import cupy

    rng = np.random.default_rng(2)
    nb, T, H, D = 64, 16, 4, 128
    jobs = {g: [(np.arange(i * 16, i * 16 + 16), _rand(rng, 16, H, D)) for i in range(40)]
            for g in (0, 1)}
    caches = {g: PagedKVCache(nb, T, H, D, device=f"cuda:{g}") for g in (0, 1)}
    refs = {g: PagedKVCache(nb, T, H, D, device="cpu") for g in (0, 1)}
    for g in (0, 1):
        for slots, k in jobs[g]:
            refs[g].store(slots, k, k)
    errors = []

    def worker(g):
        try:
            with cupy.cuda.Device(g):
                for slots, k in jobs[g]:
                    kd = cupy.asarray(k)
                    caches[g].store(cupy.asarray(slots), kd, kd)
                    caches[g].gather_dequant(cupy.arange(8, dtype=cupy.int32))
                cupy.cuda.get_current_stream().synchronize()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(g,)) for g in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for g in (0, 1):
        assert np.array_equal(caches[g].buffer.get(), refs[g].buffer)


@pytest.mark.gpu(2)
def test_graph_on_gpu1_while_gpu0_holds_a_cache():
    import cupy

    c0 = PagedKVCache(16, 16, 2, 64, device="cuda:0")
    with cupy.cuda.Device(1):
        c1 = PagedKVCache(16, 16, 2, 64, device="cuda:1")
        ref = PagedKVCache(16, 16, 2, 64, device="cpu")
        slots = cupy.arange(24, dtype=cupy.int64)
        k = cupy.zeros((24, 2, 64), BF16)
        stream = capture_stream()
        with stream:
            c1.store(slots, k, k)
            c1.store(slots, k, k)
            stream.begin_capture()
            c1.store(slots, k, k)
            graph = stream.end_capture()
            rng = np.random.default_rng(4)
            for _ in range(50):
                s_h = rng.permutation(256)[:24]
                k_h = _rand(rng, 24, 2, 64)
                slots.set(s_h, stream=stream)
                k.set(k_h, stream=stream)
                graph.launch(stream)
                ref.store(s_h, k_h, k_h)
                stream.synchronize()
        assert np.array_equal(c1.buffer.get(), ref.buffer)
    assert not c0.buffer.any()


# -- what is missing when no GPU is usable -------------------------------------------------
@pytest.mark.skipif(gpu_available(), reason="checks the no-GPU error")
def test_no_gpu_error_says_what_is_missing_not_to_install_the_extra():
    """With CuPy installed but no driver or GPU, the error used to say to install the
    CUDA extra, which is installed: it says what is missing now (this machine's case
    when CuPy imports: a CPU runner with the extra installed)."""
    pytest.importorskip("cupy")
    with pytest.raises(RuntimeError) as err:
        PagedKVCache(4, 16, 2, 64, device="cuda")
    msg = str(err.value)
    assert msg.startswith("device='cuda' needs CuPy and a CUDA GPU: CuPy ")
    assert "is installed" in msg and "pip install" not in msg
    assert re.search(r"no NVIDIA driver|driver supports CUDA up to|sees no GPU", msg), msg
    with pytest.raises(RuntimeError, match="needs CuPy and a CUDA GPU: CuPy .* is installed"):
        fp4cache._backend.backend("cuda")


class _FakeRuntime:
    def __init__(self, count, driver, err=None, runtime=12090):
        self.count, self.driver, self.err, self.runtime = count, driver, err, runtime

    def getDeviceCount(self):
        if self.err:
            raise RuntimeError(self.err)
        return self.count

    def driverGetVersion(self):
        return self.driver

    def runtimeGetVersion(self):
        return self.runtime


@pytest.mark.parametrize("rt, want", [
    (_FakeRuntime(0, 0, "cudaErrorInsufficientDriver: CUDA driver version is insufficient"),
     r"CuPy 9\.9 is installed, but no NVIDIA driver was found .* install the NVIDIA driver"),
    (_FakeRuntime(0, 12020, "cudaErrorInsufficientDriver: CUDA driver version is "
                            "insufficient"),
     r"built for CUDA 12\.9, but the NVIDIA driver supports CUDA up to 12\.2 .*update the "
     r"driver"),
    (_FakeRuntime(0, 12090, "cudaErrorNoDevice: no CUDA-capable device is detected"),
     r"NVIDIA driver \(CUDA 12\.9\) is loaded, but it sees no GPU \(cudaErrorNoDevice.*"
     r"CUDA_VISIBLE_DEVICES=''"),
    (_FakeRuntime(2, 12090), None),
])
def test_gpu_unavailable_reason_names_the_missing_piece(monkeypatch, rt, want):
    import sys
    import types

    from fp4cache import _arrays

    fake = types.ModuleType("cupy")
    fake.__version__ = "9.9"
    fake.cuda = types.SimpleNamespace(runtime=rt)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    _arrays.gpu_unavailable_reason.cache_clear()
    try:
        why = _arrays.gpu_unavailable_reason()
        if want is None:
            assert why is None and _arrays.gpu_available()
        else:
            assert re.search(want, why), why
            assert "pip install" not in why
    finally:
        _arrays.gpu_unavailable_reason.cache_clear()


def test_gpu_unavailable_reason_without_cupy_names_the_extra(monkeypatch):
    import sys

    from fp4cache import _arrays

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    _arrays.gpu_unavailable_reason.cache_clear()
    try:
        assert "pip install 'fp4cache[cuda12]'" in _arrays.gpu_unavailable_reason()
    finally:
        _arrays.gpu_unavailable_reason.cache_clear()


# -- streams -------------------------------------------------------------------------------
def _kv(rng, n, h, d):
    k = rng.standard_normal((n, h, d), dtype=np.float32).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((n, h, d), dtype=np.float32).astype(ml_dtypes.bfloat16)
    return k, v


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["static6", "4over6"])
def test_store_on_one_stream_gather_on_another(rule):
    import cupy

    rng = np.random.default_rng(7)
    nb, T, H, D = 512, 16, 8, 128
    n = nb * T
    k, v = _kv(rng, n, H, D)
    slots = rng.permutation(n).astype(np.int64)
    blocks = rng.integers(0, nb, 300).astype(np.int32)

    gpu = PagedKVCache(nb, T, H, D, scale_rule=rule, device="cuda")
    cpu = PagedKVCache(nb, T, H, D, scale_rule=rule, device="cpu")
    cpu.store(slots, k, v)
    k_ref, v_ref = cpu.gather_dequant(blocks)

    producer = capture_stream()
    consumer = capture_stream()
    with producer:
        kd, vd, sd = cupy.asarray(k), cupy.asarray(v), cupy.asarray(slots)
        gpu.store(sd, kd, vd)
        stored = producer.record()
    consumer.wait_event(stored)
    with consumer:
        k_out, v_out = gpu.gather_dequant(cupy.asarray(blocks))
        page_copy = gpu.buffer.copy()
    consumer.synchronize()

    assert np.array_equal(page_copy.get(), cpu.buffer)
    assert np.array_equal(k_out.get().view(np.uint16), k_ref.view(np.uint16))
    assert np.array_equal(v_out.get().view(np.uint16), v_ref.view(np.uint16))


@pytest.mark.gpu
def test_calls_on_one_stream_are_ordered():
    """Two stores to the same slots then a gather, back to back on one stream: last wins."""
    import cupy

    rng = np.random.default_rng(11)
    nb, T, H, D = 64, 16, 4, 64
    n = nb * T
    k1, v1 = _kv(rng, n, H, D)
    k2, v2 = _kv(rng, n, H, D)
    slots = np.arange(n, dtype=np.int32)
    gpu = PagedKVCache(nb, T, H, D, device="cuda")
    cpu = PagedKVCache(nb, T, H, D, device="cpu")
    cpu.store(slots, k2, v2)
    stream = capture_stream()
    with stream:
        sd = cupy.asarray(slots)
        gpu.store(sd, cupy.asarray(k1), cupy.asarray(v1))
        gpu.store(sd, cupy.asarray(k2), cupy.asarray(v2))
        k_out, _ = gpu.gather_dequant(cupy.arange(nb, dtype=cupy.int32), dtype="float32")
    stream.synchronize()
    k_ref, _ = cpu.gather_dequant(np.arange(nb), dtype="float32")
    assert np.array_equal(k_out.get().view(np.uint32), k_ref.view(np.uint32))


# -- kernels -------------------------------------------------------------------------------
@pytest.mark.gpu
def test_every_specialization_compiles_and_loads():
    from fp4cache import _kernels

    for spec in _kernels.all_specs():
        assert _kernels.get_kernel(spec) is not None
