"""The GPU hot path: repeated calls whose argument signature was validated before skip the
checks and (decode-step sizes) go straight to a prepared launch.  Results must not change,
and a call with a new signature is validated again."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fp4cache import PagedKVCache

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [1, 64, 128, 129, 1000])
def test_repeated_stores_and_gathers_match_cpu(n):
    """The prepared decode-step store and gather against the CPU backend."""
    import cupy


    rng = np.random.default_rng(n)
    nb, T, H, D = 128, 16, 4, 128
    gpu = PagedKVCache(nb, T, H, D, scale_rule="4over6", device="cuda")
    cpu = PagedKVCache(nb, T, H, D, scale_rule="4over6", device="cpu")
    out = None
    for step in range(6):
        # A fresh (n+1)-token array each step; odd steps pass an offset view (other
        # pointer alignment), so both the prepared launch and the full path are used.
        big = rng.standard_normal((n + 1, H, D), dtype=np.float32).astype(ml_dtypes.bfloat16)
        k_np = big[step % 2:step % 2 + n]
        v_np = (big[step % 2:step % 2 + n] * 0.5).astype(ml_dtypes.bfloat16)
        slots = rng.choice(nb * T, size=n, replace=n > nb * T).astype(np.int64)
        slots[rng.random(n) < 0.1] = -1
        cpu.store(slots, k_np, v_np)
        kd = cupy.asarray(big)[step % 2:step % 2 + n]
        gpu.store(cupy.asarray(slots), kd, cupy.asarray(v_np))
        blocks = rng.integers(0, nb, 8).astype(np.int32)
        if out is None:
            out = (cupy.empty((8 * T, H, D), ml_dtypes.bfloat16),
                   cupy.empty((8 * T, H, D), ml_dtypes.bfloat16))
        k_out, v_out = gpu.gather_dequant(cupy.asarray(blocks), out=out)
        k_ref, v_ref = cpu.gather_dequant(blocks)
        assert np.array_equal(k_out.get().view(np.uint16), k_ref.view(np.uint16)), step
        assert np.array_equal(v_out.get().view(np.uint16), v_ref.view(np.uint16)), step
    assert np.array_equal(gpu.buffer.get(), cpu.buffer)


def test_new_signature_is_validated_again():
    import cupy

    gpu = PagedKVCache(16, 16, 2, 64, device="cuda")
    k = cupy.ones((4, 2, 64), dtype=cupy.float32)
    slots = cupy.arange(4, dtype=cupy.int32)
    gpu.store(slots, k, k)
    gpu.store(slots, k, k)  # prepared launch
    before = gpu.buffer.copy()
    with pytest.raises(ValueError, match="k must have shape"):
        gpu.store(slots[:3], k[:3, :1], k[:3, :1])
    with pytest.raises(ValueError, match="slot_mapping"):
        gpu.store(slots[:3], k, k)
    with pytest.raises(TypeError, match="same dtype"):
        gpu.store(slots, k, k.astype(cupy.float16))
    assert cupy.array_equal(before, gpu.buffer)


def test_prepared_store_in_a_cuda_graph():
    """The prepared decode-step store captured into a CUDA graph and
    replayed with new slot and K/V contents writes what the CPU backend writes."""
    import cupy

    rng = np.random.default_rng(7)
    nb, T, H, D, n = 32, 16, 2, 64, 24
    gpu = PagedKVCache(nb, T, H, D, device="cuda")
    cpu = PagedKVCache(nb, T, H, D, device="cpu")
    slots = cupy.arange(n, dtype=cupy.int64)
    k = cupy.ones((n, H, D), ml_dtypes.bfloat16)
    v = cupy.ones((n, H, D), ml_dtypes.bfloat16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        gpu.store(slots, k, v)  # validated once: the next calls take the prepared launch
        gpu.store(slots, k, v)
        cpu.store(np.arange(n), np.ones((n, H, D), ml_dtypes.bfloat16),
                  np.ones((n, H, D), ml_dtypes.bfloat16))
        stream.begin_capture()
        gpu.store(slots, k, v)
        graph = stream.end_capture()
        for _ in range(3):
            s_h = rng.permutation(nb * T)[:n]
            k_h = rng.standard_normal((n, H, D)).astype(ml_dtypes.bfloat16)
            v_h = rng.standard_normal((n, H, D)).astype(ml_dtypes.bfloat16)
            slots.set(s_h, stream=stream)
            k.set(k_h, stream=stream)
            v.set(v_h, stream=stream)
            graph.launch(stream)
            cpu.store(s_h, k_h, v_h)
        stream.synchronize()
    assert np.array_equal(gpu.buffer.get(), cpu.buffer)


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
def test_prepared_gather_any_length_alignment_and_out(out_dtype):
    """The prepared gather (arguments packed once, one launch per call) for block lists of
    changing length (0 included), allocated outputs and ``out=`` views at 16-byte aligned
    and unaligned offsets (the vectorized and the scalar kernel), against the CPU."""
    import cupy

    rng = np.random.default_rng(11)
    nb, T, H, D = 64, 16, 2, 64
    gpu = PagedKVCache(nb, T, H, D, scale_rule="4over6", device="cuda")
    cpu = PagedKVCache(nb, T, H, D, scale_rule="4over6", device="cpu")
    slots = rng.permutation(nb * T)
    k = rng.standard_normal((nb * T, H, D)).astype(np.float32)
    v = (rng.standard_normal((nb * T, H, D)) * 4).astype(np.float32)
    cpu.store(slots, k, v)
    gpu.store(cupy.asarray(slots), cupy.asarray(k), cupy.asarray(v))
    dt = np.dtype(getattr(ml_dtypes, out_dtype, None) or out_dtype)
    for n in (3, 3, 7, 0, 40, 1, 7):  # the same signature, lengths change
        blocks = rng.integers(0, nb, n).astype(np.int32)
        k_out, v_out = gpu.gather_dequant(cupy.asarray(blocks), out_dtype)
        k_ref, v_ref = cpu.gather_dequant(blocks, out_dtype)
        assert k_out.shape == k_ref.shape and k_out.dtype == dt
        assert np.array_equal(k_out.get().view(np.uint8), k_ref.view(np.uint8)), n
        assert np.array_equal(v_out.get().view(np.uint8), v_ref.view(np.uint8)), n
    n = 5
    rows = n * T * H * D
    for offset in (0, 1, 0, 1):  # out= views: aligned, then one element off
        flat = cupy.zeros(2 * rows + 1, dt)
        out = (flat[offset:offset + rows].reshape(n * T, H, D),
               flat[rows + offset:2 * rows + offset].reshape(n * T, H, D))
        blocks = rng.integers(0, nb, n).astype(np.int64)
        gpu.gather_dequant(cupy.asarray(blocks), out=out)
        k_ref, v_ref = cpu.gather_dequant(blocks, out_dtype)
        assert np.array_equal(out[0].get().view(np.uint8), k_ref.view(np.uint8)), offset
        assert np.array_equal(out[1].get().view(np.uint8), v_ref.view(np.uint8)), offset


def test_prepared_gather_in_a_cuda_graph():
    """The prepared gather captured into a CUDA graph and replayed with new block ids
    decodes what the CPU backend decodes."""
    import cupy

    rng = np.random.default_rng(5)
    nb, T, H, D, n = 32, 16, 2, 64, 6
    gpu = PagedKVCache(nb, T, H, D, device="cuda")
    cpu = PagedKVCache(nb, T, H, D, device="cpu")
    slots = rng.permutation(nb * T)
    k = rng.standard_normal((nb * T, H, D)).astype(ml_dtypes.bfloat16)
    cpu.store(slots, k, k)
    gpu.store(cupy.asarray(slots), cupy.asarray(k), cupy.asarray(k))
    blocks = cupy.zeros(n, cupy.int32)
    out = (cupy.empty((n * T, H, D), ml_dtypes.bfloat16),
           cupy.empty((n * T, H, D), ml_dtypes.bfloat16))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        gpu.gather_dequant(blocks, out=out)  # validated once: then the prepared launch
        stream.begin_capture()
        gpu.gather_dequant(blocks, out=out)
        graph = stream.end_capture()
        for _ in range(3):
            b = rng.integers(0, nb, n).astype(np.int32)
            blocks.set(b, stream=stream)
            graph.launch(stream)
            stream.synchronize()
            k_ref, _ = cpu.gather_dequant(b)
            assert np.array_equal(out[0].get().view(np.uint16), k_ref.view(np.uint16))
