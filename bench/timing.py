"""Timing and reporting shared by the benchmarks in ``bench/`` (``bench.py``'s sections,
``attention_bench.py``, ``attn_kernel.py``).  The method is described in ``bench/README.md``
("Timing", "Bytes counted"); in short:

- ``Env.time_calls``: device time of one call.  Each repetition enqueues a spin kernel,
  then a batch of calls that rotates through the given input sets (so L2 holds none of
  them), between two CUDA events; per-call time is elapsed / batch, and the result is the
  median over the repetitions.  ``Env.host_per_call``: host wall time per call of
  back-to-back calls without synchronization.
- ``copy_buffers`` / ``measure_copy``: the device-to-device copy whose bandwidth is the
  ceiling that every "% copy" is measured against, in the same run.
- ``Row`` and ``Runner``: one row per measurement, printed as it is measured, the JSON file
  (rewritten after every section) and the final markdown table.
- ``bind``, ``same_bf16``, ``rel_err``: call binding and the comparisons of the checks.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
SPEC_COPY_GBPS = 4100.0  # the contract's measured H200 copy, used only if the copy section fails

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



# ---------------------------------------------------------------- the copy ceiling --
def copy_buffers(env: Env, nbytes: int):
    """The copy that sets the bandwidth ceiling: ``(impl, call, src, dst)``, where ``call``
    copies ``src`` (``nbytes``, not zeros) into ``dst``: ``cudaMemcpyAsync`` device to
    device on the GPU, ``np.copyto`` on the CPU.  One call moves ``2 * nbytes`` (read +
    write)."""
    src = env.xp.arange(nbytes // 8, dtype=np.int64).view(np.uint8)  # not zeros
    dst = env.xp.empty_like(src)
    if env.gpu:
        def device_copy():
            dst.data.copy_from_device_async(src.data, nbytes)

        return "cudaMemcpyAsync D2D", device_copy, src, dst

    def host_copy():
        np.copyto(dst, src)

    return "numpy copyto", host_copy, src, dst


def measure_copy(env: Env, nbytes: int, *, reps: int) -> float:
    """Median seconds of one ``copy_buffers`` copy of ``nbytes`` (``env.time_calls``,
    batches of 3); the buffers are freed before returning.  Bandwidth: ``2 * nbytes / t``."""
    _, call, *buffers = copy_buffers(env, nbytes)
    t = env.time_calls([call], reps=reps, batch=3)["median_s"]
    del call, buffers  # release the buffers
    env.free()
    return t


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



class Runner:
    """One benchmark run: the device (``env``), the sizes (``sz``), and every row, check,
    error and skipped section, printed as they come; ``write_json`` and ``table`` report
    them.  Each section runs in isolation (``section``, ``attempt``)."""

    def __init__(self, args, *, gpu: bool, sizes: dict[str, Any], sz_key: str,
                 targets: dict[str, Any]):
        self.args = args
        self.t0 = time.perf_counter()
        self.env = Env(gpu=gpu)
        self.sz = dict(sizes)
        self.sz_key = sz_key
        self.targets = targets
        self.rows: list[Row] = []
        self.checks: list[dict[str, Any]] = []
        self.errors: list[dict[str, str]] = []
        self.skipped: list[str] = []
        self.meta: dict[str, Any] = {}
        self.copy_gbps: float | None = None

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
            parts.append(f"{gb(row.gbps):>8} GB/s")
        if row.frac_copy is not None:
            parts.append(f"{100 * row.frac_copy:5.1f}% copy")
        if row.target:
            parts.append(f"[target {row.target}: {mark(row.met)}]")
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
            self.log(f"     target {row.target}: {mark(row.met)}")
        return row

    def write_json(self) -> None:
        if not self.args.out:
            return
        doc = {
            "meta": self.meta, "sizes": {k: (list(v) if isinstance(v, tuple) else v)
                                         for k, v in self.sz.items()},
            "copy_gbps": self.copy_gbps, "targets": self.targets,
            "rows": [row_dict(r) for r in self.rows], "checks": self.checks,
            "errors": self.errors, "skipped": self.skipped, "elapsed_s": self.elapsed(),
        }
        try:
            path = Path(self.args.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps(doc, indent=1, default=json_default))
            os.replace(tmp, path)
        except Exception as e:
            self.log(f"!! could not write {self.args.out}: {type(e).__name__}: {e}")


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
            cells = [r.case, r.impl, fmt(r.time_s, 1e6, ".1f"), gb(r.gbps),
                     fmt(r.frac_copy, 100, ".1f"), fmt(sp, 1, ".2f", "x"), r.target,
                     mark(r.met) if r.target else "", note]
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


# ----------------------------------------------------------------------- helpers --
def bind(fn, *args, **kw):
    def call():
        return fn(*args, **kw)
    return call


def same_bf16(a, b):
    """Element-wise (NumPy or CuPy): same bf16 bits, or both NaN (payloads may differ)."""
    a16, b16 = a.view(np.uint16), b.view(np.uint16)
    nan_a = ((a16 & 0x7F80) == 0x7F80) & ((a16 & 0x7F) != 0)
    nan_b = ((b16 & 0x7F80) == 0x7F80) & ((b16 & 0x7F) != 0)
    return (a16 == b16) | (nan_a & nan_b)


def rel_err(env, got, ref) -> float:
    """``||got - ref|| / ||ref||`` over lists of float32 arrays (float64 sums)."""
    num = sum(float(((g.astype(np.float64) - r) ** 2).sum()) for g, r in zip(got, ref))
    den = sum(float((r.astype(np.float64) ** 2).sum()) for r in ref)
    return math.sqrt(num / den) if den else float("nan")


def fmt(x, scale, spec, suffix="") -> str:
    return "" if x is None else f"{x * scale:{spec}}{suffix}"


def gb(gbps) -> str:
    if gbps is None:
        return ""
    return f"{gbps:.0f}" if gbps >= 10 else f"{gbps:.3g}"


def mark(met) -> str:
    return {True: "yes", False: "NO", None: "?"}[met]


def row_dict(r: Row) -> dict[str, Any]:
    d = dict(r.__dict__)
    d["time_us"] = None if r.time_s is None else r.time_s * 1e6
    return d


def json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (np.bool_,)):
        return bool(o)
    return str(o)
