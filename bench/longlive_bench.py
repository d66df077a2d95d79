"""``bench.py``'s LongLive sections: ``longlive`` (``fp4cache.longlive.dequantize``, the list
API, and ``dequantize_pool`` at the seed shape and with many small blocks, checked bit for
bit against the NumPy backend) and ``longlive-list`` (the list API's cost per call as the
block count grows, against the seed's host protocol).  Methods of ``bench.Bench``.
"""

from __future__ import annotations

import time

import numpy as np
from suite import TARGETS
from timing import BF16, Row, bind, same_bf16


class LongLiveBench:
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
        calls = [bind(longlive.dequantize, *lst, H, Tb, scale_rule="4over6") for lst in lists]
        self.timed("longlive", case, "fp4cache dequantize", calls, nbytes,
                   batch=2 * len(calls), frac_target=TARGETS["longlive"],
                   note="list API: repeat call (launch and pointer tables reused)")
        calls = [bind(longlive.dequantize_pool, values, sf, amax, ids[i], H, Tb, out=outs[i],
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
            same = float(np.mean(same_bf16(env.asnumpy(got), ref)))
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
        """The list API's cost per call as the block count grows."""
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
        from fp4cache import _hotpath, longlive

        env = self.env
        values, sf, amax, ids, outs, lists, nbytes = self._longlive_inputs(H, D, Tb, nb, 41)
        case = f"LongLive list API H={H} Tb={Tb} x{nb}"
        self._log_longlive_sizes(case, H, D, Tb, nb)
        if env.gpu:  # the first call of a list: checks, pointer tables, one copy
            firsts = []
            for _ in range(3):
                _hotpath.LONGLIVE_LISTS.clear()
                env.sync()
                t0 = time.perf_counter()
                longlive.dequantize(*lists[0], H, Tb, scale_rule="4over6")
                env.sync()
                firsts.append(time.perf_counter() - t0)
            self.add(Row("longlive", case, "fp4cache dequantize (list), first call",
                         time_s=float(np.median(firsts)),
                         note="host + device, synchronized: checks, pointer tables, copy"))
        row_list = self.timed("longlive", case, "fp4cache dequantize (list)",
                              [bind(longlive.dequantize, *lst, H, Tb, scale_rule="4over6")
                               for lst in lists],
                              nbytes, batch=4, reps=reps,
                              note="hot path: same block arrays as a checked call"
                              if env.gpu else "")
        self.timed("longlive", case, "fp4cache dequantize_pool",
                   [bind(longlive.dequantize_pool, values, sf, amax, ids[i], H, Tb,
                          out=outs[i], scale_rule="4over6") for i in range(2)],
                   nbytes + nb * 4, batch=4, reps=reps)
        if env.gpu:
            from fp4cache import _cuda as cb  # imports CuPy: GPU runs only

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
                              [bind(seed_protocol, lst) for lst in lists], nbytes, batch=4,
                              reps=reps, note="3 synchronous pointer-table copies per call")
            if seed is not None and row_list is not None and row_list.time_s:
                sp = seed.time_s / row_list.time_s
                seed.extra["fp4cache_speedup"] = sp
                self.log(f"     list API is {sp:.2f}x faster than the seed's host protocol")
            ref = longlive.dequantize(*lists[0], H, Tb, scale_rule="4over6")
            same = float(cp.mean(same_bf16(seed_protocol(lists[0]), ref)))
            self.checks.append(dict(check=f"{case}: seed protocol vs list API", same=same))
            n = 200 if nb <= 256 else 50
            t = env.host_per_call(bind(longlive.dequantize, *lists[0], H, Tb,
                                       scale_rule="4over6"), n)
            self.add(Row("host", "host time per call",
                         f"fp4cache LongLive dequantize (list) {nb} blocks", time_s=t,
                         extra=dict(calls=n)))
            t = env.host_per_call(bind(seed_protocol, lists[0]), n)
            self.add(Row("host", "host time per call",
                         f"seed host protocol {nb} blocks", time_s=t, extra=dict(calls=n)))
        del values, sf, amax, outs, lists
        env.free()
