"""transformers decode steps over an NVFP4 cache (``fp4cache.hf``) against its own bf16 caches.

One decode step (one new token per sequence) of a random-weight model of Llama-3-8B's
geometry (32 layers, 32 query heads, 8 KV heads, head_dim 128, bf16, vocab 128,256) at
``B`` sequences of ``L`` cached tokens, timed with CUDA events (median of ``--steps``
steps after two warm-up steps), for:

- ``dynamic``: transformers' ``DynamicCache`` with ``attn_implementation="sdpa"``;
- ``static``: ``StaticCache`` with sdpa;
- ``fp4cache``: ``fp4cache.hf.FP4Cache`` with ``attn_implementation="fp4cache"`` (the
  fused path: each layer stores its token into the pages and attends from them), with its
  defaults (K rotated, the newest 3 pages of each row exact in bf16);
- ``fp4cache_plain``: the same with ``rotation="none", window_pages=0`` (vLLM's pages);
- ``no_attn``: the same step with attention replaced by a function that returns zeros and
  no cache (the floor: everything but attention and its cache).

The caches are filled with random K/V of the step's shape (a real prefill of 32 x 32k
tokens would dominate the run); the end-to-end row (``--e2e``) runs ``generate`` for real:
prefill of random prompt ids plus ``--new-tokens`` greedy tokens, for ``dynamic`` and
``fp4cache``.  Reports per-step latency, the ratio to ``dynamic``, the KV bytes of each
cache and the peak device memory (PyTorch's allocator plus CuPy's pool, which holds the
NVFP4 pages).  Cells whose bf16 KV does not fit next to the model are reported as such.

    PYTHONPATH=. python3 bench/generate_bench.py --out generate.json
    PYTHONPATH=. python3 bench/generate_bench.py --quick          # 4 layers, small cells
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
import transformers
from transformers import AttentionInterface, DynamicCache, StaticCache

import fp4cache
import fp4cache.hf as fh


def config(layers: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False)


def no_attention(module, query, key, value, attention_mask, **kwargs):
    b, _, q, d = query.shape
    return query.new_zeros(b, q, query.shape[1], d), None


AttentionInterface.register("no_attn", no_attention)


def kv_bytes_bf16(cfg, b, length) -> int:
    return 2 * b * length * cfg.num_key_value_heads * cfg.head_dim * 2 * cfg.num_hidden_layers


def peak_reset():
    import gc

    import cupy

    gc.collect()  # a cache's layers and the cache refer to each other
    torch.cuda.synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def peak_bytes() -> int:
    import cupy

    return torch.cuda.max_memory_allocated() + cupy.get_default_memory_pool().total_bytes()


def time_steps(model, cache, b, steps, **kw) -> float:
    ids = torch.randint(0, 1000, (b, 1), device="cuda")
    times = []
    with torch.no_grad():
        for i in range(steps + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(input_ids=ids, past_key_values=cache, use_cache=cache is not None,
                  logits_to_keep=1, **kw)
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
    return statistics.median(times)


def fill_bf16(cache, cfg, b, length):
    k = torch.randn(b, cfg.num_key_value_heads, length, cfg.head_dim, dtype=torch.bfloat16,
                    device="cuda")
    for i in range(cfg.num_hidden_layers):
        cache.update(k, k, i)


def fill_fp4(cache: fh.FP4Cache, cfg, b, length):
    """Random K/V straight into every layer's pages (what a prefill would leave)."""
    h, d = cfg.num_key_value_heads, cfg.head_dim
    k = torch.randn(b * length, h, d, dtype=torch.bfloat16, device="cuda")
    import cupy

    pos = np.broadcast_to(np.arange(length), (b, length))
    slots = cupy.asarray(fp4cache.slot_mapping(cache.block_tables[:b], pos,
                                               block_size=cache.block_size).reshape(-1))
    kc = cupy.from_dlpack(k)
    lens = np.zeros(cache.max_batch_size, np.int64)
    lens[:b] = length
    # the rows' newest pages mapped to their window slots, as the cache's own steps map them
    moves = cache.window_moves(b, np.zeros_like(lens), lens)
    for layer in cache.layers:
        if moves is not None:
            layer.pages.map_window(*moves, validate=False)
        layer.pages.store(slots, kc, kc)
        layer.positions = length
        layer.lens = lens
        layer.mode = "fused"


def run_cell(model, cfg, b, length, steps, budget, rounds=1) -> dict:
    """One cell; with ``rounds`` > 1 the caches are timed in turns that many times and each
    one's time is the median of its rounds (the steps are host-bound: one round alone moves
    by tens of percent)."""
    row: dict = {"B": b, "L": length, "bf16_kv_bytes": kv_bytes_bf16(cfg, b, length)}
    fits = row["bf16_kv_bytes"] * 2.2 < budget  # the cache plus DynamicCache's cat copies
    names = ("no_attn", "dynamic", "static", "fp4cache", "fp4cache_plain")
    per: dict[str, list] = {name: [] for name in names}
    for _ in range(rounds):
        one = _run_round(model, cfg, b, length, steps, fits, names)
        for name in names:
            per[name].append(one[name])
            if name + "_peak" in one:
                row[name + "_peak"] = max(row.get(name + "_peak", 0), one[name + "_peak"])
        row.update({k: v for k, v in one.items() if k.endswith("_kv_bytes")})
    for name in names:
        got = [t for t in per[name] if t is not None]
        row[name] = statistics.median(got) if got else None
        if rounds > 1:
            row[name + "_rounds"] = per[name]
    return row


def _run_round(model, cfg, b, length, steps, fits, names) -> dict:
    row: dict = {}
    for name in names:
        if name in ("dynamic", "static") and not fits:
            row[name] = None
            continue
        peak_reset()
        if name == "no_attn":
            model.set_attn_implementation("no_attn")
            row[name] = time_steps(model, None, b, steps)
        elif name == "dynamic":
            model.set_attn_implementation("sdpa")
            cache = DynamicCache()
            fill_bf16(cache, cfg, b, length)
            row[name] = time_steps(model, cache, b, steps)
            del cache
        elif name == "static":
            model.set_attn_implementation("sdpa")
            cache = StaticCache(config=model.config, max_cache_len=length + steps + 4)
            fill_bf16(cache, cfg, b, length)
            row[name] = time_steps(model, cache, b, steps)
            del cache
        else:
            model.set_attn_implementation("fp4cache")
            plain = {"rotation": "none", "window_pages": 0} if name == "fp4cache_plain" else {}
            cache = fh.FP4Cache(model.config, b, length + steps + 4, device="cuda", **plain)
            fill_fp4(cache, cfg, b, length)
            row[name.replace("fp4cache", "fp4") + "_kv_bytes"] = cache.nbytes
            row[name] = time_steps(model, cache, b, steps)
            del cache
        row[name + "_peak"] = peak_bytes()
        peak = row[name + "_peak"] / 2**30
        print(f"  B={b} L={length} {name}: {row[name]:.2f} ms, peak {peak:.1f} GiB", flush=True)
    return row


def profile_steps(model, cfg, b=1, length=4096):
    from torch.profiler import ProfilerActivity, profile

    for name in ("dynamic", "fp4cache"):
        if name == "dynamic":
            model.set_attn_implementation("sdpa")
            cache = DynamicCache()
            fill_bf16(cache, cfg, b, length)
        else:
            model.set_attn_implementation("fp4cache")
            cache = fh.FP4Cache(model.config, b, length + 8, device="cuda")
            fill_fp4(cache, cfg, b, length)
        time_steps(model, cache, b, 1)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            time_steps(model, cache, b, 1)
        print(f"-- {name}")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))


def run_e2e(model, cfg, b, length, new_tokens) -> dict:
    row: dict = {"B": b, "L": length, "new_tokens": new_tokens}
    ids = torch.randint(0, 1000, (b, length), device="cuda")
    for name in ("dynamic", "fp4cache"):
        peak_reset()
        if name == "dynamic":
            model.set_attn_implementation("sdpa")
            cache = DynamicCache()
        else:
            model.set_attn_implementation("fp4cache")
            cache = fh.FP4Cache(model.config, b, length + new_tokens, device="cuda")
        with torch.no_grad():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
            prefill = time.perf_counter() - t0
            if name == "fp4cache":
                cache.reset()
            else:
                cache = DynamicCache()
            t0 = time.perf_counter()
            out = model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            total = time.perf_counter() - t0
        assert out.shape == (b, length + new_tokens)
        row[name] = {"prefill_s": prefill, "generate_s": total,
                     "decode_tokens_per_s": b * new_tokens / max(total - prefill, 1e-9),
                     "tokens_per_s": b * new_tokens / total, "peak": peak_bytes()}
        print(f"  e2e {name}: prefill {prefill:.2f} s, generate {total:.2f} s, "
              f"{row[name]['tokens_per_s']:.1f} new tokens/s", flush=True)
        del cache
    return row


def table(rows) -> str:
    lines = ["| B x cached tokens | DynamicCache + sdpa | StaticCache + sdpa | fp4cache fused | "
             "vs Dynamic | plain NVFP4 (no window, no rotation) | attention removed | bf16 KV "
             "| NVFP4 KV (window included) |",
             "|---|---|---|---|---|---|---|---|---|"]

    def ms(x):
        return "OOM" if x is None else f"{x:.1f} ms"

    for r in rows:
        ratio = f"{r['dynamic'] / r['fp4cache']:.2f}x" if r.get("dynamic") else "-"
        kv = f"{r['bf16_kv_bytes'] / 2**30:.2f} GiB | {r['fp4_kv_bytes'] / 2**30:.2f} GiB"
        lines.append(f"| {r['B']} x {r['L']:,} | {ms(r.get('dynamic'))} | "
                     f"{ms(r.get('static'))} | {ms(r['fp4cache'])} | {ratio} | "
                     f"{ms(r.get('fp4cache_plain'))} | {ms(r['no_attn'])} | {kv} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="1x4096,1x8192,1x32768,8x4096,8x8192,8x32768,"
                    "32x4096,32x8192,32x32768", help="B x L cells, comma-separated")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the caches of a cell in turns this many times (median)")
    ap.add_argument("--e2e", default="8x32768", help="B x L of the generate row ('' for none)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="4 layers, small cells")
    ap.add_argument("--profile", action="store_true",
                    help="print PyTorch's profile of one DynamicCache and one fp4cache step")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.cells, args.e2e, args.new_tokens = 4, "1x4096,8x8192", "2x2048", 16
    cfg = config(args.layers)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    free, total = torch.cuda.mem_get_info()
    params = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"{torch.cuda.get_device_name()}: model {params:.2f}B params, {free / 2**30:.0f} of "
          f"{total / 2**30:.0f} GiB free; torch {torch.__version__}, transformers "
          f"{transformers.__version__}", flush=True)
    if args.profile:
        profile_steps(model, cfg)
    rows, e2e = [], None
    for cell in args.cells.split(","):
        b, length = (int(x) for x in cell.split("x"))
        rows.append(run_cell(model, cfg, b, length, args.steps, free, args.rounds))
    if args.e2e:
        b, length = (int(x) for x in args.e2e.split("x"))
        e2e = run_e2e(model, cfg, b, length, args.new_tokens)
    print(table(rows))
    if e2e:
        d, f = e2e["dynamic"], e2e["fp4cache"]
        print(f"\ngenerate B={e2e['B']} x {e2e['L']:,} + {e2e['new_tokens']}: DynamicCache "
              f"{d['tokens_per_s']:.1f} tok/s (prefill {d['prefill_s']:.2f} s), fp4cache "
              f"{f['tokens_per_s']:.1f} tok/s (prefill {f['prefill_s']:.2f} s); decode "
              f"{f['decode_tokens_per_s'] / d['decode_tokens_per_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as fh_out:
            json.dump({"device": torch.cuda.get_device_name(), "layers": args.layers,
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "cells": rows, "e2e": e2e}, fh_out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
