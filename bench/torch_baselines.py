"""``bench.py``'s PyTorch baselines: ``torch_reference.py`` (the same work written in
PyTorch from the contract) timed eager and under ``torch.compile`` on the same inputs as
fp4cache's large store and gather, with fp4cache's speed-up and the agreement checks;
torch eager's decode-step store; and ``verify_reference`` (``bench.py
--verify-reference``), which checks ``torch_reference.py`` against fp4cache's NumPy backend
on the CPU.  Methods of ``bench.Bench``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from suite import K_SCALE, TARGETS, V_SCALE
from timing import BF16, Env, Row, bind, rel_err, same_bf16


class TorchBaselines:
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
        calls = [bind(fn, target, *s["t"], rule=rule, **geo, **sc) for s in self.sets]
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
        rel = rel_err(env, t, f)
        chk.update(decoded_rel_err_vs_fp4cache=rel, quant_rel_err_fp4cache=rel_err(env, f, x),
                   quant_rel_err_torch=rel_err(env, t, x),
                   decoded_bits_identical=float(np.mean([float(same_bf16(p, q).mean())
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
        calls = [bind(fn, pool, *g["t"], **kw) for g in self.gsets]
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
        same = float(np.mean([float(same_bf16(p, q).mean())
                              for p, q in ((fk, g["ok"]), (fv, g["ov"]))]))
        rel = rel_err(env, [env.bf16_to_f32(g["ok"]), env.bf16_to_f32(g["ov"])],
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
            # exceed HBM; the gather's target is its fraction of copy alone
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

    # -- torch eager's decode-step store (run by the host section) -----------------------
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
