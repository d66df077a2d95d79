"""Probe of where the wgmma prefill kernel's time goes: the same call on the same cache with
parts of ``kernels/varlen_wgmma.cu`` switched off in a patched copy of the source (the
values of such a variant are wrong; only its time counts), or changed.

Variants (``PATCHES``): ``base`` (the shipped source), ``noload`` (the decode warps decode
the first step's rows again instead of loading each step's), ``nodecode`` (rows loaded,
not decoded: the stages keep what they hold), ``idle`` (the decode warps only pass the
rings' barriers), ``nomma`` (the row warps issue no MMAs: softmax on stale scores).  The
candidate changes measured with it and dropped are in ``docs/kernels.md`` ("What was
tried").  ``--baseline DIR`` adds the variant ``baseline``: the kernel built from DIR's
copies of kernel files (an older ``varlen_wgmma.cu`` and the headers it changed with; the
rest from ``kernels/``), for an A/B of a kernel change in one process.  Each variant's
output bytes are compared with the first variant's (equal where a change only reorders
work whose values it does not touch).

Rows (Hq 32, H 8, D ``--head-dim``, block 16, bf16): a 2,048-token chunk after 30,720
cached, a plain 8,192-token prefill, four plain 4,096-token prefills (``--rows``).

Run on an sm_90 GPU (from the repository root), under a time limit (a wrong barrier count
hangs the kernel)::

    PYTHONPATH=. timeout 300 python3 bench/wgmma_decode_probe.py
    PYTHONPATH=. timeout 240 python3 bench/wgmma_decode_probe.py --head-dim 256 \\
        --rows chunk --variants base idle nomma
    git show HEAD~1:kernels/varlen_wgmma.cu > /tmp/old/varlen_wgmma.cu  # (and its headers)
    PYTHONPATH=. timeout 240 python3 bench/wgmma_decode_probe.py --variants base \\
        --baseline /tmp/old
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

from fp4cache import _abi  # noqa: E402
from fp4cache import _kernels as K  # noqa: E402

_LOAD = "if (i + 1u < nsteps) vl_load_page<D>(S, step + STEP + off, W.s1, id[u], R[u], c0);"
_DECODE = """      vl_decode<D>(R[u], step + off, P.swizzle, my_stage,
                   SwzTile<STEP>{k, v, off - (lane & 15u)}, nan_key, sh.vnan, c0 / 16u);"""
_KEEP = """      { u32 x = R[u].sc[0];
        for (int w = 0; w < A::DC / 8; ++w) x ^= R[u].w[w];
        if (x == 0x9E3779B9u) nan_key = 0u; }"""
_MMA = """    wg_pv<D, A::STEP>(st, pa, kv_s + (A::KSTAGES + rv.stage) * A::KT);
    if constexpr (MORE) wg_scores<D, A::ROWS, A::STEP>(s, q_s, kv_s + rk.stage * A::KT);"""
_FIRST = "    wg_scores<D, A::ROWS, A::STEP>(s, q_s, kv_s + rk.stage * A::KT);\n    wg_turn_pass"


# kernel_patch's patches of kernel files per variant (kernels/varlen_wgmma.cu unless named)
PATCHES: dict[str, dict[str, list[Patch]]] = {
    "base": {},
    "noload": {"varlen_wgmma.cu": [(_LOAD, "")]},
    "nodecode": {"varlen_wgmma.cu": [(_DECODE, _KEEP)]},
    "idle": {"varlen_wgmma.cu": [(_LOAD, ""), (_DECODE, "")]},
    "nomma": {"varlen_wgmma.cu": [(_MMA, "    asm volatile(\"\" ::: \"memory\");"),
                                  (_FIRST, "    wg_turn_pass")]},
}

#: the patched files of each variant's folder (tests/test_kernels_compile.py compiles them)
FOLDERS: dict[str, dict[str, list[Patch]]] = {
    name: files for name, files in PATCHES.items() if files}

#: the probe's rows: name -> (label, sequences, query tokens, cached tokens)
ROWS = {"chunk": ("chunk 2,048 after 30,720", 1, 2048, 30720),
        "prefill": ("prefill 8,192", 1, 8192, 0),
        "batch": ("prefill 4 x 4,096", 4, 4096, 0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", nargs="*", default=list(PATCHES), choices=list(PATCHES))
    ap.add_argument("--head-dim", type=int, default=128, choices=_abi.VARLEN_WG_HEAD_DIMS)
    ap.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    add_baseline_argument(ap)
    args = ap.parse_args(argv)
    from varlen_bench import VarlenBench

    from fp4cache._cuda.decode import new_scratch

    vb = VarlenBench.plain(args.reps)
    cp = vb.cp
    shipped = K.varlen_wgmma_spec
    root = Path(tempfile.mkdtemp())
    folders = variant_folders(root, args.variants, FOLDERS, args.baseline, "varlen_wgmma.cu")
    D = args.head_dim
    sm_scale = 1.0 / np.sqrt(D)
    try:
        for case, B, n, cached in (ROWS[r] for r in args.rows):
            L = cached + n
            cache, tab, lens, _ = vb.cache_for(B, [L] * B, 8, D, 16, 5)
            q = vb.env.randn_bf16((B * n, 32, D), 6)
            qsl = cp.arange(B + 1, dtype=cp.int32) * n
            out = cp.empty((B * n, 32, D), dtype=BF16)
            log(f"== {case}, head_dim {D}")
            first = None  # the first variant's output bytes
            for name, folder in folders.items():
                if folder is None:
                    K.varlen_wgmma_spec = shipped
                else:
                    def spec(dtype, head_dim, folder=folder):
                        return dataclasses.replace(shipped(dtype, head_dim), folder=folder)
                    K.varlen_wgmma_spec = spec
                call = vb.varlen(cache, q, qsl, tab, lens, out, new_scratch(),
                                 sm_scale, n)
                call()
                cp.cuda.Device().synchronize()
                got = out.view(cp.uint16).get()
                first, same = compare_bytes(first, name, got)
                t = vb.time([call], batch=3)
                log(f"   {name:9s} {t * 1e6:9.1f} us{same}")
            K.varlen_wgmma_spec = shipped
            del cache
            vb.release()
    finally:
        K.varlen_wgmma_spec = shipped
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
