"""Benchmark of moving pages: copy_blocks, read_blocks / write_blocks through
pinned host memory, save / load, slot_mapping, each beside its ceiling measured in the
same run.

Run on the GPU (from the repository root)::

    PYTHONPATH=. python3 bench/pages_bench.py --out $OUT/pages.json

On a machine without a GPU (tests the script; the numbers mean nothing)::

    PYTHONPATH=. python3 bench/pages_bench.py --cpu --quick

Pages of (16 tokens x 8 heads x 128) in HND with swizzled V scales: 18,432 bytes each.
Timing: bench.py's ``Env.time_calls`` (a spin kernel, then a batch of calls between two
CUDA events; median of the repetitions); save / load with ``time.perf_counter``.

Rows and bytes counted (GB/s = bytes / median time):

* ``copy D2D``: ``cudaMemcpyAsync`` of 2 GiB device to device, read + write bytes: the
  ceiling of ``copy_blocks``.
* ``copy_blocks``: 4,096 random (src, dst) pairs in a pool of 32,768 pages (604 MB, L2
  kept out by rotating 3 disjoint sets), ``2 * n * page_bytes``; also with src and dst
  overlapping as sets (half of the destinations are other pairs' sources: those pairs
  go through staging rows when their destination is still to be read, 4 * page_bytes of
  traffic instead of 2, and the row still counts 2), and what a user would write
  otherwise: CuPy fancy indexing ``pool[dst] = pool[src]`` and (if importable) torch
  ``index_copy_``.
* ``D2H pinned`` / ``H2D pinned``: one ``cudaMemcpyAsync`` of the same bytes as the
  page rows (1 GiB) between the device and ``fp4cache.pinned_empty`` memory: the ceilings of
  ``read_blocks`` / ``write_blocks``.  Those are timed for random device ids (staged
  gather + copies) and for consecutive host ids (direct copies).
* ``save`` / ``load``: 1 GiB of pages to a safetensors file and back into a cache, against
  ``ndarray.tofile`` / ``numpy.fromfile`` of the same bytes (the OS page cache is not
  dropped: both sides see it alike).
* ``slot_mapping``: 1M positions (256 sequences x 4,096), CuPy with and without the
  value checks, and NumPy.

Targets (printed, never asserted): copy_blocks >= 85 % of D2D copy; read_blocks
>= 80 % of pinned D2H; write_blocks >= 80 % of pinned H2D.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from timing import Env  # noqa: E402

import fp4cache  # noqa: E402


def wall_median_s(fn, n: int = 3) -> float:
    """Median host wall time of ``n`` calls of ``fn`` (file I/O and host work: nothing to
    synchronize)."""
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


TARGETS = {"copy_blocks": 0.85, "read_blocks": 0.80, "write_blocks": 0.80}
SIZES = {
    "gpu": dict(pool=32768, n=4096, rot=3, io_bytes=1 << 30, copy_bytes=2 << 30, reps=15,
                B=256, L=4096),
    "gpu_quick": dict(pool=16384, n=4096, rot=3, io_bytes=256 << 20, copy_bytes=1 << 30,
                      reps=7, B=256, L=4096),
    "cpu": dict(pool=512, n=128, rot=2, io_bytes=16 << 20, copy_bytes=64 << 20, reps=3,
                B=64, L=1024),
    "cpu_quick": dict(pool=256, n=64, rot=2, io_bytes=4 << 20, copy_bytes=16 << 20, reps=2,
                      B=16, L=256),
}
T, H, D = 16, 8, 128


def log(msg: str) -> None:
    print(msg, flush=True)


class PagesBench:
    def __init__(self, args):
        self.args = args
        self.env = Env(gpu=not args.cpu)
        self.sz = SIZES[("cpu" if args.cpu else "gpu") + ("_quick" if args.quick else "")]
        self.xp = self.env.xp
        self.rows: list[dict] = []
        self.errors: list[str] = []
        self.ceil: dict[str, float] = {}

    # -- helpers --------------------------------------------------------------------------
    def time(self, calls, batch=None) -> float:
        return self.env.time_calls(calls, reps=self.sz["reps"], batch=batch)["median_s"]

    def row(self, case, impl, t, nbytes, ceiling=None, target=None, note=""):
        gbps = nbytes / t / 1e9
        r = dict(case=case, impl=impl, us=t * 1e6, bytes=nbytes, gbps=gbps, note=note)
        if ceiling:
            r["ceiling"] = ceiling
            r["frac"] = gbps / self.ceil[ceiling] if self.ceil.get(ceiling) else None
            if target is not None and r["frac"] is not None:
                r["target"] = target
                r["met"] = r["frac"] >= target
        self.rows.append(r)
        frac = f", {100 * r['frac']:.1f} % of {ceiling}" if r.get("frac") else ""
        met = "" if "met" not in r else (" (target met)" if r["met"] else " (target MISSED)")
        log(f"   {case:<34} {impl:<24} {t * 1e6:12.1f} us {gbps:9.1f} GB/s{frac}{met} {note}")
        self.write()

    def write(self) -> None:
        if self.args.out:
            Path(self.args.out).write_text(json.dumps(
                dict(rows=self.rows, ceilings_gbps=self.ceil, errors=self.errors,
                     sizes=self.sz, device=self.device_name()), indent=1))

    def device_name(self) -> str:
        if not self.env.gpu:
            return "cpu"
        import cupy

        return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()

    def cache(self, num_blocks, seed=0):
        """A cache whose pages hold random bytes (raw pages: nothing here decodes)."""
        cache = fp4cache.PagedKVCache(num_blocks, T, H, D, device=self.env.device)
        P = cache.geometry.page_bytes
        chunk = max(1, (256 << 20) // P)
        for a in range(0, num_blocks, chunk):
            n = min(chunk, num_blocks - a)
            data = self.env.random_bytes((n, P), 0, 256, seed + a)
            cache.write_blocks(self.xp.arange(a, a + n), data)
        self.env.sync()
        return cache

    # -- sections -------------------------------------------------------------------------
    def copy_ceiling(self) -> None:
        nbytes = self.sz["copy_bytes"]
        if self.env.gpu:
            cp = self.env.cp
            src = cp.arange(nbytes // 8, dtype=np.int64).view(np.uint8)
            dst = cp.empty_like(src)
            t = self.time([lambda: dst.data.copy_from_device_async(src.data, nbytes)], batch=3)
        else:
            src = np.arange(nbytes // 8, dtype=np.int64).view(np.uint8)
            dst = np.empty_like(src)
            t = self.time([lambda: np.copyto(dst, src)], batch=3)
        self.ceil["copy"] = 2 * nbytes / t / 1e9
        self.row("copy D2D", "cudaMemcpyAsync" if self.env.gpu else "np.copyto", t,
                 2 * nbytes, note="ceiling of copy_blocks")

    def copy_blocks(self) -> None:
        xp, sz = self.xp, self.sz
        cache = self.cache(sz["pool"])
        P = cache.geometry.page_bytes
        n, rot = sz["n"], sz["rot"]
        rng = np.random.default_rng(1)
        perm = rng.permutation(sz["pool"])
        sets = [(xp.asarray(perm[2 * i * n:(2 * i + 1) * n].astype(np.int32)),
                 xp.asarray(perm[(2 * i + 1) * n:(2 * i + 2) * n].astype(np.int32)))
                for i in range(rot)]
        nbytes = 2 * n * P
        t = self.time([lambda s=s, d=d: cache.copy_blocks(s, d) for s, d in sets], batch=rot * 4)
        note = ""
        if self.env.gpu:
            from fp4cache._cuda.pages import copy_workspace

            staging, tables = copy_workspace(cache.pool, n)
            note = (f"2 launches; workspace {staging.nbytes >> 20} MiB staging + "
                    f"{tables.nbytes >> 10} KiB tables")
        self.row(f"copy_blocks {n} pages", "fp4cache", t, nbytes, "copy",
                 TARGETS["copy_blocks"], note)
        # src and dst overlapping as sets: half of each dst set is another pair's source
        over = [(s, xp.concatenate([d[: n // 2], s[n // 2:][::-1]])) for s, d in sets]
        t = self.time([lambda s=s, d=d: cache.copy_blocks(s, d) for s, d in over],
                      batch=rot * 4)
        self.row(f"copy_blocks {n} pages, overlapping", "fp4cache", t, nbytes, "copy",
                 TARGETS["copy_blocks"])
        # correctness on one set, against NumPy on the host
        before = np.array(self.env.asnumpy(cache.buffer), copy=True)
        s, d = over[0]
        cache.copy_blocks(s, d)
        want = before.copy()
        want[self.env.asnumpy(d)] = before[self.env.asnumpy(s)]
        ok = np.array_equal(self.env.asnumpy(cache.buffer), want)
        self.rows[-1]["check"] = "ok" if ok else "FAIL"
        log(f"   check copy_blocks against NumPy: {'ok' if ok else 'FAIL'}")
        # what a user would write otherwise
        pool = cache.buffer.reshape(sz["pool"], P)

        def fancy(s, d):
            pool[d] = pool[s]

        t = self.time([lambda s=s, d=d: fancy(s, d) for s, d in sets], batch=rot * 2)
        self.row(f"copy_blocks {n} pages", "cupy pool[d] = pool[s]" if self.env.gpu
                 else "numpy pool[d] = pool[s]", t, nbytes, "copy")
        if self.env.gpu and not self.args.no_torch:
            try:
                import torch
            except ImportError:
                log("   torch not importable: no torch row")
            else:
                tp = torch.from_dlpack(pool)
                tsets = [(torch.from_dlpack(s).long(), torch.from_dlpack(d).long())
                         for s, d in sets]
                t = self.time([lambda s=s, d=d: tp.index_copy_(0, d, tp.index_select(0, s))
                               for s, d in tsets], batch=rot * 2)
                self.row(f"copy_blocks {n} pages", "torch index_copy_", t, nbytes, "copy")

    def host_io(self) -> None:
        xp, sz = self.xp, self.sz
        pool = int(sz["io_bytes"] * 1.15) // 18432 + 1
        cache = self.cache(pool, seed=7)
        P = cache.geometry.page_bytes
        n = sz["io_bytes"] // P
        nbytes = n * P
        host = fp4cache.pinned_empty((n, P))
        rng = np.random.default_rng(2)
        ids = xp.asarray(rng.permutation(pool)[:n].astype(np.int32))
        run = np.arange(7, 7 + n, dtype=np.int64)
        if self.env.gpu:
            cp = self.env.cp
            rt = cp.cuda.runtime
            dev = cp.empty((n, P), np.uint8)
            d2h = lambda: rt.memcpyAsync(host.ctypes.data, dev.data.ptr, nbytes,  # noqa: E731
                                         rt.memcpyDeviceToHost,
                                         cp.cuda.get_current_stream().ptr)
            h2d = lambda: rt.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes,  # noqa: E731
                                         rt.memcpyHostToDevice,
                                         cp.cuda.get_current_stream().ptr)
            t = self.time([d2h], batch=1)
            self.ceil["D2H"] = nbytes / t / 1e9
            self.row(f"D2H pinned {nbytes >> 20} MiB", "cudaMemcpyAsync", t, nbytes,
                     note="ceiling of read_blocks")
            t = self.time([h2d], batch=1)
            self.ceil["H2D"] = nbytes / t / 1e9
            self.row(f"H2D pinned {nbytes >> 20} MiB", "cudaMemcpyAsync", t, nbytes,
                     note="ceiling of write_blocks")
        rd, wr = ("D2H", "H2D") if self.env.gpu else (None, None)
        t = self.time([lambda: cache.read_blocks(ids, out=host)], batch=1)
        self.row(f"read_blocks {n} random pages", "fp4cache -> pinned", t, nbytes, rd,
                 TARGETS["read_blocks"] if rd else None, "device ids: staged gather + copies")
        ok = np.array_equal(host[:64], self.env.asnumpy(
            cache.buffer.reshape(pool, P)[ids[:64]]))
        t = self.time([lambda: cache.read_blocks(run, out=host)], batch=1)
        self.row(f"read_blocks {n} consecutive pages", "fp4cache -> pinned", t, nbytes, rd,
                 TARGETS["read_blocks"] if rd else None, "host ids: one direct copy")
        t = self.time([lambda: cache.write_blocks(ids, host)], batch=1)
        self.row(f"write_blocks {n} random pages", "pinned -> fp4cache", t, nbytes, wr,
                 TARGETS["write_blocks"] if wr else None, "device ids: copies + staged scatter")
        t = self.time([lambda: cache.write_blocks(run, host)], batch=1)
        self.row(f"write_blocks {n} consecutive pages", "pinned -> fp4cache", t, nbytes, wr,
                 TARGETS["write_blocks"] if wr else None, "host ids: one direct copy")
        ok &= np.array_equal(self.env.asnumpy(cache.buffer.reshape(pool, P)[run[-3:]]),
                             host[-3:])
        self.rows[-1]["check"] = "ok" if ok else "FAIL"
        log(f"   check read/write against the pool: {'ok' if ok else 'FAIL'}; staging "
            f"(workspace) {cache.workspace_nbytes >> 20} MiB")
        self.save_load(cache, run, nbytes, host)

    def save_load(self, cache, run, nbytes, host) -> None:
        try:
            import safetensors  # noqa: F401
        except ImportError:
            log("   safetensors not importable: no save/load rows")
            return
        with tempfile.TemporaryDirectory(dir=self.args.tmp) as tmp:
            path = os.path.join(tmp, "pages.safetensors")
            raw = os.path.join(tmp, "pages.bin")
            t_np = wall_median_s(lambda: host.tofile(raw))
            self.ceil["numpy write"] = nbytes / t_np / 1e9
            self.row(f"write {nbytes >> 20} MiB to a file", "ndarray.tofile", t_np, nbytes)
            self.row(f"save {len(run)} pages", "fp4cache (safetensors)",
                     wall_median_s(lambda: cache.save(path, blocks=run)), nbytes,
                     "numpy write", None, "includes the D2H")
            t_np = wall_median_s(lambda: np.fromfile(raw, dtype=np.uint8))
            self.ceil["numpy read"] = nbytes / t_np / 1e9
            self.row(f"read {nbytes >> 20} MiB from a file", "numpy.fromfile", t_np, nbytes)
            self.row(f"load_pages {len(run)} pages", "fp4cache (safetensors)",
                     wall_median_s(lambda: cache.load_pages(path)), nbytes, "numpy read", None,
                     "includes the H2D")
            t0 = time.perf_counter()
            back = fp4cache.PagedKVCache.load(path, device=self.env.device)
            t = time.perf_counter() - t0
            self.row(f"PagedKVCache.load {len(run)} pages", "fp4cache (safetensors)", t,
                     nbytes, "numpy read", None, "one run: includes allocating the pool")
            ok = np.array_equal(self.env.asnumpy(back.buffer[run[:8]]),
                                self.env.asnumpy(cache.buffer[run[:8]]))
            self.rows[-1]["check"] = "ok" if ok else "FAIL"
            log(f"   check load against the saved cache: {'ok' if ok else 'FAIL'}")

    def slot_mapping(self) -> None:
        B, L = self.sz["B"], self.sz["L"]
        rng = np.random.default_rng(3)
        max_blocks = L // T
        tables = rng.permutation(B * max_blocks).reshape(B, max_blocks).astype(np.int32)
        lens = rng.integers(1, L + 1, B)
        pos = np.where(np.arange(L)[None, :] < lens[:, None], np.arange(L)[None, :], -1)
        n = B * L
        nbytes = tables.nbytes + 8 * n + 8 * n  # tables, int64 positions in, slots out
        for name, xp in (("numpy", np), ("cupy", self.env.cp if self.env.gpu else None)):
            if xp is None:
                continue
            tb, ps = xp.asarray(tables), xp.asarray(pos)
            for validate in (True, False):
                if name == "numpy":
                    t = wall_median_s(lambda v=validate, tb=tb, ps=ps: fp4cache.slot_mapping(
                        tb, ps, block_size=T, validate=v), self.sz["reps"])
                else:
                    t = self.time([lambda v=validate, tb=tb, ps=ps: fp4cache.slot_mapping(
                        tb, ps, block_size=T, validate=v)], batch=5)
                self.row(f"slot_mapping {n} positions", f"{name}, validate={validate}", t,
                         nbytes, note="validate=True reads the checks back (a sync)"
                         if name == "cupy" and validate else "")

    # -- driver -----------------------------------------------------------------------------
    def run(self) -> None:
        sections = [("copy", self.copy_ceiling), ("copy_blocks", self.copy_blocks),
                    ("io", self.host_io), ("slot_mapping", self.slot_mapping)]
        for name, fn in sections:
            if self.args.only and name not in self.args.only:
                continue
            log(f"\n== {name}")
            self.env.free()  # the previous section's arrays are gone with its frame
            try:
                fn()
            except Exception:  # a failed section is reported, the others still run
                tb = traceback.format_exc()
                self.errors.append(f"{name}: {tb}")
                log(tb)
        self.table()
        self.write()

    def table(self) -> None:
        log("\n| case | impl | us | GB/s | % of ceiling | target | check / notes |")
        log("|---|---|---|---|---|---|---|")
        for r in self.rows:
            frac = f"{100 * r['frac']:.1f} % {r['ceiling']}" if r.get("frac") else ""
            tgt = "" if "target" not in r else \
                f"{100 * r['target']:.0f} % {'met' if r['met'] else 'MISSED'}"
            notes = "; ".join(x for x in (r.get("check", ""), r["note"]) if x)
            log(f"| {r['case']} | {r['impl']} | {r['us']:.1f} | {r['gbps']:.1f} | {frac} | "
                f"{tgt} | {notes} |")
        if self.errors:
            log(f"\n{len(self.errors)} section(s) failed; see above")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--cpu", action="store_true", help="NumPy backend, tiny sizes")
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch row")
    ap.add_argument("--tmp", default=None, help="folder for the save/load files")
    ap.add_argument("--only", nargs="*", default=None,
                    help="sections: copy, copy_blocks, io, slot_mapping")
    args = ap.parse_args(argv)
    bench = PagesBench(args)
    bench.run()
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
