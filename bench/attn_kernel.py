"""Kernel-level experiments on the fused decode attention: one or more kernel sources
(the shipped ``kernels/decode_attention.cu`` and variants of it),
timed side by side in one process on the same cache, each checked against a float32
reference over ``gather_dequant`` values.

Run on the GPU (from the repository root)::

    PYTHONPATH=. python3 bench/attn_kernel.py                     # the shipped kernel
    PYTHONPATH=. python3 bench/attn_kernel.py --variant new=path/to/variant.cu \\
        --case 8,32768,32,128 --case 32,mixed,32,128

A variant is a full replacement of ``decode_attention.cu`` (same kernel names and
arguments); it is copied into ``kernels/`` under a temporary name for the run.  Under
``ncu`` use ``--reps 1 --no-check`` and ``-k regex:decode_attn``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from timing import BF16, Env  # noqa: E402


def parse_case(text: str):
    b, length, hq, d = text.split(",")
    B = int(b)
    if length == "mixed":
        lens = np.random.default_rng(3).integers(512, 32769, B)
    else:
        lens = np.full(B, int(length))
    return B, lens.astype(np.int64), int(hq), int(d)


def build(cp, B, lens, Hq, D, T=16, H=8, seed=0):
    import fp4cache

    pages = [-(-int(L) // T) for L in lens]
    nb = sum(pages)
    cache = fp4cache.PagedKVCache(nb, T, H, D, layout="HND", swizzle_v_scales=True,
                                  k_scale=4.0 / (6 * 448), v_scale=4.0 / (6 * 448),
                                  device="cuda")
    rng = np.random.default_rng(seed)
    perm = rng.permutation(nb).astype(np.int32)
    tab = np.full((B, max(pages)), -1, np.int32)
    o = 0
    for b, n in enumerate(pages):
        tab[b, :n] = perm[o:o + n]
        o += n
    env = Env(gpu=True)
    chunk = 1 << 16
    slots = (perm[:, None] * T + np.arange(T)[None, :]).reshape(-1)
    for s in range(0, nb * T, chunk):
        sl = cp.asarray(slots[s:s + chunk].astype(np.int64))
        n = int(sl.shape[0])
        k = env.randn_bf16((n, H, D), seed + s)
        v = env.randn_bf16((n, H, D), seed + s + 1)
        cache.store(sl, k, v)
    q = env.randn_bf16((B, Hq, D), seed + 7)
    return cache, cp.asarray(tab), cp.asarray(lens.astype(np.int32)), q


def reference(cp, cache, tab, lens, q, sm_scale):
    B, Hq, D = q.shape
    H, T = cache.num_heads, cache.block_size
    g = Hq // H
    tabh, lensh = cp.asnumpy(tab), cp.asnumpy(lens)
    qf = q.astype(cp.float32)
    outs = []
    for b in range(B):
        L = int(lensh[b])
        kd, vd = cache.gather_dequant(cp.asarray(tabh[b, :-(-L // T)]), dtype="float32")
        k = kd[:L].transpose(1, 0, 2)  # (H, L, D)
        v = vd[:L].transpose(1, 0, 2)
        qb = qf[b].reshape(H, g, D)
        s = cp.einsum("hgd,hld->hgl", qb, k) * sm_scale
        s -= s.max(axis=-1, keepdims=True)
        p = cp.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        outs.append(cp.einsum("hgl,hld->hgd", p, v).reshape(Hq, D))
    return cp.stack(outs)


def run_case(cp, ca, K, env, case, variants, args) -> None:
    """Build one case's cache and time every variant on it (one line each)."""
    B, lens, Hq, D = parse_case(case)
    cache, tab, lensd, q = build(cp, B, lens, Hq, D)
    sm_scale = 1.0 / np.sqrt(D)
    ref = None if args.no_check else reference(cp, cache, tab, lensd, q, sm_scale)
    nbytes = int(lens.sum()) * cache.geometry.bytes_per_token
    for vname, fname in variants:
        try:
            out = cp.full(q.shape, np.nan, dtype=BF16)
            scratch = ca.new_scratch()

            def call(out=out, scratch=scratch, fname=fname):
                ca.decode_attention(cache.buffer, q, tab, lensd, out, None,
                                    geom=cache.geometry, k_s=cache.pool.k_s, v_s=cache.pool.v_s,
                                    sm_scale=sm_scale, stats=cache.pool.stats, scratch=scratch,
                                    kernel_file=fname)
            call()
            cp.cuda.Device().synchronize()
            plan = ca.attention_plans(scratch)[0]
            err = float("nan")
            if ref is not None:
                got = out.astype(cp.float32)
                err = float((cp.linalg.norm(got - ref, axis=-1)
                             / cp.linalg.norm(ref, axis=-1)).max())
            t = env.time_calls([call], reps=args.reps, batch=args.batch)["median_s"]
            print(f"{case:18s} {vname:10s} {t * 1e6:8.1f} us {nbytes / t / 1e9:6.0f} GB/s "
                  f"grid {plan.grid} regs {int(plan.fn.num_regs)} local "
                  f"{int(plan.fn.local_size_bytes)} err {err:.2e}", flush=True)
        except Exception as e:  # a variant that fails to compile or run
            print(f"!! {case} {vname}: {type(e).__name__}: {e}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", default=None,
                    help="B,L,Hq,D with L an int or 'mixed' (default 8,32768,32,128)")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=PATH: a replacement decode_attention.cu")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--split-tokens", type=int, default=None,
                    help="override _cuda.decode.SPLIT_TOKENS (tokens per split)")
    ap.add_argument("--nsplit", type=int, default=None, help="force this many splits")
    args = ap.parse_args(argv)

    import cupy as cp

    from fp4cache import _kernels as K
    from fp4cache._cuda import decode as ca

    if args.split_tokens:
        ca.SPLIT_TOKENS = args.split_tokens
    if args.nsplit:
        def forced(batch, kv_heads, capacity, resident, spec=None, per_sm=4, _n=args.nsplit):
            return ca.splits_of(_n, capacity, spec)
        ca.split_plan = forced
    kdir = K.kernel_dir()
    variants = [("shipped", "decode_attention.cu")]
    made = []
    for v in args.variant:
        name, path = v.split("=", 1)
        fname = f"_exp_{name}.cu"
        shutil.copy(path, kdir / fname)
        made.append(kdir / fname)
        variants.append((name, fname))
    env = Env(gpu=True)
    try:
        for case in args.case or ["8,32768,32,128"]:
            run_case(cp, ca, K, env, case, variants, args)
            cp.get_default_memory_pool().free_all_blocks()
    finally:
        for p in made:
            p.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
