"""Timeline of the wgmma prefill kernel's work items: ``clock64`` stamps at the phases of
each CTA (a patched copy of ``kernels/varlen_wgmma.cu`` writes them to a ``__device__``
array), reported as cycles per phase and per step, grouped by the item's step count.

Phases of an item, as the row warps see it (``clock64`` of the CTA's SM): ``setup`` (from
the item's start to ``find_work`` done), ``q`` (q converted, the row warps' barrier passed;
``q sync`` / ``q load`` / ``q bar`` its parts: the CTA barrier, ``load_q16``, the row
warps' barrier), ``fill`` (until step 0's K stage is decoded), ``steps`` (step 0's scores
to the last P V), ``epilogue`` (``end bar`` / ``merge`` / ``finish``: the item's end
barrier, the merge into shared memory, the write); the decode warps' ``dec start`` (their
first load issued) and ``dec first`` (step 0's stages arrived), from the item's start.  The
items' ``%globaltimer`` spans summed per SM against the kernel's time show the gaps.

Run on an sm_90 GPU (from the repository root)::

    PYTHONPATH=. python3 bench/wgmma_timeline.py
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
from kernel_patch import Patch, write_folder  # noqa: E402
from timing import BF16  # noqa: E402

from fp4cache import _kernels as K  # noqa: E402

SLOTS, FIELDS = 8192, 16
_HEAD = f"""#include "pipeline.cuh"
__device__ unsigned long long fp4c_tl[{SLOTS}][{FIELDS}];
FP4C_DEVICE unsigned long long tl_clock() {{
  unsigned long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
  return t;
}}
FP4C_DEVICE unsigned long long tl_global() {{
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}}
__shared__ unsigned fp4c_tl_item;  // the CTA's current item
#define TL(f, v) do {{ if (fp4c_tl_item < {SLOTS}u) fp4c_tl[fp4c_tl_item][f] = (v); }} while (0)
"""

_FW = "      if (!find_work<ROWS, STEP>(P, item, qsl, seq_lens, W)) continue;\n"
_SYNC = "      __syncthreads();  // the last item's shared memory is free\n"
# kernel_patch's patches of kernels/varlen_steps.cuh and kernels/varlen_wgmma.cu
STEPS_PATCHES: list[Patch] = [
    ('#include "hadamard.cuh"\n', '#include "hadamard.cuh"\n' + _HEAD),
    ("  EndBar::sync();\n  float(*s_o)[D + 1] = reinterpret_cast<float(*)[D + 1]>(s_kv);\n"
     "  vl_merge_warps<D, MW, Bar>(st, s_o, s_m, s_l, s_lim, s_nan, s_vnan, s_M, s_L);\n",
     "  EndBar::sync();\n  if (threadIdx.x == 0u) TL(12, tl_clock());\n"
     "  float(*s_o)[D + 1] = reinterpret_cast<float(*)[D + 1]>(s_kv);\n"
     "  vl_merge_warps<D, MW, Bar>(st, s_o, s_m, s_l, s_lim, s_nan, s_vnan, s_M, s_L);\n"
     "  if (threadIdx.x == 0u) TL(13, tl_clock());\n"),
]
PATCHES: list[Patch] = [
    ("      if (((u64)q & 15u) == 0u)\n",
     "      if (threadIdx.x == 0u) TL(14, tl_clock());\n      if (((u64)q & 15u) == 0u)\n"),
    ("      fence_proxy_async();  // q, for the wgmma reads\n",
     "      if (threadIdx.x == 0u) TL(15, tl_clock());\n"
     "      fence_proxy_async();  // q, for the wgmma reads\n"),
    ("  u32 dyn;\n  asm(",
     "  const unsigned long long t_entry = tl_clock();\n  u32 dyn;\n  asm("),
    ("      VlWork W;\n" + _FW + _SYNC,
     "      VlWork W;\n"
     "      const unsigned long long t_it = item == blockIdx.x ? t_entry : tl_clock(),\n"
     "                               g_it = tl_global();\n" + _FW +
     "      const unsigned long long t_fw = tl_clock();\n"
     "      if (threadIdx.x == 0u) fp4c_tl_item = item;\n" + _SYNC),
    ("      wg_row_item<T, D>(W, P, s_q,",
     "      const unsigned long long t_q = tl_clock();\n      wg_row_item<T, D>(W, P, s_q,"),
    ("                        lse);\n    }\n    if (warp < 4u)",
     "                        lse);\n"
     "      if (threadIdx.x == 0u) {\n"
     "        TL(0, t_it); TL(1, t_fw); TL(2, t_q); TL(5, tl_clock());\n"
     "        TL(6, (W.s1 - W.s0 + STEP - 1u) / STEP); TL(7, g_it); TL(11, tl_global());\n"
     "      }\n    }\n    if (warp < 4u)"),
    ("    R.first();\n", "    R.first();\n    if (threadIdx.x == 0u) TL(3, tl_clock());\n"),
    ("    R.last();\n", "    R.last();\n    if (threadIdx.x == 0u) TL(4, tl_clock());\n"),
    ("      wg_decode_item<D>(W, P, S,",
     "      if (threadIdx.x == 256u) TL(10, tl_clock());\n      wg_decode_item<D>(W, P, S,"),
    ("    mbar_arrive(B.full_v(rv.stage));\n",
     "    mbar_arrive(B.full_v(rv.stage));\n"
     "    if (i == 0u && threadIdx.x == 256u) TL(8, tl_clock());\n"),
]


#: the patched files of the stamped kernel's folder (tests/test_kernels_compile.py compiles
#: them)
FOLDERS: dict[str, dict[str, list[Patch]]] = {
    "timeline": {"varlen_wgmma.cu": PATCHES, "varlen_steps.cuh": STEPS_PATCHES}}


def report(tl: np.ndarray, items: int, kernel_us: float) -> None:
    t = tl[:items].astype(np.int64)
    n = t[:, 6]
    ok = t[:, 0] > 0
    t, n = t[ok], n[ok]
    phases = {"setup": t[:, 1] - t[:, 0], "q": t[:, 2] - t[:, 1], "fill": t[:, 3] - t[:, 2],
              "steps": t[:, 4] - t[:, 3], "epilogue": t[:, 5] - t[:, 4],
              "q sync": t[:, 14] - t[:, 1], "q load": t[:, 15] - t[:, 14],
              "q bar": t[:, 2] - t[:, 15], "end bar": t[:, 12] - t[:, 4],
              "merge": t[:, 13] - t[:, 12], "finish": t[:, 5] - t[:, 13],
              "dec start": t[:, 10] - t[:, 0], "dec first": t[:, 8] - t[:, 0]}
    span_ns = t[:, 11] - t[:, 7]  # an item's span
    cyc = t[:, 5] - t[:, 0]
    ghz = float(np.median(cyc / np.maximum(span_ns, 1)))
    log(f"   {ok.sum()} items, clock {ghz:.2f} cycles/ns; sum of item spans "
        f"{span_ns.sum() / 1e3 / 132:.1f} us per SM vs kernel {kernel_us:.1f} us")
    edges = sorted(set(np.quantile(n, [0, 0.25, 0.5, 0.75, 1.0]).astype(int)))
    groups = [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:])] or [(edges[0], edges[0])]
    head = "   steps      items " + " ".join(f"{k:>9s}" for k in phases) + "  cyc/step"
    log(head)
    for lo, hi in groups:
        m = (n >= lo) & (n <= hi)
        if not m.any():
            continue
        cells = " ".join(f"{np.median(v[m]):9.0f}" for v in phases.values())
        per = np.median(phases["steps"][m] / np.maximum(n[m] - 1, 1))
        log(f"   {lo:4d}-{hi:<4d} {m.sum():6d} {cells}  {per:8.0f}")
    main = ("setup", "q", "fill", "steps", "epilogue")
    tot = {k: float(v.sum()) for k, v in phases.items() if k in main}
    all_ = sum(tot.values())
    log("   share of CTA cycles: " + ", ".join(f"{k} {v / all_:.1%}" for k, v in tot.items()))


def main(argv=None) -> int:
    import cupy
    from varlen_bench import VarlenBench

    from fp4cache._cuda.decode import new_scratch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    vb = VarlenBench.plain(args.reps)
    cp = vb.cp
    shipped = K.varlen_wgmma_spec
    root = Path(tempfile.mkdtemp())
    write_folder(root, FOLDERS["timeline"])
    mods: dict = {}

    def spec(dtype, head_dim):
        s = shipped(dtype, head_dim)
        s = dataclasses.replace(s, folder=str(root))
        key = (cupy.cuda.runtime.getDevice(), s)
        if key not in K._FUNCS:
            opts = K.NVRTC_OPTIONS + (f"--gpu-architecture={s.arch}",)
            mod = cupy.RawModule(code=K.build_source(s.file, [s]), options=opts)
            K._FUNCS[key] = mod.get_function(s.name)
            mods["tl"] = mod
        return s

    rows = [("chunk 2,048 after 30,720", 1, 2048, 30720), ("prefill 8,192", 1, 8192, 0),
            ("chunk 2,048 after 2,048", 1, 2048, 2048), ("4 x 4,096 prefill", 4, 4096, 0)]
    try:
        for case, B, n, cached in rows:
            L = cached + n
            cache, tab, lens, _ = vb.cache_for(B, [L] * B, 8, 128, 16, 5)
            q = vb.env.randn_bf16((B * n, 32, 128), 6)
            qsl = cp.arange(B + 1, dtype=cp.int32) * n
            out = cp.empty((B * n, 32, 128), dtype=BF16)
            log(f"== {case}")
            K.varlen_wgmma_spec = shipped
            base = vb.varlen(cache, q, qsl, tab, lens, out, new_scratch(), 1.0 / np.sqrt(128), n)
            base()
            t_base = vb.time([base], batch=3)
            K.varlen_wgmma_spec = spec
            call = vb.varlen(cache, q, qsl, tab, lens, out, new_scratch(), 1.0 / np.sqrt(128), n)
            call()
            cp.cuda.Device().synchronize()
            t_tl = vb.time([call], batch=3)
            g = mods["tl"].get_global("fp4c_tl")
            arr = cp.ndarray((SLOTS, FIELDS), cp.uint64, g)
            arr.fill(0)
            call()
            cp.cuda.Device().synchronize()
            items = B * 8 * (-(-n * 4 // 128))
            log(f"   shipped {t_base * 1e6:.1f} us, stamped {t_tl * 1e6:.1f} us, {items} items")
            report(arr.get(), min(items, SLOTS), t_tl * 1e6)
            K.varlen_wgmma_spec = shipped
            del cache
            vb.release()
    finally:
        K.varlen_wgmma_spec = shipped
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
