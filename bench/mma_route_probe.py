"""Probe of the mma.sync prefill kernel (``kernels/varlen_attention.cu``, ``_r128``: the
route every GPU but sm_90 takes, forced with route "mma") on patched copies of its source:
the same calls on the same cache, each variant's time and whether its output bytes equal
the first variant's.

Variants (``PATCHES``): ``base`` (the shipped source) and the patched copies of candidate
changes while they wait for a GPU (none now).  The candidates measured are in
``docs/kernels.md`` ("What was tried").  ``--baseline DIR`` adds the variant ``baseline``,
the kernel built from DIR's copies of kernel files (of the shared-memory layout that
``_abi.varlen_smem_bytes`` gives), for an A/B of a kernel change in one process.

Rows (Hq 32, H 8, D ``--head-dim``, block 16, bf16): a 2,048-token chunk after 30,720
cached, a plain 8,192-token prefill (``--rows``).

Run on a GPU (from the repository root), under a time limit::

    PYTHONPATH=. timeout 300 python3 bench/mma_route_probe.py
    PYTHONPATH=. timeout 300 python3 bench/mma_route_probe.py --head-dim 64 --rows chunk
    git show HEAD~1:kernels/varlen_attention.cu > /tmp/old/varlen_attention.cu
    PYTHONPATH=. timeout 300 python3 bench/mma_route_probe.py --baseline /tmp/old
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from attention_bench import log  # noqa: E402
from kernel_patch import (  # noqa: E402
    Patch,
    add_baseline_argument,
    compare_bytes,
    variant_folders,
)
from timing import BF16  # noqa: E402

from fp4cache import _kernels as K  # noqa: E402

# kernel_patch's patches of kernel files per variant
PATCHES: dict[str, dict[str, list[Patch]]] = {
    "base": {},
}

#: the patched files of each variant's folder (tests/test_kernels_compile.py compiles them)
FOLDERS: dict[str, dict[str, list[Patch]]] = {
    name: files for name, files in PATCHES.items() if files}

#: the probe's rows: name -> (label, sequences, query tokens, cached tokens)
ROWS = {"chunk": ("chunk 2,048 after 30,720", 1, 2048, 30720),
        "prefill": ("prefill 8,192", 1, 8192, 0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", nargs="*", default=list(PATCHES), choices=list(PATCHES))
    ap.add_argument("--head-dim", type=int, default=128, choices=K.ATTN_HEAD_DIMS)
    ap.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    add_baseline_argument(ap)
    args = ap.parse_args(argv)
    from varlen_bench import VarlenBench

    from fp4cache._cuda.decode import new_scratch

    vb = VarlenBench.plain(args.reps)
    cp = vb.cp
    shipped = K.varlen_attention_spec
    root = Path(tempfile.mkdtemp())
    folders = variant_folders(root, args.variants, FOLDERS, args.baseline,
                              "varlen_attention.cu")
    D = args.head_dim
    sm_scale = 1.0 / np.sqrt(D)
    try:
        for case, B, n, cached in (ROWS[r] for r in args.rows):
            L = cached + n
            cache, tab, lens, _ = vb.cache_for(B, [L] * B, 8, D, 16, 5)
            q = vb.env.randn_bf16((B * n, 32, D), 6)
            qsl = cp.arange(B + 1, dtype=cp.int32) * n
            out = cp.empty((B * n, 32, D), dtype=BF16)
            log(f"== {case}, head_dim {D}, route mma")
            first = None  # the first variant's output bytes
            for name, folder in folders.items():
                if folder is None:
                    K.varlen_attention_spec = shipped
                else:
                    def spec(*a, folder=folder, **kw):
                        return dataclasses.replace(shipped(*a, **kw), folder=folder)
                    K.varlen_attention_spec = spec
                scratch = new_scratch()
                call = vb.varlen(cache, q, qsl, tab, lens, out, scratch, sm_scale, n,
                                 route="mma")
                call()
                cp.cuda.Device().synchronize()
                got = out.view(cp.uint16).get()
                names = [lp.name for lp in next(iter(scratch.plans.values())).launches]
                first, same = compare_bytes(first, name, got)
                t = vb.time([call], batch=3)
                log(f"   {name:9s} {t * 1e6:9.1f} us  {' + '.join(names)}{same}")
            K.varlen_attention_spec = shipped
            del cache
            vb.release()
    finally:
        K.varlen_attention_spec = shipped
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
