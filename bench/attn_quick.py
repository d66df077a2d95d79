"""Quick timing of the fused decode attention (development check; the benchmark is
bench/attention_bench.py)."""
import os
import sys
import time

import cupy as cp
import numpy as np

import fp4cache
from fp4cache import _cupy_attention as ca


def main():
    B, L, H, g, D, T = 8, 32768, 8, 4, 128, 16
    if len(sys.argv) > 1:
        B, L = int(sys.argv[1]), int(sys.argv[2])
    nb = B * L // T
    cache = fp4cache.PagedKVCache(nb, T, H, D, device="cuda", k_scale=1 / 448, v_scale=1 / 448)
    cache.buffer[...] = cp.random.randint(0, 256, cache.buffer.shape, dtype=cp.int32).astype(
        cp.uint8) & 0x77
    tab = cp.arange(nb, dtype=cp.int32).reshape(B, L // T)
    lens = cp.full((B,), L, dtype=cp.int32)
    q = cp.random.standard_normal((B, H * g, D), dtype=cp.float32).astype(cp.float16)
    out = cp.empty_like(q)
    scratch = {}

    def call():
        ca.decode_attention(cache.buffer, q, tab, lens, out, None, geom=cache.geometry,
                            k_s=cache._k_s, v_s=cache._v_s, sm_scale=D ** -0.5,
                            stats=cache._stats, scratch=scratch)
    call()
    cp.cuda.Device().synchronize()
    plan = next(iter(scratch.values()))
    print("grid", plan.grid, "regs", plan.fn.num_regs, "smem", plan.fn.shared_size_bytes)
    if os.environ.get("ATTN_QUICK_ONCE"):
        call()
        cp.cuda.Device().synchronize()
        return
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(10):
        e0.record()
        for _ in range(10):
            call()
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) / 10 * 1e3)
    t = float(np.median(ts))
    nbytes = B * L * cache.geometry.bytes_per_token
    print(f"B={B} L={L}: {t:.1f} us, {nbytes / t / 1e3:.0f} GB/s page bytes")
    h0 = time.perf_counter()
    for _ in range(1000):
        call()
    print(f"host {1e6 * (time.perf_counter() - h0) / 1000:.2f} us/call")


if __name__ == "__main__":
    main()
