"""Store and gather with the Hadamard rotation and the exact window against the plain ones
(``docs/window.md``): device time per call (``timing.Env.time_calls``: rotating input
sets, so L2 holds none of the large ones) and the ratio to the plain cache's, for a decode
step and a prefill-sized store, and the window functions (map_window of a page per
sequence, copy_blocks with both ends mapped).

    python bench/window_store.py [--heads 8] [--head-dim 128] [--json out.json]

The issue's target: a store with rotation and/or window within 10% of the plain store.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import BF16, Env, bind  # noqa: E402

#: name -> (cache options, pages mapped: "ring" the newest 4 of each of 8 sequences of 128
#: pages, "all" every page of the pool's first 1024, i.e. every stored token), gather rows
VARIANTS = {"plain": ({}, None, True),
            "rot": (dict(rotation="hadamard"), None, True),
            "win": (dict(window_pages=4), "ring", True),
            "win-all": (dict(window_pages=4), "all", True),
            "rot+win": (dict(rotation="hadamard", window_pages=4), "ring", True),
            "rot+win-all": (dict(rotation="hadamard", window_pages=4), "all", True)}
RING = np.array([b for b in range(1024) if b % 128 >= 124], np.int32)  # 32 pages


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", type=str, default="")
    a = ap.parse_args(argv)
    import cupy as cp

    import fp4cache

    env = Env(True)
    H, D, T = a.heads, a.head_dim, a.block_size
    num_blocks = 8192
    rows = []
    sizes = {"decode 64 tok": 64, "decode 256 tok": 256, "prefill 16384 tok": 16384}
    for rule in ("static6", "4over6"):
        base = {}
        for name, (opts, mapped, pair) in VARIANTS.items():
            opts = dict(opts)
            if mapped is not None:
                opts["window_slots"] = 1024 if mapped == "all" else len(RING)
            cache = fp4cache.PagedKVCache(num_blocks, T, H, D, device="cuda", scale_rule=rule,
                                          k_scale=0.02, v_scale=0.02, **opts)
            if mapped is not None:
                pages = np.arange(1024, dtype=np.int32) if mapped == "all" else RING
                cache.map_window(cp.asarray(pages), cp.arange(len(pages), dtype=cp.int32))
            ring_slots = (RING[:, None] * T + np.arange(T)).reshape(-1)
            for label, n in sizes.items():
                sets = []
                nsets = 4 if n >= 4096 else 8
                for j in range(nsets):
                    rng = np.random.default_rng(j)
                    k = cp.asarray(rng.standard_normal((n, H, D), dtype=np.float32).astype(BF16))
                    v = cp.asarray(rng.standard_normal((n, H, D), dtype=np.float32).astype(BF16))
                    # decode: tokens in the newest pages (the ring); prefill: all 1024 pages
                    pool = ring_slots if n <= len(ring_slots) else np.arange(1024 * T)
                    s = cp.asarray(rng.permutation(pool)[:n].astype(np.int64))
                    sets.append((s, k, v))
                calls = [bind(cache.store, s, k, v) for s, k, v in sets]
                t = env.time_calls(calls, reps=a.reps, batch=4 * len(calls))["median_s"]
                key = (label, "store")
                if name == "plain":
                    base[key] = t
                rows.append(dict(op="store", rule=rule, variant=name, size=label,
                                 us=t * 1e6, ratio=t / base[key]))
                print(f"store {rule:8s} {label:18s} {name:8s} {t * 1e6:8.2f} us  "
                      f"{t / base[key]:.3f}x plain", flush=True)
            if rule == "static6" and pair:
                for npages in (8, 512):
                    ids = [cp.asarray(np.random.default_rng(j).permutation(1024)[:npages]
                                      .astype(np.int32)) for j in range(4)]
                    calls = [bind(cache.gather_dequant, b) for b in ids]
                    t = env.time_calls(calls, reps=a.reps, batch=4 * len(calls))["median_s"]
                    key = (npages, "gather")
                    if name == "plain":
                        base[key] = t
                    label = f"gather {npages} pages"
                    rows.append(dict(op="gather", rule=rule, variant=name, size=label,
                                     us=t * 1e6, ratio=t / base[key]))
                    print(f"gather {label:27s} {name:8s} {t * 1e6:8.2f} us  "
                          f"{t / base[key]:.3f}x plain", flush=True)
            if cache.window is not None and rule == "static6" and mapped == "all":
                for npages in (64, 512):
                    b = cp.arange(npages, dtype=cp.int32)
                    s = cp.arange(npages, dtype=cp.int32)
                    t = env.time_calls([bind(cache.map_window, b, s, validate=False)],
                                       reps=a.reps, batch=8)["median_s"]
                    rows.append(dict(op="map_window", rule=rule, variant=name,
                                     size=f"{npages} pages", us=t * 1e6))
                    print(f"map_window {npages} pages {name:8s} {t * 1e6:8.2f} us", flush=True)
                    src = cp.arange(npages, dtype=cp.int32)
                    dst = cp.arange(npages, 2 * npages, dtype=cp.int32)
                    t = env.time_calls([bind(cache.copy_blocks, src, dst, validate=False)],
                                       reps=a.reps, batch=8)["median_s"]
                    rows.append(dict(op="copy_blocks", rule=rule, variant=name,
                                     size=f"{npages} pages", us=t * 1e6))
                    print(f"copy_blocks {npages} pages (window) {name:8s} {t * 1e6:8.2f} us",
                          flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(H=H, D=D, T=T, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
