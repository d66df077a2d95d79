"""Benchmark of the NVFP4 paged attention for any query length: speculative
verification, a prefill chunk, a mixed batch and the host time of a call, side by side with
``decode_attention`` on the same cache and torch SDPA over contiguous bf16 K/V.

Run on the GPU (from the repository root)::

    PYTHONPATH=. python3 bench/varlen_bench.py --out $OUT/varlen.json
    PYTHONPATH=. python3 bench/varlen_bench.py --window 3 --rotate --only spec prefill mixed

The prefill rows (``prefill``; ``prefill_shapes``: head_dim 64 and 256, a plain 8,192-token
prefill) time the default route (on sm_90 the wgmma kernel) and the mma.sync route
(``--route mma`` times only that one; ``fp4cache._kernels.PREFILL_ROUTES``) on the same
cache and q.

``--window P`` also times every row with the exact window (``docs/window.md``: the last P
pages of every sequence mapped to random bf16 slots), ``--rotate`` with the q rotation (with
``--window``: window + rotation), in the same run, on the same cache and q (the variants'
values are not checked here: tests/test_attention_varlen.py's TestWindow does that).

Timing, caches and SDPA backends come from bench/attention_bench.py (spin kernel + batch
between events, median of reps; random page order, HND, block 16).  Every row is checked
in the same run against a float32 torch reference over ``gather_dequant(...,
dtype="float32")`` values with the bottom-right causal mask (max relative row error <=
1e-2, printed).  Verification rows compare with SDPA *without* a mask on the same shapes
(a lower bound of the bf16 cost); the prefill rows with SDPA and ``causal_lower_right``;
the mixed row with the best SDPA doing its work (the decodes as one padded batch with a key
mask or one call per sequence, the chunk with ``causal_lower_right``).
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

from attention_bench import AttnBench, log  # noqa: E402
from timing import BF16  # noqa: E402

from fp4cache import _kernels as K  # noqa: E402
from fp4cache._cuda.decode import new_scratch  # noqa: E402

#: the targets (printed, never asserted)
TARGETS = {"n4_vs_decode": 1.2, "n4_vs_sdpa": 2.0, "n8_vs_decode": 1.6,
           "prefill_vs_sdpa": 0.9, "host_ratio": 2.5}


class VarlenBench(AttnBench):
    @classmethod
    def plain(cls, reps: int) -> VarlenBench:
        """The bench of the probes: route "auto", no window or rotation, no JSON file."""
        return cls(argparse.Namespace(reps=reps, out=None, only=None, route="auto", window=0,
                                      rotate=False))

    def varlen(self, cache, q, qsl, tab, lens, out, scratch, sm_scale, mql, causal=True,
               window=None, rotate=False, route=None):
        from fp4cache._cuda import varlen as cv

        route = self.args.route if route is None else route

        def call():
            cv.attention(cache.buffer, q, qsl, tab, lens, out, None, max_query_len=mql,
                         causal=causal, geom=cache.geometry, k_s=cache.pool.k_s, v_s=cache.pool.v_s,
                         sm_scale=sm_scale, stats=cache.pool.stats, scratch=scratch,
                         window=window, rotate=rotate, route=route)
        return call

    def window_of(self, cache, tab, lens, P):
        """(slots, map, P): the last P pages of every sequence mapped (a ring of P slots
        per sequence), random bf16 slot values."""
        cp = self.cp
        g = cache.geometry
        T, H, D = g.block_size, g.num_heads, g.head_dim
        tabh, lensh = cp.asnumpy(tab), cp.asnumpy(lens)
        B = tabh.shape[0]
        win_map = np.full(cache.buffer.shape[0], -1, np.int32)
        for b in range(B):
            n = -(-int(lensh[b]) // T)
            for p in range(max(0, n - P), n):
                win_map[int(tabh[b, p])] = b * P + p % P
        from fp4cache.formats import bf16_bits
        x = np.random.default_rng(0).standard_normal((B * P, 2, T, H, D), dtype=np.float32)
        return (cp.asarray(bf16_bits(x)), cp.asarray(win_map), P)

    def variants(self, row, cache, tab, lens, make, batch):
        """Time the --window / --rotate variants of a row: make(window, rotate) -> call;
        adds <variant>_us and <variant>_vs_plain (over row['varlen_us'])."""
        P, rot = self.args.window, self.args.rotate
        todo = ([("window", True, False)] if P else []) + (
            [("window_rot" if P else "rot", bool(P), True)] if rot else [])
        if not todo:
            return
        win = self.window_of(cache, tab, lens, P) if P else None
        for name, w, r in todo:
            try:
                call = make(win if w else None, r)
                call()
                self.cp.cuda.Device().synchronize()
                t = self.time([call], batch=batch)
            except Exception as e:
                log(f"   {name}: failed ({type(e).__name__}: {e})")
                continue
            row[f"{name}_us"] = t * 1e6
            row[f"{name}_vs_plain"] = t * 1e6 / row["varlen_us"]
            log(f"   {name} (P={P}): {t * 1e6:.1f} us = {row[f'{name}_vs_plain']:.3f}x plain")

    def check(self, cache, tab, lens, qsl, q, out, sm_scale, H, D, T, causal=True):
        """max relative row error of `out` against a float32 torch reference."""
        torch, cp = self.torch, self.cp
        tabh, lensh, qslh = cp.asnumpy(tab), cp.asnumpy(lens), cp.asnumpy(qsl)
        qt = torch.from_dlpack(q.view(cp.int16)).view(torch.bfloat16).float()
        got = torch.from_dlpack(out.view(cp.int16)).view(torch.bfloat16).float()
        worst = 0.0
        for b in range(len(qslh) - 1):
            s0, s1 = int(qslh[b]), int(qslh[b + 1])
            n, L = s1 - s0, int(lensh[b])
            if n == 0:
                continue
            kd, vd = cache.gather_dequant(cp.asarray(tabh[b, :-(-L // T)]), dtype="float32")
            k = torch.from_dlpack(kd[:L]).permute(1, 0, 2)  # (H, L, D)
            v = torch.from_dlpack(vd[:L]).permute(1, 0, 2)
            g = qt.shape[1] // H
            key = torch.arange(L, device=k.device)
            lim = (L - n + torch.arange(n, device=k.device) + 1) if causal else \
                torch.full((n,), L, device=k.device)
            mask = key[None, :] < lim[:, None]  # (n, L)
            for h in range(H):
                qb = qt[s0:s1, h * g:(h + 1) * g]  # (n, g, D)
                s = torch.einsum("ngd,ld->ngl", qb, k[h]) * sm_scale
                s = s.masked_fill(~mask[:, None, :], float("-inf"))
                ref = torch.einsum("ngl,ld->ngd", torch.softmax(s, dim=-1), v[h])
                err = (got[s0:s1, h * g:(h + 1) * g] - ref).norm(dim=-1) / ref.norm(dim=-1)
                worst = max(worst, err.max().item())
                del s, ref
            del kd, vd, k, v
        return worst

    def spec(self, n_list, B=8, L=32768, Hq=32, H=8, D=128, T=16, seed=0):
        cp, torch = self.cp, self.torch
        log(f"\n== verification: B={B} x {L}, Hq={Hq}, H={H}, D={D}, n={n_list}")
        cache, tab, lensd, max_blocks = self.cache_for(B, [L] * B, H, D, T, seed)
        sm_scale = 1.0 / np.sqrt(D)
        # decode_attention on the same cache (n = 1)
        qd = self.env.randn_bf16((B, Hq, D), seed + 3)
        od = cp.empty((B, Hq, D), dtype=BF16)
        dcall = self.fused(cache, qd, tab, lensd, od, new_scratch(), sm_scale)
        dcall()
        td = self.time([dcall], batch=10)
        log(f"   decode_attention (n=1): {td * 1e6:.1f} us")
        # contiguous bf16 K/V for SDPA
        kd, vd = cache.gather_dequant(tab.reshape(-1))
        kt = torch.from_dlpack(kd.view(cp.int16)).view(torch.bfloat16)
        vt = torch.from_dlpack(vd.view(cp.int16)).view(torch.bfloat16)
        k4 = kt.view(B, L, H, D).transpose(1, 2).contiguous()
        v4 = vt.view(B, L, H, D).transpose(1, 2).contiguous()
        del kd, vd, kt, vt
        for n in n_list:
            q = self.env.randn_bf16((B * n, Hq, D), seed + 11 * n)
            qsl = cp.arange(B + 1, dtype=cp.int32) * n
            out = cp.empty((B * n, Hq, D), dtype=BF16)
            scratch = new_scratch()
            call = self.varlen(cache, q, qsl, tab, lensd, out, scratch, sm_scale, n)
            call()
            cp.cuda.Device().synchronize()
            t = self.time([call], batch=10)
            rel = self.check(cache, tab, lensd, qsl, q, out, sm_scale, H, D, T)
            plan = next(iter(scratch.plans.values())).plan.launches[-1]
            q4 = torch.from_dlpack(q.view(cp.int16)).view(torch.bfloat16).view(
                B, n, Hq, D).transpose(1, 2)
            best = self.sdpa_best(q4, k4, v4, sm_scale)
            row = dict(case=f"verify B={B} x {L}, n={n}", n=n, varlen_us=t * 1e6,
                       decode_us=td * 1e6, vs_decode=t / td, grid=plan.grid,
                       regs=int(plan.fn.num_regs),
                       kernel=plan.keep[0].spec.name if len(plan.keep) == 1 else "varlen",
                       max_row_rel_err=rel, check="ok" if rel <= 1e-2 else "FAIL")
            if best is not None:
                row.update(sdpa_us=best[0] * 1e6, sdpa_backend=best[1].name,
                           speedup_vs_sdpa=best[0] / t)
            log(f"   n={n}: {t * 1e6:.1f} us = {t / td:.2f}x decode; SDPA unmasked "
                f"{row.get('sdpa_us', float('nan')):.1f} us ({row.get('speedup_vs_sdpa', 0):.2f}x)"
                f"; grid {plan.grid}, regs {plan.fn.num_regs}; err {rel:.1e} ({row['check']})")
            self.variants(row, cache, tab, lensd, lambda w, r, q=q, qsl=qsl, out=out, n=n:
                          self.varlen(cache, q, qsl, tab, lensd, out, new_scratch(), sm_scale,
                                      n, window=w, rotate=r), 10)
            self.rows.append(row)
            self.write()
        del k4, v4

    def sdpa_causal(self, q4, k4, v4, sm_scale, every=None):
        """(time, backend) of SDPA with a bottom-right causal mask (K/V expanded to the
        query heads: not every backend takes GQA with a mask); ``every`` (a dict) gets each
        backend's time in us."""
        torch = self.torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
        F = torch.nn.functional
        mask = causal_lower_right(q4.shape[2], k4.shape[2])
        best = None
        for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                   SDPBackend.EFFICIENT_ATTENTION):
            def call(be=be):
                with sdpa_kernel([be]):
                    F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=sm_scale)
            t = self.try_time(call, f"sdpa causal_lower_right {be.name}")
            if t is not None and every is not None:
                every[be.name] = t * 1e6
            if t is not None and (best is None or t < best[0]):
                best = (t, be)
        return best

    def try_time(self, call, label):
        """Seconds of ``call`` (torch work, batches of 3), or None (logged) where it raises,
        e.g. an SDPA backend that refuses the shape."""
        try:
            call()
            self.torch.cuda.synchronize()
            t = self.time([call], batch=3)
        except Exception as e:
            log(f"   {label}: unavailable ({type(e).__name__})")
            return None
        log(f"   {label}: {t * 1e6:.1f} us")
        return t

    def prefill(self, n=2048, cached=30720, Hq=32, H=8, D=128, T=16, seed=5, B=1):
        """B sequences of cached + n tokens, each an n-token causal chunk after its cached
        ones, in one call."""
        cp = self.cp
        L = cached + n
        log(f"\n== prefill chunk: B={B}, n={n} after {cached} cached, Hq={Hq}, H={H}, D={D}")
        cache, tab, lensd, _ = self.cache_for(B, [L] * B, H, D, T, seed)
        sm_scale = 1.0 / np.sqrt(D)
        q = self.env.randn_bf16((B * n, Hq, D), seed + 1)
        qsl = cp.arange(B + 1, dtype=cp.int32) * n
        out = cp.empty((B * n, Hq, D), dtype=BF16)
        scratch = new_scratch()
        call = self.varlen(cache, q, qsl, tab, lensd, out, scratch, sm_scale, n)
        call()
        cp.cuda.Device().synchronize()
        t = self.time([call], batch=3)
        pairs = B * (n * (L - n) + n * (n + 1) // 2)  # (query, key) pairs, causal mask
        flops = 4.0 * pairs * Hq * D
        rel = self.check(cache, tab, lensd, qsl, q, out, sm_scale, H, D, T)
        plan = next(iter(scratch.plans.values())).plan.launches[-1]
        row = dict(case=f"prefill B={B}, {n} after {cached}, D={D}", varlen_us=t * 1e6,
                   tflops=flops / t / 1e12, grid=plan.grid, regs=int(plan.fn.num_regs),
                   kernel=plan.name, max_row_rel_err=rel, check="ok" if rel <= 1e-2 else "FAIL")
        if "_wgmma_" in plan.name:  # the mma.sync route on the same cache and q
            mcall = self.varlen(cache, q, qsl, tab, lensd, out, new_scratch(), sm_scale, n,
                                route="mma")
            mcall()
            cp.cuda.Device().synchronize()
            tm = self.time([mcall], batch=3)
            mrel = self.check(cache, tab, lensd, qsl, q, out, sm_scale, H, D, T)
            row.update(mma_us=tm * 1e6, mma_tflops=flops / tm / 1e12, mma_rel_err=mrel)
            log(f"   route mma: {tm * 1e6:.1f} us, {flops / tm / 1e12:.1f} TFLOPS; err "
                f"{mrel:.1e}")
            call()  # out of the timed route again
            cp.cuda.Device().synchronize()
        kd, vd = cache.gather_dequant(tab.reshape(-1))  # B x (its pages) x T tokens
        P = int(tab.shape[1])
        kt = self.env.to_torch(kd).view(B, P * T, H, D)[:, :L]
        vt = self.env.to_torch(vd).view(B, P * T, H, D)[:, :L]
        g = Hq // H
        k4 = kt.transpose(1, 2).repeat_interleave(g, dim=1).contiguous()  # (B, Hq, L, D)
        v4 = vt.transpose(1, 2).repeat_interleave(g, dim=1).contiguous()
        del kd, vd, kt, vt
        q4 = self.env.to_torch(q).view(B, n, Hq, D).transpose(1, 2)
        every: dict = {}
        best = self.sdpa_causal(q4.contiguous(), k4, v4, sm_scale, every)
        row.update(sdpa_backends_us=every)
        if best is not None:
            row.update(sdpa_us=best[0] * 1e6, sdpa_backend=best[1].name,
                       sdpa_tflops=flops / best[0] / 1e12, speedup_vs_sdpa=best[0] / t)
        log(f"   varlen {t * 1e6:.1f} us, {row['tflops']:.1f} TFLOPS; SDPA "
            f"{row.get('sdpa_tflops', float('nan')):.1f} TFLOPS "
            f"({row.get('speedup_vs_sdpa', 0):.2f}x); grid {plan.grid}, regs "
            f"{plan.fn.num_regs}; err {rel:.1e} ({row['check']})")
        self.variants(row, cache, tab, lensd, lambda w, r: self.varlen(
            cache, q, qsl, tab, lensd, out, new_scratch(), sm_scale, n, window=w, rotate=r), 3)
        self.exact_new(row, cache, q, qsl, tab, lensd, out, sm_scale, n)
        self.rows.append(row)
        self.write()
        del k4, v4

    def exact_new(self, row, cache, q, qsl, tab, lens, out, sm_scale, n):
        """The row with the exact new tokens (``new_kv``: the chunk's K/V read from bf16
        rows, the mma.sync route's _win kernel), with --window / --rotate as given; adds
        exact_new_us and its ratios to the row's routes."""
        from fp4cache._cuda import varlen as cv

        g = cache.geometry
        P, rot = self.args.window, self.args.rotate
        win = self.window_of(cache, tab, lens, P) if P else None
        k = self.env.randn_bf16((q.shape[0], g.num_heads, g.head_dim), 17)
        v = self.env.randn_bf16((q.shape[0], g.num_heads, g.head_dim), 19)
        run = cv.make_varlen_run(cache.buffer, q, qsl, tab, lens, max_query_len=n, causal=True,
                                 geom=g, k_s=cache.pool.k_s, v_s=cache.pool.v_s,
                                 sm_scale=sm_scale, stats=cache.pool.stats,
                                 scratch=new_scratch(), window=win, rotate=rot, exact_new=True)

        def call():
            run(q, qsl, tab, lens, out, None, new_kv=(k, v))
        call()
        self.cp.cuda.Device().synchronize()
        t = self.time([call], batch=3)
        row.update(exact_new_us=t * 1e6, exact_new_vs_auto=t * 1e6 / row["varlen_us"])
        if "mma_us" in row:
            row["exact_new_vs_mma"] = t * 1e6 / row["mma_us"]
        for name in ("window_rot", "rot", "window"):
            if f"{name}_us" in row:  # the same cache options without new_kv
                row["exact_new_vs_same_options"] = t * 1e6 / row[f"{name}_us"]
                break
        log(f"   exact new tokens (P={P}, rotate={rot}): {t * 1e6:.1f} us = "
            f"{row['exact_new_vs_auto']:.3f}x auto"
            + (f", {row['exact_new_vs_mma']:.3f}x mma" if "mma_us" in row else "")
            + (f", {row['exact_new_vs_same_options']:.3f}x same options"
               if "exact_new_vs_same_options" in row else ""))

    def prefill_shapes(self):
        """The prefill row at head_dim 64 and 256, a plain 8,192-token prefill, and four
        sequences of 4,096 tokens with a 2,048-token chunk each."""
        for kw in (dict(D=64), dict(D=256), dict(n=8192, cached=0),
                   dict(B=4, n=2048, cached=2048)):
            self.prefill(**kw)
            self.release()

    def mixed(self, Hq=32, H=8, D=128, T=16, seed=9):
        cp = self.cp
        rng = np.random.default_rng(seed)
        dec = [int(x) for x in rng.integers(4096, 32769, 32)]
        chunk, at = 1024, 16384
        lens = dec + [at + chunk]
        B = len(lens)
        log(f"\n== mixed: 32 decoding ({min(dec)}..{max(dec)}) + one {chunk}-token chunk at "
            f"{at}")
        cache, tab, lensd, _ = self.cache_for(B, lens, H, D, T, seed)
        sm_scale = 1.0 / np.sqrt(D)
        ns = [1] * 32 + [chunk]
        qsl = cp.asarray(np.concatenate([[0], np.cumsum(ns)]).astype(np.int32))
        N = sum(ns)
        q = self.env.randn_bf16((N, Hq, D), seed + 1)
        out = cp.empty((N, Hq, D), dtype=BF16)
        call = self.varlen(cache, q, qsl, tab, lensd, out, new_scratch(), sm_scale, chunk)
        call()
        cp.cuda.Device().synchronize()
        t = self.time([call], batch=5)
        rel = self.check(cache, tab, lensd, qsl, q, out, sm_scale, H, D, T)
        # the two kinds called separately: decode_attention over the 32, varlen over the chunk
        od = cp.empty((32, Hq, D), dtype=BF16)
        dcall = self.fused(cache, q[:32], tab[:32], lensd[:32], od, new_scratch(), sm_scale)
        oc = cp.empty((chunk, Hq, D), dtype=BF16)
        ccall = self.varlen(cache, q[32:], qsl[32:] - 32, tab[32:], lensd[32:], oc, new_scratch(),
                            sm_scale, chunk)
        dcall()
        ccall()
        td = self.time([dcall], batch=5)
        tc = self.time([ccall], batch=5)
        ts = td + tc  # (time_calls with several calls times each of them, not the sum)
        # the 32 decoding sequences alone through this kernel (n = 1: the 16-row kernel)
        ov = cp.empty((32, Hq, D), dtype=BF16)
        vcall = self.varlen(cache, q[:32], qsl[:33], tab[:32], lensd[:32], ov, new_scratch(),
                            sm_scale, 1)
        vcall()
        tv = self.time([vcall], batch=5)
        row = dict(case="mixed 32 decode + 1024 chunk", varlen_us=t * 1e6,
                   separate_us=ts * 1e6, vs_separate=t / ts, decode_part_us=td * 1e6,
                   chunk_part_us=tc * 1e6, decode_part_varlen_us=tv * 1e6,
                   max_row_rel_err=rel, check="ok" if rel <= 1e-2 else "FAIL")
        log(f"   one call {t * 1e6:.1f} us; separately {ts * 1e6:.1f} us ({t / ts:.2f}x): "
            f"decode_attention {td * 1e6:.1f} us + chunk {tc * 1e6:.1f} us; the 32 decodes "
            f"through varlen {tv * 1e6:.1f} us; err {rel:.1e} ({row['check']})")
        try:
            sd, sc = self.sdpa_mixed(cache, tab, dec, at + chunk, q, chunk, sm_scale, Hq, H, D,
                                     T)
            row.update(sdpa_decodes_us=sd * 1e6, sdpa_chunk_us=sc * 1e6,
                       sdpa_us=(sd + sc) * 1e6, speedup_vs_sdpa=(sd + sc) / t)
            log(f"   SDPA: decodes {sd * 1e6:.1f} us + chunk {sc * 1e6:.1f} us = "
                f"{(sd + sc) * 1e6:.1f} us; one call {(sd + sc) / t:.2f}x faster")
        except Exception as e:
            log(f"   SDPA for the mixed work failed ({type(e).__name__}: {e})")
        self.variants(row, cache, tab, lensd, lambda w, r: self.varlen(
            cache, q, qsl, tab, lensd, out, new_scratch(), sm_scale, chunk, window=w,
            rotate=r), 5)
        self.rows.append(row)
        self.write()

    def sdpa_mixed(self, cache, tab, dec, chunk_len, q, chunk, sm_scale, Hq, H, D, T):
        """(decodes, chunk) seconds of the best SDPA doing the mixed row's work over bf16
        K/V: the decodes either as one padded batch with a key mask (K/V expanded to the
        query heads) or one call per sequence (its exact length, GQA), whichever is faster;
        the chunk with ``causal_lower_right`` (sdpa_causal)."""
        torch, cp = self.torch, self.cp
        from torch.nn.attention import SDPBackend, sdpa_kernel
        F = torch.nn.functional
        tabh = cp.asnumpy(tab)
        g = Hq // H
        nd, Lmax = len(dec), max(dec)

        def kv(b, L):  # (H, L, D) bf16 K and V of sequence b
            kd, vd = cache.gather_dequant(cp.asarray(tabh[b, :-(-L // T)]))
            kt = self.env.to_torch(kd)[:L].permute(1, 0, 2)
            vt = self.env.to_torch(vd)[:L].permute(1, 0, 2)
            return kt, vt

        qt = self.env.to_torch(q)
        k4 = torch.zeros((nd, H, Lmax, D), dtype=torch.bfloat16, device=qt.device)
        v4 = torch.zeros_like(k4)
        for b, L in enumerate(dec):
            k4[b, :, :L], v4[b, :, :L] = kv(b, L)
        qd = qt[:nd].unsqueeze(2)  # (nd, Hq, 1, D)
        lens = torch.tensor(dec, device=qt.device)
        mask = (torch.arange(Lmax, device=qt.device)[None, :] < lens[:, None])[:, None, None]
        ke, ve = k4.repeat_interleave(g, dim=1), v4.repeat_interleave(g, dim=1)
        cands = []
        for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                   SDPBackend.EFFICIENT_ATTENTION):
            def padded(be=be):
                with sdpa_kernel([be]):
                    F.scaled_dot_product_attention(qd, ke, ve, attn_mask=mask, scale=sm_scale)

            def per_seq(be=be):
                with sdpa_kernel([be]):
                    for b, L in enumerate(dec):
                        F.scaled_dot_product_attention(qd[b:b + 1], k4[b:b + 1, :, :L],
                                                       v4[b:b + 1, :, :L], scale=sm_scale,
                                                       enable_gqa=True)
            for name, call in (("padded + mask", padded), ("per sequence", per_seq)):
                tt = self.try_time(call, f"sdpa decodes {name} {be.name}")
                if tt is not None:
                    cands.append(tt)
        kc, vc = kv(nd, chunk_len)
        q4 = qt[nd:nd + chunk].transpose(0, 1)[None].contiguous()  # (1, Hq, chunk, D)
        best = self.sdpa_causal(q4, kc.repeat_interleave(g, dim=0)[None].contiguous(),
                                vc.repeat_interleave(g, dim=0)[None].contiguous(), sm_scale)
        return min(cands), best[0]

    def host(self, B=8, L=4096, n=4, Hq=32, H=8, D=128, T=16, seed=13):
        cp = self.cp
        log(f"\n== host time: n={n} call with max_query_len, B={B} x {L}")
        cache, tab, lensd, _ = self.cache_for(B, [L] * B, H, D, T, seed)
        q = self.env.randn_bf16((B * n, Hq, D), seed)
        qsl = cp.arange(B + 1, dtype=cp.int32) * n
        out = cp.empty((B * n, Hq, D), dtype=BF16)
        from fp4cache._cuda import varlen as cv
        call = self.varlen(cache, q, qsl, tab, lensd, out, new_scratch(), 1 / np.sqrt(D), n)
        call()
        # what a front end keeps for its hot path: the prepared runner (one launch)
        runner = cv.varlen_runner(cache.buffer, q, qsl, tab, lensd, max_query_len=n,
                                     causal=True, geom=cache.geometry, k_s=cache.pool.k_s,
                                     v_s=cache.pool.v_s, sm_scale=1 / np.sqrt(D),
                                     stats=cache.pool.stats, scratch=new_scratch())

        def hot():
            runner(q, qsl, tab, lensd, out, None)
        hot()
        tr = self.env.host_per_call(hot, 2000, rounds=40)
        empty = self.env.empty_kernel
        te = self.env.host_per_call(lambda: empty((1,), (1,), ()), 2000, rounds=40)
        tb = self.env.host_per_call(call, 2000, rounds=40)
        row = dict(case=f"host n={n}", backend_host_us=tb * 1e6, runner_host_us=tr * 1e6,
                   empty_launch_us=te * 1e6, host_ratio=tr / te, check="-")
        if hasattr(cache, "attention"):
            def public():
                cache.attention(q, qsl, tab, lensd, max_query_len=n, out=out)
            try:
                public()
                th = self.env.host_per_call(public, 2000, rounds=40)
                row.update(host_us=th * 1e6, host_ratio=th / te)
            except Exception as e:
                log(f"   public method failed: {type(e).__name__}: {e}")
        log(f"   backend attention() {tb * 1e6:.2f} us/call, prepared runner {tr * 1e6:.2f} us"
            f", public {row.get('host_us', float('nan')):.2f} us, empty RawKernel "
            f"{te * 1e6:.2f} us (ratio {row['host_ratio']:.2f}x)")
        self.rows.append(row)
        self.write()

    def run(self):
        self.copy()
        steps = [("spec", lambda: self.spec([2, 4, 8])), ("prefill", self.prefill),
                 ("prefill_shapes", self.prefill_shapes), ("mixed", self.mixed),
                 ("host", self.host)]
        for name, fn in steps:
            if self.args.only and name not in self.args.only:
                continue
            try:
                fn()
            except Exception as e:
                import traceback
                log(f"!! {name} failed: {type(e).__name__}: {e}\n"
                    f"{traceback.format_exc(limit=6)}")
            self.release()
        self.write()

    def write(self):
        if self.args.out:
            Path(self.args.out).write_text(json.dumps(
                dict(copy_gbps=self.copy_gbps, rows=self.rows, targets=TARGETS,
                     date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())), indent=1,
                default=str))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--only", nargs="*", default=None,
                    help="spec, prefill, prefill_shapes, mixed, host")
    ap.add_argument("--route", default="auto", choices=K.PREFILL_ROUTES,
                    help="the prefill route (fp4cache._kernels.PREFILL_ROUTES): auto (the "
                         "wgmma kernel on sm_90; the prefill rows time mma beside it) or mma")
    ap.add_argument("--window", type=int, default=0, metavar="P",
                    help="also time each row with the last P pages in the exact window")
    ap.add_argument("--rotate", action="store_true",
                    help="also time each row with the q rotation (with --window: both)")
    ap.add_argument("--max-row-warps", type=int, default=None, metavar="MW",
                    help="experiment: launch no varlen kernel of more row warps than MW "
                         "(e.g. 4: the 64-row kernel for long sequences instead of _r128)")
    args = ap.parse_args(argv)
    if args.max_row_warps is not None:
        from fp4cache import _abi

        _abi.VARLEN_ROW_WARPS = tuple(mw for mw in _abi.VARLEN_ROW_WARPS
                                      if mw <= args.max_row_warps)
    VarlenBench(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
