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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="1x4096,8x32768,32x8192", help="B x context, ...")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
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
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
