"""Stream semantics on the GPU: kernels run on CuPy's current stream; events order them."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fp4cache import PagedKVCache

pytestmark = pytest.mark.gpu


def _kv(rng, n, h, d):
    k = rng.standard_normal((n, h, d), dtype=np.float32).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((n, h, d), dtype=np.float32).astype(ml_dtypes.bfloat16)
    return k, v


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

    producer = cupy.cuda.Stream(non_blocking=True)
    consumer = cupy.cuda.Stream(non_blocking=True)
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
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        sd = cupy.asarray(slots)
        gpu.store(sd, cupy.asarray(k1), cupy.asarray(v1))
        gpu.store(sd, cupy.asarray(k2), cupy.asarray(v2))
        k_out, _ = gpu.gather_dequant(cupy.arange(nb, dtype=cupy.int32), dtype="float32")
    stream.synchronize()
    k_ref, _ = cpu.gather_dequant(np.arange(nb), dtype="float32")
    assert np.array_equal(k_out.get().view(np.uint32), k_ref.view(np.uint32))
