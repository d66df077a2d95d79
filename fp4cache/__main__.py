"""``python -m fp4cache``: store synthetic K/V in an NVFP4 cache, gather them back, report.

Prints bytes per token, compression against bf16, reconstruction error (relative RMSE
and SNR) for ``static6`` and ``4over6``, and store / gather throughput, on the GPU when
one is usable (CuPy), else on the CPU (NumPy backend).
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

from . import PagedKVCache, gpu_available


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fp4cache", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens to store (default: 65536 on GPU, 4096 on CPU)")
    p.add_argument("--heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head_dim (default 128)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--layout", choices=("HND", "NHD"), default="HND")
    p.add_argument("--rule", choices=("static6", "4over6", "both"), default="both")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--reps", type=int, default=None,
                   help="timed repetitions (default 20 GPU, 3 CPU)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _synthetic_kv(rng, n, h, d):
    """Keys with per-channel outliers (as real keys have) and Gaussian values."""
    k = rng.standard_normal((n, h, d), dtype=np.float32)
    k *= 1.0 + 4.0 * (rng.random((1, h, d), dtype=np.float32) < 0.03)
    v = rng.standard_normal((n, h, d), dtype=np.float32)
    return k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)


def _err(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    ref = ref.astype(np.float64)
    got = got.astype(np.float64)
    noise = np.sum((got - ref) ** 2)
    power = np.sum(ref**2)
    return float(np.sqrt(noise / power)), float(10 * np.log10(power / noise))


def main(argv=None) -> int:
    args = _parse(argv)
    device = ("cuda" if gpu_available() else "cpu") if args.device == "auto" else args.device
    gpu = device == "cuda"
    n = args.tokens or (65536 if gpu else 4096)
    reps = args.reps or (20 if gpu else 3)
    H, D, T = args.heads, args.head_dim, args.block_size
    rng = np.random.default_rng(args.seed)
    k_np, v_np = _synthetic_kv(rng, n, H, D)
    num_blocks = -(-n // T)
    slots_np = rng.permutation(num_blocks * T)[:n].astype(np.int64)
    blocks_np = np.arange(num_blocks, dtype=np.int32)

    if gpu:
        import cupy as cp

        xp = cp
        name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
        where = f"GPU ({name}, CuPy {cp.__version__})"

        def sync():
            cp.cuda.get_current_stream().synchronize()
    else:
        xp = np
        where = "CPU (NumPy backend; no usable GPU)" if args.device == "auto" else "CPU"

        def sync():
            pass

    k, v = xp.asarray(k_np), xp.asarray(v_np)
    slots, blocks = xp.asarray(slots_np), xp.asarray(blocks_np)
    print(f"fp4cache demo on {where}")
    print(f"workload: {n} tokens x {H} heads x head_dim {D}, bf16, block_size {T}, "
          f"layout {args.layout}, {num_blocks} pages")

    rules = ("static6", "4over6") if args.rule == "both" else (args.rule,)
    rows = []
    for rule in rules:
        cache = PagedKVCache(num_blocks, T, H, D, layout=args.layout, scale_rule=rule,
                             device=device)
        cache.store(slots, k, v)
        k_out, v_out = cache.gather_dequant(blocks)
        sync()
        times = {}
        def run_store(c=cache):
            c.store(slots, k, v)

        def run_gather(c=cache, o=(k_out, v_out)):
            c.gather_dequant(blocks, out=o)

        for label, fn in (("store", run_store), ("gather", run_gather)):
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            times[label] = (time.perf_counter() - t0) / reps
        kg = k_out.get() if gpu else k_out
        vg = v_out.get() if gpu else v_out
        kg = kg.reshape(-1, H, D)[slots_np].astype(np.float32)
        vg = vg.reshape(-1, H, D)[slots_np].astype(np.float32)
        k_err = _err(k_np.astype(np.float32), kg)
        v_err = _err(v_np.astype(np.float32), vg)
        bf16_bytes = 2 * n * H * D * 2
        nvfp4_bytes = n * cache.bytes_per_token
        store_bw = (bf16_bytes + nvfp4_bytes + slots_np.nbytes) / times["store"]
        gather_bw = (num_blocks * cache.geometry.page_bytes + 2 * num_blocks * T * H * D * 2
                     + blocks_np.nbytes) / times["gather"]
        rows.append((rule, k_err, v_err, times, store_bw, gather_bw, n / times["store"]))
        if rule == rules[0]:
            print(f"bytes per token (K+V, all heads): {cache.bytes_per_token} NVFP4 vs "
                  f"{2 * H * D * 2} bf16 vs {2 * H * D} fp8 -> {cache.compression_ratio:.2f}x "
                  "smaller than bf16")
            print(f"pool: {cache.nbytes / 2**20:.1f} MiB for {num_blocks * T} token slots")

    print()
    print("| rule | K rel. RMSE | K SNR (dB) | V rel. RMSE | V SNR (dB) | store (ms) | "
          "store GB/s | gather (ms) | gather GB/s | tokens/s stored |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rule, ke, ve, t, sbw, gbw, tps in rows:
        print(f"| {rule} | {ke[0]:.4f} | {ke[1]:.2f} | {ve[0]:.4f} | {ve[1]:.2f} | "
              f"{t['store'] * 1e3:.3f} | {sbw / 1e9:.1f} | {t['gather'] * 1e3:.3f} | "
              f"{gbw / 1e9:.1f} | {tps:.3g} |")
    print("\nGB/s count bytes read + written once (bf16 K/V, NVFP4 pages, index arrays).")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
