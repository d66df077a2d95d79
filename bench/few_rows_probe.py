"""Probe of the few-row attention kernel (``kernels/decode_attention.cu`` with
``query_start_loc``: speculative verification) on patched copies of its source: the same
calls on the same cache, each variant's time and whether its output bytes equal the first
variant's.

Variants: ``base`` (the shipped source; ``PATCHES`` holds the patched copies of candidate
changes while they wait for a GPU: none now) and ``rows16`` (``ROUTES``: routes as the
library did before the four-tile form, sequences of 17 to 32 rows to the varlen kernels).
The candidates measured and dropped are in ``docs/kernels.md`` ("Alternatives measured and
not taken"); ``--baseline DIR`` adds the variant ``baseline``, the kernel built from DIR's
copies of kernel files (an older ``decode_attention.cu`` and the headers it changed with),
for an A/B of a kernel change in one process.

Rows: B sequences of L cached tokens (Hq 32, H 8, block 16, bf16, pages in random order),
n query tokens each (``--n``), through ``attention``'s launch plan (the few-row kernel
where n x group rows fit it).

Run on the GPU (from the repository root)::

    PYTHONPATH=. python3 bench/few_rows_probe.py --n 2 4 8 --variants base rows16
    git show HEAD~1:kernels/decode_attention.cu > /tmp/old/decode_attention.cu
    PYTHONPATH=. python3 bench/few_rows_probe.py --variants base --baseline /tmp/old
"""

from __future__ import annotations

import argparse
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
    spec_in_folder,
    time_variant,
    variant_folders,
)
from timing import BF16  # noqa: E402

from fp4cache import _kernels as K  # noqa: E402

# kernel_patch's patches of kernel files per variant
PATCHES: dict[str, dict[str, list[Patch]]] = {
    "base": {},
}
#: variants that change the host's routing instead of the source: "rows16" serves at most
#: 16 rows per (sequence, KV head) in the few-row kernel (its two-tile form; more rows go to
#: the varlen kernels), as before its four-tile form
ROUTES = ("rows16",)

#: the patched files of each variant's folder (tests/test_kernels_compile.py compiles them)
FOLDERS: dict[str, dict[str, list[Patch]]] = {
    name: files for name, files in PATCHES.items() if files}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", nargs="*", default=list(PATCHES),
                    choices=list(PATCHES) + list(ROUTES))
    ap.add_argument("--head-dim", type=int, default=128, choices=K.ATTN_HEAD_DIMS)
    ap.add_argument("--n", type=int, nargs="*", default=[1, 2, 4, 8],
                    help="query tokens per sequence")
    ap.add_argument("--batch", type=int, default=8, help="sequences")
    ap.add_argument("--length", type=int, default=32768, help="cached tokens per sequence")
    add_baseline_argument(ap)
    args = ap.parse_args(argv)
    from varlen_bench import VarlenBench

    from fp4cache._cuda.decode import new_scratch

    vb = VarlenBench.plain(args.reps)
    cp = vb.cp
    shipped, max_rows = K.decode_attention_spec, K.attn_max_rows
    root = Path(tempfile.mkdtemp())
    folders = variant_folders(root, args.variants, FOLDERS, args.baseline, "decode_attention.cu")
    B, L, D = args.batch, args.length, args.head_dim
    sm_scale = 1.0 / np.sqrt(D)
    cache, tab, lens, _ = vb.cache_for(B, [L] * B, 8, D, 16, 0)
    try:
        for n in args.n:
            q = vb.env.randn_bf16((B * n, 32, D), 11 * n)
            qsl = cp.arange(B + 1, dtype=cp.int32) * n
            out = cp.empty((B * n, 32, D), dtype=BF16)
            log(f"== B={B} x {L}, n={n}, head_dim {D}")
            first = None  # the first variant's output bytes
            for name, folder in folders.items():
                K.attn_max_rows = max_rows
                K.decode_attention_spec = spec_in_folder(shipped, folder)
                if name == "rows16":
                    K.attn_max_rows = lambda dtype, head_dim: min(16, max_rows(dtype, head_dim))
                scratch = new_scratch()
                call = vb.varlen(cache, q, qsl, tab, lens, out, scratch, sm_scale, n)
                first, line = time_variant(vb, call, out, scratch, first, name, 10)
                log(line)
            K.decode_attention_spec, K.attn_max_rows = shipped, max_rows
    finally:
        K.decode_attention_spec, K.attn_max_rows = shipped, max_rows
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
