"""Time the fp4cache CUDA kernels against device-to-device copy bandwidth (CuPy events).

Run on a GPU machine from the repository root::

    PYTHONPATH=. python3 bench/kernel_timing.py [--reps 50] [--json out.json]

Every kernel is timed with CUDA events around a batch of 8 back-to-back backend calls
(all launches of each call included; the host enqueues ahead of the device), median of
``--reps`` after warm-up, rotating between two input sets so that no input stays in L2.
Bandwidth counts the bytes each call must read plus write (inputs once, outputs once),
the same way the copy ceiling is counted.
The host-time row measures the Python + launch cost of a 64-token store (decode step)
against an empty RawKernel launch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import cupy as cp
import ml_dtypes
import numpy as np

from fp4cache import _cupy_backend as cb
from fp4cache.layout import PageGeometry, longlive_padded_rows

BF16 = np.dtype(ml_dtypes.bfloat16)


def gpu_time_us(fn, reps: int, warm: int = 3, batch: int = 8) -> float:
    """Median device time of one call: ``batch`` calls back to back between two events
    (so that the host's enqueue time overlaps the device work instead of adding gaps)."""
    for i in range(warm):
        fn(i)
    cp.cuda.get_current_stream().synchronize()
    times = []
    for r in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for j in range(batch):
            fn(r * batch + j)
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / batch)
    return statistics.median(times)


def copy_bandwidth(reps: int) -> float:
    n = 1 << 30  # 1 GiB per buffer
    src = [cp.ones(n, cp.uint8) for _ in range(2)]
    dst = cp.empty(n, cp.uint8)
    us = gpu_time_us(lambda i: dst.__setitem__(slice(None), src[i % 2]), reps)
    return 2 * n / us / 1e3  # GB/s, read + written


_BASELINES = r"""
struct alignas(16) V4 { unsigned x, y, z, w; };
struct alignas(8) V2 { unsigned x, y; };
extern "C" __global__ void fp4c_expand(const unsigned* in, V4* out, unsigned long long n) {
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  if (i < n) { unsigned v = in[i]; out[i] = V4{v, v ^ 1u, v ^ 2u, v ^ 3u}; }
}
extern "C" __global__ void fp4c_compress(const V4* in, V2* out, unsigned long long n) {
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  if (i < n) { V4 a = in[2 * i], b = in[2 * i + 1]; out[i] = V2{a.x ^ b.y, a.z ^ b.w}; }
}
"""


def pattern_baselines(reps):
    """Ceilings of the two access patterns, with no arithmetic: decode-like expand
    (4 bytes in, 16 out per thread) and store-like compress (32 in, 8 out), plus memset."""
    mod = cp.RawModule(code=_BASELINES)
    res = {}
    n = 1 << 24  # 16M threads
    ins = [cp.ones(n, cp.uint32) for _ in range(2)]
    outs = [cp.empty(4 * n, cp.uint32) for _ in range(2)]
    k = mod.get_function("fp4c_expand")
    us = gpu_time_us(lambda i: k(((n + 255) // 256,), (256,), (ins[i % 2], outs[i % 2],
                                                                np.uint64(n))), reps)
    res["expand 4B->16B"] = (us, n * 20)
    ins = [cp.ones(8 * n, cp.uint32) for _ in range(2)]
    outs = [cp.empty(2 * n, cp.uint32) for _ in range(2)]
    k = mod.get_function("fp4c_compress")
    us = gpu_time_us(lambda i: k(((n + 255) // 256,), (256,), (ins[i % 2], outs[i % 2],
                                                                np.uint64(n))), reps)
    res["compress 32B->8B"] = (us, n * 40)
    buf = cp.empty(1 << 29, cp.uint8)
    us = gpu_time_us(lambda i: cp.cuda.runtime.memsetAsync(
        buf.data.ptr, i & 0xFF, buf.nbytes, cp.cuda.get_current_stream().ptr), reps)
    res["memset (write only)"] = (us, buf.nbytes)
    return res


def rand_bf16(shape, seed):
    """Finite random bf16 (magnitudes 2^-7..2^8), made from integer bits on the device."""
    r = cp.random.default_rng(seed)
    bits = r.integers(0, 1 << 16, size=shape, dtype=cp.int32).astype(cp.uint16)
    exp = (r.integers(120, 136, size=shape, dtype=cp.int32)).astype(cp.uint16)
    bits = (bits & cp.uint16(0x807F)) | (exp << cp.uint16(7))
    return bits.view(BF16)


def bench_store(rule, reps, N=65536, H=8, D=128, T=16, slot_order="contiguous", layout="HND",
                unique_slots=False):
    geom = PageGeometry(H, T, D, layout, True)
    nblk = N // T
    buf = cp.zeros((nblk, 2, geom.side_bytes), cp.uint8)
    ks = [rand_bf16((N, H, D), s) for s in (1, 2)]
    vs = [rand_bf16((N, H, D), s) for s in (3, 4)]
    if slot_order == "random":  # every token to a random slot
        slots = [cp.asarray(np.random.default_rng(s).permutation(nblk * T)[:N].astype(np.int64))
                 for s in (5, 6)]
    else:  # whole pages in a random page order (what a prefill writes)
        slots = [cp.asarray((np.random.default_rng(s).permutation(nblk)[:, None] * T
                             + np.arange(T)).reshape(-1)[:N].astype(np.int64)) for s in (5, 6)]
    st = cp.zeros(4, cp.uint64)
    one = np.float32(1.0)

    def run(i):
        cb.store(buf, slots[i % 2], ks[i % 2], vs[i % 2], geom=geom, rule=rule, k_s=one,
                 k_g=one, v_s=one, v_g=one, stats=st, unique_slots=unique_slots)

    us = gpu_time_us(run, reps)
    nbytes = 2 * N * H * D * 2 + 2 * N * H * geom.bytes_per_row + N * 8
    return us, nbytes


def bench_claim_passes(reps, N=65536, nslots=65536):
    """The duplicate-slot claim pre-pass of a large store, alone."""
    from fp4cache import _kernels

    slots = [cp.asarray(np.random.default_rng(s).permutation(nslots)[:N].astype(np.int64))
             for s in (1, 2)]
    fn = cb._kernel(_kernels.claim_spec("i64"))

    def run(i):
        table, epoch, e_host = cb._claim_state(nslots, False)
        fn(((N + 255) // 256,), (256,), (slots[i % 2], table, epoch, np.uint32(N),
                                         np.int64(nslots), np.uint32(e_host)))

    return gpu_time_us(run, reps)


def bench_gather(reps, n_pages=4096, H=8, D=128, T=16, dtype=BF16):
    geom = PageGeometry(H, T, D, "HND", True)
    nblk = 2 * n_pages
    buf = cp.asarray(np.random.default_rng(0).integers(0, 256, (nblk, 2, geom.side_bytes),
                                                       dtype=np.uint8))
    # keep scales finite so the output is ordinary numbers
    sides = buf.reshape(nblk, 2, geom.side_bytes)
    sides[:, :, geom.data_bytes:] = 0x38
    blocks = [cp.asarray(np.random.default_rng(s).permutation(nblk)[:n_pages].astype(np.int32))
              for s in (1, 2)]
    shape = (n_pages * T, H, D)
    outs = [(cp.empty(shape, dtype), cp.empty(shape, dtype)) for _ in range(2)]
    st = cp.zeros(4, cp.uint64)

    def run(i):
        ok, ov = outs[i % 2]
        cb.gather_dequant(buf, blocks[i % 2], ok, ov, geom=geom, k_s=np.float32(0.5),
                          v_s=np.float32(2.0), stats=st)

    us = gpu_time_us(run, reps)
    nbytes = n_pages * geom.page_bytes + 2 * n_pages * T * H * D * np.dtype(dtype).itemsize \
        + n_pages * 4
    return us, nbytes


def bench_longlive_decode(reps, H=24, D=128, Tb=7040, nblk=4, wide=True):
    Rp = longlive_padded_rows(Tb, H)
    S = D // 16
    rng = np.random.default_rng(0)
    sets = []
    for _ in range(2):
        vals = [cp.asarray(rng.integers(0, 256, (Rp, D // 2), dtype=np.uint8))
                for _ in range(nblk)]
        sfs = [cp.full(Rp * S, 0x38, cp.uint8) for _ in range(nblk)]
        am = [cp.full(1, 3.0, cp.float32) for _ in range(nblk)]
        tabs = [cp.asarray(np.array([a.data.ptr for a in grp], np.uint64))
                for grp in (vals, sfs, am)]
        sets.append((tabs, vals, sfs, am))
    outs = [cp.empty((1, nblk * Tb, H, D), BF16) for _ in range(2)]
    inv = np.float32(1) / np.float32(6 * 256)

    def run(i):
        tabs = sets[i % 2][0]
        cb.longlive_dequantize(*tabs, outs[i % 2], num_heads=H, block_token_size=Tb,
                               inv_denom=inv, values_aligned=wide)

    us = gpu_time_us(run, reps)
    nbytes = nblk * (Tb * H * D // 2 + Tb * H * S + 4) + nblk * Tb * H * D * 2
    return us, nbytes


def bench_longlive_front(reps, api, H=24, D=128, Tb=7040, nblk=4):
    """``longlive.dequantize`` (list) or ``dequantize_pool`` as a user calls them."""
    from fp4cache import longlive

    Rp = longlive_padded_rows(Tb, H)
    S = D // 16
    rng = np.random.default_rng(0)
    pools = []
    for _ in range(2):
        vals = cp.asarray(rng.integers(0, 256, (nblk, Rp, D // 2), dtype=np.uint8))
        sfs = cp.full((nblk, Rp * S), 0x38, cp.uint8)
        am = cp.full((nblk, 1), 3.0, cp.float32)
        pools.append((vals, sfs, am))
    ids = cp.arange(nblk, dtype=cp.int32)
    outs = [cp.empty((1, nblk * Tb, H, D), BF16) for _ in range(2)]

    def run(i):
        vals, sfs, am = pools[i % 2]
        if api == "pool":
            longlive.dequantize_pool(vals, sfs, am, ids, H, Tb, out=outs[i % 2])
        else:
            longlive.dequantize(list(vals), list(sfs), list(am), H, Tb)

    us = gpu_time_us(run, reps)
    nbytes = nblk * (Tb * H * D // 2 + Tb * H * S + 4) + nblk * Tb * H * D * 2
    return us, nbytes


def bench_longlive_quantize(rule, reps, H=24, D=128, Tb=7040):
    Rp = longlive_padded_rows(Tb, H)
    xs = [rand_bf16((Tb, H, D), s) for s in (1, 2)]
    v = cp.empty((Rp, D // 2), cp.uint8)
    sf = cp.empty(Rp * D // 16, cp.uint8)
    am = cp.empty(1, cp.float32)

    def run(i):
        cb.longlive_quantize(xs[i % 2], rule, v, sf, am)

    us = gpu_time_us(run, reps)
    nbytes = Tb * H * D * 2 + Rp * D // 2 + Rp * D // 16  # one read counted
    return us, nbytes


def bench_flat(rule, reps, N=65536 * 8, D=128):
    xs = [rand_bf16((N, D), s) for s in (1, 2)]
    data = cp.empty((N, D // 2), cp.uint8)
    sc = cp.empty((N, D // 16), cp.uint8)

    def q(i):
        cb.quantize(xs[i % 2], np.float32(1), np.float32(1), rule, data, sc)

    us_q = gpu_time_us(q, reps)
    outs = [cp.empty((N, D), BF16) for _ in range(2)]

    def d(i):
        cb.dequantize(data, sc, np.float32(1), outs[i % 2])

    us_d = gpu_time_us(d, reps)
    nb = N * D * 2 + N * D // 2 + N * D // 16
    return (us_q, nb), (us_d, nb)


def host_time_decode_store(n_calls=3000):
    """Host microseconds per call: 64-token store vs an empty RawKernel launch."""
    empty = cp.RawKernel(r'extern "C" __global__ void fp4c_empty(int* p) {}', "fp4c_empty")
    dummy = cp.zeros(1, cp.int32)
    geom = PageGeometry(8, 16, 128, "HND", True)
    buf = cp.zeros((1024, 2, geom.side_bytes), cp.uint8)
    k = rand_bf16((64, 8, 128), 1)
    v = rand_bf16((64, 8, 128), 2)
    slots = cp.arange(64, dtype=cp.int64) * 3
    st = cp.zeros(4, cp.uint64)
    one = np.float32(1.0)

    def store():
        cb.store(buf, slots, k, v, geom=geom, rule="4over6", k_s=one, k_g=one, v_s=one,
                 v_g=one, stats=st)

    def launch():
        empty((1,), (32,), (dummy,))

    res = {}
    for name, fn in (("empty_launch", launch), ("store64", store)):
        for _ in range(200):
            fn()
        cp.cuda.get_current_stream().synchronize()
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n_calls):
                fn()
            t1 = time.perf_counter()
            cp.cuda.get_current_stream().synchronize()
            best.append((t1 - t0) / n_calls * 1e6)
        res[name] = min(best)
    # device time of one decode-step store
    res["store64_gpu_us"] = gpu_time_us(lambda i: store(), 200)
    return res


@contextlib.contextmanager
def variant(**defines):
    """Kernels compiled with ``defines`` (over ``_kernels.TUNING``) inside the block; the
    backend sizes its grids from the same values."""
    from fp4cache import _kernels

    _kernels.set_defines(**defines)
    cb.clear_caches()
    try:
        yield
    finally:
        _kernels.set_defines()
        cb.clear_caches()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", action="store_true",
                    help="also time store/gather under alternative kernel macro settings")
    ap.add_argument("--store-variants", action="store_true",
                    help="time the store under the encoder's alternative macro settings")
    ap.add_argument("--quick", action="store_true",
                    help="copy, store, gather, LongLive decode only")
    ap.add_argument("--store-only", action="store_true",
                    help="copy and the store variants only (with --store-variants)")
    args = ap.parse_args()
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    print(f"device: {props['name'].decode()} sm_{props['major']}{props['minor']}, "
          f"{props['multiProcessorCount']} SMs; date {time.strftime('%Y-%m-%d %H:%M')}")
    copy_gbs = copy_bandwidth(args.reps)
    rows = []
    base = pattern_baselines(args.reps)

    def add(name, us, nbytes):
        gbs = nbytes / us / 1e3
        rows.append({"kernel": name, "us": us, "GB/s": gbs, "pct_copy": 100 * gbs / copy_gbs})

    for name, (us, nb) in base.items():
        add(f"baseline {name}", us, nb)
    if args.store_only:
        args.quick, args.variants = True, False
    for rule in () if args.store_only else ("static6", "4over6"):
        add(f"store 64Kx8x128 bf16 {rule}", *bench_store(rule, args.reps))
    if not args.quick:
        add("store 64Kx8x128 bf16 static6 random slots",
            *bench_store("static6", args.reps, slot_order="random"))
        add("store 64Kx8x128 bf16 static6 NHD",
            *bench_store("static6", args.reps, layout="NHD"))
    if not args.store_only:
        add("gather_dequant 4096p x16 bf16", *bench_gather(args.reps))
    if not args.quick:
        add("gather_dequant 4096p x16 f32",
            *bench_gather(args.reps, dtype=np.dtype(np.float32)))
    if not args.store_only:
        add("longlive decode H24 D128 Tb7040 x4", *bench_longlive_decode(args.reps))
        add("longlive decode (narrow kernel)", *bench_longlive_decode(args.reps, wide=False))
    if args.store_variants and not args.store_only:
        for tiles in (1, 4):
            with variant(FP4C_LL_WIDE_TILES=tiles):
                add(f"longlive decode wide [tiles={tiles}]", *bench_longlive_decode(args.reps))
    if not args.store_only:
        add("longlive dequantize_pool (front end)", *bench_longlive_front(args.reps, "pool"))
        add("longlive dequantize list (front end)", *bench_longlive_front(args.reps, "list"))
    if not args.quick:
        for rule in ("static6", "4over6"):
            add(f"longlive quantize Tb7040 H24 {rule}",
                *bench_longlive_quantize(rule, args.reps))
        for rule in ("static6", "4over6"):
            (q, d) = bench_flat(rule, args.reps)
            add(f"flat quantize 512Kx128 bf16 {rule}", *q)
        add("flat dequantize 512Kx128 bf16", *d)
    if args.store_variants:
        both = frozenset({(2, "static6"), (2, "4over6")})
        names = ("STORE_PAIR", "STORE_PDL")
        default = {n: getattr(cb, n) for n in names}
        for label, defs, attrs in (
                ("default", {}, {}),
                ("no PDL", {}, {"STORE_PDL": False}),
                ("one head per thread", {}, {"STORE_PAIR": frozenset()}),
                ("two heads, 4over6 too", {}, {"STORE_PAIR": both}),
                ("software E4M3", {"FP4C_E4M3_CVT": 0}, {}),
                ("integer bf16 max", {"FP4C_ABSMAX16": 1}, {})):
            for n, val in {**default, **attrs}.items():
                setattr(cb, n, val)
            with variant(**defs):
                for rule in ("static6", "4over6"):
                    add(f"store {rule} [{label}]", *bench_store(rule, args.reps))
        for n, val in default.items():
            setattr(cb, n, val)
        for rule in ("static6", "4over6"):
            add(f"store {rule} [unique_slots=True]",
                *bench_store(rule, args.reps, unique_slots=True))
    if args.variants:
        for m in (1, 4):
            with variant(FP4C_DECODE_CHUNKS=m):
                add(f"gather bf16 [chunks/thread={m}]", *bench_gather(args.reps))
                add(f"longlive decode [chunks/thread={m}]", *bench_longlive_decode(args.reps))
        for defs in ({"FP4C_STORE_ITEMS": 2, "FP4C_STORE_MIN_BLOCKS": 2},
                     {"FP4C_PACK_EARLY": 0}):
            tag = ",".join(f"{k}={v}" for k, v in defs.items())
            with variant(**defs):
                for rule in ("static6", "4over6"):
                    add(f"store {rule} [{tag}]", *bench_store(rule, args.reps))
    claim_us = bench_claim_passes(args.reps)
    host = host_time_decode_store()
    print(f"\nD2D copy: {copy_gbs:.0f} GB/s (read + written)")
    print(f"{'kernel':42s} {'us':>9s} {'GB/s':>8s} {'% copy':>7s}")
    for r in rows:
        print(f"{r['kernel']:42s} {r['us']:9.1f} {r['GB/s']:8.0f} {r['pct_copy']:6.1f}%")
    print(f"claim pre-pass of a 64K-token store: {claim_us:.1f} us")
    print(f"host us/call: empty RawKernel {host['empty_launch']:.2f}, 64-token store "
          f"{host['store64']:.2f} (ratio {host['store64'] / host['empty_launch']:.2f}); "
          f"store64 GPU time {host['store64_gpu_us']:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": copy_gbs, "rows": rows, "host": host}, f, indent=1)


if __name__ == "__main__":
    main()
