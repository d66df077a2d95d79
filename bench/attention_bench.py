"""Benchmark of the fused NVFP4 paged decode attention against the copy ceiling, torch
SDPA over contiguous bf16 K/V and the unfused path (gather_dequant + SDPA).

Run on the GPU (from the repository root)::

    PYTHONPATH=. python3 bench/attention_bench.py --out $OUT/attention.json

Uses timing.py's timing (spin kernel + batch between events, median of reps), copy
ceiling and host-time helper.  Every configuration is checked in the same run against a float32
reference (CuPy, exact softmax) over ``gather_dequant(..., dtype="float32")`` values.
Bytes counted for the fused kernel: the NVFP4 page bytes it reads, K and V of every used
(token, KV head): ``sum(seq_lens) * 2 * H * (D/2 + D/16)``; the block tables and q are
left out (< 0.1 %).  % copy is that over the device-to-device copy bandwidth measured in
the same run (bytes read + written, as in bench.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from timing import BF16, Env, measure_copy  # noqa: E402

#: the targets (printed, never asserted)
TARGETS = {"speedup_sdpa": 2.5, "moonshot": 3.0, "frac_main": 0.80, "frac_mixed": 0.75,
           "host_ratio": 2.5}


def log(msg: str) -> None:
    print(msg, flush=True)


class AttnBench:
    """Caches, the float32 reference, the fused call, SDPA and the copy ceiling, on the GPU
    (CuPy, torch) or, with ``gpu=False``, on the NumPy backend (torch optional: without
    it there is no SDPA; ``sweep_bench.py --cpu`` tests its logic that way)."""

    def __init__(self, args, gpu: bool = True):
        try:
            import torch
        except ImportError:
            if gpu:
                raise
            torch = None
        self.args = args
        self.env = Env(gpu=gpu)
        self.cp, self.xp, self.torch = self.env.cp, self.env.xp, torch
        self.rows: list[dict] = []
        self.copy_gbps = None
        self.reps = args.reps

    # -- helpers --------------------------------------------------------------------------
    def time(self, calls, batch=None) -> float:
        return self.env.time_calls(calls, reps=self.reps, batch=batch)["median_s"]

    def copy(self, n: int = 2 << 30) -> None:
        t = measure_copy(self.env, n, reps=self.reps)
        self.copy_gbps = 2 * n / t / 1e9
        where = "D2D" if self.env.gpu else "host"
        log(f"copy {n / 2**30:g} GiB {where}: {t * 1e6:.1f} us, {self.copy_gbps:.0f} GB/s "
            "(read + write)")

    def cache_for(self, B, lens, H, D, T, seed):
        """A cache holding random realistic K/V for B sequences of `lens` tokens in random
        pages, the block tables, and the decoded float32 values for the reference."""
        import fp4cache

        xp = self.xp
        pages = [-(-int(L) // T) for L in lens]
        max_blocks = max(pages)
        nb = sum(pages)
        cache = fp4cache.PagedKVCache(nb, T, H, D, layout="HND", swizzle_v_scales=True,
                                      k_scale=4.0 / (6 * 448), v_scale=4.0 / (6 * 448),
                                      device=self.env.device)
        chunk = 1 << 16
        for i, a in enumerate(range(0, nb * T, chunk)):
            n = min(chunk, nb * T - a)
            k = self.env.randn_bf16((n, H, D), seed * 1000 + 2 * i)
            v = self.env.randn_bf16((n, H, D), seed * 1000 + 2 * i + 1)
            cache.store(xp.arange(a, a + n, dtype=xp.int64), k, v)
        perm = np.random.default_rng(seed).permutation(nb).astype(np.int32)
        tab = np.full((B, max_blocks), -1, np.int32)
        pos = 0
        for b, p in enumerate(pages):
            tab[b, :p] = perm[pos:pos + p]
            pos += p
        return (cache, self.env.asarray(tab), self.env.asarray(np.asarray(lens, np.int32)),
                max_blocks)

    def reference(self, cache, tab, lens, q, sm_scale, B, H, D, T, seqs=None):
        """float32 attention (exact softmax, CuPy or NumPy) over gather_dequant float32
        values, one sequence at a time: rows ``seqs`` (default: all ``B``) of the result."""
        xp, env = self.xp, self.env
        tabh = env.asnumpy(tab)
        lensh = env.asnumpy(lens)
        qf = env.bf16_to_f32(q)
        g = qf.shape[1] // H
        outs = []
        for b in (range(B) if seqs is None else seqs):
            L = int(lensh[b])
            ids = env.asarray(np.ascontiguousarray(tabh[b, :-(-L // T)]))
            kd, vd = cache.gather_dequant(ids, dtype="float32")
            k = kd[:L].transpose(1, 0, 2)  # (H, L, D)
            v = vd[:L].transpose(1, 0, 2)
            s = xp.matmul(qf[b].reshape(H, g, D), k.transpose(0, 2, 1)) * np.float32(sm_scale)
            p = xp.exp(s - s.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            outs.append(xp.matmul(p, v).reshape(H * g, D))
            del kd, vd, k, v, s, p
        return xp.stack(outs)

    def max_row_rel_err(self, out, ref, seqs=None) -> float:
        """max over (sequence, query head) of ||out - ref|| / ||ref|| (rows ``seqs``)."""
        xp = self.xp
        got = self.env.bf16_to_f32(out)
        if seqs is not None:
            got = got[xp.asarray(np.asarray(list(seqs), np.int64))]
        rel = xp.linalg.norm(got - ref, axis=-1) / xp.linalg.norm(ref, axis=-1)
        return float(rel.max())

    def fused(self, cache, q, tab, lens, out, scratch, sm_scale):
        if not self.env.gpu:  # the NumPy backend (scratch unused)
            def host_call():
                cache.decode_attention(q, tab, lens, sm_scale=sm_scale, out=out)
            return host_call
        from fp4cache._cuda import decode as ca

        def call():
            ca.decode_attention(cache.buffer, q, tab, lens, out, None, geom=cache.geometry,
                                k_s=cache.pool.k_s, v_s=cache.pool.v_s, sm_scale=sm_scale,
                                stats=cache.pool.stats, scratch=scratch)
        return call

    def sdpa_kv(self, cache, tab, B, L, H, D):
        """Contiguous bf16 torch K and V, (B, H, L, D), decoded from the pages of the
        B x (L / block_size) block table ``tab`` (every page full)."""
        kd, vd = cache.gather_dequant(tab.reshape(-1))  # full pages, in sequence order
        kt, vt = self.env.to_torch(kd), self.env.to_torch(vd)
        k4 = kt.view(B, L, H, D).transpose(1, 2).contiguous()
        v4 = vt.view(B, L, H, D).transpose(1, 2).contiguous()
        del kd, vd, kt, vt
        return k4, v4

    def sdpa_best(self, q4, k4, v4, sm_scale, *, batch=10, backends=None):
        """(time, backend) of the fastest SDPA backend over contiguous bf16 K/V; ``k4`` and
        ``v4`` may be lists of input sets (then timed rotating through them, ``q4`` one
        tensor or a list)."""
        torch = self.torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        F = torch.nn.functional
        ks = k4 if isinstance(k4, list) else [k4]
        vs = v4 if isinstance(v4, list) else [v4]
        qs = q4 if isinstance(q4, list) else [q4] * len(ks)
        best = None
        for be in backends or (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                               SDPBackend.EFFICIENT_ATTENTION):
            def one(q, k, v, be=be):
                with sdpa_kernel([be]):
                    F.scaled_dot_product_attention(q, k, v, scale=sm_scale, enable_gqa=True)
            calls = [lambda q=q, k=k, v=v, one=one: one(q, k, v) for q, k, v in zip(qs, ks, vs)]
            try:
                calls[0]()
                if self.env.gpu:
                    torch.cuda.synchronize()
                t = self.time(calls, batch=max(batch, len(calls)))
            except Exception as e:  # backend refuses the shape
                log(f"   sdpa {be.name}: unavailable ({type(e).__name__})")
                continue
            log(f"   sdpa {be.name}: {t * 1e6:.1f} us")
            if best is None or t < best[0]:
                best = (t, be)
        return best

    # -- one configuration -------------------------------------------------------------
    def config(self, name, B, lens, Hq, H=8, D=128, T=16, *, sdpa=True, host=False, seed=0):
        cp, torch = self.cp, self.torch
        log(f"\n== {name}: B={B}, Hq={Hq}, H={H}, D={D}, T={T}, tokens={int(np.sum(lens))}")
        cache, tab, lensd, max_blocks = self.cache_for(B, lens, H, D, T, seed)
        sm_scale = 1.0 / np.sqrt(D)
        q = self.env.randn_bf16((B, Hq, D), seed + 7)
        out = cp.empty((B, Hq, D), dtype=BF16)
        from fp4cache._cuda import decode as ca

        scratch = ca.new_scratch()
        call = self.fused(cache, q, tab, lensd, out, scratch, sm_scale)
        call()
        cp.cuda.Device().synchronize()
        plan = ca.attention_plans(scratch)[0]
        t = self.time([call], batch=10 if int(np.sum(lens)) > 100000 else 40)
        nbytes = int(np.sum(lens)) * cache.geometry.bytes_per_token
        gbps = nbytes / t / 1e9
        row = dict(case=name, B=B, Hq=Hq, H=H, D=D, T=T, tokens=int(np.sum(lens)),
                   fused_us=t * 1e6, page_bytes=nbytes, gbps=gbps,
                   frac_copy=gbps / self.copy_gbps, grid=list(plan.grid),
                   regs=int(plan.fn.num_regs))
        # correctness against the float32 reference
        ref = self.reference(cache, tab, lensd, q, sm_scale, B, H, D, T)
        rel = self.max_row_rel_err(out, ref)
        del ref
        row["max_row_rel_err"] = rel
        row["check"] = "ok" if rel <= 1e-2 else "FAIL"
        log(f"   fused: {t * 1e6:.1f} us, {gbps:.0f} GB/s page bytes, "
            f"{100 * row['frac_copy']:.1f} % copy, grid {plan.grid}, regs {plan.fn.num_regs}; "
            f"max row rel err {rel:.2e} ({row['check']})")
        if sdpa and len(set(int(x) for x in lens)) == 1:
            L = int(lens[0])
            # contiguous bf16 K/V (B, H, L, D) from the same decoded values
            k4, v4 = self.sdpa_kv(cache, tab, B, L, H, D)
            q4 = torch.from_dlpack(q.view(cp.int16)).view(torch.bfloat16).view(B, Hq, 1, D)
            best = self.sdpa_best(q4, k4, v4, sm_scale)
            if best is not None:
                row["sdpa_us"], row["sdpa_backend"] = best[0] * 1e6, best[1].name
                row["speedup_vs_sdpa"] = best[0] / t
            del k4, v4
            # today's path: gather_dequant of the used pages into bf16, then SDPA
            ids = tab.reshape(-1)
            gk = cp.empty((B * max_blocks * T, H, D), dtype=BF16)
            gv = cp.empty_like(gk)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            be = best[1] if best is not None else SDPBackend.CUDNN_ATTENTION
            gkt = torch.from_dlpack(gk.view(cp.int16)).view(torch.bfloat16)
            gvt = torch.from_dlpack(gv.view(cp.int16)).view(torch.bfloat16)
            k4g = gkt.view(B, L, H, D).transpose(1, 2)
            v4g = gvt.view(B, L, H, D).transpose(1, 2)

            def today():
                cache.gather_dequant(ids, out=(gk, gv))
                with sdpa_kernel([be]):
                    torch.nn.functional.scaled_dot_product_attention(
                        q4, k4g, v4g, scale=sm_scale, enable_gqa=True)
            try:
                today()
                tg = self.time([today], batch=10)
                row["gather_sdpa_us"] = tg * 1e6
                row["speedup_vs_gather_sdpa"] = tg / t
            except Exception as e:
                log(f"   gather + sdpa failed: {type(e).__name__}: {e}")
            del gk, gv, gkt, gvt, k4g, v4g
            log(f"   sdpa best {row.get('sdpa_backend')}: {row.get('sdpa_us', float('nan')):.1f}"
                f" us ({row.get('speedup_vs_sdpa', float('nan')):.2f}x), gather+sdpa "
                f"{row.get('gather_sdpa_us', float('nan')):.1f} us "
                f"({row.get('speedup_vs_gather_sdpa', float('nan')):.2f}x)")
        if host:
            # host time per call of the public method (what a serving loop calls; its hot
            # path) and of the backend launch, against an empty RawKernel launch
            # (rounds of 50 calls with a sync between them: the device, slower per call
            # than the host here, never holds enough queued launches to stall the host)
            empty = self.env.empty_kernel
            te = self.env.host_per_call(lambda: empty((1,), (1,), ()), 2000, rounds=40)

            def public():
                cache.decode_attention(q, tab, lensd, sm_scale=sm_scale, out=out)
            public()
            th = self.env.host_per_call(public, 2000, rounds=40)
            tb = self.env.host_per_call(call, 2000, rounds=40)
            row.update(host_us=th * 1e6, empty_launch_us=te * 1e6, host_ratio=th / te,
                       backend_host_us=tb * 1e6)
            log(f"   host time {th * 1e6:.2f} us/call (public method; backend launch "
                f"{tb * 1e6:.2f} us), empty RawKernel {te * 1e6:.2f} us ({th / te:.2f}x)")
        self.rows.append(row)
        return row

    def release(self) -> None:
        if self.env.gpu:
            self.torch.cuda.empty_cache()
        self.env.free()

    def run(self):
        self.copy()
        rng = np.random.default_rng(3)
        plan = [
            ("B=8 x 32768", 8, [32768] * 8, 32, {}),
            ("B=64 x 4096", 64, [4096] * 64, 32, {}),
            ("B=1 x 131072", 1, [131072], 32, {}),
            ("B=32 mixed [512, 32768]", 32, list(rng.integers(512, 32769, 32)), 32, {}),
            ("decode B=1 x 1024", 1, [1024], 32, dict(host=True)),
            ("decode B=32 x 512", 32, [512] * 32, 32, dict(host=True)),
            ("group 1 (Hq=8) B=8 x 32768", 8, [32768] * 8, 8, {}),
            ("group 8 (Hq=64) B=8 x 32768", 8, [32768] * 8, 64, {}),
            ("D=64 B=8 x 32768", 8, [32768] * 8, 32, dict(D=64)),
            ("D=256 B=8 x 32768", 8, [32768] * 8, 32, dict(D=256)),
        ]
        if self.args.only:
            plan = [p for p in plan if any(o in p[0] for o in self.args.only)]
        for i, (name, B, lens, Hq, kw) in enumerate(plan):
            try:
                self.config(name, B, lens, Hq, seed=i, **kw)
                self.release()
            except Exception as e:
                import traceback
                log(f"!! {name} failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")
            self.write()
        self.table()

    def write(self):
        if self.args.out:
            Path(self.args.out).write_text(json.dumps(
                dict(copy_gbps=self.copy_gbps, rows=self.rows, targets=TARGETS,
                     date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())), indent=1))

    def table(self):
        log("\n| work | fused us | GB/s (pages) | % copy | SDPA us | vs SDPA | gather+SDPA us "
            "| vs gather+SDPA | host us (x empty) | check |")
        log("|---|---|---|---|---|---|---|---|---|---|")
        for r in self.rows:
            def f(k, fmt, r=r):
                return format(r[k], fmt) if k in r else "-"
            host = (f"{r['host_us']:.1f} ({r['host_ratio']:.2f}x)" if "host_us" in r else "-")
            log(f"| {r['case']} | {r['fused_us']:.1f} | {r['gbps']:.0f} | "
                f"{100 * r['frac_copy']:.1f} | {f('sdpa_us', '.1f')} | "
                f"{f('speedup_vs_sdpa', '.2f')} | {f('gather_sdpa_us', '.1f')} | "
                f"{f('speedup_vs_gather_sdpa', '.2f')} | {host} | "
                f"{r['check']} ({r['max_row_rel_err']:.1e}) |")
        log(f"copy bandwidth {self.copy_gbps:.0f} GB/s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--only", nargs="*", default=None, help="run configurations containing")
    args = ap.parse_args(argv)
    AttnBench(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
