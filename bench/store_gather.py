"""``bench.py``'s fp4cache store and gather sections: ``sanity`` (GPU against the NumPy
backend, bit for bit), ``large`` (store of N tokens and gather of n pages, with L2 kept out
by rotating input sets) and ``decode`` (decode-step sizes, L2-resident).  Methods of
``bench.Bench``; the inputs and page pools come from ``suite.Suite.sec_setup``.
"""

from __future__ import annotations

import numpy as np
from suite import TARGETS
from timing import BF16, bind, mark, same_bf16


class StoreGather:
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
                same_bf16(env.asnumpy(gk), rk).ravel(), same_bf16(env.asnumpy(gv), rv).ravel()
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
            calls = [bind(cache.store, s["slots"], s["k"], s["v"]) for s in self.sets]
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
                             f"(target <= {lim}x): {mark(ratio <= lim)}")
            calls = [bind(cache.store, s["slots"], s["k"], s["v"], unique_slots=False)
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
            calls = [bind(cache.gather_dequant, g["ids"], out=(g["ok"], g["ov"]))
                     for g in self.gsets]
            self.timed("gather", f"gather {n} pages {rule}", "fp4cache", calls, gather_bytes,
                       batch=2 * len(calls), frac_target=TARGETS[f"gather {rule}"],
                       note="same kernel for both rules" if rule == "4over6" else "")

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
                calls.append(bind(cache.store, slots, s["k"][off:off + n_tok],
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
                calls.append(bind(cache.gather_dequant, ids, out=(ok, ov)))
            nbytes = n * 4 + n * 2 * H * T * (D // 2 + S) + 2 * n * T * H * D * 2
            self.timed("decode", f"decode gather {n} pages", "fp4cache", calls, nbytes,
                       batch=40, note="L2-resident")
