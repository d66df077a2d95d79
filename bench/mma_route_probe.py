"""Probe of the mma.sync prefill kernel (``kernels/varlen_attention.cu``, ``_r128``: the
route every GPU but sm_90 takes, forced with route "mma") on patched copies of its source:
the same calls on the same cache, each variant's time and whether its output bytes equal
the first variant's.

Variants (``PATCHES``): ``base`` (the shipped source) and the patched copies of candidate
changes while they wait for a GPU (none now). The candidates measured are in
``docs/kernels.md`` ("Alternatives measured and not taken"). ``--baseline DIR`` adds the
variant ``baseline``, the kernel built from DIR's copies of kernel files (of the
shared-memory layout that ``_abi.varlen_smem_bytes`` gives), for an A/B of a kernel change
in one process.

Rows (``kernel_patch.PREFILL_ROWS``; Hq 32, H 8, D ``--head-dim``, block 16, bf16): a
2,048-token chunk after 30,720 cached, a plain 8,192-token prefill (``--rows``; four plain
4,096-token prefills on request).

Run on a GPU (from the repository root), under a time limit::

    PYTHONPATH=. timeout 300 python3 bench/mma_route_probe.py
    PYTHONPATH=. timeout 300 python3 bench/mma_route_probe.py --head-dim 64 --rows chunk
    git show HEAD~1:kernels/varlen_attention.cu > /tmp/old/varlen_attention.cu
    PYTHONPATH=. timeout 300 python3 bench/mma_route_probe.py --baseline /tmp/old
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from kernel_patch import Patch, prefill_probe_main  # noqa: E402

from fp4cache import _kernels as K  # noqa: E402

# kernel_patch's patches of kernel files per variant
PATCHES: dict[str, dict[str, list[Patch]]] = {
    "base": {},
}

#: the patched files of each variant's folder (tests/test_kernels_compile.py compiles them)
FOLDERS: dict[str, dict[str, list[Patch]]] = {
    name: files for name, files in PATCHES.items() if files}


def main(argv=None) -> int:
    return prefill_probe_main(argv, __doc__.splitlines()[0], FOLDERS, list(PATCHES),
                              "varlen_attention.cu", "varlen_attention_spec",
                              K.ATTN_HEAD_DIMS, reps=3, rows=["chunk", "prefill"],
                              route="mma")


if __name__ == "__main__":
    sys.exit(main())
