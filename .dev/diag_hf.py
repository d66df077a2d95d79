import sys, itertools, torch, numpy as np
sys.path.insert(0, "tests")
import test_hf as th
import fp4cache.hf as fh
G = sys.argv[1] if len(sys.argv) > 1 else "cuda"

cfg = th._config("llama", heads=8, kv_heads=2, head_dim=64)
ids = torch.randint(1, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(6))
for use_mask, rot, wp in list(itertools.product([True, False], ["none", "hadamard"], [0, 3]))[: 8 if G == "cuda" else 1]:
    kw = dict(rotation=rot, window_pages=wp)
    mask = torch.ones_like(ids)
    if use_mask:
        mask[1, :5] = 0
    res = {}
    for dev, impl in [(G, "fp4cache"), (G, "sdpa"), ("cpu", "fp4cache")]:
        m = th._model(cfg, impl, device=dev)
        c = fh.FP4Cache(m.config, 2, 80, device=dev, **kw)
        _, l = th._greedy(m, c, ids.to(dev), 16, mask.to(dev))
        res[(dev, impl)] = l.cpu()
    a, b, cc = res[(G, "fp4cache")], res[(G, "sdpa")], res[("cpu", "fp4cache")]
    def e(x, y):  # per step (dim?) max abs diff
        return (x - y).abs().amax(-1).reshape(-1)
    print(f"mask={use_mask} rot={rot} wp={wp} shape={tuple(a.shape)} scale={float(b.abs().max()):.3f}")
    print("  gpu fused - gpu sdpa :", " ".join(f"{v:.3f}" for v in e(a, b).tolist()))
    print("  gpu fused - cpu fused:", " ".join(f"{v:.3f}" for v in e(a, cc).tolist()))
    print("  gpu sdpa  - cpu fused:", " ".join(f"{v:.3f}" for v in e(b, cc).tolist()), flush=True)
