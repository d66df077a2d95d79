"""Decode attention with the exact window and the rotation against the plain kernel, in
one run: the few-row kernel (``fp4cache._cuda.decode``) on the same pages, plain (no
window, no rotation), with a window of ``--pages`` mapped pages per sequence (random bf16
slot rows), with the window and the rotation, and with the rotation alone (and, with
``--baseline FILE``, the plain call of another decode_attention.cu: an A/B of the plain
path); the peer is the fastest torch SDPA backend (cuDNN, flash, efficient) over
contiguous bf16 K/V of the same tokens, timed in the same run (``--no-sdpa``: without).

Run on the GPU (from the repository root)::

    PYTHONPATH=. python3 bench/window_bench.py [--out $OUT/window.json]

Timing: timing.py's ``time_calls`` (spin kernel, a batch of calls between events, median
of reps); the variants are measured in turns (``--rounds``), each variant's time is the
median of its rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from timing import Env  # noqa: E402

CONFIGS = [(8, 32768), (64, 4096)]  # (batch, tokens per sequence)


def setup(env: Env, B: int, L: int, Hq: int, H: int, D: int, T: int, P: int, seed: int = 0):
    import fp4cache

    cp = env.cp
    pages = -(-L // T)
    nb = B * pages
    cache = fp4cache.PagedKVCache(nb, T, H, D, layout="HND", swizzle_v_scales=True,
                                  k_scale=4.0 / (6 * 448), v_scale=4.0 / (6 * 448),
                                  device="cuda")
    chunk = 1 << 16
    for i, a in enumerate(range(0, nb * T, chunk)):
        n = min(chunk, nb * T - a)
        cache.store(cp.arange(a, a + n, dtype=cp.int64), env.randn_bf16((n, H, D), 2 * i),
                    env.randn_bf16((n, H, D), 2 * i + 1))
    perm = np.random.default_rng(seed).permutation(nb).astype(np.int32)
    tab = perm.reshape(B, pages)
    # the window: the last P pages of every sequence in slots b * P + j
    win = env.randn_bf16((B * P, 2, T, H, D), 99).view(np.uint16)
    wmap = np.full(nb, -1, np.int32)
    for b in range(B):
        for j in range(P):
            wmap[tab[b, pages - 1 - j]] = b * P + j
    q = env.randn_bf16((B, Hq, D), 7)
    return cache, cp.asarray(tab), cp.asarray(np.full(B, L, np.int32)), win, \
        cp.asarray(wmap), q


def sdpa_peer(args, cache, tab, q, B, L, H, D):
    """(seconds, backend name) of the fastest SDPA backend over the same tokens as
    contiguous bf16 K/V (attention_bench.py's), or None where torch has none."""
    from attention_bench import AttnBench

    bench = AttnBench(argparse.Namespace(reps=args.reps))
    k4, v4 = bench.sdpa_kv(cache, tab, B, L, H, D)
    q4 = bench.env.to_torch(q).view(B, q.shape[1], 1, D)
    best = bench.sdpa_best(q4, k4, v4, 1 / np.sqrt(D))
    del k4, v4
    return None if best is None else (best[0], best[1].name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pages", type=int, default=3)
    ap.add_argument("--batch", type=int, default=20, help="calls between the events")
    ap.add_argument("--no-sdpa", action="store_true", help="leave out the SDPA peer")
    ap.add_argument("--baseline", default=None, metavar="FILE",
                    help="also time the plain call of this replacement of decode_attention.cu "
                         "in the kernel folder (e.g. the previous commit's, for an A/B)")
    args = ap.parse_args(argv)
    from fp4cache._cuda import decode as ca

    env = Env(gpu=True)
    cp = env.cp
    Hq, H, D, T, P = 32, 8, 128, 16, args.pages
    rows = []
    for B, L in CONFIGS:
        cache, tab, lens, win, wmap, q = setup(env, B, L, Hq, H, D, T, P)
        out = cp.empty_like(q)
        scratch = ca.new_scratch()
        kw = dict(geom=cache.geometry, k_s=cache.pool.k_s, v_s=cache.pool.v_s,
                  sm_scale=1 / np.sqrt(D), stats=cache.pool.stats, scratch=scratch)
        variants = {"plain": (None, False), "window": ((win, wmap, P), False),
                    "window+rotate": ((win, wmap, P), True), "rotate": (None, True)}
        files = {name: None for name in variants}
        if args.baseline:
            variants["baseline"] = (None, False)
            files["baseline"] = args.baseline
        calls = {}
        for name, (w, r) in variants.items():
            run = ca.decode_runner(cache.buffer, q, tab, lens, window=w, rotate=r,
                                   kernel_file=files[name], **kw)
            calls[name] = (lambda run=run, a=(q, tab, lens, out): run(*a, None))
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name].append(env.time_calls([call], reps=args.reps,
                                                  batch=args.batch)["median_s"])
        base = float(np.median(times["plain"]))
        sdpa = None if args.no_sdpa else sdpa_peer(args, cache, tab, q, B, L, H, D)
        for name in variants:
            t = float(np.median(times[name]))
            row = dict(B=B, L=L, Hq=Hq, H=H, D=D, T=T, window_pages=P, variant=name,
                       us=t * 1e6, vs_plain=t / base, rounds_us=[x * 1e6 for x in times[name]])
            peer = ""
            if sdpa is not None:
                row.update(sdpa_us=sdpa[0] * 1e6, sdpa_backend=sdpa[1],
                           speedup_vs_sdpa=sdpa[0] / t)
                peer = f"  {sdpa[0] / t:.2f}x SDPA {sdpa[1]}"
            rows.append(row)
            print(f"B={B:3d} L={L:6d} {name:14s} {t * 1e6:8.1f} us  x{t / base:.3f}{peer}  "
                  f"rounds {' '.join(f'{x * 1e6:.1f}' for x in times[name])}", flush=True)
        del cache, tab, lens, win, wmap, q, out, scratch
        env.free()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
