"""One launch of each varlen attention kernel of bench/varlen_bench.py's main rows, for ncu
(``ncu --clock-control none -k regex:varlen_attn ...``): B=8 x 32768 with n=4 (16-row
kernel) and the 2048-token prefill chunk after 30720 cached tokens (64-row kernel)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from timing import BF16  # noqa: E402
from varlen_bench import VarlenBench  # noqa: E402

from fp4cache._cuda.decode import new_scratch  # noqa: E402


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=["spec", "prefill"])
    args = ap.parse_args()
    vb = VarlenBench.plain(1)
    cp = vb.cp
    H, D, T, Hq = 8, 128, 16, 32
    if "spec" in args.only:
        B, L, n = 8, 32768, 4
        cache, tab, lens, _ = vb.cache_for(B, [L] * B, H, D, T, 0)
        q = vb.env.randn_bf16((B * n, Hq, D), 1)
        qsl = cp.arange(B + 1, dtype=cp.int32) * n
        out = cp.empty((B * n, Hq, D), dtype=BF16)
        vb.varlen(cache, q, qsl, tab, lens, out, new_scratch(), 1 / np.sqrt(D), n)()
        cp.cuda.Device().synchronize()
        del cache
        vb.release()
    if "prefill" in args.only:
        n, L = 2048, 32768
        cache, tab, lens, _ = vb.cache_for(1, [L], H, D, T, 5)
        q = vb.env.randn_bf16((n, Hq, D), 1)
        qsl = cp.asarray(np.array([0, n], np.int32))
        out = cp.empty((n, Hq, D), dtype=BF16)
        vb.varlen(cache, q, qsl, tab, lens, out, new_scratch(), 1 / np.sqrt(D), n)()
        cp.cuda.Device().synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
