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

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from kernel_patch import PREFILL_ROWS, Patch, prefill_probe_main  # noqa: E402

from fp4cache import _abi  # noqa: E402

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


def main(argv=None) -> int:
    return prefill_probe_main(argv, __doc__.splitlines()[0], FOLDERS, list(PATCHES),
                              "varlen_wgmma.cu", "varlen_wgmma_spec",
                              _abi.VARLEN_WG_HEAD_DIMS, reps=5, rows=list(PREFILL_ROWS))


if __name__ == "__main__":
    sys.exit(main())
