"""fp4cache benchmark: bandwidth of the NVFP4 KV-cache kernels against the copy ceiling
and against the same work written in PyTorch (eager and ``torch.compile``).

Run on a GPU (from the repository root)::

    PYTHONPATH=. python3 bench/bench.py --out bench.json

or on the CPU, NumPy backend, tiny sizes (same code paths, for testing the script)::

    python3 bench/bench.py --cpu --quick

See ``bench/README.md`` for what is measured and how bytes are counted.  Every section
is wrapped: a failure prints its error and the rest still runs.  The JSON file is
rewritten after every section, and a markdown table is the last thing printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import ml_dtypes  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
SPEC_COPY_GBPS = 4100.0  # the contract's measured H200 copy, used only if the copy section fails
K_SCALE = 1.0 / 448.0  # ~ calibrated amax/(6*448) for unit-normal data (amax ~ 6)
V_SCALE = 1.0 / 448.0

# ---------------------------------------------------------------------------- sizes --
SIZES: dict[str, dict[str, Any]] = {
    "gpu": dict(
        N=65536, H=8, D=128, T=16, pool_pages=16384, gather_pages=4096, rot=3,
        ll_seed=dict(H=24, D=128, Tb=7040, nb=4), ll_small=dict(H=24, D=128, Tb=128, nb=256),
        ll_list=dict(H=8, D=128, Tb=256, counts=(4, 256, 2048), reps=10),
        decode_tokens=(1, 16, 64, 256), decode_pages=(1, 4, 16, 64), copy_bytes=2 << 30,
        reps=25, host_calls=2000, ll_check_values=1 << 22,
    ),
    "gpu_quick": dict(
        N=16384, H=8, D=128, T=16, pool_pages=4096, gather_pages=1024, rot=3,
        ll_seed=dict(H=24, D=128, Tb=7040, nb=4), ll_small=dict(H=24, D=128, Tb=128, nb=64),
        ll_list=dict(H=8, D=128, Tb=256, counts=(4, 256, 2048), reps=5),
        decode_tokens=(1, 64), decode_pages=(1, 16), copy_bytes=1 << 30,
        reps=10, host_calls=500, ll_check_values=1 << 22,
    ),
    "cpu": dict(
        N=512, H=2, D=128, T=16, pool_pages=128, gather_pages=32, rot=3,
        ll_seed=dict(H=4, D=128, Tb=64, nb=4), ll_small=dict(H=8, D=128, Tb=16, nb=8),
        ll_list=dict(H=2, D=128, Tb=16, counts=(4, 16), reps=3),
        decode_tokens=(1, 16, 64), decode_pages=(1, 4), copy_bytes=64 << 20,
        reps=5, host_calls=200, ll_check_values=1 << 20,
    ),
    "cpu_quick": dict(
        N=256, H=2, D=128, T=16, pool_pages=64, gather_pages=16, rot=2,
        ll_seed=dict(H=4, D=128, Tb=64, nb=2), ll_small=dict(H=8, D=128, Tb=16, nb=4),
        ll_list=dict(H=2, D=128, Tb=16, counts=(4,), reps=2),
        decode_tokens=(1, 64), decode_pages=(1, 4), copy_bytes=16 << 20,
        reps=3, host_calls=50, ll_check_values=1 << 20,
    ),
}

TARGETS = {
    "store static6": 0.85, "store 4over6": 0.40, "gather static6": 0.85, "gather 4over6": 0.85,
    "longlive": 0.85, "vs_compile": 3.0, "host_ratio": 2.0,
    # 4over6's exact float32 error sums make its store arithmetic-bound (issue 13): at least
    # 40 % of copy and at most 2.2x the static6 store time
    "store 4over6 vs static6": 2.2,
}

_SPIN_SRC = r"""
extern "C" __global__ void fp4bench_spin(unsigned long long ns, unsigned long long max_iter) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (unsigned long long i = 0; i < max_iter; ++i) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 >= ns) break;
    }
}
extern "C" __global__ void fp4bench_empty() {}
"""


# ------------------------------------------------------------------------ the device --
class Env:
    """Array namespace, RNG, timing and torch bridging for the GPU (CuPy) or the CPU."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        self.device = "cuda" if gpu else "cpu"
        self.spin_ok = False
        if gpu:
            import cupy

            self.cp = cupy
            self.xp = cupy
            self._start = cupy.cuda.Event()
            self._end = cupy.cuda.Event()
            try:
                mod = cupy.RawModule(code=_SPIN_SRC, options=("-std=c++17",))
                self._spin = mod.get_function("fp4bench_spin")
                self.empty_kernel = mod.get_function("fp4bench_empty")
                self.spin_ok = True
            except Exception as e:  # timing still works, without the host-gap shield
                print(f"!! spin kernel unavailable ({type(e).__name__}: {e}); timing "
                      "small ops may include host launch gaps", flush=True)
                self.empty_kernel = None
        else:
            self.cp = None
            self.xp = np
            self.empty_kernel = None

    # -- basics -------------------------------------------------------------------------
    def sync(self) -> None:
        if self.gpu:
            self.cp.cuda.get_current_stream().synchronize()

    def asnumpy(self, a) -> np.ndarray:
        return a.get() if self.gpu else np.asarray(a)

    def asarray(self, a: np.ndarray):
        return self.cp.asarray(a) if self.gpu else np.ascontiguousarray(a)

    def free(self) -> None:
        if self.gpu:
            self.sync()
            self.cp.get_default_memory_pool().free_all_blocks()

    def normal_f32(self, shape, seed: int):
        if self.gpu:
            return self.cp.random.RandomState(seed).standard_normal(shape, dtype=np.float32)
        return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)

    def randn_bf16(self, shape, seed: int):
        """Unit-normal bfloat16 values (float32 rounded to nearest even via bit ops)."""
        x = self.normal_f32(shape, seed)
        u = x.view(np.uint32)
        r = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
        return r.astype(np.uint16).view(BF16)

    def random_bytes(self, shape, low: int, high: int, seed: int):
        """uint8 array with values in ``[low, high)``."""
        if self.gpu:
            rs = self.cp.random.RandomState(seed)
            return rs.randint(low, high, size=shape, dtype=np.int32).astype(np.uint8)
        return np.random.default_rng(seed).integers(low, high, size=shape, dtype=np.uint8)

    def bf16_to_f32(self, a):
        xp = self.xp
        return (a.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32).astype(
            xp.float32)

    # -- timing -------------------------------------------------------------------------
    def spin(self, seconds: float) -> None:
        if self.spin_ok and seconds > 0:
            ns = int(seconds * 1e9)
            self._spin((1,), (1,), (np.uint64(ns), np.uint64(ns + 1000)))

    def time_calls(self, calls, *, reps: int, batch: int | None = None) -> dict[str, Any]:
        """Median time of one call, rotating through ``calls`` (zero-argument callables).

        GPU: each repetition enqueues a spin kernel, then ``batch`` calls between two
        CUDA events, so the device runs them back to back even when the host is slower
        (the spin hides the enqueue time); time = elapsed / batch.  ``host_gaps`` counts
        repetitions whose host enqueue outlasted the spin plus the device time (then the
        device waited for the host and the time includes launch gaps).
        CPU: ``time.perf_counter`` around ``batch`` calls.
        """
        batch = batch or len(calls)
        for c in calls:  # warm-up: compile, allocate, load
            c()
        self.sync()
        t0 = time.perf_counter()
        for i in range(batch):
            calls[i % len(calls)]()
        enq = time.perf_counter() - t0
        self.sync()
        times: list[float] = []
        gaps = 0
        spin_s = min(max(1.5 * enq, 100e-6), 0.2) if self.gpu else 0.0
        for r in range(reps):
            if self.gpu:
                self.spin(spin_s)
                self._start.record()
                h0 = time.perf_counter()
                for i in range(batch):
                    calls[(r * batch + i) % len(calls)]()
                h1 = time.perf_counter()
                self._end.record()
                self._end.synchronize()
                dev = self.cp.cuda.get_elapsed_time(self._start, self._end) / 1e3
                if (h1 - h0) > (spin_s if self.spin_ok else 0.0) + dev:
                    gaps += 1
                times.append(dev / batch)
            else:
                h0 = time.perf_counter()
                for i in range(batch):
                    calls[(r * batch + i) % len(calls)]()
                times.append((time.perf_counter() - h0) / batch)
        ts = np.sort(np.array(times))
        return dict(median_s=float(np.median(ts)), p10_s=float(np.quantile(ts, 0.1)),
                    p90_s=float(np.quantile(ts, 0.9)), reps=reps, batch=batch,
                    host_gaps=gaps)

    def host_per_call(self, fn, n: int, rounds: int = 5) -> float:
        """Median over ``rounds`` of host wall time per call, ``n/rounds`` calls, no sync."""
        for _ in range(min(20, n)):
            fn()
        self.sync()
        per = []
        m = max(1, n // rounds)
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(m):
                fn()
            per.append((time.perf_counter() - t0) / m)
            self.sync()
        return float(np.median(per))

    # -- torch bridging (zero copy: DLPack on the GPU, shared memory on the CPU) ----------
    def to_torch(self, a):
        import torch

        if a.dtype == BF16:
            return self.to_torch(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(a) if self.gpu else torch.from_numpy(np.asarray(a))

    def from_torch(self, t):
        import torch

        if t.dtype == torch.bfloat16:
            return self.from_torch(t.view(torch.int16)).view(BF16)
        return self.cp.from_dlpack(t) if self.gpu else t.numpy()


# ------------------------------------------------------------------------ the runner --
@dataclass
class Row:
    """One measured case."""

    section: str
    case: str
    impl: str
    time_s: float | None = None
    nbytes: int | None = None
    gbps: float | None = None
    frac_copy: float | None = None
    target: str = ""
    met: bool | None = None
    check: str = ""
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Bench:
    def __init__(self, args):
        self.args = args
        self.t0 = time.perf_counter()
        self.env = Env(gpu=not args.cpu)
        key = ("cpu" if args.cpu else "gpu") + ("_quick" if args.quick else "")
        self.sz = dict(SIZES[key])
        self.sz_key = key
        self.rows: list[Row] = []
        self.checks: list[dict[str, Any]] = []
        self.errors: list[dict[str, str]] = []
        self.skipped: list[str] = []
        self.meta: dict[str, Any] = {}
        self.copy_gbps: float | None = None
        self.torch = None
        self.tr = None
        self.caches: dict[str, Any] = {}  # rule -> PagedKVCache (pool for store and gather)
        self.sets: list[dict[str, Any]] = []  # rotation sets of store inputs
        self.gsets: list[dict[str, Any]] = []  # rotation sets of gather ids and outputs
        self.tbufs: dict[str, Any] = {}  # rule -> torch page pool

    # -- bookkeeping ----------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def remaining(self) -> float:
        return self.args.budget_s - self.elapsed()

    def log(self, msg: str) -> None:
        print(msg, flush=True)

    def error(self, where: str, e: BaseException) -> None:
        tb = traceback.format_exc(limit=6)
        self.errors.append({"where": where, "error": f"{type(e).__name__}: {e}",
                            "traceback": tb})
        self.log(f"!! {where} failed: {type(e).__name__}: {e}\n{tb}")

    def attempt(self, where: str, fn, *a, **kw):
        """Run ``fn``; on failure record the error and return None."""
        try:
            return fn(*a, **kw)
        except Exception as e:
            self.error(where, e)
            return None

    def section(self, name: str, fn, *, need_s: float = 0.0) -> None:
        if self.remaining() < need_s:
            msg = (f"{name}: skipped, {self.remaining():.0f} s left of the "
                   f"{self.args.budget_s:.0f} s budget (needs ~{need_s:.0f} s)")
            self.skipped.append(msg)
            self.log("-- " + msg)
            return
        t = time.perf_counter()
        self.log(f"\n== {name}  (t = {self.elapsed():.1f} s)")
        self.attempt(f"section '{name}'", fn)
        self.log(f"   [{name}: {time.perf_counter() - t:.1f} s]")
        self.write_json()

    def add(self, row: Row) -> Row:
        if row.time_s and row.nbytes:
            row.gbps = row.nbytes / row.time_s / 1e9
            ceil = self.copy_gbps or SPEC_COPY_GBPS
            row.frac_copy = row.gbps / ceil
        self.rows.append(row)
        parts = [f"   {row.case:<34} {row.impl:<26}"]
        if row.time_s is not None:
            parts.append(f"{row.time_s * 1e6:10.1f} us")
        if row.gbps is not None:
            parts.append(f"{_gb(row.gbps):>8} GB/s")
        if row.frac_copy is not None:
            parts.append(f"{100 * row.frac_copy:5.1f}% copy")
        if row.target:
            parts.append(f"[target {row.target}: {_mark(row.met)}]")
        if row.check:
            parts.append(f"check: {row.check}")
        if row.note:
            parts.append(f"({row.note})")
        self.log(" ".join(parts))
        return row

    def timed(self, section: str, case: str, impl: str, calls, nbytes: int | None, *,
              batch: int | None = None, reps: int | None = None, frac_target: float | None = None,
              note: str = "") -> Row | None:
        """Time ``calls`` and record a row; returns None (error recorded) on failure."""
        try:
            t = self.env.time_calls(calls, reps=reps or self.sz["reps"], batch=batch)
        except Exception as e:
            self.error(f"{case} / {impl}", e)
            return None
        notes = [note] if note else []
        if self.env.gpu and t["host_gaps"]:
            notes.append(f"host-bound in {t['host_gaps']}/{t['reps']} reps")
        row = Row(section, case, impl, time_s=t["median_s"], nbytes=nbytes,
                  note="; ".join(notes), extra=t)
        self.add(row)
        if frac_target is not None and row.frac_copy is not None:
            row.target = f">= {100 * frac_target:.0f}% copy"
            row.met = row.frac_copy >= frac_target
            self.log(f"     target {row.target}: {_mark(row.met)}")
        return row

    def write_json(self) -> None:
        if not self.args.out:
            return
        doc = {
            "meta": self.meta, "sizes": {k: (list(v) if isinstance(v, tuple) else v)
                                         for k, v in self.sz.items()},
            "copy_gbps": self.copy_gbps, "targets": TARGETS,
            "rows": [_row_dict(r) for r in self.rows], "checks": self.checks,
            "errors": self.errors, "skipped": self.skipped, "elapsed_s": self.elapsed(),
        }
        try:
            path = Path(self.args.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps(doc, indent=1, default=_json_default))
            os.replace(tmp, path)
        except Exception as e:
            self.log(f"!! could not write {self.args.out}: {type(e).__name__}: {e}")

    # -- sections ---------------------------------------------------------------------------
    def sec_info(self) -> None:
        import fp4cache

        m = self.meta
        m.update(mode=self.sz_key, python=platform.python_version(), numpy=np.__version__,
                 fp4cache=fp4cache.__version__, argv=sys.argv, started=time.strftime("%c"),
                 k_scale=K_SCALE, v_scale=V_SCALE)
        if self.env.gpu:
            cp = self.env.cp
            props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
            name = props["name"]
            m.update(
                cupy=cp.__version__, device=name.decode() if isinstance(name, bytes) else name,
                sms=props.get("multiProcessorCount"), l2_bytes=props.get("l2CacheSize"),
                cc=f"{props.get('major')}.{props.get('minor')}",
                driver=cp.cuda.runtime.driverGetVersion(),
                runtime=cp.cuda.runtime.runtimeGetVersion(), spin_kernel=self.env.spin_ok,
            )
            if self.env.spin_ok:  # the spin shields timings from host gaps; check it spins
                s, e = cp.cuda.Event(), cp.cuda.Event()
                s.record()
                self.env.spin(200e-6)
                e.record()
                e.synchronize()
                got = cp.cuda.get_elapsed_time(s, e) * 1e3
                m["spin_200us_measured_us"] = got
                if not 100 <= got <= 1000:  # a broken timer: time without the spin
                    self.env.spin_ok = False
                    self.log(f"!! spin kernel spun {got:.0f} us for 200 us: disabled; small "
                             "ops may include host launch gaps")
        else:
            m.update(device=f"CPU ({platform.processor() or platform.machine()}), NumPy backend",
                     cpus=os.cpu_count())
        if not self.args.no_torch:
            try:
                import torch
                import torch_reference

                self.torch, self.tr = torch, torch_reference
                m["torch"] = torch.__version__
                if self.env.gpu:
                    if not torch.cuda.is_available():
                        raise RuntimeError("torch sees no CUDA device")
                    m["torch_stream_is_default"] = torch.cuda.current_stream().cuda_stream == 0
                try:
                    import triton

                    m["triton"] = triton.__version__
                except Exception:
                    m["triton"] = None
            except Exception as e:
                self.torch = None
                self.error("import torch (torch sections will be skipped)", e)
        for k, v in m.items():
            self.log(f"   {k}: {v}")

    def sec_copy(self) -> None:
        env, xp = self.env, self.env.xp
        n = self.sz["copy_bytes"]
        src = xp.arange(n // 8, dtype=np.int64).view(np.uint8)  # not zeros
        dst = xp.empty_like(src)
        if env.gpu:
            def call():
                dst.data.copy_from_device_async(src.data, n)

            impl = "cudaMemcpyAsync D2D"
        else:
            def call():
                np.copyto(dst, src)

            impl = "numpy copyto"
        row = self.timed("copy", f"copy {n / 2**30:.2f} GiB", impl, [call], 2 * n,
                         batch=3, reps=max(5, self.sz["reps"] // 2))
        if row is not None:
            self.copy_gbps = row.gbps
            row.frac_copy = 1.0
        # an elementwise copy kernel too (8-byte elements), for reference
        s64, d64 = src.view(np.int64), dst.view(np.int64)
        self.timed("copy", f"copy {n / 2**30:.2f} GiB", "elementwise copy (int64)",
                   [lambda: xp.copyto(d64, s64)], 2 * n, batch=3,
                   reps=max(5, self.sz["reps"] // 2))
        if self.copy_gbps:
            self.meta["copy_gbps"] = self.copy_gbps
        src = dst = s64 = d64 = None  # release the buffers
        env.free()

    def _geom_kwargs(self, rule):
        sz = self.sz
        return dict(num_blocks=sz["pool_pages"], block_size=sz["T"], num_heads=sz["H"],
                    head_dim=sz["D"], layout="HND", scale_rule=rule, k_scale=K_SCALE,
                    v_scale=V_SCALE, swizzle_v_scales=True, device=self.env.device)

    def sec_setup(self) -> None:
        """Inputs (rotation sets), the two page pools, filled with random data."""
        import fp4cache

        env, sz = self.env, self.sz
        N, H, D, T, P = sz["N"], sz["H"], sz["D"], sz["T"], sz["pool_pages"]
        rng = np.random.default_rng(1234)
        for r in range(sz["rot"]):
            pages = rng.permutation(P)[: N // T].astype(np.int64)
            slots = (pages[np.arange(N) // T] * T + np.arange(N) % T).astype(np.int64)
            self.sets.append(dict(
                k=env.randn_bf16((N, H, D), 10 + 2 * r), v=env.randn_bf16((N, H, D), 11 + 2 * r),
                slots=env.asarray(slots), pages=pages, pages_dev=env.asarray(pages),
            ))
        n = sz["gather_pages"]
        for _ in range(sz["rot"]):
            ids = rng.permutation(P)[:n].astype(np.int32)
            self.gsets.append(dict(ids=env.asarray(ids), ids_host=ids,
                                   ok=env.xp.empty((n * T, H, D), dtype=BF16),
                                   ov=env.xp.empty((n * T, H, D), dtype=BF16)))
        self.log(f"   {sz['rot']} input sets of {N} tokens x {H} heads x D={D} bf16; "
                 f"pools of {P} pages x {T} tokens; gather {n} pages")
        for rule in ("static6", "4over6"):
            try:
                cache = fp4cache.PagedKVCache(**self._geom_kwargs(rule))
                for c in range(0, P * T, N):  # fill the whole pool (never time on zeros)
                    s = self.sets[(c // N) % len(self.sets)]
                    m = min(N, P * T - c)
                    cache.store(env.asarray(np.arange(c, c + m, dtype=np.int64)),
                                s["k"][:m], s["v"][:m])
                env.sync()
                self.caches[rule] = cache
                self.log(f"   {cache!r}")
            except Exception as e:
                self.error(f"fp4cache PagedKVCache(device={env.device!r}, {rule}) setup", e)

    def sec_sanity(self) -> None:
        """fp4cache on this device vs the NumPy backend, bit for bit, on a small sample."""
        import fp4cache

        env, sz = self.env, self.sz
        H, D, T = sz["H"], sz["D"], sz["T"]
        P, n_tok = 64, 256
        rng = np.random.default_rng(7)
        kh = rng.standard_normal((n_tok, H, D)).astype(BF16)
        vh = (rng.standard_normal((n_tok, H, D)) * 30).astype(BF16)
        kh[3, 1, 5], vh[8, 0, 100], kh[9, 1, 64] = np.nan, np.inf, -np.inf  # NaN groups
        k, v = env.asarray(kh), env.asarray(vh)
        slots = rng.permutation(P * T)[:n_tok].astype(np.int64)
        slots[[10, 20]] = -1  # padding tokens are skipped
        slots[30] = slots[31]  # a duplicate slot: the last token wins
        blocks = rng.integers(0, P, 24).astype(np.int32)
        for rule in ("static6", "4over6"):
            kw = self._geom_kwargs(rule) | dict(num_blocks=P)
            dev = fp4cache.PagedKVCache(**kw)
            ref = fp4cache.PagedKVCache(**(kw | dict(device="cpu")))
            dev.store(env.asarray(slots), k, v, unique_slots=False)
            ref.store(slots, kh, vh, unique_slots=False)
            same = float(np.mean(env.asnumpy(dev.buffer) == ref.buffer))
            gk, gv = dev.gather_dequant(env.asarray(blocks))
            rk, rv = ref.gather_dequant(blocks)
            g_same = float(np.mean(np.concatenate([
                _same_bf16(env.asnumpy(gk), rk).ravel(), _same_bf16(env.asnumpy(gv), rv).ravel()
            ])))
            chk = dict(check=f"fp4cache {env.device} vs NumPy backend, {rule}",
                       page_bytes_identical=same, gather_bits_identical=g_same,
                       tokens=n_tok, pages=P)
            self.checks.append(chk)
            self.log(f"   {rule}: page bytes identical {same:.6f}, gathered bf16 identical "
                     f"{g_same:.6f} (expected 1.0: bit-exact contract; NaN/Inf groups, "
                     "padding and a duplicate slot included)")

    def sec_fp4_large(self) -> None:
        sz = self.sz
        N, H, D, T = sz["N"], sz["H"], sz["D"], sz["T"]
        S = D // 16
        store_bytes = 2 * N * H * D * 2 + N * 8 + 2 * N * H * (D // 2 + S)
        for rule in ("static6", "4over6"):
            cache = self.caches.get(rule)
            if cache is None:
                self.log(f"   (no fp4cache pool for {rule}: see the setup error)")
                continue
            # the default: slots unique, as a serving engine builds them
            calls = [_bind(cache.store, s["slots"], s["k"], s["v"]) for s in self.sets]
            row = self.timed("store", f"store {N} tok {rule}", "fp4cache", calls, store_bytes,
                             batch=2 * len(calls), frac_target=TARGETS[f"store {rule}"])
            if rule == "4over6" and row is not None and row.time_s:
                ref = next((r for r in self.rows if r.case == f"store {N} tok static6"
                            and r.impl == "fp4cache" and r.time_s), None)
                if ref is not None:
                    ratio = row.time_s / ref.time_s
                    lim = TARGETS["store 4over6 vs static6"]
                    row.extra["vs_static6"] = ratio
                    row.target += f", <= {lim}x static6 time ({ratio:.2f}x)"
                    row.met = bool(row.met) and ratio <= lim
                    self.log(f"     4over6 / static6 store time {ratio:.2f}x "
                             f"(target <= {lim}x): {_mark(ratio <= lim)}")
            calls = [_bind(cache.store, s["slots"], s["k"], s["v"], unique_slots=False)
                     for s in self.sets]
            self.timed("store", f"store {N} tok {rule}", "fp4cache unique_slots=False", calls,
                       store_bytes, batch=2 * len(calls), frac_target=TARGETS[f"store {rule}"],
                       note="last occurrence wins: claim pass, store, clear pass")
        n = sz["gather_pages"]
        page_bytes = 2 * H * T * (D // 2 + S)
        gather_bytes = n * 4 + n * page_bytes + 2 * n * T * H * D * 2
        for rule in ("static6", "4over6"):
            cache = self.caches.get(rule)
            if cache is None:
                continue
            calls = [_bind(cache.gather_dequant, g["ids"], out=(g["ok"], g["ov"]))
                     for g in self.gsets]
            self.timed("gather", f"gather {n} pages {rule}", "fp4cache", calls, gather_bytes,
                       batch=2 * len(calls), frac_target=TARGETS[f"gather {rule}"],
                       note="same kernel for both rules" if rule == "4over6" else "")

    def _longlive_inputs(self, H: int, D: int, Tb: int, nb: int, seed: int):
        """Two rotation sets of ``nb`` random LongLive blocks (values, blocked scales, amax;
        padding rows and scales zero), their pool ids, outputs and per-set lists, and
        the bytes one call moves."""
        from fp4cache import layout

        env, xp = self.env, self.env.xp
        S = D // 16
        R, Rp = Tb * H, layout.longlive_padded_rows(Tb, H)
        NB = 2 * nb
        values = env.random_bytes((NB, Rp, D // 2), 0, 256, seed)
        sf = env.random_bytes((NB, Rp * S), 0x30, 0x59, seed + 1)  # E4M3 0.5 .. 18
        if Rp > R:
            values[:, R:] = 0
            pad = layout.blocked_scale_offset(np.arange(R, Rp)[:, None], np.arange(S)[None, :],
                                              S).ravel()
            sf[:, env.asarray(pad)] = 0
        amax = env.asarray(np.random.default_rng(seed + 2).uniform(1, 8, NB).astype(np.float32))
        sets = [list(range(i * nb, (i + 1) * nb)) for i in range(2)]
        ids = [env.asarray(np.array(st, dtype=np.int32)) for st in sets]
        outs = [xp.empty((1, nb * Tb, H, D), dtype=BF16) for _ in sets]
        lists = [([values[i] for i in st], [sf[i] for i in st], [amax[i:i + 1] for i in st])
                 for st in sets]
        nbytes = nb * (R * (D // 2 + S) + 4) + nb * Tb * H * D * 2
        return values, sf, amax, ids, outs, lists, nbytes

    def _log_longlive_sizes(self, case: str, H: int, D: int, Tb: int, nb: int) -> None:
        self.log(f"   {case}: {nb * Tb * H * (D // 2 + D // 16) / 2**20:.1f} MiB in, "
                 f"{nb * Tb * H * D * 2 / 2**20:.1f} MiB out per call")

    def _longlive_case(self, label: str, H: int, D: int, Tb: int, nb: int) -> None:
        from fp4cache import longlive

        env = self.env
        R = Tb * H
        values, sf, amax, ids, outs, lists, nbytes = self._longlive_inputs(H, D, Tb, nb, 31)
        case = f"LongLive {label} H={H} Tb={Tb} x{nb}"
        self._log_longlive_sizes(case, H, D, Tb, nb)
        calls = [_bind(longlive.dequantize, *lst, H, Tb, scale_rule="4over6") for lst in lists]
        self.timed("longlive", case, "fp4cache dequantize", calls, nbytes,
                   batch=2 * len(calls), frac_target=TARGETS["longlive"],
                   note="list API: repeat call (launch and pointer tables reused)")
        calls = [_bind(longlive.dequantize_pool, values, sf, amax, ids[i], H, Tb, out=outs[i],
                       scale_rule="4over6")
                 for i in range(2)]
        self.timed("longlive", case, "fp4cache dequantize_pool", calls, nbytes + nb * 4,
                   batch=2 * len(calls), frac_target=TARGETS["longlive"])
        # bit-exactness against the NumPy backend on a few blocks
        nchk = min(nb, self.sz["ll_check_values"] // (R * D))
        if nchk >= 1 and env.gpu:
            got = longlive.dequantize(*(x[:nchk] for x in lists[0]), H, Tb, scale_rule="4over6")
            ref = longlive.dequantize([env.asnumpy(a) for a in lists[0][0][:nchk]],
                                      [env.asnumpy(a) for a in lists[0][1][:nchk]],
                                      [env.asnumpy(a) for a in lists[0][2][:nchk]], H, Tb,
                                      scale_rule="4over6")
            same = float(np.mean(_same_bf16(env.asnumpy(got), ref)))
            self.checks.append(dict(check=f"{case}: GPU vs NumPy backend ({nchk} blocks)",
                                    bits_identical=same))
            self.log(f"   {case}: decoded bf16 identical to the NumPy backend on {nchk} "
                     f"block(s): {same:.6f}")
        del values, sf, amax, outs, lists
        self.env.free()

    def sec_longlive(self) -> None:
        for label, key in (("seed", "ll_seed"), ("small blocks", "ll_small")):
            c = self.sz[key]
            self.attempt(f"LongLive {label}", self._longlive_case, label, c["H"], c["D"],
                         c["Tb"], c["nb"])

    def sec_longlive_list(self) -> None:
        """The list API's cost per call as the block count grows (issue 14)."""
        c = self.sz["ll_list"]
        for nb in c["counts"]:
            self.attempt(f"LongLive list API x{nb}", self._longlive_list_case, c["H"], c["D"],
                         c["Tb"], nb, c["reps"])

    def _longlive_list_case(self, H: int, D: int, Tb: int, nb: int, reps: int) -> None:
        """``longlive.dequantize`` (list API), ``dequantize_pool`` and the seed kernel's
        host protocol at ``nb`` blocks of ``Tb`` tokens x ``H`` heads.

        The seed's protocol (per call: read every block's pointers, three synchronous
        ``cudaMemcpy`` of the pointer tables, allocate the output, one launch) is timed
        with fp4cache's decode kernel, since the seed itself is a torch extension.
        """
        from fp4cache import _cupy_backend as cb
        from fp4cache import longlive

        env = self.env
        values, sf, amax, ids, outs, lists, nbytes = self._longlive_inputs(H, D, Tb, nb, 41)
        case = f"LongLive list API H={H} Tb={Tb} x{nb}"
        self._log_longlive_sizes(case, H, D, Tb, nb)
        if env.gpu:  # the first call of a list: checks, pointer tables, one copy
            firsts = []
            for _ in range(3):
                longlive._LIST_FAST.clear()
                env.sync()
                t0 = time.perf_counter()
                longlive.dequantize(*lists[0], H, Tb, scale_rule="4over6")
                env.sync()
                firsts.append(time.perf_counter() - t0)
            self.add(Row("longlive", case, "fp4cache dequantize (list), first call",
                         time_s=float(np.median(firsts)),
                         note="host + device, synchronized: checks, pointer tables, copy"))
        row_list = self.timed("longlive", case, "fp4cache dequantize (list)",
                              [_bind(longlive.dequantize, *lst, H, Tb,
                                     scale_rule="4over6") for lst in lists],
                              nbytes, batch=4, reps=reps,
                              note="hot path: same block arrays as a checked call"
                              if env.gpu else "")
        self.timed("longlive", case, "fp4cache dequantize_pool",
                   [_bind(longlive.dequantize_pool, values, sf, amax, ids[i], H, Tb,
                          out=outs[i], scale_rule="4over6") for i in range(2)],
                   nbytes + nb * 4, batch=4, reps=reps)
        if env.gpu:
            cp = env.cp
            inv = longlive.inverse_global_denominator()
            h2d = cp.cuda.runtime.memcpyHostToDevice

            def seed_protocol(lst):
                tabs = []
                for group in lst:  # make_device_pointer_tensor, three times
                    host = np.array([a.data.ptr for a in group], dtype=np.uint64)
                    dev = cp.empty(len(group), dtype=np.uint64)
                    cp.cuda.runtime.memcpy(dev.data.ptr, host.ctypes.data, host.nbytes, h2d)
                    tabs.append(dev)
                out = cp.empty((1, len(lst[0]) * Tb, H, D), dtype=BF16)
                cb.longlive_dequantize(*tabs, out, num_heads=H, block_token_size=Tb,
                                       inv_denom=inv)
                return out

            seed = self.timed("longlive", case, "seed host protocol, fp4cache kernel",
                              [_bind(seed_protocol, lst) for lst in lists], nbytes, batch=4,
                              reps=reps, note="3 synchronous pointer-table copies per call")
            if seed is not None and row_list is not None and row_list.time_s:
                sp = seed.time_s / row_list.time_s
                seed.extra["fp4cache_speedup"] = sp
                self.log(f"     list API is {sp:.2f}x faster than the seed's host protocol")
            ref = longlive.dequantize(*lists[0], H, Tb, scale_rule="4over6")
            same = float(cp.mean(_same_bf16(seed_protocol(lists[0]), ref)))
            self.checks.append(dict(check=f"{case}: seed protocol vs list API", same=same))
            n = 200 if nb <= 256 else 50
            t = env.host_per_call(_bind(longlive.dequantize, *lists[0], H, Tb,
                                        scale_rule="4over6"), n)
            self.add(Row("host", "host time per call",
                         f"fp4cache LongLive dequantize (list) {nb} blocks", time_s=t,
                         extra=dict(calls=n)))
            t = env.host_per_call(_bind(seed_protocol, lists[0]), n)
            self.add(Row("host", "host time per call",
                         f"seed host protocol {nb} blocks", time_s=t, extra=dict(calls=n)))
        del values, sf, amax, outs, lists
        env.free()

    def sec_decode(self) -> None:
        env, sz = self.env, self.sz
        H, D, T, P = sz["H"], sz["D"], sz["T"], sz["pool_pages"]
        S = D // 16
        rng = np.random.default_rng(99)
        cache = self.caches.get("static6")
        if cache is None:
            raise RuntimeError("no fp4cache pool (see the setup error)")
        for n_tok in sz["decode_tokens"]:
            calls = []
            for r in range(4):
                s = self.sets[r % len(self.sets)]
                off = (r * 997) % max(1, sz["N"] - n_tok)
                slots = env.asarray(rng.permutation(P * T)[:n_tok].astype(np.int64))
                calls.append(_bind(cache.store, slots, s["k"][off:off + n_tok],
                                   s["v"][off:off + n_tok]))
            nbytes = 2 * n_tok * H * D * 2 + n_tok * 8 + 2 * n_tok * H * (D // 2 + S)
            self.timed("decode", f"decode store {n_tok} tok static6", "fp4cache", calls, nbytes,
                       batch=40, note="L2-resident")
        for n in sz["decode_pages"]:
            calls = []
            for _ in range(4):
                ids = env.asarray(rng.integers(0, P, n).astype(np.int32))
                ok = env.xp.empty((n * T, H, D), dtype=BF16)
                ov = env.xp.empty((n * T, H, D), dtype=BF16)
                calls.append(_bind(cache.gather_dequant, ids, out=(ok, ov)))
            nbytes = n * 4 + n * 2 * H * T * (D // 2 + S) + 2 * n * T * H * D * 2
            self.timed("decode", f"decode gather {n} pages", "fp4cache", calls, nbytes,
                       batch=40, note="L2-resident")

    def _host_row(self, impl: str, fn, n: int, empty: float | None, *,
                  target: bool = False) -> None:
        t = self.env.host_per_call(fn, n)
        ratio = t / empty if empty else None
        row = Row("host", "host time per call", impl, time_s=t,
                  note="" if ratio is None else f"{ratio:.2f}x empty launch",
                  extra=dict(ratio=ratio, calls=n))
        if target:
            row.target = f"<= {TARGETS['host_ratio']:.0f}x empty launch"
            row.met = None if ratio is None else ratio <= TARGETS["host_ratio"]
        self.add(row)

    def sec_host(self) -> None:
        """Host wall time per call of back-to-back calls (no sync), vs an empty launch."""
        env, sz = self.env, self.sz
        H, D, T, P = sz["H"], sz["D"], sz["T"], sz["pool_pages"]
        n = sz["host_calls"]
        rng = np.random.default_rng(5)
        empty = None
        if env.gpu:
            k = env.empty_kernel
            if k is None:
                self.error("empty RawKernel", RuntimeError("the empty kernel did not compile"))
            else:
                empty = env.host_per_call(lambda: k((1,), (1,), ()), n)
                self.add(Row("host", "host time per call", "empty cupy.RawKernel launch",
                             time_s=empty))
        else:
            a = np.zeros(1, np.float32)
            empty = env.host_per_call(lambda: np.add(a, 1, out=a), n)
            self.add(Row("host", "host time per call", "CPU stand-in: np.add on 1 element",
                         time_s=empty))
        cache = self.caches.get("static6")
        if cache is not None:
            s = self.sets[0]
            slots = env.asarray(rng.permutation(P * T)[:64].astype(np.int64))
            k64, v64 = s["k"][:64], s["v"][:64]
            self.attempt("host time: fp4cache store 64", self._host_row,
                         "fp4cache store 64 tok", lambda: cache.store(slots, k64, v64), n,
                         empty, target=True)
            ids = env.asarray(rng.integers(0, P, 4).astype(np.int32))
            ok = env.xp.empty((4 * T, H, D), dtype=BF16)
            ov = env.xp.empty((4 * T, H, D), dtype=BF16)
            self.attempt("host time: fp4cache gather 4 pages", self._host_row,
                         "fp4cache gather 4 pages",
                         lambda: cache.gather_dequant(ids, out=(ok, ov)), n, empty)
        else:
            self.log("   (no fp4cache pool: store/gather host times skipped)")
        if env.gpu:
            self.attempt("host time: LongLive", self._host_longlive, n, empty)
        if self.torch is not None:
            self.attempt("torch eager store 64", self._torch_decode_store, rng, n, empty)

    def _host_longlive(self, n: int, empty: float | None) -> None:
        """Host time of the two LongLive decode APIs, 4 blocks of Tb=128, H=24, D=128."""
        from fp4cache import layout, longlive

        xp = self.env.xp
        H, D, Tb = 24, 128, 128
        Rp = layout.longlive_padded_rows(Tb, H)
        vals = xp.zeros((8, Rp, D // 2), dtype=np.uint8)
        sfs = xp.full((8, Rp * D // 16), 0x38, dtype=np.uint8)
        am = xp.ones((8, 1), dtype=np.float32)
        ids = xp.arange(4, dtype=np.int32)
        out = xp.empty((1, 4 * Tb, H, D), dtype=BF16)
        self._host_row("fp4cache LongLive dequantize_pool 4 blocks",
                       lambda: longlive.dequantize_pool(vals, sfs, am, ids, H, Tb, out=out,
                                                        scale_rule="4over6"),
                       n, empty)
        lv, ls, la = list(vals[:4]), list(sfs[:4]), list(am[:4])
        self._host_row("fp4cache LongLive dequantize (list) 4 blocks",
                       lambda: longlive.dequantize(lv, ls, la, H, Tb,
                                                   scale_rule="4over6"), n, empty)

    def _torch_decode_store(self, rng, n: int, empty: float | None) -> None:
        env, sz, tr = self.env, self.sz, self.tr
        H, D, T, P = sz["H"], sz["D"], sz["T"], sz["pool_pages"]
        tb = self.torch.zeros((P, 2, H * T * (D // 2 + D // 16)), dtype=self.torch.uint8,
                              device=env.device)
        geo, sc = self._torch_kw()
        s = self.sets[0]
        sl = env.to_torch(env.asarray(rng.permutation(P * T)[:64].astype(np.int64)))
        tk, tv = env.to_torch(s["k"][:64]), env.to_torch(s["v"][:64])

        def call():
            tr.store(tb, sl, tk, tv, rule="static6", **geo, **sc)

        self._host_row("torch eager store 64 tok", call, max(20, n // 10), empty)
        nbytes = 2 * 64 * H * D * 2 + 64 * 8 + 2 * 64 * H * (D // 2 + D // 16)
        row = self.timed("decode", "decode store 64 tok static6", "torch eager", [call], nbytes,
                         batch=10, note="L2-resident")
        if row is not None:
            self._speedup(row, "decode store 64 tok static6")

    # -- torch ------------------------------------------------------------------------------
    def _torch_kw(self):
        tr, sz = self.tr, self.sz
        ks, kg = tr.scalars_from_scale(K_SCALE)
        vs, vg = tr.scalars_from_scale(V_SCALE)
        geo = dict(num_heads=sz["H"], block_size=sz["T"], head_dim=sz["D"], layout="HND",
                   swizzle=True)
        return geo, dict(k_s=ks, k_g=kg, v_s=vs, v_g=vg)

    def _torch_sets(self):
        env = self.env
        if "t" not in self.sets[0]:
            for s in self.sets:
                s["t"] = (env.to_torch(s["slots"]), env.to_torch(s["k"]), env.to_torch(s["v"]))
            for g in self.gsets:
                g["t"] = (env.to_torch(g["ids"]), env.to_torch(g["ok"]), env.to_torch(g["ov"]))

    def _tbuf(self, rule):
        if rule not in self.tbufs:
            sz = self.sz
            side = sz["H"] * sz["T"] * (sz["D"] // 2 + sz["D"] // 16)
            self.tbufs[rule] = self.torch.zeros((sz["pool_pages"], 2, side),
                                                dtype=self.torch.uint8, device=self.env.device)
        return self.tbufs[rule]

    def _torch_store_case(self, rule: str, mode: str) -> None:
        """Time the torch store (``mode`` 'eager' or 'compile') and check it."""
        torch, tr, sz = self.torch, self.tr, self.sz
        N, H, D = sz["N"], sz["H"], sz["D"]
        geo, sc = self._torch_kw()
        self._torch_sets()
        buf = self._tbuf(rule)
        if mode == "eager":
            fn, target, impl = tr.store, buf, "torch eager"
        else:
            fn, target, impl = torch.compile(tr.store_flat), buf.view(-1), "torch.compile"
            s0 = self.sets[0]["t"]
            t = time.perf_counter()
            fn(target, *s0, rule=rule, **geo, **sc)
            self.env.sync()
            ct = time.perf_counter() - t
            self.meta[f"compile_s store {rule}"] = ct
            self.log(f"   torch.compile(store_flat, {rule}): first call (compile) {ct:.1f} s")
        calls = [_bind(fn, target, *s["t"], rule=rule, **geo, **sc) for s in self.sets]
        nbytes = 2 * N * H * D * 2 + N * 8 + 2 * N * H * (D // 2 + D // 16)
        row = self.timed("torch", f"store {N} tok {rule}", impl, calls, nbytes,
                         batch=len(calls), reps=max(5, self.sz["reps"] // 2))
        if row is None:
            return
        self._speedup(row, f"store {N} tok {rule}")
        chk = self.attempt(f"check {impl} store {rule}", self._check_store, rule, impl,
                           lambda: fn(target, *self.sets[0]["t"], rule=rule, **geo, **sc))
        if chk:
            row.check = (f"bytes {100 * chk['page_bytes_identical']:.3f}% same, decoded rel "
                         f"{chk['decoded_rel_err_vs_fp4cache']:.1e}")

    def _check_store(self, rule: str, impl: str, run_torch) -> dict[str, Any]:
        """Store set 0 with fp4cache and with torch; compare page bytes and decoded values."""
        import fp4cache

        env = self.env
        cache = self.caches.get(rule)
        if cache is None:
            raise RuntimeError("no fp4cache pool to compare with")
        s = self.sets[0]
        cache.store(s["slots"], s["k"], s["v"])
        run_torch()
        env.sync()
        pages = s["pages_dev"]
        a = cache.buffer[pages]
        b = env.from_torch(self.tbufs[rule])[pages]
        same = float((a == b).mean())
        db = cache.geometry.data_bytes
        same_sc = float((a[:, :, db:] == b[:, :, db:]).mean())
        self.log(f"     check vs fp4cache: page bytes identical {same:.5f} (scale bytes "
                 f"{same_sc:.5f})")
        chk: dict[str, Any] = dict(check=f"{impl} store ({rule}) vs fp4cache store",
                                   page_bytes_identical=same, scale_bytes_identical=same_sc)
        self.checks.append(chk)  # completed below (if decoding works)
        fk, fv = cache.gather_dequant(pages)
        other = fp4cache.PagedKVCache(**(self._geom_kwargs(rule)
                                         | dict(num_blocks=int(pages.shape[0]))))
        other.buffer[...] = b
        tk, tv = other.gather_dequant(env.xp.arange(pages.shape[0], dtype=np.int32))
        f = [env.bf16_to_f32(x) for x in (fk, fv)]
        t = [env.bf16_to_f32(x) for x in (tk, tv)]
        x = [env.bf16_to_f32(s["k"]), env.bf16_to_f32(s["v"])]
        rel = _rel(env, t, f)
        chk.update(decoded_rel_err_vs_fp4cache=rel, quant_rel_err_fp4cache=_rel(env, f, x),
                   quant_rel_err_torch=_rel(env, t, x),
                   decoded_bits_identical=float(np.mean([float(_same_bf16(p, q).mean())
                                                         for p, q in ((fk, tk), (fv, tv))])))
        self.log(f"     check vs fp4cache: decoded values rel err {rel:.2e} (bf16 identical "
                 f"{chk['decoded_bits_identical']:.5f}); "
                 f"quantization rel err fp4cache {chk['quant_rel_err_fp4cache']:.4f} / torch "
                 f"{chk['quant_rel_err_torch']:.4f}")
        del a, b, other
        return chk

    def _torch_gather_case(self, mode: str) -> None:
        torch, tr, sz = self.torch, self.tr, self.sz
        n, H, D, T = sz["gather_pages"], sz["H"], sz["D"], sz["T"]
        geo, sc = self._torch_kw()
        self._torch_sets()
        cache = self.caches.get("static6")
        if cache is not None:
            pool, src = self.env.to_torch(cache.buffer), "fp4cache pool"
        else:  # no fp4cache: fill a torch pool with the torch store
            pool, src = self._tbuf("static6"), "torch-filled pool"
            P, N = sz["pool_pages"], sz["N"]
            for c in range(0, P * T, N):
                s = self.sets[(c // N) % len(self.sets)]["t"]
                m = min(N, P * T - c)
                tr.store(pool, torch.arange(c, c + m, device=pool.device), s[1][:m], s[2][:m],
                         rule="static6", **geo, **sc)
        kw = dict(**geo, k_s=sc["k_s"], v_s=sc["v_s"])
        if mode == "eager":
            fn, impl = tr.gather_dequant, "torch eager"
        else:
            fn, impl = torch.compile(tr.gather_dequant), "torch.compile"
            t = time.perf_counter()
            fn(pool, *self.gsets[0]["t"], **kw)
            self.env.sync()
            ct = time.perf_counter() - t
            self.meta["compile_s gather"] = ct
            self.log(f"   torch.compile(gather_dequant): first call (compile) {ct:.1f} s")
        calls = [_bind(fn, pool, *g["t"], **kw) for g in self.gsets]
        nbytes = n * 4 + n * 2 * H * T * (D // 2 + D // 16) + 2 * n * T * H * D * 2
        row = self.timed("torch", f"gather {n} pages static6", impl, calls, nbytes,
                         batch=len(calls), reps=max(5, self.sz["reps"] // 2),
                         note=src if cache is None else "")
        if row is None:
            return
        self._speedup(row, f"gather {n} pages static6")
        if cache is not None:
            chk = self.attempt(f"check {impl} gather", self._check_gather, cache, impl,
                               lambda g: fn(pool, *g["t"], **kw))
            if chk:
                row.check = (f"bf16 {100 * chk['bits_identical']:.3f}% same, rel "
                             f"{chk['rel_err']:.1e}")

    def _check_gather(self, cache, impl: str, run_torch) -> dict[str, Any]:
        env = self.env
        g = self.gsets[0]
        fk, fv = cache.gather_dequant(g["ids"])
        run_torch(g)  # writes g["ok"], g["ov"] (shared with torch)
        env.sync()
        same = float(np.mean([float(_same_bf16(p, q).mean())
                              for p, q in ((fk, g["ok"]), (fv, g["ov"]))]))
        rel = _rel(env, [env.bf16_to_f32(g["ok"]), env.bf16_to_f32(g["ov"])],
                   [env.bf16_to_f32(fk), env.bf16_to_f32(fv)])
        chk = dict(check=f"{impl} gather vs fp4cache gather (same pages)", bits_identical=same,
                   rel_err=rel)
        self.checks.append(chk)
        self.log(f"     check vs fp4cache: decoded bf16 identical {same:.6f}, rel err {rel:.2e}")
        return chk

    def _speedup(self, row: Row, case: str) -> None:
        ref = next((r for r in self.rows if r.case == case and r.impl == "fp4cache"
                    and r.time_s), None)
        if ref is None:
            row.note = "; ".join(x for x in (row.note, "no fp4cache time to compare") if x)
            return
        sp = row.time_s / ref.time_s
        row.extra["fp4cache_speedup"] = sp
        if row.impl == "torch.compile" and not case.startswith("gather"):
            # the store only: Inductor's gather already runs at 39 % of copy, so 3x would
            # exceed HBM (issue 13); the gather's target is its fraction of copy alone
            row.target = f"fp4cache >= {TARGETS['vs_compile']:.0f}x"
            row.met = sp >= TARGETS["vs_compile"]
        self.log(f"     fp4cache is {sp:.2f}x faster than {row.impl}")

    def sec_torch(self, mode: str) -> None:
        if self.torch is None:
            raise RuntimeError("torch is not available (see the import error above)")
        self.tr.constants(self.env.device)  # filled before any compile
        per_compile = self.args.compile_need_s
        for rule in ("static6", "4over6"):
            if mode == "compile" and self.remaining() < per_compile:
                self.skipped.append(f"torch.compile store {rule}: not enough time left")
                self.log(f"-- torch.compile store {rule}: skipped ({self.remaining():.0f} s "
                         f"left, a compile may need ~{per_compile:.0f} s)")
                continue
            self.attempt(f"torch {mode} store {rule}", self._torch_store_case, rule, mode)
        if mode == "compile" and self.remaining() < per_compile:
            self.skipped.append("torch.compile gather: not enough time left")
            self.log("-- torch.compile gather: skipped (time budget)")
            return
        self.attempt(f"torch {mode} gather", self._torch_gather_case, mode)

    # -- report -----------------------------------------------------------------------------
    def table(self) -> str:
        ceil = self.copy_gbps
        lines = [
            "",
            f"## fp4cache benchmark ({self.meta.get('device', '?')}; copy ceiling "
            + (f"{ceil:.0f} GB/s measured" if ceil else f"{SPEC_COPY_GBPS:.0f} GB/s (spec)")
            + f"; {self.elapsed():.0f} s)",
            "",
            "| case | impl | time (us) | GB/s | % copy | fp4cache speed-up | target | met | "
            "check / note |",
            "|---|---|---:|---:|---:|---:|---|---|---|",
        ]
        for r in self.rows:
            sp = r.extra.get("fp4cache_speedup")
            note = "; ".join(x for x in (r.check, r.note) if x)
            cells = [r.case, r.impl, _fmt(r.time_s, 1e6, ".1f"), _gb(r.gbps),
                     _fmt(r.frac_copy, 100, ".1f"), _fmt(sp, 1, ".2f", "x"), r.target,
                     _mark(r.met) if r.target else "", note]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        for c in self.checks:
            vals = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in c.items() if k != "check")
            lines.append(f"check: {c['check']}: {vals}")
        if self.errors:
            lines.append(f"{len(self.errors)} error(s):")
            lines.extend(f"- {e['where']}: {e['error'][:200]}" for e in self.errors)
        if self.skipped:
            lines.append("skipped: " + "; ".join(self.skipped))
        return "\n".join(lines)

    def run(self) -> None:
        a = self.args
        only = set(a.only.split(",")) if a.only else None
        unknown = (only or set()) - set(SECTIONS)
        if unknown:
            raise SystemExit(f"--only: unknown section(s) {sorted(unknown)}; choose from "
                             f"{', '.join(SECTIONS)}")

        def want(key: str) -> bool:
            return only is None or key in only

        self.section("device and versions", self.sec_info)
        for key, title, fn in (
                ("copy", "copy bandwidth (ceiling)", self.sec_copy),
                ("setup", "setup: inputs and page pools", self.sec_setup),
                ("sanity", "sanity: bit-exact vs NumPy backend", self.sec_sanity),
                ("large", "fp4cache store / gather, large", self.sec_fp4_large),
                ("longlive", "fp4cache LongLive decode", self.sec_longlive),
                ("longlive-list", "LongLive list API by block count", self.sec_longlive_list),
                ("decode", "decode-step sizes", self.sec_decode),
                ("host", "host time per call", self.sec_host)):
            if want(key):
                self.section(title, fn)
        if not a.no_torch and want("torch"):
            self.section("torch eager", lambda: self.sec_torch("eager"), need_s=20)
            if not a.no_compile:
                self.section("torch.compile", lambda: self.sec_torch("compile"),
                             need_s=a.compile_need_s)
        self.write_json()


#: Section keys for ``--only`` (the device/version section always runs).
SECTIONS = ("copy", "setup", "sanity", "large", "longlive", "longlive-list", "decode", "host",
            "torch")


def _bind(fn, *args, **kw):
    def call():
        return fn(*args, **kw)
    return call


def _same_bf16(a, b):
    """Element-wise (NumPy or CuPy): same bf16 bits, or both NaN (payloads may differ)."""
    a16, b16 = a.view(np.uint16), b.view(np.uint16)
    nan_a = ((a16 & 0x7F80) == 0x7F80) & ((a16 & 0x7F) != 0)
    nan_b = ((b16 & 0x7F80) == 0x7F80) & ((b16 & 0x7F) != 0)
    return (a16 == b16) | (nan_a & nan_b)


def _rel(env, got, ref) -> float:
    """``||got - ref|| / ||ref||`` over lists of float32 arrays (float64 sums)."""
    num = sum(float(((g.astype(np.float64) - r) ** 2).sum()) for g, r in zip(got, ref))
    den = sum(float((r.astype(np.float64) ** 2).sum()) for r in ref)
    return math.sqrt(num / den) if den else float("nan")


def _fmt(x, scale, spec, suffix="") -> str:
    return "" if x is None else f"{x * scale:{spec}}{suffix}"


def _gb(gbps) -> str:
    if gbps is None:
        return ""
    return f"{gbps:.0f}" if gbps >= 10 else f"{gbps:.3g}"


def _mark(met) -> str:
    return {True: "yes", False: "NO", None: "?"}[met]


def _row_dict(r: Row) -> dict[str, Any]:
    d = dict(r.__dict__)
    d["time_us"] = None if r.time_s is None else r.time_s * 1e6
    return d


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (np.bool_,)):
        return bool(o)
    return str(o)


def verify_reference(compile_too: bool = False) -> int:
    """Torch reference vs fp4cache's NumPy backend on the CPU, every layout and rule.

    Prints page-byte and decoded-value agreement; returns 0 when they agree bit for
    bit (up to NaN payloads), 1 otherwise.  NaN and Inf inputs are included.
    """
    import torch
    import torch_reference as tr

    import fp4cache

    env = Env(gpu=False)
    rng = np.random.default_rng(2024)
    H, T, D, P, N, n = 4, 16, 128, 48, 600, 40
    ks_, vs_ = 3.0 / (6 * 448), 5.0 / (6 * 448)
    ksg, vsg = tr.scalars_from_scale(ks_), tr.scalars_from_scale(vs_)
    print("| layout | swizzle V | rule | impl | page bytes identical | scale bytes identical |"
          " gathered bf16 identical | decoded rel err |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    bad = 0
    impls = ["eager", "eager flat"] + (["compile flat"] if compile_too else [])
    for layout in ("HND", "NHD"):
        for swz in (True, False):
            for rule in ("static6", "4over6"):
                k = (rng.standard_normal((N, H, D)) * 2).astype(BF16)
                v = (rng.standard_normal((N, H, D)) * 40).astype(BF16)
                k[5, 1, 3], v[7, 2, 100], k[9, 0, 64] = np.nan, np.inf, -np.inf
                slots = rng.permutation(P * T)[:N].astype(np.int64)
                blocks = rng.integers(0, P, n).astype(np.int64)
                c = fp4cache.PagedKVCache(P, T, H, D, layout=layout, scale_rule=rule,
                                          k_scale=ks_, v_scale=vs_, swizzle_v_scales=swz,
                                          device="cpu")
                c.store(slots, k, v)
                rk, rv = c.gather_dequant(blocks)
                geo = dict(num_heads=H, block_size=T, head_dim=D, layout=layout, swizzle=swz)
                sc = dict(k_s=ksg[0], k_g=ksg[1], v_s=vsg[0], v_g=vsg[1])
                for impl in impls:
                    buf = torch.zeros((P, 2, c.geometry.side_bytes), dtype=torch.uint8)
                    args = (torch.from_numpy(slots), env.to_torch(k), env.to_torch(v))
                    if impl == "eager":
                        tr.store(buf, *args, rule=rule, **geo, **sc)
                    elif impl == "eager flat":
                        tr.store_flat(buf.view(-1), *args, rule=rule, **geo, **sc)
                    else:
                        torch.compile(tr.store_flat)(buf.view(-1), *args, rule=rule, **geo,
                                                     **sc)
                    b = buf.numpy()
                    same = float(np.mean(b == c.buffer))
                    db = c.geometry.data_bytes
                    same_sc = float(np.mean(b[:, :, db:] == c.buffer[:, :, db:]))
                    tk = torch.empty((n * T, H, D), dtype=torch.bfloat16)
                    tv = torch.empty_like(tk)
                    gfn = (torch.compile(tr.gather_dequant) if impl == "compile flat"
                           else tr.gather_dequant)
                    gfn(torch.from_numpy(c.buffer), torch.from_numpy(blocks), tk, tv, **geo,
                        k_s=sc["k_s"], v_s=sc["v_s"])
                    gk, gv = env.from_torch(tk), env.from_torch(tv)
                    eq = [(x.view(np.uint16) == y.view(np.uint16)) | (np.isnan(x.astype(
                        np.float32)) & np.isnan(y.astype(np.float32))) for x, y in
                          ((gk, rk), (gv, rv))]
                    g_same = float(np.mean(np.concatenate([e.ravel() for e in eq])))
                    fin = [np.isfinite(x.astype(np.float32)) for x in (rk, rv)]
                    num = sum(float(((x.astype(np.float64) - y.astype(np.float64))[f] ** 2)
                                    .sum()) for x, y, f in ((gk, rk, fin[0]), (gv, rv, fin[1])))
                    den = sum(float((y.astype(np.float64)[f] ** 2).sum())
                              for y, f in ((rk, fin[0]), (rv, fin[1])))
                    rel = math.sqrt(num / den)
                    bad += not (same == 1.0 and g_same == 1.0)
                    print(f"| {layout} | {swz} | {rule} | {impl} | {same:.6f} | {same_sc:.6f} |"
                          f" {g_same:.6f} | {rel:.1e} |", flush=True)
    print(f"\n{'all identical' if not bad else f'{bad} configuration(s) differ'}: torch "
          "reference vs the NumPy backend (the bit-exact oracle)")
    return 1 if bad else 0


def _watchdog(bench: Bench) -> None:
    """Past the hard limit (a hung kernel, a slow compile): report what we have and exit."""
    try:
        bench.errors.append({"where": "watchdog", "traceback": "",
                             "error": f"still running after {bench.args.watchdog_s:.0f} s: "
                                      "stopped; the sections after the last one printed "
                                      "did not finish"})
        bench.write_json()
        print(f"\n!! watchdog: {bench.args.watchdog_s:.0f} s elapsed, stopping", flush=True)
        print(bench.table(), flush=True)
    finally:
        os._exit(3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true",
                   help="NumPy backend at tiny sizes, perf_counter timing (tests the script)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions")
    p.add_argument("--out", help="write all numbers to this JSON file (rewritten per section)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    p.add_argument("--only", metavar="KEYS",
                   help="comma-separated sections to run: " + ", ".join(SECTIONS)
                   + " (setup is needed by sanity, large, decode, host and torch)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="wall-clock budget: later sections are skipped past it (default 420)")
    p.add_argument("--compile-need-s", type=float, default=90.0,
                   help="time left needed before starting a torch.compile (default 90)")
    p.add_argument("--watchdog-s", type=float, default=470.0,
                   help="hard stop: print the table so far and exit 3 (default 470; 0: off)")
    p.add_argument("--verify-reference", action="store_true",
                   help="only check bench/torch_reference.py against the NumPy backend on "
                        "the CPU (all layouts and rules) and exit")
    args = p.parse_args(argv)
    if args.verify_reference:
        return verify_reference(compile_too=not args.no_compile)
    if not args.cpu:
        import fp4cache

        if not fp4cache.gpu_available():
            print("error: no usable CUDA GPU through CuPy; run with --cpu to test the script "
                  "on the NumPy backend", file=sys.stderr)
            return 2
    bench = Bench(args)
    watchdog = threading.Timer(args.watchdog_s, _watchdog, (bench,))
    watchdog.daemon = True
    if args.watchdog_s > 0:
        watchdog.start()
    try:
        bench.run()
    except KeyboardInterrupt:
        bench.errors.append({"where": "run", "error": "KeyboardInterrupt", "traceback": ""})
    finally:
        watchdog.cancel()
        bench.write_json()
        if args.out:
            print(f"\nJSON: {args.out}")
        print(bench.table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
