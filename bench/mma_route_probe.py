"""Probe of the mma.sync prefill kernel (``kernels/varlen_attention.cu``, ``_r128``: the
route every GPU but sm_90 takes, forced with route "mma") on patched copies of its source:
the same calls on the same cache, each variant's time and whether its output bytes equal
the first variant's.

Variants (``PATCHES``): ``base`` (the shipped source) and the candidate not measured yet:
``dbuf`` (the 128-row kernel decodes step i + 1 into a second set of tiles while its warps
compute step i, one CTA barrier per step instead of two; warps 0-3 decode first, warps 4-7
compute first, so that each SM sub-partition holds one of each (``dbuf_same``: every
warp decodes first); q, held in registers,
gives its shared memory to the second set: ``SMEM_BYTES`` is the host's size while the
variant is timed).  ``--baseline DIR`` adds the variant ``baseline``, the kernel built from
DIR's copies of kernel files, for an A/B of a kernel change in one process.

Rows (Hq 32, H 8, D ``--head-dim``, block 16, bf16): a 2,048-token chunk after 30,720
cached, a plain 8,192-token prefill (``--rows``).

Run on a GPU (from the repository root), under a time limit::

    PYTHONPATH=. timeout 300 python3 bench/mma_route_probe.py
    PYTHONPATH=. timeout 300 python3 bench/mma_route_probe.py --head-dim 64 --rows chunk
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

_DBUF_LOOP = """  if constexpr (A::DBUF) {
    // two sets of decoded tiles: step i + 1 decoded into one while step i is computed
    // from the other (the set is free: the barrier ending step i - 1 follows its last
    // read); warps 0-3 decode first, 4-7 compute first
    VlRaw<D> R;
    auto decode_into = [&](u32 k0, u32 set) {
      u16* tile = (u16*)(s_kv + set * A::KVSET + warp * A::TILE);
      if (WIN && k0 + 16u * warp >= nv_end && k0 + 16u * warp < W.s1)  // warp-uniform
        vl_window<D, LD>(P, S, k0 + my_key, W.s1, tile, s_vnan);
      else
        vl_decode<D>(R, k0 + my_key, P.swizzle, my_stage, PaddedTile<LD>{tile}, nan_key,
                     s_vnan);
      if (k0 + A::STEP < W.s1) vl_load<D>(S, k0 + A::STEP + my_key, nv_end, R);
    };
    if (W.s0 < W.s1) {
      vl_load<D>(S, W.s0 + my_key, nv_end, R);
      decode_into(W.s0, 0u);
    }
    __syncthreads();  // the first set, and q's fragments read (q's place is the second)
    const u32 order = @ORDER@;
    u32 set = 0u;
    for (u32 step = W.s0; step < W.s1; step += A::STEP, set ^= 1u) {
#pragma unroll 1
      for (u32 ph = 0; ph < 2u; ++ph) {
        if (ph == order) {
          if (step + A::STEP < W.s1) decode_into(step + A::STEP, set ^ 1u);
        } else {
#pragma unroll
          for (int hc = 0; hc < A::NCALL; ++hc) {
            const u32 t0 = kw + (u32)(hc * A::NTL * A::KW);
            if (step + 16u * t0 < wmax)
              vl_tiles<D, A::NTL, LD, SPLIT, A::QREG>(
                  kv_s + set * A::KVSET + t0 * A::TILE, A::KW * A::TILE, step + 16u * t0,
                  16u * A::KW, wmax, qaddr, qladdr, qf, qlf, lim, rs, st);
          }
        }
      }
      __syncthreads();
    }
  } else {
  VlRaw<D> R;
"""

_QREG = ("  static constexpr bool QREG = MW > 1 && D * (SPLIT ? 2 : 1) <= 128;"
         "  // q fragments in registers\n")


# the 128-row kernel with two sets of decoded tiles where q stays in registers; `order`: 0
# for a warp that decodes step i + 1 before it computes step i
def _dbuf(order: str) -> dict[str, list[Patch]]:
    return {"varlen_attention.cu": [
    ("  static constexpr int SMEM = KV + SC + QB * (SPLIT ? 2 : 1);  // = _abi.varlen_smem_bytes\n"
     + _QREG, _QREG +
     "  static constexpr bool DBUF = MW == 8 && QREG;\n"
     "  static constexpr int KVSET = KV + SC;  // the second set's offset (after the staging)\n"
     "  static constexpr int SMEM = DBUF ? 2 * KV + SC : KV + SC + QB * (SPLIT ? 2 : 1);\n"
     "  static_assert(!DBUF || QB * (SPLIT ? 2 : 1) <= KV, \"q in the second set's place\");\n"),
    ("  VlRaw<D> R;\n", _DBUF_LOOP.replace("@ORDER@", order)),
    ("  static_assert(ROWS * FP4C_VARLEN_MAX_SPLITS * 4 <= A::QB",
     "  }\n  static_assert(ROWS * FP4C_VARLEN_MAX_SPLITS * 4 <= A::QB"),
    ]}


#: the host's dynamic shared memory per variant while it is timed (head_dim, row_warps,
#: split_q) -> bytes
def _dbuf_smem(head_dim: int, row_warps: int, split_q: bool) -> int:
    ld = head_dim + _abi.VARLEN_SMEM_PAD
    qreg = row_warps > 1 and head_dim * (2 if split_q else 1) <= 128
    if row_warps == 8 and qreg:
        w = _abi.varlen_warps(row_warps)
        kv = w * 2 * _abi.VARLEN_TILE_KEYS * ld * 2
        sc = w * 2 * _abi.VARLEN_TILE_KEYS * (head_dim // 16)
        return 2 * kv + sc
    return _SHIPPED_SMEM(head_dim, row_warps, split_q)


_SHIPPED_SMEM = _abi.varlen_smem_bytes
SMEM_BYTES = {"dbuf": _dbuf_smem, "dbuf_same": _dbuf_smem}

# kernel_patch's patches of kernel files per variant
PATCHES: dict[str, dict[str, list[Patch]]] = {
    "base": {},
    "dbuf": _dbuf("warp < (u32)(A::W / 2) ? 0u : 1u"),
    "dbuf_same": _dbuf("0u"),
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
                _abi.varlen_smem_bytes = SMEM_BYTES.get(name, _SHIPPED_SMEM)
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
            _abi.varlen_smem_bytes = _SHIPPED_SMEM
            del cache
            vb.release()
    finally:
        K.varlen_attention_spec = shipped
        _abi.varlen_smem_bytes = _SHIPPED_SMEM
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
