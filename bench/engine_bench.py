"""A decode step of an engine through fp4cache: ``L`` layers, each storing its new K/V and
attending, by the per-call API (``PagedKVCache.store`` + ``PagedKVCache.attention``) and by
the engine API (``AttentionPlan.plan`` once per step, ``AttentionPlan.run`` per layer), with
CuPy arrays and with PyTorch tensors (no ``out=``, PyTorch's stream).

Run on the GPU (from the repository root)::

    PYTHONPATH=. python3 bench/engine_bench.py --out $OUT/engine.json

Each row gives the GPU time of a whole step (events around ``L`` layers, median of
``--reps``) and the host time per layer (wall time of back-to-back steps without
synchronization, divided by ``L``: what a step costs the CPU when the GPU keeps up).  The
``per-call`` rows run on any tree that has ``PagedKVCache.attention``; the plan rows need
``fp4cache.AttentionPlan``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import fp4cache  # noqa: E402


def _step_metadata(B: int, ctx: int, T: int, pages: int):
    lens = np.full(B, ctx, np.int32)
    tables = (np.arange(B)[:, None] * pages + np.arange(pages)).astype(np.int32)
    slots = (tables[np.arange(B), (ctx - 1) // T].astype(np.int64) * T + (ctx - 1) % T)
    return np.arange(B + 1, dtype=np.int32), lens, tables, slots


def _time(step, reps: int, layers: int) -> tuple[float, float]:
    import cupy

    for _ in range(3):
        step()
    cupy.cuda.get_current_stream().synchronize()
    gpu = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        step()
        b.record()
        b.synchronize()
        gpu.append(cupy.cuda.get_elapsed_time(a, b) * 1e3)
    n = max(3, reps)
    cupy.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - t0) / n / layers * 1e6
    cupy.cuda.get_current_stream().synchronize()
    return statistics.median(gpu), host


def run(B: int, ctx: int, layers: int, reps: int) -> list[dict]:
    import cupy
    import ml_dtypes

    H, Hq, D, T = 8, 32, 128, 16
    pages = -(-ctx // T)
    caches = [fp4cache.PagedKVCache(B * pages, T, H, D, scale_rule="4over6", k_scale=0.01,
                                    v_scale=0.01, device="cuda", max_batch_size=B,
                                    max_seq_len=pages * T, num_query_heads=Hq)
              for _ in range(layers)]
    qsl, lens, tables, slots = _step_metadata(B, ctx, T, pages)
    bf16 = ml_dtypes.bfloat16
    q = cupy.asarray(np.random.default_rng(0).standard_normal((B, Hq, D)).astype(bf16))
    k = cupy.asarray(np.random.default_rng(1).standard_normal((B, H, D)).astype(bf16))
    out = cupy.empty_like(q)
    d_qsl, d_lens, d_tab, d_slots = (cupy.asarray(a) for a in (qsl, lens, tables, slots))
    rows = []

    def per_call():
        for c in caches:
            c.store(d_slots, k, k)
            c.attention(q, d_qsl, d_tab, d_lens, max_query_len=1, out=out)

    cell = f"B={B} x {ctx}, {layers} layers"
    g, h = _time(per_call, reps, layers)
    rows.append({"case": cell, "impl": "fp4cache per-call store + attention", "step_us": g,
                 "host_us_per_layer": h})
    if hasattr(fp4cache, "AttentionPlan"):
        plan = fp4cache.AttentionPlan(B, B, pages, device="cuda")
        plan.plan(qsl, lens, tables, slots, max_query_len=1)

        def planned():
            for c in caches:
                plan.run(c, q, k, k, out=out)

        g, h = _time(planned, reps, layers)
        rows.append({"case": cell, "impl": "fp4cache plan.run (CuPy, out=)", "step_us": g,
                     "host_us_per_layer": h})
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and torch.cuda.is_available():
            tq, tk = torch.from_dlpack(q), torch.from_dlpack(k)

            def planned_torch():
                for c in caches:
                    plan.run(c, tq, tk, tk)

            g, h = _time(planned_torch, reps, layers)
            rows.append({"case": cell, "impl": "fp4cache plan.run (torch, no out=)",
                         "step_us": g, "host_us_per_layer": h})
    return rows


def soak(steps: int, seed: int = 3) -> list[dict]:
    """Random steps through one plan and two layers: B in [1, 64] sequences of 1-8 query
    tokens (decode, verification) or one 1-512-token chunk, contexts of 1-4,096 tokens; the
    CuPy pool's bytes, the caches' ``nbytes`` and the launches the plan keeps, four times."""
    import cupy
    import ml_dtypes

    H, Hq, D, T, pages = 8, 32, 128, 16, 256
    rng = np.random.default_rng(seed)
    caches = [fp4cache.PagedKVCache(64 * pages, T, H, D, scale_rule="4over6", k_scale=0.01,
                                    v_scale=0.01, device="cuda", max_batch_size=64,
                                    max_seq_len=pages * T, num_query_heads=Hq)
              for _ in range(2)]
    plan = fp4cache.AttentionPlan(64, 64 * 8 + 512, pages, device="cuda")
    bf16 = ml_dtypes.bfloat16
    q_all = cupy.asarray(rng.standard_normal((1024, Hq, D)).astype(bf16))
    k_all = cupy.asarray(rng.standard_normal((1024, H, D)).astype(bf16))
    pool = cupy.get_default_memory_pool()
    rows = []
    for step in range(1, steps + 1):
        B = int(rng.integers(1, 65))
        n = (np.full(B, int(rng.integers(1, 9))) if rng.random() < 0.8
             else np.concatenate([[int(rng.integers(1, 513))], np.ones(B - 1, np.int64)]))
        ctx = rng.integers(n, 4097)
        tables = (np.arange(B)[:, None] * pages + np.arange(pages)).astype(np.int32)
        pos = np.concatenate([np.arange(c - m, c) for c, m in zip(ctx, n)])
        seq = np.repeat(np.arange(B), n)
        slots = tables[seq, pos // T].astype(np.int64) * T + pos % T
        qsl = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
        plan.plan(qsl, ctx.astype(np.int32), tables, slots, max_query_len=int(n.max()))
        N = int(qsl[-1])
        for c in caches:
            plan.run(c, q_all[:N], k_all[:N], k_all[:N])
        if step % max(1, steps // 4) == 0:
            cupy.cuda.get_current_stream().synchronize()
            rows.append({"step": step, "pool_used_mib": pool.used_bytes() / 2**20,
                         "pool_held_mib": pool.total_bytes() / 2**20,
                         "cache_nbytes_mib": sum(c.nbytes for c in caches) / 2**20,
                         "plan_launches": len(plan._runs)})
            print(f"soak step {step}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float)
                                                     else f"{k} {v}"
                                                     for k, v in rows[-1].items()
                                                     if k != "step"), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="1x4096,8x32768,32x8192", help="B x context, ...")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--soak", type=int, default=0,
                    help="also this many random-shape steps through one plan (memory stays "
                         "flat after warm-up)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    rows = []
    for cell in a.cells.split(","):
        B, ctx = (int(x) for x in cell.split("x"))
        for r in run(B, ctx, a.layers, a.reps):
            rows.append(r)
            print(f"{name} | {r['case']:<26} | {r['impl']:<40} | step {r['step_us']:9.1f} us"
                  f" | host {r['host_us_per_layer']:7.1f} us/layer", flush=True)
    soak_rows = soak(a.soak) if a.soak else []
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": name, "rows": rows, "soak": soak_rows},
                                          indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
