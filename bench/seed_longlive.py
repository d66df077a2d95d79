"""Time LongLive's own decode kernel against ``fp4cache.longlive.dequantize`` (list API).

LongLive's ``dequantize_kv_cache_fp4`` is a PyTorch CUDA extension; it is not part of
fp4cache and is not copied here.  Given its source file (``--seed-src``), this script
builds it with ``nvcc`` against the installed torch (plus a two-line ``TORCH_LIBRARY``
schema, since the file only registers the CUDA implementation), loads it with
``torch.ops.load_library`` and times both APIs on the same device tensors (shared with
CuPy through DLPack), at 4, 256 and 2048 blocks of 256 tokens x 8 heads x head_dim 128
by default.

Timing: wall time of batches of back-to-back calls with a synchronization after each
batch, median over repetitions (the seed synchronizes inside every call, so device-event
timing would hide nothing); both APIs are timed the same way.  The decoded bf16 values
of the two are compared bit for bit.

    PYTHONPATH=. python3 bench/seed_longlive.py --seed-src path/to/longlive_kv_dequant_cuda.cu
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

SCHEMA = r"""
#include <torch/library.h>
TORCH_LIBRARY(longlive_kernels, m) {
  m.def("dequantize_kv_cache_fp4(Tensor[] values, Tensor[] scale_factors, Tensor[] amax, "
        "int num_heads, int block_token_size, int dtype_code, float e2m1_max, "
        "float e4m3_max) -> Tensor");
}
"""


def build(src: Path, workdir: Path, arch: str) -> Path:
    import torch
    from torch.utils import cpp_extension as ce

    try:
        incs, libs = ce.include_paths(device_type="cuda"), ce.library_paths(device_type="cuda")
    except TypeError:  # older torch: include_paths(cuda=True)
        incs, libs = ce.include_paths(cuda=True), ce.library_paths(cuda=True)
    schema = workdir / "schema.cpp"
    schema.write_text(SCHEMA)
    so = workdir / "longlive_seed.so"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = ["nvcc", "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", f"-arch={arch}",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{p}" for p in incs],
           f"-I{sysconfig.get_paths()['include']}", str(src), str(schema),
           *[f"-L{p}" for p in libs], *[f"-Xlinker=-rpath,{p}" for p in libs],
           "-ltorch", "-ltorch_cpu", "-ltorch_cuda", "-lc10", "-lc10_cuda", "-o", str(so)]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"nvcc failed ({r.returncode}):\n{r.stderr[-3000:]}")
    print(f"built {so.name} in {time.perf_counter() - t:.1f} s", flush=True)
    return so


def wall_per_call(fn, sync, batch: int, reps: int) -> float:
    for _ in range(2):
        fn()
    sync()
    per = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        sync()
        per.append((time.perf_counter() - t0) / batch)
    return float(np.median(per))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed-src", required=True, type=Path,
                   help="LongLive's longlive_kv_dequant_cuda.cu")
    p.add_argument("--counts", default="4,256,2048", help="block counts (default 4,256,2048)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per block (default 256)")
    p.add_argument("--heads", type=int, default=8, help="heads (default 8)")
    p.add_argument("--reps", type=int, default=10, help="repetitions (default 10)")
    p.add_argument("--arch", default="sm_90", help="nvcc -arch (default sm_90)")
    args = p.parse_args(argv)

    import cupy as cp
    import torch

    from fp4cache import layout, longlive

    with tempfile.TemporaryDirectory() as tmp:
        torch.ops.load_library(str(build(args.seed_src, Path(tmp), args.arch)))
    seed = torch.ops.longlive_kernels.dequantize_kv_cache_fp4
    H, Tb, D = args.heads, args.tokens, 128
    S, R, Rp = D // 16, Tb * H, layout.longlive_padded_rows(Tb, H)
    now = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), CuPy {cp.__version__}, "
          f"{torch.cuda.get_device_name()}, {now}")
    print("| blocks | seed (us/call) | fp4cache list API (us/call) | seed / fp4cache | "
          "bf16 identical |")
    print("|---:|---:|---:|---:|---|")

    def sync():
        torch.cuda.synchronize()

    g = torch.Generator(device="cuda").manual_seed(0)
    for nb in (int(c) for c in args.counts.split(",")):
        vals = torch.randint(0, 256, (nb, Rp, D // 2), dtype=torch.uint8, device="cuda",
                             generator=g)
        sfs = torch.randint(0x30, 0x59, (nb, Rp * S), dtype=torch.uint8, device="cuda",
                            generator=g)
        if Rp > R:
            vals[:, R:] = 0
        ams = torch.rand((nb, 1), device="cuda", generator=g) * 7 + 1
        tv, ts = list(vals.unbind(0)), [s.view(torch.float8_e4m3fn) for s in sfs.unbind(0)]
        ta = list(ams.unbind(0))
        cv = [cp.from_dlpack(t) for t in tv]
        cs = [cp.from_dlpack(t) for t in sfs.unbind(0)]
        ca = [cp.from_dlpack(t) for t in ta]

        def run_seed(tv=tv, ts=ts, ta=ta):
            return seed(tv, ts, ta, H, Tb, 0, 6.0, 256.0)

        def run_ours(cv=cv, cs=cs, ca=ca):
            return longlive.dequantize(cv, cs, ca, H, Tb, scale_rule="4over6")

        batch = 20 if nb <= 256 else 5
        t_seed = wall_per_call(run_seed, sync, batch, args.reps)
        t_ours = wall_per_call(run_ours, sync, batch, args.reps)
        a = run_seed().view(torch.int16)
        b = torch.from_dlpack(run_ours().view(cp.int16))
        same = bool(torch.equal(a, b))
        print(f"| {nb} | {t_seed * 1e6:.1f} | {t_ours * 1e6:.1f} | {t_seed / t_ours:.2f}x | "
              f"{same} |", flush=True)
        del vals, sfs, ams, tv, ts, ta, cv, cs, ca
        torch.cuda.empty_cache()
        cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
