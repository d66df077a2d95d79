"""Probe of Hopper's ``wgmma.mma_async`` operand layouts for an sm_90a attention kernel over
decoded NVFP4 tiles: which shared-memory descriptors (128-byte swizzle, leading and stride
byte offsets) and register fragments give S = Q K^T and O = P V, checked against NumPy.

One warpgroup (128 threads) per case; the host writes the swizzled shared-memory image,
the kernel copies it to shared memory, runs the wgmma chain and writes the accumulators
(the m64nN f32 layout: warp w rows 16 w .., lane (g, c) rows g, g + 8, columns 8 j + 2 c,
+1).  Cases:

- ``qk``: A = Q (64 x 64, K-major) and B = K (N keys x 64, K-major), four k16 steps that
  advance both descriptors by 32 bytes inside the 128-byte swizzle atom;
- ``pv``: A = P from registers (64 x 32, the mma.sync m16n8k16 A fragment per warp), B = V
  (32 keys x N d values, MN-major: rows of d contiguous, ``tnspB``), two k16 steps of 2,048
  bytes; for N = 128 the two 64-wide d halves are separate regions (the descriptor's
  offset between them is tried as the leading and as the stride byte offset).

Run on an sm_90 GPU (from the repository root)::

    PYTHONPATH=. python3 bench/wgmma_probe.py
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def _regs(n: int, first: int = 0) -> str:
    return ", ".join(f"%{i}" for i in range(first, first + n))


def source(n: int) -> str:
    """The probe kernels for N = n columns (m64nNk16, bf16 in, f32 accumulators)."""
    nd = n // 2  # accumulator registers per thread
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
    ss = (f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{_regs(nd)}}}, "
          f"%{nd}, %{nd + 1}, p, 1, 1, 0, %{nd + 3};")
    rs = (f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{_regs(nd)}}}, "
          f"{{{_regs(4, nd)}}}, %{nd + 4}, p, 1, 1, %{nd + 6};")
    return r"""
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u64 desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) |
         (1ull << 62);  // 128-byte swizzle
}

struct V4 {
  u32 x, y, z, w;
};

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm("{\n.reg .u64 a;\ncvta.to.shared.u64 a, %1;\ncvt.u32.u64 %0, a;\n}\n" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ void stage(const unsigned char* img, u32 bytes, unsigned char* sm) {
  for (u32 i = threadIdx.x * 16u; i < bytes; i += blockDim.x * 16u)
    *(V4*)(sm + i) = *(const V4*)(img + i);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
}

__device__ __forceinline__ void write_acc(const float* d, float* out) {
  const u32 t = threadIdx.x, w = t >> 5, lane = t & 31u, g = lane >> 2, c = lane & 3u;
  for (int i = 0; i < NACC; ++i) {
    const u32 j = i / 4, e = i % 4;
    const u32 row = 16u * w + g + 8u * (e >> 1), col = 8u * j + 2u * c + (e & 1u);
    out[row * NCOL + col] = d[i];
  }
}

// Stage the image, zero the accumulators and fence them: the image's shared address.
__device__ __forceinline__ u32 begin(const unsigned char* img, u32 bytes, unsigned char* sm,
                                     float* d) {
  stage(img, bytes, sm);
  for (int i = 0; i < NACC; ++i) d[i] = 0.0f;
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  return smem_addr(sm);
}

// Wait for the wgmma chain and write the accumulators (out[0] = -1e30 when the image was
// not 1024-byte aligned: the swizzle's pattern would start elsewhere).
__device__ __forceinline__ void end(const float* d, u32 base, float* out) {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  write_acc(d, out);
  if (threadIdx.x == 0 && (base & 1023u)) out[0] = -1e30f;
}

// A and B in shared memory (K-major unless tnsp_b), nk k16 steps
extern "C" __global__ void probe_ss(const unsigned char* img, u32 bytes, u32 a_off, u32 b_off,
                                    u32 a_lbo, u32 a_sbo, u32 b_lbo, u32 b_sbo, u32 a_step,
                                    u32 b_step, u32 nk, u32 tnsp_b, float* out) {
  extern __shared__ __align__(1024) unsigned char sm[];
  float d[NACC];
  const u32 base = begin(img, bytes, sm, d);
  for (u32 k = 0; k < nk; ++k) {
    const u64 da = desc(base + a_off + k * a_step, a_lbo, a_sbo);
    const u64 db = desc(base + b_off + k * b_step, b_lbo, b_sbo);
    const u32 sc = k > 0u ? 1u : 0u;
    if (tnsp_b)
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %NSC, 0;\n" SS_T "\n}\n"
                   : OUTS : "l"(da), "l"(db), "r"(sc), "n"(1));
    else
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %NSC, 0;\n" SS_T "\n}\n"
                   : OUTS : "l"(da), "l"(db), "r"(sc), "n"(0));
  }
  end(d, base, out);
}

// A from registers (afrag: [nk][128 threads][4] u32, the m16n8k16 A fragment of each
// warp's 16 rows), B in shared memory, MN-major (tnsp_b = 1) or K-major
extern "C" __global__ void probe_rs(const unsigned char* img, u32 bytes, const u32* afrag,
                                    u32 b_off, u32 b_lbo, u32 b_sbo, u32 b_step, u32 nk,
                                    u32 tnsp_b, float* out) {
  extern __shared__ __align__(1024) unsigned char sm[];
  float d[NACC];
  const u32 base = begin(img, bytes, sm, d);
  for (u32 k = 0; k < nk; ++k) {
    const u32* a = afrag + (k * 128u + threadIdx.x) * 4u;
    const u32 a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
    const u64 db = desc(base + b_off + k * b_step, b_lbo, b_sbo);
    const u32 sc = k > 0u ? 1u : 0u;
    if (tnsp_b)
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %NSCR, 0;\n" RS_T "\n}\n"
                   : OUTS : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(sc), "n"(1));
    else
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %NSCR, 0;\n" RS_T "\n}\n"
                   : OUTS : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(sc), "n"(0));
  }
  end(d, base, out);
}
""".replace("NACC", str(nd)).replace("NCOL", str(n)).replace("OUTS", outs) \
        .replace('" SS_T "', ss).replace('" RS_T "', rs) \
        .replace("%NSCR", f"%{nd + 5}").replace("%NSC", f"%{nd + 2}")


def swizzled(tile: np.ndarray) -> np.ndarray:
    """Bytes of a bf16 tile (rows x 64) in the 128-byte swizzle: row r at r * 128, its
    16-byte chunk j at chunk j ^ (r % 8)."""
    rows = tile.shape[0]
    raw = np.ascontiguousarray(tile.astype(BF16)).view(np.uint8).reshape(rows, 8, 16)
    out = np.empty_like(raw)
    for r in range(rows):
        out[r, np.arange(8) ^ (r % 8)] = raw[r]
    return out.reshape(-1)


def a_fragments(p: np.ndarray) -> np.ndarray:
    """The m16n8k16 A fragments of p (64 x 16 nk) per k step and thread, u32 bf16 pairs."""
    nk = p.shape[1] // 16
    bits = p.astype(BF16).view(np.uint16).astype(np.uint32)
    f = np.zeros((nk, 128, 4), np.uint32)
    for k in range(nk):
        for t in range(128):
            w, lane = divmod(t, 32)
            g, c = divmod(lane, 4)
            for i, (dr, dk) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
                r, col = 16 * w + g + dr, 16 * k + 2 * c + dk
                f[k, t, i] = bits[r, col] | (bits[r, col + 1] << 16)
    return f


def main() -> int:
    try:
        import cupy as cp

        cc = cp.cuda.Device().compute_capability
    except Exception as e:  # no CuPy, or no GPU
        print(f"needs CuPy and an sm_90 GPU ({type(e).__name__}: {e})")
        return 0
    rng = np.random.default_rng(0)
    if cc != "90":
        print(f"needs sm_90, this is sm_{cc}")
        return 0
    results = []
    for n in (64, 128):
        mod = cp.RawModule(code=source(n), options=("--gpu-architecture=sm_90a", "-std=c++17"))
        ss, rs = mod.get_function("probe_ss"), mod.get_function("probe_rs")
        for f in (ss, rs):
            f.max_dynamic_shared_size_bytes = 64 * 1024
        u32 = np.uint32
        # qk: Q (64 x 64) . K (n x 64)^T, both K-major
        q = rng.standard_normal((64, 64)).astype(BF16).astype(np.float32)
        k = rng.standard_normal((n, 64)).astype(BF16).astype(np.float32)
        img = np.concatenate([swizzled(q), swizzled(k)])
        out = cp.full((64, n), np.nan, np.float32)
        ss((1,), (128,), (cp.asarray(img), u32(img.size), u32(0), u32(64 * 128), u32(16),
                          u32(1024), u32(16), u32(1024), u32(32), u32(32), u32(4), u32(0), out),
           shared_mem=64 * 1024)
        err = float(np.abs(cp.asnumpy(out) - q @ k.T).max())
        results.append((f"qk n={n} K-major, +32 B per k16", err))
        # pv: P (64 x 32) from registers . V (32 x n), V MN-major
        p = rng.standard_normal((64, 32)).astype(BF16).astype(np.float32)
        v = rng.standard_normal((32, n)).astype(BF16).astype(np.float32)
        halves = [swizzled(v[:, h * 64:(h + 1) * 64]) for h in range(n // 64)]
        region = 32 * 128  # bytes of one 64-wide d half (32 keys)
        img = np.concatenate(halves)
        af = cp.asarray(a_fragments(p))
        for name, lbo, sbo in (("LBO = half, SBO = 1024", region, 1024),
                               ("LBO = 1024, SBO = half", 1024, region)):
            out = cp.full((64, n), np.nan, np.float32)
            rs((1,), (128,), (cp.asarray(img), u32(img.size), af, u32(0), u32(lbo), u32(sbo),
                              u32(16 * 128), u32(2), u32(1), out), shared_mem=64 * 1024)
            err = float(np.abs(cp.asnumpy(out) - p @ v).max())
            results.append((f"pv n={n} MN-major, {name}, +2048 B per k16", err))
    cp.cuda.Device().synchronize()
    for name, err in results:
        print(f"{name:60s} max |err| {err:.3g} {'ok' if err < 1e-2 else 'WRONG'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
