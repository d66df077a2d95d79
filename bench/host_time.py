"""``bench.py``'s ``host`` section: host wall time per call of back-to-back calls (no
synchronization) against an empty ``cupy.RawKernel`` launch measured in the same run:
fp4cache's store of 64 tokens (the target: at most 2x), gather of 4 pages, the two LongLive
decode APIs and torch eager's store of 64 tokens.  Methods of ``bench.Bench``.
"""

from __future__ import annotations

import numpy as np
from suite import TARGETS
from timing import BF16, Row


class HostTime:
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
