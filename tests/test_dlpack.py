"""Arrays from other libraries come in through DLPack, zero copy, on both backends."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import DLPackProducer

import fp4cache
from fp4cache import PagedKVCache


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
