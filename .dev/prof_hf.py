import cProfile, pstats, io, sys, time, statistics
sys.path.insert(0, "bench")
import torch, transformers
import generate_bench as gb
import fp4cache.hf as fh
cfg = gb.config(8)
torch.manual_seed(0)
with torch.device("cuda"):
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
model.set_attn_implementation("fp4cache")
for b, L in [(8, 32768), (32, 8192)]:
    for rnd in range(2):
        for name, kw in [("plain", {"rotation": "none", "window_pages": 0}), ("defaults", {}),
                         ("rot", {"window_pages": 0}), ("win", {"rotation": "none"})]:
            cache = fh.FP4Cache(model.config, b, L + 40, device="cuda", **kw)
            gb.fill_fp4(cache, cfg, b, L)
            t = gb.time_steps(model, cache, b, 9)
            pr = None
            if rnd == 1 and name in ("plain", "defaults"):
                pr = cProfile.Profile(); pr.enable()
                gb.time_steps(model, cache, b, 5)
                pr.disable()
            print(f"B={b} L={L} round {rnd} {name}: {t:.2f} ms", flush=True)
            if pr:
                s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
                print(s.getvalue()[-3500:], flush=True)
            del cache
            gb.peak_reset()
