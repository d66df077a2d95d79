"""Soak benchmark: a server's call pattern for many steps on one cache, device
memory and time per step over time, printed as a table.

Every step, shapes drawn at random: a ``store`` of 1-4,095 tokens, a ``decode_attention``
of B in [1, 64] sequences over block tables of 1-256 columns (32 query heads, GQA group 4,
bf16), a ``gather_dequant`` of 1-300 pages; on a cache of 8,192 pages x 16 tokens x 8
heads x 128.  Inputs are slices of arrays made once (the block table and sequence lengths
of a step are one small device copy each), so the time is the library's.

Run on the GPU (from the repository root)::

    PYTHONPATH=. python3 bench/soak_bench.py --steps 10000 --out $OUT/soak.json
    PYTHONPATH=. python3 bench/soak_bench.py --steps 10000 --no-hints   # grow mode

Columns, per interval of ``--every`` steps: the CuPy pool's used and held bytes and
``cache.nbytes`` (MiB) at the interval's end, the workspace's part of it, the plans kept,
the host wall time per step (the interval between two device synchronizations, over its
steps) and the device time per step (CUDA events around the interval).  ``--buckets N``
draws the shapes from N fixed ones instead (a CUDA-graph server's padded batch sizes):
then most calls take the prepared hot path.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

NB, T, H, D, HQ = 8192, 16, 8, 128, 32
MAX_TOKENS, MAX_B, MAX_W, MAX_PAGES = 4095, 64, 256, 300
MiB = 2**20


def log(msg: str) -> None:
    print(msg, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--every", type=int, default=1_000, help="steps per table row")
    ap.add_argument("--no-hints", action="store_true",
                    help="no workspace hints: the workspace grows to the largest call")
    ap.add_argument("--buckets", type=int, default=0,
                    help="draw shapes from this many fixed ones (0: a new draw each step)")
    ap.add_argument("--seed", type=int, default=26)
    ap.add_argument("--out", type=Path, default=None, help="JSON file for the rows")
    args = ap.parse_args(argv)

    import cupy as cp
    import ml_dtypes

    import fp4cache

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(args.seed)
    rs = cp.random.RandomState(args.seed)

    def randn_bf16(shape):
        x = rs.standard_normal(shape, dtype=np.float32)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(bf16)

    hints = {} if args.no_hints else dict(max_batch_size=MAX_B, max_seq_len=MAX_W * T,
                                          num_query_heads=HQ)
    scale = 4.5 / (6 * 448)
    cache = fp4cache.PagedKVCache(NB, T, H, D, k_scale=scale, v_scale=scale, device="cuda",
                                  **hints)
    log(repr(cache))
    # inputs made once; each step takes slices
    k_all, v_all = randn_bf16((MAX_TOKENS, H, D)), randn_bf16((MAX_TOKENS, H, D))
    slots_all = cp.asarray(rng.permutation(NB * T).astype(np.int64))
    q_all = randn_bf16((MAX_B, HQ, D))
    tables_all = cp.asarray(rng.integers(0, NB, (MAX_B, MAX_W)).astype(np.int32))
    lens_all = cp.asarray(rng.random(MAX_B).astype(np.float32))
    blocks_all = cp.asarray(rng.integers(0, NB, MAX_PAGES).astype(np.int32))

    def draw():
        return (int(rng.integers(1, MAX_TOKENS + 1)), int(rng.integers(1, MAX_B + 1)),
                int(rng.integers(1, MAX_W + 1)), int(rng.integers(1, MAX_PAGES + 1)))

    fixed = [draw() for _ in range(args.buckets)]

    def step(i):
        n, B, W, m = fixed[i % len(fixed)] if fixed else draw()
        off = int(rng.integers(0, NB * T - n + 1))
        cache.store(slots_all[off:off + n], k_all[:n], v_all[:n])
        tab = cp.ascontiguousarray(tables_all[:B, :W])
        lens = (lens_all[:B] * (W * T + 1)).astype(np.int32)
        cache.decode_attention(q_all[:B], tab, lens)
        cache.gather_dequant(blocks_all[:m])

    pool = cp.get_default_memory_pool()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    rows = []
    header = ("| steps | pool used MiB | pool held MiB | cache.nbytes MiB | workspace MiB "
              "| plans | host ms/step | device ms/step |")
    log(header)
    log("|" + "---|" * 8)
    done = 0
    while done < args.steps:
        n = min(args.every, args.steps - done)
        cp.cuda.Device().synchronize()
        start.record()
        t0 = time.perf_counter()
        for i in range(done, done + n):
            step(i)
        end.record()
        end.synchronize()
        host = (time.perf_counter() - t0) / n
        dev = cp.cuda.get_elapsed_time(start, end) / 1e3 / n
        done += n
        row = dict(steps=done, pool_used=pool.used_bytes(), pool_held=pool.total_bytes(),
                   cache_nbytes=cache.nbytes, workspace=cache.workspace_nbytes,
                   plans=len(cache.pool.plans), host_s=host, device_s=dev)
        rows.append(row)
        log(f"| {done} | {row['pool_used'] / MiB:.1f} | {row['pool_held'] / MiB:.1f} "
            f"| {row['cache_nbytes'] / MiB:.1f} | {row['workspace'] / MiB:.2f} "
            f"| {row['plans']} | {host * 1e3:.3f} | {dev * 1e3:.3f} |")
    cache.check()
    first, last = rows[0], rows[-1]
    growth = (last["pool_used"] - first["pool_used"]) / MiB
    log(f"\npool used after the first interval -> the end: {growth:+.2f} MiB; "
        f"cache.nbytes {first['cache_nbytes'] / MiB:.1f} -> {last['cache_nbytes'] / MiB:.1f}"
        f" MiB; {repr(cache)}")
    if args.out is not None:
        dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
        args.out.write_text(json.dumps(dict(
            args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            device=dev["name"].decode() if isinstance(dev["name"], bytes) else str(dev["name"]),
            cupy=cp.__version__, cache=repr(cache), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
