"""Sweep of the fused NVFP4 paged decode attention (its speed at every shape):
``decode_attention`` at B in {1, 4, 16, 64} x L in {512, 1024, 4096, 16384, 65536}
against torch SDPA over contiguous bf16 K/V, and against the copy bandwidth.

Run on the GPU (from the repository root)::

    PYTHONPATH=. python3 bench/sweep_bench.py --out $OUT/sweep.json --plot $OUT/sweep.png

On a machine without a GPU (tests the script on the NumPy backend at tiny shapes; the
numbers mean nothing)::

    PYTHONPATH=. python3 bench/sweep_bench.py --cpu --quick

Shapes: Hq=32 query heads, H=8 KV heads (GQA 4), D=128, block 16, HND with swizzled V
scales, bf16 q, every sequence of a cell L tokens long.  The caches, the fused call, the
float32 reference, the SDPA backends (the fastest of cuDNN / flash / efficient) and the
timing are ``attention_bench.AttnBench``'s (``timing.Env.time_calls``: spin kernel, then a
batch of calls rotating through the input sets between two CUDA events, median of
``--reps``).

One cache per B, built once for the largest L (``max(B, 4)`` rows of pages in random
order, so that it outgrows L2 also at B=1); a cell (B, L) reads B rows x L/16 columns of
that block table.  Small cells rotate through disjoint such tiles (up to 256, until they
hold 256 MiB of pages) so L2 holds none of them; SDPA rotates through the same tiles,
decoded to contiguous bf16 (B, H, L, D) K and V.

Per cell: fused time (us), GB/s of page bytes (``B * L * 2 * H * (D/2 + D/16)``; the block
table and q are left out), % of the device-to-device copy bandwidth measured in the same
run, the best SDPA time and ratio = SDPA / fused.  Targets (printed as met /
MISSED, never asserted): ratio >= 1.0 everywhere, >= 1.5 where B * L >= 65536.
Correctness: every cell against the float32 reference (max relative row error <= 1e-2);
all sequences up to 2^18 tokens a cell, beyond that the first and the last sequence.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from attention_bench import AttnBench, log  # noqa: E402
from timing import BF16, gb  # noqa: E402

#: the targets (printed, never asserted): SDPA time / fused time
TARGETS = {"ratio": 1.0, "ratio_big": 1.5, "big_tokens": 65536}
SIZES = {
    # rot_bytes: page bytes the rotated tiles of a cell hold together (at most max_sets);
    # check_tokens: cells up to this many tokens check every sequence, larger ones 2
    "gpu": dict(Bs=(1, 4, 16, 64), Ls=(512, 1024, 4096, 16384, 65536), reps=15,
                rot_bytes=256 << 20, max_sets=256, min_rows=4, copy_bytes=2 << 30,
                check_tokens=1 << 18),
    "gpu_quick": dict(Bs=(1, 16, 64), Ls=(512, 4096, 65536), reps=7, rot_bytes=128 << 20,
                      max_sets=128, min_rows=4, copy_bytes=1 << 30, check_tokens=1 << 16),
    "cpu": dict(Bs=(1, 4, 16), Ls=(64, 256, 1024), reps=2, rot_bytes=4 << 20, max_sets=4,
                min_rows=2, copy_bytes=64 << 20, check_tokens=1 << 12),
    "cpu_quick": dict(Bs=(1, 4), Ls=(64, 128, 256), reps=2, rot_bytes=1 << 20, max_sets=3,
                      min_rows=2, copy_bytes=16 << 20, check_tokens=256),
}
HQ, H, D, T = 32, 8, 128, 16


def target_ratio(B: int, L: int) -> float:
    """The least SDPA / fused ratio targeted for a cell of B sequences of L tokens."""
    return TARGETS["ratio_big"] if B * L >= TARGETS["big_tokens"] else TARGETS["ratio"]


def tiles(rows: int, cols: int, B: int, nb: int, want: int) -> list[tuple[int, int]]:
    """Up to ``want`` disjoint (first row, first column) tiles of B rows x nb columns in a
    rows x cols block table (at least one)."""
    row_groups, col_groups = rows // B, cols // nb
    n = max(1, min(want, row_groups * col_groups))
    return [((i % row_groups) * B, (i // row_groups) * nb) for i in range(n)]


class SweepBench(AttnBench):
    def __init__(self, args):
        self.sz = dict(SIZES[("cpu" if args.cpu else "gpu") + ("_quick" if args.quick else "")])
        if args.reps is not None:
            self.sz["reps"] = args.reps
        args.reps = self.sz["reps"]
        super().__init__(args, gpu=not args.cpu)
        self.Bs = tuple(args.only_b or self.sz["Bs"])
        self.Ls = tuple(args.only_l or self.sz["Ls"])
        self.errors: list[str] = []
        self.skipped: list[str] = []
        self.t0 = time.perf_counter()
        self.device = self.device_name()

    def device_name(self) -> str:
        if not self.env.gpu:
            return "cpu (NumPy backend)"
        return self.cp.cuda.runtime.getDeviceProperties(
            self.cp.cuda.Device().id)["name"].decode()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def batch_for(self, tokens: int, n_sets: int) -> int:
        base = 2 if not self.env.gpu else 40 if tokens <= 100_000 else \
            10 if tokens <= 1 << 20 else 4
        return n_sets * -(-base // n_sets)

    # -- one cell -----------------------------------------------------------------------
    def cell(self, cache, tab, B: int, L: int, seed: int) -> dict:
        env, xp, sz = self.env, self.xp, self.sz
        nb = -(-L // T)
        bpt = cache.geometry.bytes_per_token
        tokens = B * L
        nbytes = tokens * bpt
        sets = tiles(tab.shape[0], tab.shape[1], B, nb, -(-sz["rot_bytes"] // nbytes))
        sets = sets[:sz["max_sets"]]
        tabs = [xp.ascontiguousarray(tab[r:r + B, c:c + nb]) for r, c in sets]
        lens = xp.full((B,), L, dtype=xp.int32)
        sm_scale = 1.0 / np.sqrt(D)
        q = env.randn_bf16((B, HQ, D), seed)
        out = xp.empty((B, HQ, D), dtype=BF16)
        scratch = None
        if env.gpu:
            from fp4cache._cuda.decode import attention_plans, new_scratch

            scratch = new_scratch()
        calls = [self.fused(cache, q, t, lens, out, scratch, sm_scale) for t in tabs]
        calls[0]()
        env.sync()
        batch = self.batch_for(tokens, len(calls))
        t = self.time(calls, batch=batch)
        gbps = nbytes / t / 1e9
        row = dict(B=B, L=L, tokens=tokens, sets=len(calls), batch=batch, fused_us=t * 1e6,
                   page_bytes=nbytes, gbps=gbps, frac_copy=gbps / self.copy_gbps,
                   target=target_ratio(B, L))
        if env.gpu:
            plan = attention_plans(scratch)[0]
            row.update(grid=list(plan.grid), regs=int(plan.fn.num_regs))
        # correctness of the first tile against the float32 reference
        calls[0]()
        seqs = list(range(B)) if tokens <= sz["check_tokens"] else sorted({0, B - 1})
        ref = self.reference(cache, tabs[0], lens, q, sm_scale, B, H, D, T, seqs=seqs)
        rel = self.max_row_rel_err(out, ref, seqs)
        del ref
        row.update(checked_seqs=len(seqs), max_row_rel_err=rel,
                   check="ok" if rel <= 1e-2 else "FAIL")
        log(f"   fused: {t * 1e6:.1f} us ({len(calls)} tile(s), batch {batch}), "
            f"{gb(gbps)} GB/s page bytes, {100 * row['frac_copy']:.1f} % copy"
            + (f", grid {row['grid']}, regs {row['regs']}" if env.gpu else "")
            + f"; max row rel err {rel:.2e} over {len(seqs)} seq(s) ({row['check']})")
        # the best torch SDPA backend over contiguous bf16 K/V of the same tiles
        if self.torch is None:
            row["sdpa_note"] = "torch not importable"
        else:
            kv = [self.sdpa_kv(cache, tb, B, L, H, D) for tb in tabs]
            self.release()  # the bf16 gathers (CuPy) are copied into torch tensors now
            q4 = env.to_torch(q).view(B, HQ, 1, D)
            backends = None
            if not env.gpu:
                from torch.nn.attention import SDPBackend

                backends = (SDPBackend.MATH,)
            best = self.sdpa_best(q4, [k for k, _ in kv], [v for _, v in kv], sm_scale,
                                  batch=batch, backends=backends)
            del kv
            if best is not None:
                row.update(sdpa_us=best[0] * 1e6, sdpa_backend=best[1].name,
                           ratio=best[0] / t)
                row["met"] = row["ratio"] >= row["target"]
        ratio = (f"{row['ratio']:.2f}x ({row['sdpa_backend']} {row['sdpa_us']:.1f} us)"
                 if "ratio" in row else "-")
        log(f"   SDPA / fused: {ratio}; target >= {row['target']:.1f}: {mark(row.get('met'))}")
        return row

    # -- the sweep ------------------------------------------------------------------------
    def run(self) -> None:
        sz = self.sz
        log(f"device: {self.device}; B {list(self.Bs)} x L {list(self.Ls)}, Hq={HQ}, H={H}, "
            f"D={D}, T={T}, reps {sz['reps']}")
        self.copy(sz["copy_bytes"])
        self.write()
        Lmax = max(self.Ls)
        for B in self.Bs:
            if self.elapsed() > self.args.budget_s:
                self.skipped.append(f"B={B}: past the {self.args.budget_s:.0f} s budget")
                log(f"-- B={B}: skipped ({self.elapsed():.0f} s elapsed)")
                continue
            bpt = 2 * H * (D // 2 + D // 16)
            rows = max(B, sz["min_rows"], -(-sz["rot_bytes"] // (Lmax * bpt)))
            t0 = time.perf_counter()
            try:
                cache, tab, _, _ = self.cache_for(rows, [Lmax] * rows, H, D, T, seed=B)
                self.env.sync()
            except Exception as e:
                self.fail(f"B={B} cache", e)
                continue
            log(f"\n== B={B}: cache of {rows} x {Lmax} tokens ({cache.nbytes / 2**30:.2f} GiB)"
                f" in {time.perf_counter() - t0:.1f} s")
            for L in self.Ls:
                log(f"-- B={B}, L={L}  (t = {self.elapsed():.1f} s)")
                try:
                    self.rows.append(self.cell(cache, tab, B, L, seed=B * 7919 + L))
                except Exception as e:
                    self.fail(f"B={B}, L={L}", e)
                self.release()
                self.write()
            del cache, tab
            self.release()
        self.table()
        if self.args.plot:
            self.plot(self.args.plot)
        self.write()

    def fail(self, where: str, e: BaseException) -> None:
        tb = traceback.format_exc(limit=6)
        self.errors.append(f"{where}: {type(e).__name__}: {e}")
        log(f"!! {where} failed: {type(e).__name__}: {e}\n{tb}")

    # -- report ---------------------------------------------------------------------------
    def write(self) -> None:
        if self.args.out:
            path = Path(self.args.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dict(
                device=self.device, copy_gbps=self.copy_gbps, shape=dict(Hq=HQ, H=H, D=D, T=T),
                Bs=list(self.Bs), Ls=list(self.Ls), sizes=self.sz, targets=TARGETS,
                rows=self.rows, errors=self.errors, skipped=self.skipped,
                elapsed_s=self.elapsed(), date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                             time.gmtime())), indent=1))

    def grid(self, title: str, fmt) -> None:
        by = {(r["B"], r["L"]): r for r in self.rows}
        log(f"\n{title}\n")
        log("| B \\ L | " + " | ".join(str(L) for L in self.Ls) + " |")
        log("|---|" + "---:|" * len(self.Ls))
        for B in self.Bs:
            cells = [fmt(by[(B, L)]) if (B, L) in by else "-" for L in self.Ls]
            log(f"| {B} | " + " | ".join(cells) + " |")

    def table(self) -> None:
        def main_cell(r):
            ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
            bad = "" if r["check"] == "ok" else " CHECK FAILED"
            return f"{r['fused_us']:.1f} / {ratio} {mark(r.get('met'))}{bad}"

        self.grid(f"fused us / SDPA-over-fused ratio, target met? (>= {TARGETS['ratio']} "
                  f"everywhere, >= {TARGETS['ratio_big']} where B*L >= "
                  f"{TARGETS['big_tokens']}); {self.device}", main_cell)
        self.grid("GB/s of page bytes (% of copy)",
                  lambda r: f"{gb(r['gbps'])} ({100 * r['frac_copy']:.1f} %)")
        self.grid("best SDPA us (backend)", lambda r: f"{r['sdpa_us']:.1f} "
                  f"({r['sdpa_backend'].split('_')[0].lower()})" if "sdpa_us" in r else "-")
        met = [r.get("met") for r in self.rows]
        log(f"\ntargets met in {met.count(True)} of {len(self.rows)} cells"
            f" ({met.count(False)} missed, {met.count(None)} without SDPA); copy bandwidth "
            f"{self.copy_gbps:.0f} GB/s; checks failed: "
            f"{sum(r['check'] != 'ok' for r in self.rows)}; {self.elapsed():.0f} s")
        if self.errors:
            log(f"{len(self.errors)} error(s): " + "; ".join(self.errors))
        if self.skipped:
            log("skipped: " + "; ".join(self.skipped))

    def plot(self, path: str) -> None:
        try:
            import matplotlib
        except ImportError:
            log("matplotlib not importable: no plot")
            return
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullLocator

        fig, ax = plt.subplots(figsize=(7, 5))
        for i, B in enumerate(self.Bs):
            rs = sorted((r for r in self.rows if r["B"] == B), key=lambda r: r["L"])
            if not rs:
                continue
            color = f"C{i}"
            ax.plot([r["L"] for r in rs], [r["fused_us"] for r in rs], "o-", color=color,
                    label=f"B={B} fused NVFP4")
            sd = [r for r in rs if "sdpa_us" in r]
            if sd:
                ax.plot([r["L"] for r in sd], [r["sdpa_us"] for r in sd], "x--", color=color,
                        label=f"B={B} SDPA bf16")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        Ls = sorted({r["L"] for r in self.rows})
        ax.set_xticks(Ls, [str(L) for L in Ls])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("L (tokens per sequence)")
        ax.set_ylabel("time per call (us)")
        ax.set_title(f"decode attention, Hq={HQ}, H={H}, D={D}: {self.device}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        log(f"plot: {path}")


def mark(met) -> str:
    return {True: "met", False: "MISSED", None: "?"}[met]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the cells as JSON here")
    ap.add_argument("--plot", default=None, help="time vs L per B, as a PNG (matplotlib)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 15 on the GPU)")
    ap.add_argument("--only-b", type=int, nargs="+", default=None, help="batch sizes to run")
    ap.add_argument("--only-l", type=int, nargs="+", default=None,
                    help=f"sequence lengths to run (multiples of {T})")
    ap.add_argument("--cpu", action="store_true", help="NumPy backend, tiny shapes")
    ap.add_argument("--quick", action="store_true", help="fewer cells and repetitions")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="no new B is started after this many seconds")
    args = ap.parse_args(argv)
    for L in args.only_l or ():
        if L <= 0 or L % T:
            ap.error(f"--only-l: {L} is not a positive multiple of the block size {T}")
    if any(B <= 0 for B in args.only_b or ()):
        ap.error("--only-b: batch sizes must be positive")
    bench = SweepBench(args)
    bench.run()
    failed = any(r["check"] != "ok" for r in bench.rows)
    return 1 if bench.errors or failed else 0


if __name__ == "__main__":
    sys.exit(main())
